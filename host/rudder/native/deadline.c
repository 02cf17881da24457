/* CPU-time deadlines for controller calls, as wasmtime epoch-deadline callbacks.
 *
 * The epoch ticker advances every few milliseconds of wall time; when a store's epoch deadline
 * passes, wasmtime calls rudder_deadline_callback on the guest's own thread. It compares that
 * thread's CPU time (host imports such as tokenizing run on it too) with the call's budget: under
 * budget, the deadline moves on by the ticks still left; over it, the callback returns an error
 * and the call ends. So a controller is charged for the time it computed, not for time its
 * thread waited for a core on a busy machine. A wall-clock cap (several times the budget) still
 * ends a call whose thread is starved for far too long. No Python, no GIL: this runs while the
 * engine thread holds it.
 *
 * Reading a thread's CPU clock is a system call (~0.5 us here; the monotonic clock is not), and
 * almost every call ends long before one tick. So arming reads only the monotonic clock and sets
 * the epoch deadline one tick ahead; the CPU clock is first read at that tick. The CPU time the
 * call took before it is counted as the wall time since the call began, at most one tick: exact
 * for a thread that ran throughout, and at most one tick too much for one that waited.
 */
#include <stdint.h>
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
