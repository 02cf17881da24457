"""native/parallel.c: the model kernels' helper threads. Helpers that claim items and then come
late (their core taken by another process) again and again make the next jobs run on the caller's
thread alone, so a busy machine never makes every kernel call wait out a helper's time slice."""

import ctypes
import itertools
import threading
import time
from pathlib import Path

import pytest
import torch

from rudder import kernels, native

pytestmark = pytest.mark.skipif("not kernels.available()", reason="no native kernels")  # evaluated at set-up, not collection


def run_job(item, n: int) -> None:
    run_job_threads(item, n, 2)


def run_job_threads(item, n: int, threads: int) -> None:
    kernels._kernels().rudder_parallel_for(item, native.ffi.NULL, n, threads)


@native.ffi.callback("void(void *, int64_t)")
def _nothing(ctx, i):
    pass


@pytest.fixture(autouse=True)
def helpers_started():
    """Helpers started, and the pool offering jobs to them: an earlier test in this process (a
    model's kernels on a busy host) may have left it running jobs inline after a late helper."""
    run_job(_nothing, 2)  # the pool's threads start with their first job (and may miss that one)
    time.sleep(0.01)
    _offering_jobs_to_helpers()


def _offering_jobs_to_helpers() -> None:
    deadline = time.monotonic() + 10  # (the longest backoff is 4 s)
    while time.monotonic() < deadline:
        before = kernels.parallel_stats()
        run_job(_nothing, 2)
        after = kernels.parallel_stats()
        if after["inline"] == before["inline"] and after["late"] == before["late"]:
            return
        time.sleep(0.001)
    pytest.fail("the helper pool kept running jobs inline")


def _late_job(pause: float) -> bool:
    """A job whose helper claims an item and then stalls for `pause` s (its core lost to another
    process, as far as the caller can tell); True if a helper took part."""
    main = threading.get_ident()
    on_helper = []

    @native.ffi.callback("void(void *, int64_t)")
    def slow_helper(ctx, i):
        if threading.get_ident() != main:
            on_helper.append(i)
            time.sleep(pause)
            return
        deadline = time.monotonic() + 2
        while not on_helper and time.monotonic() < deadline:  # the caller: until a helper claimed one
            time.sleep(0.0001)

    run_job(slow_helper, 8)
    return bool(on_helper)


def _record_jobs(count: int) -> set:
    threads = set()

    @native.ffi.callback("void(void *, int64_t)")
    def record(ctx, i):
        threads.add(threading.get_ident())
        time.sleep(0.0005)  # long enough that an idle helper would take some

    for _ in range(count):
        run_job(record, 8)
    return threads


def test_a_lone_late_helper_leaves_the_next_jobs_to_the_helpers():
    """Even a quiet host preempts a helper now and then: one late helper costs its wait, not the
    second core for the jobs after it."""
    # On a loaded host a try may not test this: the caller itself descheduled longer than the helper
    # stalled (its wait is then shorter than its own share, and the helper is not late), or another
    # helper late on its own afterwards. Such a try is made again.
    for _ in range(10):
        time.sleep(0.03)  # past the window of any earlier late helper: this one is alone
        before = kernels.parallel_stats()
        assert _late_job(0.005), "no helper took part"
        after = kernels.parallel_stats()
        if after["late"] == before["late"] + 1:
            _record_jobs(5)  # at once: where a backoff would send them inline
            now = kernels.parallel_stats()
            if now["late"] == after["late"]:  # no other late helper: the lone one changed nothing
                assert now["inline"] == after["inline"]
                return
        _offering_jobs_to_helpers()
    pytest.fail("no try had exactly one late helper")


