"""native/parallel.c: the model kernels' helper threads. A helper that claims an item and then
comes late (its core taken by another process) makes the next jobs run on the caller's thread
alone, so a busy machine never makes every kernel call wait out a helper's time slice."""

import threading
import time

import pytest

from rudder import kernels, native

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no native kernels")


def run_job(item, n: int) -> None:
    kernels._kernels().rudder_parallel_for(item, native.ffi.NULL, n, 2)


@native.ffi.callback("void(void *, int64_t)")
def _nothing(ctx, i):
    pass


@pytest.fixture(autouse=True)
def helpers_started():
    run_job(_nothing, 2)  # the pool's threads start with their first job (and may miss that one)
    time.sleep(0.01)


def test_a_late_helper_sends_the_next_jobs_inline():
    main = threading.get_ident()
    on_helper = []

    @native.ffi.callback("void(void *, int64_t)")
    def slow_helper(ctx, i):
        if threading.get_ident() != main:
            on_helper.append(i)
            time.sleep(0.02)  # a helper that lost its core for a while
            return
        deadline = time.monotonic() + 2
        while not on_helper and time.monotonic() < deadline:  # the caller: until a helper claimed one
            time.sleep(0.0001)

    before = kernels.parallel_stats()
    run_job(slow_helper, 8)
    assert on_helper, "no helper took part"
    after = kernels.parallel_stats()
    assert after["late"] == before["late"] + 1

    threads = []

    @native.ffi.callback("void(void *, int64_t)")
    def record(ctx, i):
        threads.append(threading.get_ident())
        time.sleep(0.0005)  # long enough that an idle helper would take some

    for _ in range(5):
        run_job(record, 8)
    assert set(threads) == {main}  # all on the caller: the helpers sit out
    assert kernels.parallel_stats()["inline"] == after["inline"] + 5


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
