/* uppercase: bytes 0, 4, 8, ... of the output must be capital letters A-Z; stops after N tokens (arg, default 40). */
#include "rudder.h"

static uint32_t max_tokens = 40;

/* The state is the position of the next byte, mod 4. */
static uint32_t push(void *self, uint32_t pos, uint8_t byte) {
    (void)self;
    if (pos == 0 && (byte < 'A' || byte > 'Z'))
        return RUDDER_DEAD;
    return (pos + 1) & 3;
}

static const rudder_recognizer every_4th_upper = {.push = push};

int controller_start(const char *arg, uint32_t len) {
    if (len > 0 && !rudder_parse_uint(arg, len, &max_tokens)) {
        rudder_logf("uppercase: the argument must be a number of tokens, not \"%.*s\"\n", (int)len, arg);
        return 1;
    }
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    uint32_t n_gen = step->n_seq - step->n_prompt;
    if (n_gen >= max_tokens)
        return;   /* stop */
    uint32_t n_bytes = rudder_detokenize(step->seq + step->n_prompt, n_gen, NULL, 0);
    uint32_t *mask = rudder_out_mask(out);
    rudder_trie_fill_mask(mask, &every_4th_upper, n_bytes & 3);
    rudder_out_sample(out, mask);
}
