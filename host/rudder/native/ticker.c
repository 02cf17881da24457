/* The epoch ticker of the Wasm sandbox, as a native thread.
 *
 * wasmtime interrupts a guest once the engine's epoch passes the store's deadline; something
 * must advance the epoch every tick. A Python thread doing it takes the GIL 500-1000 times a
 * second and measurably slows the model's forward pass on a small CPU host; this thread never
 * touches Python: it sleeps, calls wasmtime_engine_increment_epoch, and sleeps again.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

typedef void (*rudder_increment_fn)(void *engine);

typedef struct rudder_ticker {
    pthread_t thread;
    atomic_int stop;
    void *engine;
    rudder_increment_fn increment;
    struct timespec period;
} rudder_ticker;

static void *run(void *arg) {
    rudder_ticker *t = arg;
    while (!atomic_load(&t->stop)) {
        nanosleep(&t->period, NULL);
        t->increment(t->engine);
    }
    return NULL;
}

/* Starts ticking `engine` every `period_ns`; NULL if the thread cannot be created. */
rudder_ticker *rudder_ticker_start(void *engine, void *increment, long period_ns) {
    rudder_ticker *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->engine = engine;
    t->increment = (rudder_increment_fn)increment;
    t->period.tv_sec = period_ns / 1000000000L;
    t->period.tv_nsec = period_ns % 1000000000L;
    if (pthread_create(&t->thread, NULL, run, t) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

/* Stops the thread and waits for it; the engine may be freed afterwards. */
void rudder_ticker_stop(rudder_ticker *t) {
    atomic_store(&t->stop, 1);
    pthread_join(t->thread, NULL);
    free(t);
}
