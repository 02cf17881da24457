"""Controller: the per-sequence handle the engine drives (mid_process / fork / close).

One Controller = one sandboxed instance (its own Store and memory). All Controllers of one
request share a RequestContext (argument, variables, log, limits, live count). Any failure
raises ControllerError and leaves the Controller dead: its state may be half-updated, so
later calls refuse rather than run on it.

Not thread-safe per Controller (one sequence is stepped by one thread at a time); different
Controllers may run in parallel threads, and their guest code then really runs in parallel
(the GIL is released during wasm calls).
"""

from __future__ import annotations

from ..branch import Branch
from .errors import ControllerError
from .fastcall import lib
from .host_api import TOKENIZE_BYTES_STEP, HostState, RequestContext
from .instance import Instance, wall_cap_ms
from .limits import deadline_ticks
from .result import ResultDecoder
from .snapshot import clone_state

__all__ = ["Controller"]

# rudder_input is asked for at least this many tokens, so that the common one-token steps
# after a short prompt don't each need a second call into the guest.
MIN_INPUT_CAPACITY = 64
_memory_size = lib.wasmtime_memory_data_size
STEP_FAILED = -1  # rudder_step_call's codes (native/deadline.c)


class Controller:
    """Drives one sequence's controller instance. See docs/abi.md for the protocol."""

    def __init__(self, shared, cmod, request: RequestContext, inst: Instance):
        self.request = request
        self._shared = shared
        self._cmod = cmod
        self._inst: Instance | None = inst
        limits = request.limits
        self._decoder = ResultDecoder(shared.vocab_size, limits.max_forks, limits.max_ff_tokens)
        self._ms = limits.mid_process_ms
        self._ticks = deadline_ticks(limits.mid_process_ms, shared.tick_ms)
        inst.state.tokenize_cap = TOKENIZE_BYTES_STEP  # a step's budget is milliseconds
        self._in_ptr = 0   # the guest's input buffer, from the last rudder_input call
        self._in_cap = 0   # ... and its capacity in tokens
        self._step = inst.step  # the native step (None without the native library)
        self._mask_words = self._decoder.mask_words
        if self._step is not None:
            st = self._step
            st.mask_words, st.tail_bits = self._decoder.mask_words, self._decoder.tail_bits
            st.cpu_budget_ns, st.wall_budget_ns = int(self._ms * 1e6), int(wall_cap_ms(self._ms) * 1e6)
        self._failure: ControllerError | None = None
        self._closed = False

    # ------------------------------------------------------------------ the step

    def mid_process(self, branch_idx: int, backtrack: int, tokens) -> list[Branch]:
        """Call rudder_mid_process with the tokens appended since the last call; return the
        Branch records. Masks are zero-copy views of guest memory, valid until the next call
        into this controller."""
        inst = self._inst
        if inst is None or self._failure is not None or self._shared.closed:
            raise self._unusable()
        try:
            n = len(tokens)
            if n > self._in_cap:
                self._reserve_input(n)
            st = self._step
            if n > 1 or (n and st is None):  # (the native step writes a lone token itself)
                p = self._in_ptr >> 2
                inst.u32[p:p + n] = tokens
            if st is not None:
                # One crossing: the token written, the guarded call, the common answer checked
                # (native/deadline.c, rudder_step_call); anything else is read below.
                r = inst.step_call(st, branch_idx, backtrack, n, tokens[0] if n == 1 else 0)
                if r > 0:  # one Branch: 1 | mask pointer << 1 | backtrack << 33
                    mask = (r >> 1) & 0xFFFFFFFF
                    if mask:
                        view = inst.views.get(mask)  # (mask_view, its common case inlined)
                        return [Branch(r >> 33, view if view is not None else inst.mask_view(mask, self._mask_words))]
                    return [Branch(r >> 33)]
                if r == 0:
                    return []
                if r == STEP_FAILED:
                    raise inst.native_call_error(st.error, "rudder_mid_process", self._ms)
                ptr = st.result  # STEP_DECODE: result.py reads it
            else:
                slots = inst.vals_i32
                slots[0] = branch_idx
                slots[4] = backtrack
                slots[8] = n
                ptr = inst.call("rudder_mid_process", 3, self._ticks, self._ms)
            if _memory_size(inst.ctx, inst.memory) != inst.size:  # it grew: count it (~0.3 us a call)
                inst.remap()
                if not inst.within_budget:
                    raise ControllerError("oom", f"the controller grew its memory to {inst.size >> 20} MiB while the "
                                          f"server's guest memory budget is spent", inst.log_tail())
            return self._decoder.decode(inst, ptr)
        except ControllerError as e:
            # A copy without the traceback: its frames hold this controller and its instance,
            # and keeping them here would make a cycle that holds guest memory until a gc.
            self._failure = ControllerError(e.kind, str(e), e.log_tail, e.busy)
            raise

    def _reserve_input(self, n: int) -> None:
        inst = self._inst
        cap = max(n, MIN_INPUT_CAPACITY)
        inst.vals_i32[0] = cap
        ptr = inst.call("rudder_input", 1, self._ticks, self._ms) & 0xFFFFFFFF
        if ptr + 4 * cap > inst.size:
            inst.check_growth()  # the guest may have grown its memory to make room
        if ptr == 0 or ptr & 3 or ptr + 4 * cap > inst.size:
            raise ControllerError(
                "invalid_result", f"rudder_input({cap}) returned {ptr:#x}: not a 4-byte aligned "
                f"buffer of {4 * cap} bytes inside memory ({inst.size} bytes)", inst.log_tail())
        self._set_input(ptr, cap)

    def _set_input(self, ptr: int, cap: int) -> None:
        self._in_ptr, self._in_cap = ptr, cap
        if self._step is not None:
            self._step.in_ptr = ptr

    # ------------------------------------------------------------------ fork / close

    def fork(self) -> "Controller":
        """A copy of this controller (memory and exported mutable globals as they are now)
        for a new sequence of the same request; it counts toward max_forks."""
        inst = self._inst
        if inst is None or self._failure is not None or self._shared.closed:
            raise self._unusable()
        req = self.request
        with req.lock:
            if req.live >= req.limits.max_forks:
                raise ControllerError("limit", f"cannot fork: the request already has {req.live} live "
                                      f"sequences (max_forks {req.limits.max_forks})", inst.log_tail())
            req.live += 1
        try:
            shared = self._shared
            shared.guest_memory.admit(inst.size, "fork the controller")
            child_inst = Instance(shared, self._cmod, HostState(shared, req), req.limits.memory_bytes,
                                  deadline_ticks(req.limits.init_ms, shared.tick_ms))
            try:
                clone_state(inst, child_inst, shared.eager_bytes)
            except BaseException:
                child_inst.store.close()
                raise
        except BaseException:
            with req.lock:
                req.live -= 1
            raise
        child = Controller(shared, self._cmod, req, child_inst)
        child._set_input(self._in_ptr, self._in_cap)
        return child

    def close(self) -> None:
        """Release this sequence's instance and its place among the request's live
        sequences. Masks handed out earlier stay readable (they keep the memory alive)."""
        if self._closed:
            return
        self._closed = True
        self._inst = None
        with self.request.lock:
            self.request.live -= 1

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ misc

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
        return self._inst.size if self._inst is not None else 0

    def _unusable(self) -> ControllerError:
        tail = ControllerError.tail_of(self.request.log)
        if self._failure is not None:
            return ControllerError(self._failure.kind, f"controller already failed: {self._failure}", tail)
        if self._shared.closed:
            return ControllerError("limit", "the controller runtime was closed", tail)
        return ControllerError("limit", "the controller was closed", tail)

