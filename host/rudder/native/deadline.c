/* CPU-time deadlines for controller calls, as wasmtime epoch-deadline callbacks.
 *
 * The epoch ticker advances every few milliseconds of wall time; when a store's epoch deadline
 * passes, wasmtime calls rudder_deadline_callback on the guest's own thread. It compares that
 * thread's CPU time (host imports such as tokenizing run on it too) with the call's budget: under
 * budget, the deadline moves on by the ticks still left; over it, the callback returns an error
 * and the call ends. So a controller is charged for the time it computed, not for time its
 * thread waited for a core on a busy machine. A wall-clock cap (many times the budget:
 * controller/store.py's wall_cap_ms) still ends a call whose thread is starved for far too long.
 * No Python, no GIL: this runs while the engine thread holds it.
 *
 * Reading a thread's CPU clock is a system call (the monotonic clock is not), and
 * almost every call ends long before one tick. So arming reads only the monotonic clock and sets
 * the epoch deadline one tick ahead; the CPU clock is first read at that tick. The CPU time the
 * call took before it is counted as the wall time since the call began, at most one tick: exact
 * for a thread that ran throughout, and at most one tick too much for one that waited.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void *(*rudder_error_new_fn)(const char *message);   /* wasmtime_error_new */
typedef void (*rudder_set_deadline_fn)(void *context, uint64_t ticks);  /* wasmtime_context_set_epoch_deadline */
typedef void *(*rudder_call_fn)(void *context, const void *func, void *args, size_t n, void **trap);
                                                              /* wasmtime_func_call_unchecked */

typedef struct rudder_deadline {
    int64_t cpu_limit_ns;   /* thread CPU time (CLOCK_THREAD_CPUTIME_ID) at which the call is over;
                               NOT_STARTED until the call's first tick */
    int64_t cpu_budget_ns;  /* the call's budget of CPU time */
    int64_t wall_start_ns;  /* CLOCK_MONOTONIC time at which the call began */
    int64_t wall_limit_ns;  /* CLOCK_MONOTONIC time at which it is over, however little CPU it used */
    int64_t tick_ns;        /* the epoch tick */
    int32_t expired;        /* 1: CPU budget spent, 2: wall cap reached (set when the call is ended) */
    rudder_error_new_fn error_new;
    rudder_set_deadline_fn set_deadline;
    rudder_call_fn call;
} rudder_deadline;

#define NOT_STARTED INT64_MIN

static int64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Start a call's budget (on the thread that makes the call); the caller sets the store's epoch
 * deadline to one tick. */
void rudder_deadline_arm(rudder_deadline *d, int64_t cpu_budget_ns, int64_t wall_budget_ns) {
    d->cpu_limit_ns = NOT_STARTED;
    d->cpu_budget_ns = cpu_budget_ns;
    d->wall_start_ns = now_ns(CLOCK_MONOTONIC);
    d->wall_limit_ns = d->wall_start_ns + wall_budget_ns;
    d->expired = 0;
}

/* CPU time this thread still has before the call is over budget (negative: over). */
int64_t rudder_deadline_left_ns(rudder_deadline *d) {
    int64_t cpu = now_ns(CLOCK_THREAD_CPUTIME_ID);
    if (d->cpu_limit_ns == NOT_STARTED) {
        int64_t before = now_ns(CLOCK_MONOTONIC) - d->wall_start_ns;
        d->cpu_limit_ns = cpu - (before < d->tick_ns ? before : d->tick_ns) + d->cpu_budget_ns;
    }
    return d->cpu_limit_ns - cpu;
}

/* One call into the guest under a fresh budget: arm, set the epoch deadline, call (one crossing
 * from Python instead of three: this is on the per-token path). */
void *rudder_guarded_call(rudder_deadline *d, void *context, const void *func, void *args, size_t n, void **trap,
                          int64_t cpu_budget_ns, int64_t wall_budget_ns) {
    rudder_deadline_arm(d, cpu_budget_ns, wall_budget_ns);
    d->set_deadline(context, 1);
    return d->call(context, func, args, n, trap);
}

