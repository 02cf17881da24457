"""ControllerError: every way a controller can fail, as one exception with a `kind`.

A controller's failure ends its own request and nothing else, so the engine only needs to know
*that* it failed and a one-line reason to show the user; `kind` lets callers and tests tell the
causes apart without parsing messages, and `log_tail` carries what the controller printed
last, which is usually what explains the failure to its author.
"""

from __future__ import annotations

__all__ = ["ControllerError", "KINDS"]

KINDS = frozenset({
    "bad_module",      # not a valid wasm module, or not a controller (missing/wrong exports)
    "bad_import",      # imports something other than the `rudder` host functions
    "init",            # rudder_abi_version / rudder_init failed (returned non-zero, trapped)
    "start",           # rudder_start returned non-zero
    "timeout",         # a hook ran past its deadline (epoch interruption)
    "trap",            # the guest trapped (unreachable, out-of-bounds access, stack overflow...)
    "oom",             # the guest ran out of its linear memory limit
    "invalid_result",  # rudder_mid_process returned a malformed result
    "limit",           # a per-request limit was exceeded (forks, fast-forward tokens...)
})

LOG_TAIL_BYTES = 2048


class ControllerError(Exception):
    """A controller failed. `str(e)` is one line; `kind` is one of `KINDS`; `log_tail` is the
    end (~2 KiB) of the controller's log for this request; `busy`: the failure is a shared
    resource being in use (guest memory, instance slots), not the request's fault."""

    def __init__(self, kind: str, message: str, log_tail: str = "", busy: bool = False):
        if kind not in KINDS:
            raise ValueError(f"unknown ControllerError kind {kind!r}")
        # One line: messages may embed guest-provided or wasmtime text with newlines.
        message = " ".join(message.split()) if "\n" in message else message
        super().__init__(message)
        self.kind = kind
        self.log_tail = log_tail
        self.busy = busy  # a shared resource is in use right now: the same request may succeed later (429)

    def detached(self) -> "ControllerError":
        """A copy without the traceback, for keeping: a traceback holds the frames that raised,
        and with them instances, guest memory and module bytes."""
        return ControllerError(self.kind, str(self), self.log_tail, self.busy)

    @staticmethod
    def tail_of(log: bytes | bytearray) -> str:
        """The last ~2 KiB of a log as text (a split UTF-8 character becomes U+FFFD)."""
        return bytes(log[-LOG_TAIL_BYTES:]).decode("utf-8", "replace")

    def __reduce__(self):  # keep kind/log_tail across pickling (e.g. process pools)
        return (type(self), (self.kind, str(self), self.log_tail, self.busy))
