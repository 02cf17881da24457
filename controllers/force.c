/* force: fast-forwards the tokenization of the argument text, then stops. */
#include "rudder.h"

static uint32_t *tokens, n_tokens;

int controller_start(const char *arg, uint32_t len) {
    tokens = rudder_tokenize(arg, len, &n_tokens);
    if (!tokens) {
        rudder_log("force: the text is not valid UTF-8\n");
        return 1;
    }
    rudder_logf("force: %u bytes -> %u tokens\n", len, n_tokens);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    if (step->index == 0 && n_tokens > 0)
        rudder_out_ff(out, tokens, n_tokens);
    /* else: no branch, the sequence stops (right after the forced text) */
}
