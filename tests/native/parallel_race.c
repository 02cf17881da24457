/* tests/test_native_parallel.py: native/parallel.c built with RUDDER_TEST_CLAIM_DELAY and
 * RUDDER_TEST_PUBLISH_DELAY (a thread stalls between reading the claim word and comparing it,
 * the caller while it publishes a job: as when each loses its core there), driven with a small
 * job then a larger one, over and over. Every item must run exactly once, and be done when the call
 * returns. Built as a shared library (no C runtime of zig's own to build first) and called
 * through ctypes. */
#include <stdint.h>
#include <stdlib.h>

typedef void (*rudder_chunk_fn)(void *ctx, int64_t i);
void rudder_parallel_for(rudder_chunk_fn fn, void *ctx, int64_t n, int threads);

typedef struct {
    int *runs;
    int64_t n;
} job;

static void item(void *p, int64_t i) {
    job *j = p;
    if (i >= j->n)
        abort(); /* an item past this job's end: another job's index */
    for (volatile int spin = 0; spin < 5000; spin++)
        ;
    __atomic_fetch_add(&j->runs[i], 1, __ATOMIC_RELAXED);
}

/* `rounds` of a 2-item job then a 64-item one: out[0] items run twice, out[1] items not done
 * when their call returned. */
void parallel_race(long rounds, long *out) {
    long twice = 0, not_done = 0;
    for (long r = 0; r < rounds; r++) {
        int small[2] = {0}, large[64] = {0};
        job a = {small, 2}, b = {large, 64};
        rudder_parallel_for(item, &a, 2, 2);
        rudder_parallel_for(item, &b, 64, 2);
        for (int i = 0; i < 64; i++) {
            twice += large[i] > 1;
            not_done += large[i] == 0;
        }
        for (int i = 0; i < 2; i++) {
            twice += small[i] > 1;
            not_done += small[i] == 0;
        }
    }
    out[0] = twice;
    out[1] = not_done;
}
