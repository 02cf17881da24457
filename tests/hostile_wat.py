"""A catalogue of hostile controllers (WAT), each misbehaving in one way, with the error kind its
request must end with. Shared by the tenant tests over a real server, the budget tests (in both
controller shapes: `kinds`) and benchmarks/soak.py.

Result records live at fixed addresses (see controller_wat.controller_wat: 0x100 holds one
unconstrained Branch); the ones here add their own.
"""

from __future__ import annotations

from controller_wat import controller_wat

LOOP = "(loop $l (br $l)) (i32.const 0)"

# {n 1, branches 0x500}; branch {backtrack 1, mask 0, n_ff 0, ff 0}: take one back, sample again.
_BACKTRACK_ONE = r'(data (i32.const 0x400) "\01\00\00\00\00\05\00\00") (data (i32.const 0x500) "\01\00\00\00")'
# 16 unconstrained branches: every step forks as much as allowed.
_FORK_16 = r'(data (i32.const 0x600) "\10\00\00\00\00\07\00\00")'


def _steps_after_first(then: str) -> str:
    """mid_process answers one plain Branch on its first call, then `then` (an address)."""
    return f"""(i32.store (i32.const 0x80) (i32.add (i32.load (i32.const 0x80)) (i32.const 1)))
               (if (result i32) (i32.le_u (i32.load (i32.const 0x80)) (i32.const 1))
                 (then (i32.const 0x100)) (else {then}))"""


HOSTILE: dict[str, tuple[str, set[str]]] = {
    "infinite loop": (controller_wat(mid=LOOP), {"timeout"}),
    "unreachable": (controller_wat(mid="(unreachable)"), {"trap"}),
    "memory bomb": (controller_wat(mid="""
        (block $oom (loop $l (br_if $oom (i32.eq (memory.grow (i32.const 16)) (i32.const -1))) (br $l)))
        (i32.load (i32.const 0x7fffffff))"""), {"oom"}),
    # +10 MiB a step up to its 64 MiB: fine alone; several at once meet the server's memory budget.
    "growth bomb": (controller_wat(mid="(drop (memory.grow (i32.const 160))) (i32.const 0x100)"), {"ok", "oom", "limit"}),
    "garbage result": (controller_wat(mid="(i32.const 0xFFFFFFF0)"), {"invalid_result"}),
    "livelock": (controller_wat(mid=_steps_after_first("(i32.const 0x400)"), extra=_BACKTRACK_ONE), {"limit"}),
    "fork bomb": (controller_wat(mid=_steps_after_first("(i32.const 0x600)"), extra=_FORK_16), {"limit"}),
    "tokenize loop": (controller_wat(
        mid_locals="(local $i i32)",
        mid="""(loop $l
                 (drop (call $tokenize (i32.const 0x1000) (i32.const 16000) (i32.const 0x8000) (i32.const 0)))
                 (local.set $i (i32.add (local.get $i) (i32.const 1)))
                 (br_if $l (i32.lt_u (local.get $i) (i32.const 100000))))
               (i32.const 0x100)"""), {"limit", "timeout"}),
    "start refuses": (controller_wat(start="(i32.const 7)"), {"start"}),
    "init loops": (controller_wat(init=LOOP), {"timeout"}),
}


# What differs when the same module runs as a component (tests/shapes.py): its memory is hidden
# from the host, so a trap at its memory limit is a trap.
COMPONENT_KINDS = {"memory bomb": {"trap"}}


def kinds(name: str, shape) -> set[str]:
    """The kinds the request of HOSTILE[name] may end with, in `shape`."""
    return COMPONENT_KINDS.get(name, HOSTILE[name][1]) if str(shape) == "component" else HOSTILE[name][1]


def dirty_init_wat(mib: int, mark: int) -> str:
    """rudder_init grows memory to `mib` MiB and writes `mark` over all of it (a big snapshot);
    different marks make different modules."""
    pages = mib * 16
    return controller_wat(
        memory='(memory (export "memory") 2)',
        init=f"""(drop (memory.grow (i32.const {pages - 2})))
                 (memory.fill (i32.const 0x10000) (i32.const {mark}) (i32.const {mib * (1 << 20) - 0x10000}))
                 (i32.const 0)""")
