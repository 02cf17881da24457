/* grammar: the output is a sentence of the context-free grammar in the argument (docs/grammar.md). */
#include "rudder.h"
#include "rudder_grammar.h"

/* Forced bytes followed in one go, at most (a longer run continues at the next step). */
#define MAX_FORCED 1024u
/* ff lists are offered when at most this many tokens are allowed, each at most this long. */
#define MAX_LIST_CANDIDATES 16u
#define MAX_LIST_TOKENS 64u

static rudder_grammar *g;
static rudder_gm_pos *saved;       /* saved[k]: the parse after k generated tokens */
static uint32_t n_saved, cap_saved, eos, ff_budget;
static uint8_t *run;

int controller_start(const char *arg, uint32_t len) {
    static char err[256];
    g = rudder_gm_new(arg, len, err, sizeof err);
    if (!g) {
        rudder_logf("grammar: %s\n", err);
        return 1;
    }
    eos = rudder_eos_token();
    int32_t budget = rudder_config(RUDDER_CONFIG_MAX_FF);
    ff_budget = budget > 0 ? (uint32_t)budget : 0;
    run = rudder_xalloc(MAX_FORCED);
    cap_saved = 64;
    saved = rudder_xalloc(cap_saved * sizeof *saved);
    saved[0] = rudder_gm_save(g);
    n_saved = 1;
    return 0;
}

/* Bring the parse to the generated tokens: back to the last position still valid, then push
 * the new tokens. false (after failing the step) when a token does not continue a sentence. */
static bool follow(const rudder_step *step, rudder_out *out) {
    uint32_t n_gen = step->n_seq - step->n_prompt, known = n_saved - 1;
    known = step->backtrack > known ? 0 : known - step->backtrack;
    if (known > n_gen)
        known = n_gen;
    rudder_gm_restore(g, saved[known]);
    for (uint32_t i = known; i < n_gen; i++) {
        uint32_t len, tok = step->seq[step->n_prompt + i];
        const uint8_t *bytes = rudder_token_bytes(tok, &len);
        if (!bytes || len == 0) {
            rudder_out_fail(out, "grammar: a special token was generated inside the sentence");
            return false;
        }
        if (!rudder_gm_push(g, bytes, len)) {
            rudder_logf("grammar: token %u (%.*s) after %u generated tokens does not continue a sentence\n",
                        tok, (int)len, (const char *)bytes, i);
            rudder_out_fail(out, "grammar: a generated token does not continue a sentence of the grammar");
            return false;
        }
        if (i + 2 > cap_saved) {
            cap_saved *= 2;
            saved = rudder_realloc(saved, cap_saved * sizeof *saved);
            if (!saved)
                rudder_panic("grammar: out of memory");
        }
        saved[i + 1] = rudder_gm_save(g);
    }
    n_saved = n_gen + 1;
    return true;
}

/* The tokens to fast-forward for the bytes the grammar forces now (whole UTF-8 characters,
 * tokenized canonically): all of them when they finish the sentence, else all but the last,
 * which could merge with the free text after it. NULL when there are none (free the result). */
static uint32_t *forced_tokens(uint32_t *n_out) {
    uint32_t n = rudder_gm_forced(g, run, MAX_FORCED), n_toks, total = 0;
    *n_out = 0;
    while (n && !rudder_utf8_valid(run, n))
        n--;
    uint32_t *toks = n ? rudder_tokenize(run, n, &n_toks) : NULL;
    if (!toks)
        return NULL;
    for (uint32_t i = 0; i < n_toks; i++) {   /* the tokenizer may drop bytes it has no token for */
        uint32_t len;
        rudder_token_bytes(toks[i], &len);
        total += len;
    }
    rudder_gm_pos here = rudder_gm_save(g);
    bool finished = total == n && rudder_gm_push(g, run, n) && rudder_gm_accepting(g) && !rudder_gm_can_continue(g);
    rudder_gm_restore(g, here);
    if (total != n || (!finished && --n_toks == 0)) {
        rudder_free(toks);
        return NULL;
    }
    *n_out = n_toks;
    return toks;
}

/* When few tokens are allowed, give each one after which bytes are forced an ff list: the
 * token, then the forced tokens (one step instead of several). */
static void add_ff_lists(rudder_out *out, rudder_branch *b, const uint32_t *mask, uint32_t count) {
    uint32_t used = 0, words = rudder_mask_words(), list[1 + MAX_LIST_TOKENS];
    if (count > MAX_LIST_CANDIDATES || !ff_budget)
        return;
    rudder_gm_pos here = rudder_gm_save(g);
    for (uint32_t w = 0; w < words; w++)
        for (uint32_t bits = mask[w]; bits; bits &= bits - 1) {
            uint32_t t = 32 * w + (uint32_t)__builtin_ctz(bits), len, n;
            const uint8_t *bytes = rudder_token_bytes(t, &len);
            if (!len || !rudder_gm_push(g, bytes, len))
                continue;   /* EOS */
            uint32_t *toks = forced_tokens(&n);
            rudder_gm_restore(g, here);
            if (toks && n <= MAX_LIST_TOKENS && used + 1 + n <= ff_budget) {
                list[0] = t;
                memcpy(list + 1, toks, n * sizeof(uint32_t));
                rudder_out_ff_list(out, b, list, 1 + n);
                used += 1 + n;
            }
            rudder_free(toks);
        }
}

void controller_step(const rudder_step *step, rudder_out *out) {
    if (!follow(step, out))
        return;
    uint32_t n_ff;
    uint32_t *ff = ff_budget ? forced_tokens(&n_ff) : NULL;
    if (ff) {
        rudder_out_ff(out, ff, n_ff < ff_budget ? n_ff : ff_budget);
        rudder_free(ff);
        return;
    }
    uint32_t *mask = rudder_out_mask(out);
    uint32_t count = rudder_gm_fill_mask(g, mask);
    if (rudder_gm_accepting(g)) {
        if (count == 0 || eos == RUDDER_NO_TOKEN)
            return;   /* the sentence is complete and nothing can extend it: stop */
        rudder_mask_set(mask, eos);
        count++;
    }
    if (count == 0) {
        rudder_out_fail(out, "grammar: no token of the vocabulary continues the sentence");
        return;
    }
    add_ff_lists(out, rudder_out_sample(out, mask), mask, count);
}
