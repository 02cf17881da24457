/* The model kernels' parallel loop: helper threads that never make the caller wait for them.
 *
 * An OpenMP-style fork-join (GOMP_parallel) ends at a barrier that every thread of the team must
 * reach. On a host whose cores are shared with other jobs, the second thread is often not
 * running when a kernel starts, and every one of the kernel calls of a decode step then waits a
 * scheduler time slice for it: while other jobs used the cores, 2 threads ran a step slower than
 * 1 thread (benchmarks/RESULTS.md, "Numbers the code's design rests on", has the figures here).
 *
 * Here the caller publishes a job and claims work items itself, one at a time, like each
 * helper. When none is left it waits only for the items a helper has already claimed: a helper
 * that did not show up claims nothing and costs nothing. Items are claimed with a compare-and-swap
 * on (job generation << 32 | next item), and a new job closes that word (an item past any end)
 * before it writes its fields: a helper that wakes late for one job can never take an item of
 * the next. Helpers spin briefly between jobs (the kernels of a step come microseconds apart),
 * then sleep on a futex.
 *
 * What a helper can still cost: it claims an item and is then preempted by another process, and
 * the caller waits out the rest of its time slice (milliseconds, against microseconds of work).
 * On a quiet machine two threads decode faster than one; on a busy one a step took longer. So
 * the caller times that wait: a job whose caller waited more than STRAGGLER_NS (and
 * longer than its own share of the work) had a late helper. Two late helpers within LATE_WINDOW_NS
 * mark the helpers as late: jobs run inline for BACKOFF_MIN_NS, then one job tries the helpers
 * again; each late try doubles the wait (up to BACKOFF_MAX_NS), an on-time one resets it. A lone
 * late helper changes nothing: even a quiet host preempts a helper now and then (its system
 * daemons, for milliseconds, several times a second), and running the next jobs inline then cost
 * a prefill more than the wait itself. The backoff is a time, not a count of jobs, for the same
 * reason: a count of jobs is a sliver of a decode step but a large part of a prefill.
 *
 * Which thread runs which item varies; each item's arithmetic does not, so results never depend
 * on the thread count. One job at a time: a second caller (another thread) runs its loop inline.
 * Without Linux futexes the loop always runs inline.
 */
#include "kernels.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_POOL 1
#endif

#include <time.h>

#ifdef HAVE_POOL
#define MAX_HELPERS 15
#define SPIN_TURNS 20000 /* ~tens of us of spinning before a helper sleeps */
#define STRAGGLER_NS 300000 /* a wait for a claimed item this long: its helper lost its core */
#define LATE_WINDOW_NS 20000000 /* a second late helper this soon: the helpers are late (> 50/s) */
#define BACKOFF_MIN_NS 2000000LL    /* jobs run inline this long after late helpers (~32 decode jobs) */
#define BACKOFF_MAX_NS 4000000000LL /* ... doubling up to this while the helpers stay late */

static struct {
    rudder_chunk_fn fn;
    void *ctx;
    int64_t n;
    int helpers;      /* helpers that take part in this job (threads - 1) */
    uint64_t claim;   /* generation << 32 | next unclaimed item */
    int64_t done;     /* items finished */
} job;
static uint32_t generation; /* futex word: bumped when a job is published */
static uint32_t sleepers;   /* helpers asleep on it */
static int started;         /* helpers created */
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
/* under job_lock: until when jobs run inline, the next backoff, the last late helper, and counts
 * for rudder_parallel_stats */
static int64_t inline_until, next_backoff = BACKOFF_MIN_NS, last_late = -LATE_WINDOW_NS;
static int64_t stat_jobs, stat_inline, stat_late;

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void relax(void) { __builtin_ia32_pause(); }

static void claim_and_run(uint32_t gen) {
    for (;;) {
        uint64_t c = __atomic_load_n(&job.claim, __ATOMIC_ACQUIRE);
#ifdef RUDDER_TEST_CLAIM_DELAY /* tests/test_native_parallel.py: this thread preempted right here */
        for (volatile int spin = 0; spin < RUDDER_TEST_CLAIM_DELAY; spin++)
            ;
#endif
        if ((uint32_t)(c >> 32) != gen || (int64_t)(uint32_t)c >= __atomic_load_n(&job.n, __ATOMIC_ACQUIRE))
            return;
        if (!__atomic_compare_exchange_n(&job.claim, &c, c + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        job.fn(job.ctx, (int64_t)(uint32_t)c);
        __atomic_fetch_add(&job.done, 1, __ATOMIC_RELEASE);
    }
}

static void *helper(void *arg) {
    int index = (int)(intptr_t)arg, took_part = 1;
    uint32_t seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t g = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        if (g != seen) {
            seen = g;
            took_part = index < __atomic_load_n(&job.helpers, __ATOMIC_ACQUIRE);
            if (took_part)
                claim_and_run(g);
            continue;
        }
        /* spin for the next job only after taking part in one: a helper a smaller job left out
         * (woken with the others) goes back to sleep at once, off the cores */
        for (int i = 0; took_part && i < SPIN_TURNS && __atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen; i++)
            relax();
        if (__atomic_load_n(&generation, __ATOMIC_ACQUIRE) != seen)
            continue;
        __atomic_fetch_add(&sleepers, 1, __ATOMIC_ACQ_REL);
        syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, 0, 0, 0);
        __atomic_fetch_sub(&sleepers, 1, __ATOMIC_ACQ_REL);
    }
    return 0;
}

