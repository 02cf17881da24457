/* backtrack: free sampling, but a banned word (arg, default " very") is taken back and resampled differently. */
#include "rudder.h"

/* Whenever the generated text contains the word, remove the tokens from the one where it
 * starts, and sample again at that position with every token banned there so far left out.
 * (A host stop, e.g. max_tokens, right after the word was sampled leaves it in place.) */

#define MAX_BACKTRACKS 100

typedef struct {
    uint32_t pos, token;
} ban;

static const char *word = " very";
static uint32_t word_len = 5, n_backtracks, n_bans;
static ban bans[MAX_BACKTRACKS];
static bool giving_up;

int controller_start(const char *arg, uint32_t len) {
    if (len > 0)
        word = arg, word_len = len;
    if (!(rudder_config(RUDDER_CONFIG_FLAGS) & RUDDER_FLAG_BACKTRACK)) {
        rudder_log("backtrack: this server does not allow backtracking\n");
        return 1;
    }
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    if (giving_up)
        return;   /* stop */
    const uint32_t *gen = step->seq + step->n_prompt;
    uint32_t n_gen = step->n_seq - step->n_prompt, k = 0, tok_start = 0, len;
    uint32_t n_bytes = rudder_detokenize(gen, n_gen, NULL, 0);
    uint8_t *text = rudder_xalloc(n_bytes + 1);
    rudder_detokenize(gen, n_gen, text, n_bytes);
    uint32_t at = 0;
    while (at + word_len <= n_bytes && memcmp(text + at, word, word_len) != 0)
        at++;
    rudder_free(text);
    if (at + word_len > n_bytes) {
        rudder_out_sample(out, NULL);
        return;
    }
    while (rudder_token_bytes(gen[k], &len), tok_start + len <= at)   /* the token holding byte `at` */
        tok_start += len, k++;
    uint32_t pos = step->n_prompt + k, back = step->n_seq - pos;
    if (pos == 0) {
        rudder_out_fail(out, "the banned word starts in the first token");
        return;
    }
    while (n_bans > 0 && bans[n_bans - 1].pos > pos)   /* bans for a prefix that is gone */
        n_bans--;
    bans[n_bans++] = (ban){pos, gen[k]};
    uint32_t *mask = rudder_out_mask(out);
    rudder_mask_set_all(mask);
    for (uint32_t i = 0; i < n_bans; i++)
        if (bans[i].pos == pos)
            rudder_mask_clear(mask, bans[i].token);
    if (++n_backtracks == MAX_BACKTRACKS || rudder_mask_count(mask) == 0) {
        rudder_logf("backtrack: giving up after %u tries; removing the word and stopping\n", n_backtracks);
        rudder_out_backtrack(out, back);
        giving_up = true;
        return;
    }
    rudder_logf("backtrack: \"%.*s\" found; removing %u tokens, banning token %u at position %u\n",
                (int)word_len, word, back, gen[k], pos);
    rudder_out_sample(out, mask)->backtrack = back;
}
