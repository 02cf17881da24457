"""The component's exports (wit/controller.wit) around the user's Controller subclass.

componentize-py makes a new WitWorld object for every export call, so the controller lives
in a module global. `rudder build` generates the app module: `WitWorld = world_for(UserClass)`.
"""

from __future__ import annotations

import pickle
import random
import traceback

import wit_world
from componentize_py_types import Err
from wit_world.imports import types as _t

from ._sdk import Branch, Controller, HandOff, Refuse, Step, TokenSet

__all__ = ["world_for"]

_ctl: Controller | None = None
_cls: type | None = None


def _failure(e: BaseException):
    """The WIT failure for an exception: also logged with its traceback (stderr is the log)."""
    if isinstance(e, Refuse):
        return Err(_t.Failure_Refused(str(e) or "refused"))
    if isinstance(e, MemoryError):
        return Err(_t.Failure_OutOfMemory(f"MemoryError: {e}"))
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    traceback.print_exception(e)
    return Err(_t.Failure_Exception(f"{type(e).__name__}: {e}{where}"))


def _mask(m):
    if m is None:
        return None
    if isinstance(m, TokenSet):
        return m.wire()
    return bytes(m).decode("latin-1")


def _branch(b) -> _t.Branch:
    if not isinstance(b, Branch):
        raise TypeError(f"mid_process must return Branch objects, not {type(b).__name__}")
    return _t.Branch(int(b.backtrack), _mask(b.mask), [[int(t) for t in lst] for lst in b.ff])


def _step(answer):
    if answer is None:
        return _t.Step_Branches([])
    if isinstance(answer, HandOff):
        return _t.Step_HandOff(_t.HandOff(answer.controller, answer.arg))
    if isinstance(answer, Branch):
        return _t.Step_Branches([_branch(answer)])
    return _t.Step_Branches([_branch(b) for b in answer])


def world_for(cls: type):
    """The WitWorld class that runs controllers of class `cls`."""
    global _cls
    if not (isinstance(cls, type) and issubclass(cls, Controller)):
        raise TypeError("world_for takes a subclass of rudder_sdk.Controller")
    _cls = cls

    class World(wit_world.WitWorld):
        def init(self) -> None:
            global _ctl
            try:
                _ctl = _cls()
                _ctl.seq, _ctl.prompt_len, _ctl._steps = [], 0, 0
                _ctl.init()
            except BaseException as e:  # noqa: BLE001 - every failure goes to the host
                raise _failure(e) from None

        def start(self) -> None:
            try:
                # The random module was seeded when the component was built: re-seed it from
                # WASI random, which the host seeds from the request (seeded runs repeat).
                random.seed(random.SystemRandom().getrandbits(128))
                from ._sdk import arg

                _ctl.start(arg() or b"")
            except BaseException as e:  # noqa: BLE001
                raise _failure(e) from None

        def mid_process(self, branch_idx: int, backtrack: int, tokens):
            try:
                ctl = _ctl
                seq = ctl.seq
                if backtrack:
                    del seq[len(seq) - backtrack:]
                seq.extend(tokens)
                if ctl._steps == 0:
                    ctl.prompt_len = len(seq)
                step = Step(ctl._steps, branch_idx, backtrack, tokens, seq, ctl.prompt_len)
                ctl._steps += 1
                return _step(ctl.mid_process(step))
            except BaseException as e:  # noqa: BLE001
                raise _failure(e) from None

        def save(self) -> str:
            try:
                return pickle.dumps((_ctl, random.getstate()), protocol=pickle.HIGHEST_PROTOCOL).decode("latin-1")
            except BaseException as e:  # noqa: BLE001
                raise _failure(e) from None

        def restore(self, state: str) -> None:
            global _ctl
            try:
                _ctl, rstate = pickle.loads(state.encode("latin-1"))
                random.setstate(rstate)
            except BaseException as e:  # noqa: BLE001
                raise _failure(e) from None

    return World