static int ensure_helpers(int count) {
    if (__atomic_load_n(&started, __ATOMIC_ACQUIRE) >= count)
        return count;
    pthread_mutex_lock(&start_lock);
    while (started < count && started < MAX_HELPERS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        int ok = pthread_create(&t, &attr, helper, (void *)(intptr_t)started) == 0;
        pthread_attr_destroy(&attr);
        if (!ok)
            break;
        pthread_detach(t);
        __atomic_store_n(&started, started + 1, __ATOMIC_RELEASE);
    }
    int have = started;
    pthread_mutex_unlock(&start_lock);
    return have < count ? have : count;
}
#endif

void rudder_parallel_for(rudder_chunk_fn fn, void *ctx, int64_t n, int threads) {
#ifdef HAVE_POOL
    int helpers = threads - 1 < n - 1 ? threads - 1 : (int)(n - 1);
    if (helpers > 0 && n < (1LL << 31) && (helpers = ensure_helpers(helpers)) > 0 &&
        pthread_mutex_trylock(&job_lock) == 0) {
        stat_jobs++;
        int64_t start = monotonic_ns();
        if (start < inline_until) { /* helpers were late lately: this job on this thread alone */
            stat_inline++;
            pthread_mutex_unlock(&job_lock);
            for (int64_t i = 0; i < n; i++)
                fn(ctx, i);
            return;
        }
        uint32_t gen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE) + 1;
        /* Close the last job's claims first. A helper late for it may have read its claim word
         * (every item taken) and be about to compare that item with job.n: were job.n already
         * this job's, and larger, its compare-and-swap on the unchanged word would succeed and
         * run an item of this job that another thread runs too, and count it after `done` was
         * reset, so the caller could return while an item still uses its memory (a crash). */
        __atomic_store_n(&job.claim, (uint64_t)gen << 32 | UINT32_MAX, __ATOMIC_RELEASE);
        job.fn = fn;
        job.ctx = ctx;
        __atomic_store_n(&job.n, n, __ATOMIC_RELEASE);
        __atomic_store_n(&job.done, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&job.helpers, helpers, __ATOMIC_RELEASE);
#ifdef RUDDER_TEST_PUBLISH_DELAY /* tests/test_native_parallel.py: the caller preempted right here */
        for (volatile int spin = 0; spin < RUDDER_TEST_PUBLISH_DELAY; spin++)
            ;
#endif
        __atomic_store_n(&job.claim, (uint64_t)gen << 32, __ATOMIC_RELEASE);
        __atomic_store_n(&generation, gen, __ATOMIC_RELEASE);
        /* A futex wakes any of its sleepers: when more helpers exist than this job takes, wake
         * them all, or the one woken could be a helper the job leaves out (it runs on the caller
         * alone then: a 4-thread call before a 2-thread one left the latter without its helper) */
        if (__atomic_load_n(&sleepers, __ATOMIC_ACQUIRE) > 0)
            syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE,
                    helpers < __atomic_load_n(&started, __ATOMIC_ACQUIRE) ? MAX_HELPERS : helpers, 0, 0, 0);
        claim_and_run(gen);
        /* only items a helper has claimed are left; wait for those (yielding now and then: the
         * helper may be waiting for this very core) */
        int64_t own = 0, waited = 0;
        if (__atomic_load_n(&job.done, __ATOMIC_ACQUIRE) < n) {
            int64_t from = monotonic_ns();
            for (long turn = 1; __atomic_load_n(&job.done, __ATOMIC_ACQUIRE) < n; turn++) {
                relax();
                if (turn % 4096 == 0)
                    sched_yield();
            }
            own = from - start;
            waited = monotonic_ns() - from;
        }
        if (waited > STRAGGLER_NS && waited > own) {
            stat_late++;
            int64_t now = start + own + waited;
            /* late again right after backing off, or a second late helper soon after the first */
            if (next_backoff > BACKOFF_MIN_NS || now - last_late < LATE_WINDOW_NS) {
                inline_until = now + next_backoff;
                next_backoff = next_backoff < BACKOFF_MAX_NS ? 2 * next_backoff : BACKOFF_MAX_NS;
            }
            last_late = now;
        } else {
            next_backoff = BACKOFF_MIN_NS;
        }
        pthread_mutex_unlock(&job_lock);
        return;
    }
#else
    (void)threads;
#endif
    for (int64_t i = 0; i < n; i++)
        fn(ctx, i);
}

/* Jobs that could use helpers, those of them run inline after a late helper, and late helpers
 * seen (tests and benchmarks read them; out[0..2]). */
void rudder_parallel_stats(int64_t *out) {
#ifdef HAVE_POOL
    pthread_mutex_lock(&job_lock);
    out[0] = stat_jobs;
    out[1] = stat_inline;
    out[2] = stat_late;
    pthread_mutex_unlock(&job_lock);
#else
    out[0] = out[1] = out[2] = 0;
#endif
}