def test_late_helpers_send_the_next_jobs_inline_for_a_while():
    """Two late helpers in quick succession (a busy host): jobs run on the caller alone for a
    while (2 ms; longer while the helpers stay late), then the helpers are tried again."""
    main = threading.get_ident()
    before = kernels.parallel_stats()
    for _ in range(5):  # back to back, ~6 ms apart: in the window (more tries on a loaded host)
        _offering_jobs_to_helpers()  # (past a backoff that a third late helper began: a loaded host)
        assert _late_job(0.005), "no helper took part"
        inline = kernels.parallel_stats()["inline"]
        threads = _record_jobs(1)  # right after the late one: within the backoff
        if kernels.parallel_stats()["inline"] == inline + 1:
            break
    after = kernels.parallel_stats()
    assert after["late"] >= before["late"] + 2 and after["inline"] > before["inline"]
    assert threads == {main}  # on the caller: the helpers sat out
    # Then the helpers are tried again: after 2 ms, or longer where they stay late (a loaded
    # host; each late try doubles the wait, up to 4 s).
    deadline = time.monotonic() + 10
    while len(_record_jobs(1)) == 1:
        assert time.monotonic() < deadline, "the helpers were never tried again"
        time.sleep(0.005)


def test_a_job_that_takes_fewer_helpers_than_exist_still_gets_one():
    """A futex wakes any of its sleepers: a job of two threads after one of four must wake a
    helper that takes part, not only one that the job leaves out."""
    main = threading.get_ident()
    for _ in range(5):
        arrived = []

        @native.ffi.callback("void(void *, int64_t)")
        def staggered(ctx, i):  # three helpers; they go to sleep in the reverse order of arrival
            if threading.get_ident() != main:
                arrived.append(i)
                time.sleep(0.03 * max(0, 3 - len(arrived)))  # (a loaded host may let helpers claim all four)
            else:
                deadline = time.monotonic() + 2
                while len(arrived) < 3 and time.monotonic() < deadline:
                    time.sleep(0.0001)

        run_job_threads(staggered, 4, 4)
        time.sleep(0.05)  # all of them asleep
        assert _late_job(0.0), "no helper took part"


def test_items_run_once_each_whatever_thread_runs_them():
    counts = [0] * 200
    lock = threading.Lock()

    @native.ffi.callback("void(void *, int64_t)")
    def count(ctx, i):
        with lock:
            counts[i] += 1

    for _ in range(20):
        run_job(count, 200)
    assert counts == [20] * 200


def test_thread_choice_takes_the_count_measured_faster(monkeypatch):
    """Every call of a size runs with the current count; every so often one runs with the other,
    and it takes over only when measured faster; a probe that loses waits longer for the next."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(native, "amx_usable", lambda: False)
    choice = kernels.ThreadChoice()
    cost = {1: 1.0, 2: 0.7}  # two threads faster (a quiet host)

    def calls(n):
        used = []
        for _ in range(n):
            t = choice.pick(1)
            used.append(t)
            choice.record(1, t, cost[t])
        return used

    first = calls(100)
    assert first[0] == 2 and first.count(1) <= 4  # starts with both threads; rare losing probes
    probes = [i for i, t in enumerate(first) if t == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # each loss waits longer

    cost = {1: 1.0, 2: 1.8}  # another process takes the second core: one thread wins
    later = calls(1200)
    assert later[-200:].count(1) >= 199  # one thread now, with at most one losing probe

    cost = {1: 1.0, 2: 0.7}  # quiet again: back to both
    assert calls(1200)[-200:].count(2) >= 199


def test_calls_of_many_rows_are_probed_only_once_the_host_changed(monkeypatch):
    """A one-thread probe of a prefill costs most of the prefill again: on schedule only calls of
    up to PROBE_ROWS rows are probed; a class of more rows is probed once another class's probe
    won (then it switches if one thread is faster there too)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(native, "amx_usable", lambda: False)
    choice = kernels.ThreadChoice()

    def calls(n, cost):
        used = []
        for i in range(n):
            rows = (1, 3, 236)[i % 3]
            t = choice.pick(rows)
            used.append((rows, t))
            choice.record(rows, t, cost[rows][t])
        return used

    quiet = {1: {1: 1.0, 2: 0.7}, 3: {1: 1.2, 2: 0.8}, 236: {1: 30.0, 2: 16.0}}
    used = calls(3000, quiet)
    assert [t for r, t in used if r == 236] == [2] * 1000
    assert any(t == 1 for r, t in used if r < 16)  # the small ones were probed
    busy = {rows: {1: c[1], 2: 2 * c[2]} for rows, c in quiet.items()}
    used = calls(3000, busy)
    assert choice.threads(236) == 1 and [t for r, t in used if r == 236][-100:] == [1] * 100


