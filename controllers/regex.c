/* regex: the output matches the regular expression in the argument (whole match). */
#include "rudder.h"
#include "rudder_regex.h"

/* ff tokens attached to one masked step (all lists together), at most; the host's budget may
 * be lower. Lists are only a shortcut, so a small cap keeps the step small. */
#define MAX_LIST_TOKENS 64u
/* Forced bytes followed in one go, at most (a longer run continues at the next step). */
#define MAX_FORCED 1024u
/* Memory for cached masks, at most. */
#define MAX_MASK_BYTES (16u << 20)

static rudder_rx *rx;
static uint32_t start_state;
static uint32_t *states, n_states, cap_states;   /* states[k]: the DFA state after k generated tokens */
static uint32_t eos, ff_budget;
static uint8_t *run;                              /* scratch for forced bytes */

/* Per DFA state, built on first use: the mask (with EOS when the state accepts), the ff lists
 * of the tokens after which the constraint forces more bytes, and the fast-forward from the
 * state itself (the forced tokens). */
typedef struct {
    const uint32_t *mask;   /* the cached mask, or NULL (not cached, or no token continues) */
    uint32_t *lists;        /* [len, tokens...] one after another */
    uint32_t n_lists;
    uint32_t *ff, n_ff;     /* NULL: nothing to fast-forward */
    bool ready;             /* the lists are known (the mask may not be cached) */
    bool empty;             /* no token continues */
    bool ff_ready;
} state_info;
static state_info *infos;
static uint32_t cap_infos, cached_masks;

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
    uint32_t keep = total != n ? 0 : rudder_rx_can_extend(rx, end) || !rudder_rx_accepting(rx, end) ? n_toks - 1 : n_toks;
    /* End on a whole character (tokens can hold parts of one): what follows starts cleanly. */
    uint32_t bytes = 0, boundary = 0;
    n_toks = 0;
    for (uint32_t i = 0; i < keep; i++) {
        uint32_t len;
        rudder_token_bytes(toks[i], &len);
        bytes += len;
        if (rudder_utf8_valid(run + boundary, bytes - boundary))
            boundary = bytes, n_toks = i + 1;
    }
    if (n_toks == 0) {
        rudder_free(toks);
        return NULL;
    }
    *n_out = n_toks;
    return toks;
}

/* Tokens allowed at a state after which bytes are forced: candidates for ff lists. */
typedef struct {
    uint32_t *tokens, *ends, n, cap;
} candidates;

/* Per DFA state: 0 not known yet, 1 a byte is forced, 2 none (the walk asks once per token). */
static uint8_t *forces;
static uint32_t cap_forces;

static bool note_forced(void *self, uint32_t state, uint32_t token) {
    candidates *c = self;
    if (c->n >= c->cap)
        return true;
    if (state >= cap_forces) {
        uint32_t old = cap_forces;
        forces = rudder_grow(forces, &cap_forces, state + 1, 1);
        memset(forces + old, 0, cap_forces - old);
    }
    if (!forces[state])
        forces[state] = rudder_rx_forced_byte(rx, state) >= 0 ? 1 : 2;
    if (forces[state] == 1) {
        c->tokens[c->n] = token;
        c->ends[c->n++] = state;
    }
    return true;
}

static uint32_t push(void *self, uint32_t state, uint8_t byte) {
    (void)self;
    return rudder_rx_push(rx, state, byte);
}

/* The state's entry (`infos` may move: do not keep the pointer across another slot() call). */
static state_info *slot(uint32_t state) {
    if (state >= cap_infos) {
        uint32_t old = cap_infos;
        infos = rudder_grow(infos, &cap_infos, state + 1, sizeof(state_info));
        memset(infos + old, 0, (cap_infos - old) * sizeof(state_info));
    }
    return &infos[state];
}