void *rudder_deadline_callback(void *context, void *data, uint64_t *delta, uint8_t *kind) {
    (void)context;
    rudder_deadline *d = data;
    *kind = 0; /* continue (no async yield) */
    int64_t left = rudder_deadline_left_ns(d);
    if (left <= 0) {
        d->expired = 1;
        return d->error_new("rudder: the call spent its CPU time budget");
    }
    if (now_ns(CLOCK_MONOTONIC) >= d->wall_limit_ns) {
        d->expired = 2;
        return d->error_new("rudder: the call reached its wall-clock cap");
    }
    *delta = (uint64_t)(left / d->tick_ns) + 1;
    return 0;
}

/* The per-token step (controller/controller.py's fast path), one crossing from Python: write the
 * step's one new token into the guest's input buffer, make the guarded call, and check the common
 * answer - no branch, or one Branch with a mask or none and no fast-forward lists - against the
 * memory it lies in, as controller/result.py would (the mask inside memory and 4-byte aligned, no
 * bit at or past the vocabulary, some bit set). Anything else (several branches, ff lists, a
 * null or bad pointer, memory that grew during the call) is left to result.py, which also words
 * every error. No allocation, no vocabulary-sized work but the scan for a set bit, which stops
 * at the first non-zero word.
 *
 * Returns STEP_FAILED (the call's error in `error`, or a trap in `*trap`), STEP_DECODE (result.py
 * reads the answer at `result`), 0 (no branch: stop), or one Branch packed into the value (read
 * with the fewest Python operations): 1 | mask pointer << 1 | backtrack << 33. */
typedef struct rudder_step {
    rudder_deadline *deadline;
    void *context; const void *func; int32_t *args; void **trap;
    const void *memory; void *memory_size; /* wasmtime_memory_data_size */
    uint8_t *base; uint64_t size;          /* linear memory as the host mapped it (Instance.remap) */
    uint32_t in_ptr;                       /* the input buffer that rudder_input returned */
    uint32_t mask_words, tail_bits;        /* words of a mask; used bits of its last word (0: 32) */
    int64_t cpu_budget_ns, wall_budget_ns;
    void *error;                           /* out (STEP_FAILED): the call's error, if not a trap */
    int32_t result;                        /* out (STEP_DECODE): the call's i32 result */
} rudder_step;

#define STEP_FAILED (-1)
#define STEP_DECODE (-2)
#define MAX_PACKED_BACKTRACK (1u << 29)

typedef size_t (*rudder_memory_size_fn)(const void *context, const void *memory);

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

int64_t rudder_step_call(rudder_step *s, int32_t branch_idx, int32_t backtrack, int32_t n, uint32_t token) {
    if (n == 1)
        memcpy(s->base + s->in_ptr, &token, 4); /* (more tokens: the caller wrote them) */
    s->args[0] = branch_idx; /* 16-byte value slots, an i32 in the first 4 bytes of each */
    s->args[4] = backtrack;
    s->args[8] = n;
    s->error = rudder_guarded_call(s->deadline, s->context, s->func, s->args, 3, s->trap, s->cpu_budget_ns,
                                   s->wall_budget_ns);
    if (s->error || *s->trap)
        return STEP_FAILED;
    uint32_t ptr = (uint32_t)(s->result = s->args[0]);
    if (((rudder_memory_size_fn)s->memory_size)(s->context, s->memory) != s->size)
        return STEP_DECODE;
    if (ptr == 0 || (uint64_t)ptr + 8 > s->size)
        return STEP_DECODE;
    uint32_t n_branches = load_u32(s->base + ptr), branches = load_u32(s->base + ptr + 4);
    if (n_branches == 0)
        return 0;
    if (n_branches != 1 || (uint64_t)branches + 16 > s->size || load_u32(s->base + branches + 8) != 0)
        return STEP_DECODE;
    uint32_t back = load_u32(s->base + branches), mask = load_u32(s->base + branches + 4);
    if (back >= MAX_PACKED_BACKTRACK)
        return STEP_DECODE;
    if (mask) {
        if ((mask & 3) || (uint64_t)mask + 4 * (uint64_t)s->mask_words > s->size)
            return STEP_DECODE;
        const uint32_t *w = (const uint32_t *)(s->base + mask);
        if (s->tail_bits && (w[s->mask_words - 1] >> s->tail_bits))
            return STEP_DECODE;
        uint32_t i = 0;
        while (i < s->mask_words && w[i] == 0)
            i++;
        if (i == s->mask_words)
            return STEP_DECODE;
    }
    return 1 | (int64_t)mask << 1 | (int64_t)back << 33;
}
