/* regex: the output matches the regular expression in the argument (whole match). */
#include "rudder.h"
#include "rudder_regex.h"

/* ff tokens attached to one masked step (all lists together), at most; the host's budget may
 * be lower. Lists are only a shortcut, so a small cap keeps the step small. */
#define MAX_LIST_TOKENS 256u
/* Forced bytes followed in one go, at most (a longer run continues at the next step). */
#define MAX_FORCED 1024u

static rudder_rx *rx;
static uint32_t start_state;
static uint32_t *states, n_states, cap_states;   /* states[k]: the DFA state after k generated tokens */
static uint32_t eos, ff_budget;
static uint8_t *run;                              /* scratch for forced bytes */

/* Per DFA state, built on its first visit: the mask (with EOS when the state accepts) and the
 * ff lists of tokens after which the constraint forces more bytes. */
typedef struct {
    const uint32_t *mask; /* NULL: no token continues */
    uint32_t *lists;      /* [len, tokens...] one after another */
    uint32_t n_lists;
    bool ready;
} state_info;
static state_info *infos;
static uint32_t cap_infos;

int controller_start(const char *arg, uint32_t len) {
    static char err[256];
    rx = rudder_rx_compile(arg, len, err, sizeof err);
    if (!rx) {
        rudder_logf("regex: %s\n", err);
        return 1;
    }
    start_state = rudder_rx_start(rx, NULL);
    eos = rudder_eos_token();
    int32_t budget = rudder_config(RUDDER_CONFIG_MAX_FF);
    ff_budget = budget > 0 ? (uint32_t)budget : 0;
    run = rudder_xalloc(MAX_FORCED);
    return 0;
}

/* The forced bytes from `state` (whole UTF-8 characters only: the tokenizer takes text) into
 * run[]; returns their number and the state after them in *end. */
static uint32_t forced_run(uint32_t state, uint32_t *end) {
    uint32_t n = 0, whole = 0, whole_state = state;
    int32_t b;
    while (n < MAX_FORCED && (b = rudder_rx_forced_byte(rx, state)) >= 0) {
        run[n++] = (uint8_t)b;
        state = rudder_rx_push(rx, state, (uint8_t)b);
        if (rudder_utf8_valid(run + whole, n - whole))   /* a partial character is invalid */
            whole = n, whole_state = state;
    }
    *end = whole_state;
    return whole;
}

/* Tokens for the forced run from `state` as a fast-forward: all of them when the run
 * completes the match, else all but the last (it could merge with what comes next). NULL
 * when nothing is left; the caller frees the result. */
static uint32_t *forced_tokens(uint32_t state, uint32_t *n_out) {
    uint32_t end, n = forced_run(state, &end), n_toks;
    *n_out = 0;
    if (n == 0)
        return NULL;
    uint32_t *toks = rudder_tokenize(run, n, &n_toks);
    if (!toks)
        return NULL;
    /* The tokenizer may drop bytes it has no token for: then no shortcut. */
    uint32_t total = 0;
    for (uint32_t i = 0; i < n_toks; i++) {
        uint32_t len;
        rudder_token_bytes(toks[i], &len);
        total += len;
    }
    if (total != n)
        n_toks = 0;
    else if (rudder_rx_can_extend(rx, end) || !rudder_rx_accepting(rx, end))
        n_toks--;
    if (n_toks == 0) {
        rudder_free(toks);
        return NULL;
    }
    *n_out = n_toks;
    return toks;
}

/* Tokens allowed at a state whose end state forces more bytes: candidates for ff lists. */
typedef struct {
    uint32_t *tokens, n, cap;
} candidates;

static bool note_forced(void *self, uint32_t state, uint32_t token) {
    candidates *c = self;
    if (c->n < c->cap && rudder_rx_forced_byte(rx, state) >= 0)
        c->tokens[c->n++] = token;
    return true;
}

static uint32_t push(void *self, uint32_t state, uint8_t byte) {
    (void)self;
    return rudder_rx_push(rx, state, byte);
}

