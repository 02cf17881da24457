/* fork: at the first step splits the request into N (arg, default 3) freely sampled sequences. */
#include "rudder.h"

static uint32_t n_forks = 3;

int controller_start(const char *arg, uint32_t len) {
    if (len > 0 && !rudder_parse_uint(arg, len, &n_forks)) {
        rudder_logf("fork: the argument must be a number, not \"%.*s\"\n", (int)len, arg);
        return 1;
    }
    int32_t max_forks = rudder_config(RUDDER_CONFIG_MAX_FORKS);
    bool allowed = (rudder_config(RUDDER_CONFIG_FLAGS) & RUDDER_FLAG_FORKS) != 0;
    if (n_forks < 1 || (n_forks > 1 && (!allowed || n_forks > (uint32_t)max_forks))) {
        rudder_logf("fork: cannot fork into %u sequences (forks %s, max_forks %d)\n", n_forks,
                    allowed ? "allowed" : "not allowed", (int)max_forks);
        return 1;
    }
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    if (step->index == 0) {
        for (uint32_t i = 0; i < n_forks; i++)
            rudder_out_sample(out, NULL);   /* same logits, each fork samples on its own */
        return;
    }
    if (step->index == 1)
        rudder_logf("fork: this is fork %u of %u\n", step->branch_idx, n_forks);
    rudder_out_sample(out, NULL);
}
