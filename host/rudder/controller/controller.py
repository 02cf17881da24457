"""Controller and ControllerModule: what the engine and the server hold, the same for every
controller shape (a core module, core.py; a component, component.py).

One Controller = one sandboxed instance (its own store and memory). All Controllers of one
request share a RequestContext (argument, variables, log, limits, live count). Any failure
raises ControllerError and leaves the Controller dead: its state may be half-updated, so
later calls refuse rather than run on it.

Not thread-safe per Controller (one sequence is stepped by one thread at a time); different
Controllers may run in parallel threads, and their guest code then really runs in parallel
(the GIL is released during wasm calls).
"""

from __future__ import annotations

import threading

from ..branch import Branch
from .errors import ControllerError
from .host_api import RequestContext

__all__ = ["Controller", "ControllerModule"]


class ControllerModule:
    """A loaded controller: `sha256` (of the wasm bytes), `wasm_size`, `compiled_size` (bytes of
    compiled code, as serialized), `kind` ("module" or "component"). The other fields belong
    to the ControllerRuntime that loaded it (`shared`) and to its shape, which alone change
    them: the compiled code, and the post-init snapshot every request starts from."""

    kind = ""

    def __init__(self, sha256: str, wasm_size: int, compiled_size: int, shape, shared):
        self.sha256 = sha256
        self.wasm_size = wasm_size
        self.compiled_size = compiled_size
        self.shape = shape      # how it is instantiated and called (core.CoreShape, component.ComponentShape)
        self.shared = shared    # the runtime it belongs to
        self.init_lock = threading.Lock()  # one init at a time
        self.snapshot = None    # set after a successful init (and dropped by the snapshot budget)
        self.init_error: ControllerError | None = None  # a deterministic init failure

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sha256={self.sha256[:12]}..., wasm_size={self.wasm_size}, "
                f"compiled_size={self.compiled_size})")


class Controller:
    """Drives one sequence's controller instance (docs/abi.md has the protocol). A shape
    supplies the step (`mid_process`), the copy of its state for a fork (`_fork`) and what
    closing frees (`_close_instance`); counting, failure and refusal are the same for all."""

    def __init__(self, shared, cmod: ControllerModule, request: RequestContext):
        self.request = request
        self._shared = shared
        self._cmod = cmod
        self._failure: ControllerError | None = None
        self._closed = False

    def mid_process(self, branch_idx: int, backtrack: int, tokens) -> list[Branch]:
        """The answer to the tokens appended since the last call (after `backtrack` were taken
        back), as Branch records. A mask may be a view of guest memory, valid until the next
        call into this controller."""
        raise NotImplementedError

    def fork(self) -> "Controller":
        """A copy of this controller, its state as it is now, for a new sequence of the same
        request; it counts toward max_forks."""
        if self._closed or self._failure is not None or self._shared.closed:
            raise self._unusable()
        req = self.request
        with req.lock:
            if req.live >= req.limits.max_forks:
                raise ControllerError("limit", f"cannot fork: the request already has {req.live} live "
                                      f"sequences (max_forks {req.limits.max_forks})", self._log_tail())
            req.live += 1
        try:
            return self._fork()
        except BaseException as e:
            with req.lock:
                req.live -= 1
            if isinstance(e, ControllerError) and not e.busy:
                self._failure = e.detached()  # (a busy refusal is the server's state, not this controller's)
            raise

    def close(self) -> None:
        """Release this sequence's instance and its place among the request's live sequences."""
        if self._closed:
            return
        self._closed = True
        self._close_instance()
        with self.request.lock:
            self.request.live -= 1

    def _fork(self) -> "Controller":
        raise NotImplementedError

    def _close_instance(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def limits(self):
        """The request's limits (its budgets are enforced by the sandbox and by the engine)."""
        return self.request.limits

    def log_text(self) -> str:
        """The request's log so far (shared by all its forks)."""
        return self.request.log_text()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def memory_size(self) -> int:
        """Bytes of guest memory this controller counts in the server's budget (0 once closed)."""
        raise NotImplementedError

    def _log_tail(self) -> str:
        return ControllerError.tail_of(self.request.log)

    def _failed(self, e: ControllerError) -> ControllerError:
        """Remember `e` as why this controller is dead; returns it to raise. A copy without the
        traceback: its frames hold this controller and its instance, and keeping them here would
        make a cycle that holds guest memory until a gc."""
        self._failure = e.detached()
        return e

    def _unusable(self) -> ControllerError:
        tail = self._log_tail()
        if self._failure is not None:
            return ControllerError(self._failure.kind, f"controller already failed: {self._failure}", tail)
        if self._shared.closed:
            return ControllerError("limit", "the controller runtime was closed", tail)
        return ControllerError("limit", "the controller was closed", tail)