static const state_info *info(uint32_t state) {
    if (state >= cap_infos) {
        uint32_t old = cap_infos, cap = cap_infos ? cap_infos : 64;
        while (cap <= state)
            cap *= 2;
        infos = rudder_realloc(infos, cap * sizeof(state_info));
        if (!infos)
            rudder_panic("regex: out of memory");
        memset(infos + old, 0, (cap - old) * sizeof(state_info));
        cap_infos = cap;
    }
    if (infos[state].ready)
        return &infos[state];
    /* One trie walk gives the mask and the tokens after which bytes are forced. */
    uint32_t *mask = rudder_mask_new(), limit = ff_budget < MAX_LIST_TOKENS ? ff_budget : MAX_LIST_TOKENS;
    if (!mask)
        rudder_panic("regex: out of memory");
    uint32_t cand[MAX_LIST_TOKENS];
    candidates c = {.tokens = cand, .cap = limit / 2};   /* a list is at least 2 tokens */
    rudder_recognizer r = {.push = push, .allow = note_forced, .self = &c};
    uint32_t count = rudder_trie_fill_mask(mask, &r, state);
    if (rudder_rx_accepting(rx, state) && eos != RUDDER_NO_TOKEN) {
        rudder_mask_set(mask, eos);
        count++;
    }
    uint32_t *lists = NULL, used = 0, n_lists = 0, list_tokens = 0;
    for (uint32_t i = 0; i < c.n; i++) {
        uint32_t len, n_toks;
        const uint8_t *bytes = rudder_token_bytes(cand[i], &len);
        uint32_t after = rudder_rx_push_bytes(rx, state, bytes, len);
        uint32_t *toks = forced_tokens(after, &n_toks);
        if (toks && list_tokens + 1 + n_toks <= limit) {
            list_tokens += 1 + n_toks;
            lists = rudder_realloc(lists, (used + 2 + n_toks) * sizeof(uint32_t));
            if (!lists)
                rudder_panic("regex: out of memory");
            lists[used] = 1 + n_toks;
            lists[used + 1] = cand[i];
            memcpy(lists + used + 2, toks, n_toks * sizeof(uint32_t));
            used += 2 + n_toks;
            n_lists++;
        }
        rudder_free(toks);
    }
    state_info *si = &infos[state];   /* `infos` does not move during the walk */
    si->mask = count ? mask : NULL;
    si->lists = lists;
    si->n_lists = n_lists;
    si->ready = true;
    return si;
}

void controller_step(const rudder_step *step, rudder_out *out) {
    /* Rewind: states[k] stays valid for the first k generated tokens that are still there. */
    uint32_t n_gen = step->n_seq - step->n_prompt;
    if (n_states == 0) {
        states = rudder_xalloc(64 * sizeof(uint32_t));
        cap_states = 64;
        states[0] = start_state;
        n_states = 1;
    }
    uint32_t known = n_states - 1;
    known = step->backtrack > known ? 0 : known - step->backtrack;
    if (known > n_gen)
        known = n_gen;
    uint32_t state = states[known];
    for (uint32_t i = known; i < n_gen; i++) {
        uint32_t len, tok = step->seq[step->n_prompt + i];
        const uint8_t *bytes = rudder_token_bytes(tok, &len);
        if (!bytes || (len == 0 && tok == eos)) {
            rudder_out_fail(out, "regex: a special token was generated inside the match");
            return;
        }
        state = rudder_rx_push_bytes(rx, state, bytes, len);
        if (state == RUDDER_DEAD) {
            rudder_logf("regex: token %u (%.*s) after %u generated tokens cannot continue the match\n",
                        tok, (int)len, (const char *)bytes, i);
            rudder_out_fail(out, "regex: a generated token does not continue the match");
            return;
        }
        if (i + 2 > cap_states) {
            cap_states *= 2;
            states = rudder_realloc(states, cap_states * sizeof(uint32_t));
            if (!states)
                rudder_panic("regex: out of memory");
        }
        states[i + 1] = state;
    }
    n_states = n_gen + 1;

    if (rudder_rx_accepting(rx, state) && !rudder_rx_can_extend(rx, state))
        return;   /* the match is complete: stop */
    uint32_t n_ff;
    uint32_t *ff = ff_budget ? forced_tokens(state, &n_ff) : NULL;
    if (ff) {
        rudder_out_ff(out, ff, n_ff < ff_budget ? n_ff : ff_budget);
        rudder_free(ff);
        return;
    }
    const state_info *si = info(state);
    if (!si->mask) {
        rudder_out_fail(out, "regex: no token of the vocabulary continues the match");
        return;
    }
    rudder_branch *b = rudder_out_sample(out, si->mask);
    for (uint32_t i = 0, at = 0; i < si->n_lists; i++) {
        rudder_out_ff_list(out, b, si->lists + at + 1, si->lists[at]);
        at += 1 + si->lists[at];
    }
}