/* The fast-forward from `state`, computed once per state. */
static const uint32_t *forced_ff(uint32_t state, uint32_t *n) {
    state_info *si = slot(state);
    if (!si->ff_ready) {
        uint32_t n_ff;
        uint32_t *ff = forced_tokens(state, &n_ff);
        si = slot(state);
        si->ff = ff;
        si->n_ff = n_ff;
        si->ff_ready = true;
    }
    *n = si->n_ff;
    return si->ff;
}

/* The mask of `state` (NULL: no token continues) and, in its slot, its ff lists. Masks are
 * cached per state up to MAX_MASK_BYTES; past that, a state's mask is rebuilt in the SDK's
 * per-step mask whenever it is needed (a very long pattern cannot exhaust memory). */
static const uint32_t *mask_of(uint32_t state, rudder_out *out) {
    state_info *si = slot(state);
    if (si->ready && (si->mask || si->empty))
        return si->mask;
    bool cache = cached_masks < MAX_MASK_BYTES / (rudder_mask_words() * 4);
    bool lists_wanted = !si->ready;
    uint32_t *mask = cache ? rudder_mask_new() : rudder_out_mask(out);
    if (!mask)
        rudder_panic("regex: out of memory");
    /* One trie walk gives the mask and the tokens after which bytes are forced. */
    uint32_t limit = ff_budget < MAX_LIST_TOKENS ? ff_budget : MAX_LIST_TOKENS;
    uint32_t cand[MAX_LIST_TOKENS / 2], ends[MAX_LIST_TOKENS / 2];
    candidates c = {.tokens = cand, .ends = ends, .cap = lists_wanted ? limit / 2 : 0};   /* a list is >= 2 tokens */
    /* Two calls, so that each inlines its recognizer (no call per trie node). */
    static const rudder_recognizer plain = {.push = push};
    const rudder_recognizer noting = {.push = push, .allow = note_forced, .self = &c};
    uint32_t count = c.cap ? rudder_trie_fill_mask(mask, &noting, state) : rudder_trie_fill_mask(mask, &plain, state);
    if (rudder_rx_accepting(rx, state) && eos != RUDDER_NO_TOKEN) {
        rudder_mask_set(mask, eos);
        count++;
    }
    uint32_t *lists = NULL, used = 0, n_lists = 0, list_tokens = 0;
    for (uint32_t i = 0; i < c.n; i++) {
        uint32_t n_ff;
        const uint32_t *ff = forced_ff(ends[i], &n_ff);
        if (!ff || list_tokens + 1 + n_ff > limit)
            continue;
        list_tokens += 1 + n_ff;
        lists = rudder_realloc(lists, (used + 2 + n_ff) * sizeof(uint32_t));
        if (!lists)
            rudder_panic("regex: out of memory");
        lists[used] = 1 + n_ff;
        lists[used + 1] = cand[i];
        memcpy(lists + used + 2, ff, n_ff * sizeof(uint32_t));
        used += 2 + n_ff;
        n_lists++;
    }
    si = slot(state);
    if (lists_wanted) {
        si->lists = lists;
        si->n_lists = n_lists;
        si->ready = true;
    }
    si->empty = count == 0;
    if (cache && count) {
        si->mask = mask;
        cached_masks++;
    } else if (cache) {
        rudder_free(mask);
    }
    return count ? mask : NULL;
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
        if (!bytes || len == 0) {
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
    const uint32_t *ff = ff_budget ? forced_ff(state, &n_ff) : NULL;
    if (ff) {
        rudder_out_ff(out, ff, n_ff < ff_budget ? n_ff : ff_budget);
        return;
    }
    const uint32_t *mask = mask_of(state, out);
    if (!mask) {
        rudder_out_fail(out, "regex: no token of the vocabulary continues the match");
        return;
    }
    const state_info *si = slot(state);
    rudder_branch *b = rudder_out_sample(out, mask);
    for (uint32_t i = 0, at = 0; i < si->n_lists; i++) {
        rudder_out_ff_list(out, b, si->lists + at + 1, si->lists[at]);
        at += 1 + si->lists[at];
    }
}