def test_a_count_before_the_first_timing_is_no_probe(monkeypatch):
    """Threads with different torch thread counts share a model's choice (a pipeline's stages in
    one process): a call that ran with the other count before the class's own was ever timed
    is ignored, not judged against a time that does not exist."""
    monkeypatch.setattr(native, "amx_usable", lambda: False)
    choice = kernels.ThreadChoice()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert choice.pick(1) == 2  # the class starts at two threads, untimed
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert choice.pick(1) == 1  # a one-thread caller
    choice.record(1, 1, 0.5)
    assert choice.threads(1) == 2 and choice.state[kernels.size_class(1)][1] is None


def test_rows_take_their_own_choice(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(native, "amx_usable", lambda: False)
    choice = kernels.ThreadChoice()
    for _ in range(300):
        for rows, cost in ((1, {1: 1.0, 2: 2.0}), (64, {1: 2.0, 2: 1.0})):
            t = choice.pick(rows)
            choice.record(rows, t, cost[t])
    assert choice.pick(1) in (1, 2) and choice.threads(1) == 1 and choice.threads(64) == 2


def test_classes_share_when_to_probe(monkeypatch):
    """The classes measure the same host: a probe lost in one class lengthens the wait of all (a
    draft's rare row counts do not keep probing), and one won makes the others probe soon."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(native, "amx_usable", lambda: False)
    choice = kernels.ThreadChoice()
    quiet = {rows: {1: 1.0 + rows / 10, 2: 0.7 + rows / 20} for rows in (1, 3, 9, 14)}

    counter = itertools.count()

    def calls(n, cost):
        used = []
        for _ in range(n):
            rows = (1, 3, 9, 14)[next(counter) % 4]
            t = choice.pick(rows)
            used.append((rows, t))
            choice.record(rows, t, cost[rows][t])
        return used

    probes = [rows for rows, t in calls(2000, quiet) if t == 1]
    assert 5 <= len(probes) <= 8  # after 8, 16, ... 512 calls of any class (a count per class: 20)
    assert len(set(probes)) > 1  # each class is probed in its turn

    busy = {rows: {1: c[1], 2: 2 * c[2]} for rows, c in quiet.items()}  # another process took a core
    switched = {}
    for i in range(600):
        calls(1, busy)
        for rows in (1, 3, 9, 14):
            if choice.threads(rows) == 1:
                switched.setdefault(rows, i)
    assert len(switched) == 4  # within PROBE_MAX calls
    assert max(switched.values()) - min(switched.values()) <= 4  # one class's probe won: the others next


class _Busy:
    """A stand-in controller whose every call computes for `ms` of CPU."""

    def __init__(self, ms: float):
        self.ms = ms

    def mid_process(self, branch_idx, backtrack, tokens):
        end = time.thread_time() + self.ms / 1000
        while time.thread_time() < end:
            pass
        return []


def test_controllers_that_keep_a_core_busy_are_measured():
    """ControllerCalls.demand: cores' worth of CPU its calls used lately; the engine leaves the
    controllers a core above CONTROLLER_CORE_DEMAND (a cheap controller stays below it)."""
    from rudder.engine.controller_calls import ControllerCalls
    from rudder.engine.llm_engine import CONTROLLER_CORE_DEMAND

    calls = ControllerCalls(2)
    try:
        def steps(controller, n):
            for _ in range(n):
                for f in calls.submit([(i, controller, 0, 0, [1]) for i in range(2)]).values():
                    f.result()
                time.sleep(0.004)  # the rest of a step
                demand = calls.demand()
            return demand

        assert steps(_Busy(4), 12) > CONTROLLER_CORE_DEMAND  # two calls of 4 ms per ~12 ms step
        assert steps(_Busy(0.02), 40) < CONTROLLER_CORE_DEMAND  # a json-like 20 us: the model keeps both
    finally:
        calls.close()


class _Where:
    def mid_process(self, branch_idx, backtrack, tokens):
        return threading.current_thread().name


def test_inline_calls_run_on_the_calling_thread():
    """A speculative draft's lone call runs inline (no worker round trip); others on workers."""
    from rudder.engine.controller_calls import ControllerCalls

    calls = ControllerCalls(1)
    try:
        here = threading.current_thread().name
        assert calls.submit([(0, _Where(), 0, 0, [1])], inline=True)[0].result()[0] == here
        assert calls.submit([(0, _Where(), 0, 0, [1])])[0].result()[0] != here
    finally:
        calls.close()


def _decoder_threads(monkeypatch, engine_options: dict, busy_controllers: bool) -> tuple[set, object]:
    """The thread counts the native decoder was called with over a short generation."""
    from rudder import SamplingParams
    from rudder.engine import Engine
    from rudder.loading import load_model
    from rudder.model import native_stack

    model, tok = load_model("tiny", dtype="bf16")
    stack = native_stack(model)
    assert stack is not None
    seen = []
    real = kernels._kernels()

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def rudder_decoder(self, *args):
            seen.append(args[-1])
            return real.rudder_decoder(*args)

    monkeypatch.setattr(kernels, "_kernels", lambda: Spy())
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    engine = Engine(model, tok, **engine_options)
    engine.calls.demand = (lambda: 1.0) if busy_controllers else (lambda: 0.0)
    # a prompt of 16 tokens or more: with AMX, calls of fewer rows always run on one thread
    engine.add_request("hello " * 20, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        kernels.leave_cores(0)
    return set(seen), stack


def test_model_threads_caps_the_decoder(monkeypatch):
    assert max(_decoder_threads(monkeypatch, {}, False)[0]) == 2
    assert _decoder_threads(monkeypatch, {"model_threads": 1}, False)[0] == {1}
    # "shared" (rudder serve's default): one core kept for controllers, whatever they do
    assert _decoder_threads(monkeypatch, {"model_threads": "shared"}, False)[0] == {1}
    from rudder.engine.config import EngineConfig
    for bad in (0, "half", True):
        with pytest.raises(ValueError, match="model_threads"):
            EngineConfig(model_threads=bad)


def test_model_threads_is_refused_where_the_native_kernels_do_not_run():
    """fp32 runs on torch's GEMMs, which the cap would not reach: refused by name, not ignored."""
    from rudder.engine import Engine
    from rudder.loading import load_model

    model, tok = load_model("tiny", dtype="fp32")
    with pytest.raises(ValueError, match="model_threads caps the native CPU kernels"):
        Engine(model, tok, model_threads=1)
    Engine(model, tok).close()  # without the option: fine
    engine = Engine(model, tok, model_threads="shared")  # "where there is a core to keep": none here
    assert engine.config.model_threads is None
    engine.close()


def test_leave_cores_caps_the_decoder_without_teaching_the_choice(monkeypatch):
    seen, stack = _decoder_threads(monkeypatch, {}, True)  # controllers busy on a whole core
    assert seen == {1}
    assert all(st[1] is None for st in stack.threads.state.values())  # capped calls teach nothing


def test_a_late_helper_never_takes_an_item_of_the_next_job(tmp_path):
    """A helper late for a job (every item already taken) that reads the claim word just before
    the caller publishes the next, larger job must not claim an item of that job: it would run
    twice, and the caller could return while it still ran (and its memory went: a segfault in the
    suite once). Both stalls a preemption would cause are made long (each thread between reading
    the claim word and comparing it, the caller while it publishes a job), so that the race
    comes in most rounds (before the fix: thousands of items ran twice in 3000 rounds) instead
    of once in hours."""
    here = Path(native.__file__).parent
    lib = native._zig(["-shared", "-nostdlib", "-DRUDDER_TEST_PUBLISH_DELAY=20000", "-DRUDDER_TEST_CLAIM_DELAY=500",
                       "-I", str(here),
                       str(here / "parallel.c"), str(Path(__file__).with_name("native") / "parallel_race.c"),
                       "-lc", "-lpthread"], tmp_path / "race.so")
    race = ctypes.CDLL(str(lib))
    out = (ctypes.c_long * 2)()
    race.parallel_race(ctypes.c_long(3000), out)
    assert (out[0], out[1]) == (0, 0), f"{out[0]} items ran twice, {out[1]} were not done when their call returned"
