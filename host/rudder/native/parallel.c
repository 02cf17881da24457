/* The model kernels' parallel loop, on the OpenMP team torch itself uses.
 *
 * torch's CPU ops run on libgomp's thread team, whose idle threads spin for a while after each
 * op. A pool of our own would fight those spinning threads for the same cores (on a 2-core host
 * every kernel would then pay a context switch); calling libgomp's GOMP_parallel - the entry
 * point `#pragma omp parallel` compiles to - with torch's own copy of libgomp reuses its team.
 * Python hands us that function's address (native/__init__.py); without it the loop runs inline.
 */
#include "kernels.h"

typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

static gomp_parallel_fn gomp_parallel;

void rudder_set_gomp(void *gomp_parallel_address) { gomp_parallel = (gomp_parallel_fn)gomp_parallel_address; }

typedef struct {
    rudder_chunk_fn fn;
    void *ctx;
    int64_t n;
    int64_t next;
} job;

static void work(void *p) {
    job *j = (job *)p;
    for (;;) {
        int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n)
            return;
        j->fn(j->ctx, i);
    }
}

void rudder_parallel_for(rudder_chunk_fn fn, void *ctx, int64_t n, int threads) {
    job j = {fn, ctx, n, 0};
    if (threads > n)
        threads = (int)n;
    if (gomp_parallel != 0 && threads > 1)
        gomp_parallel(work, &j, (unsigned)threads, 0);
    else
        work(&j);
}
