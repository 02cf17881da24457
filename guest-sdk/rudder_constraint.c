/* rudder_constraint.c - the token layer of rudder_constraint.h. */
#include "rudder_constraint.h"

#define MAX_FORCED 256u       /* forced bytes looked ahead per step (a longer run goes on next step) */
#define LIST_MAX_TOKENS 16u   /* ff lists are offered when a mask allows at most this many tokens */
#define LIST_BUDGET 64u       /* tokens in all the lists of one step, at most */
#define CACHE_SLOTS 64u
#define MAX_KEY 8192u         /* positions with longer keys are not cached */
#define TEXT_SLOTS 64u        /* tokenizations of forced text kept (the same runs come back: `,"`) */

/* One cached answer: the info, its mask (preallocated: growing memory in the middle of a
 * step costs milliseconds), the ff tokens then the list tokens, and the lists. */
typedef struct {
    bool used;
    uint32_t hash, key_len, key_cap;
    uint8_t *key;
    rudder_cx_info info;
    uint32_t *mask;
    uint32_t *toks, n_toks, cap_toks;
    uint32_t *lists, cap_lists;
} entry;

struct rudder_cx {
    rudder_engine e;
    uint32_t origin;                  /* the checkpoint the layer started at */
    uint32_t *cps, n_cps, cap_cps;    /* cps[k]: the checkpoint after k tokens (cps[0]: the start) */
    bool ff;
    uint32_t ff_budget, eos;
    entry *cache, scratch;            /* scratch: the answer when the position has no key */
    uint32_t next_slot, hits, misses;
    uint8_t *keybuf;
    uint32_t *walk_mask;              /* for walks whose tokens are only counted */
    char why[160];
    uint8_t run[MAX_FORCED];
    struct {
        uint8_t *text;
        uint32_t n_text, *toks, n_toks;
    } texts[TEXT_SLOTS];   /* forced text -> its tokens (the tokenize import takes the host's GIL) */
    uint32_t next_text;
};

static void entry_init(entry *e, uint32_t *mask) {
    *e = (entry){.mask = mask};
    e->toks = rudder_xalloc(64 * 4);
    e->cap_toks = 64;
}

rudder_cx *rudder_cx_new(const rudder_engine *engine) {
    rudder_cx *cx = rudder_zalloc(sizeof *cx);
    if (!cx)
        rudder_panic("constraint: out of memory");
    cx->e = *engine;
    int32_t budget = rudder_config(RUDDER_CONFIG_MAX_FF);
    cx->ff_budget = budget > 0 ? (uint32_t)budget : 0;
    cx->ff = cx->ff_budget > 0;
    cx->eos = rudder_eos_token();
    uint32_t words = rudder_mask_words();
    uint32_t *masks = rudder_xalloc((size_t)(CACHE_SLOTS + 2) * words * 4);
    cx->cache = rudder_xalloc(CACHE_SLOTS * sizeof(entry));
    for (uint32_t i = 0; i < CACHE_SLOTS; i++)
        entry_init(&cx->cache[i], masks + (size_t)i * words);
    entry_init(&cx->scratch, masks + (size_t)CACHE_SLOTS * words);
    cx->walk_mask = masks + (size_t)(CACHE_SLOTS + 1) * words;
    cx->keybuf = rudder_xalloc(MAX_KEY);
    cx->cap_cps = 64;
    cx->cps = rudder_xalloc(cx->cap_cps * 4);
    cx->origin = cx->cps[0] = cx->e.save(cx->e.self);
    cx->n_cps = 1;
    /* the first answer now, at start (its deadline is a second): the first step, which also
     * has the first call of the host's tokenizer (a pool warms up), is then a lookup */
    rudder_cx_info_now(cx);
    return cx;
}

const rudder_engine *rudder_cx_engine(const rudder_cx *cx) { return &cx->e; }

void rudder_cx_disable_ff(rudder_cx *cx) {
    cx->ff = false;
    for (uint32_t i = 0; i < CACHE_SLOTS; i++)   /* (answers made with it) */
        cx->cache[i].used = false;
}

uint32_t rudder_cx_count(const rudder_cx *cx) { return cx->n_cps - 1; }

void rudder_cx_stats(const rudder_cx *cx, uint32_t *hits, uint32_t *misses) {
    *hits = cx->hits;
    *misses = cx->misses;
}

bool rudder_cx_begin(rudder_cx *cx, const uint8_t *prefix, uint32_t n) {
    cx->e.restore(cx->e.self, cx->origin);
    cx->n_cps = 1;
    if (n && !cx->e.push(cx->e.self, prefix, n))
        return false;
    cx->cps[0] = n ? cx->e.save(cx->e.self) : cx->origin;
    return true;
}

void rudder_cx_rewind(rudder_cx *cx, uint32_t kept) {
    if (kept > cx->n_cps - 1)
        kept = cx->n_cps - 1;
    cx->e.restore(cx->e.self, cx->cps[kept]);
    cx->n_cps = kept + 1;
}

bool rudder_cx_push(rudder_cx *cx, uint32_t token) {
    uint32_t len;
    const uint8_t *bytes = rudder_token_bytes(token, &len);
    if (!bytes || !len || !cx->e.push(cx->e.self, bytes, len))
        return false;
    cx->cps = rudder_grow(cx->cps, &cx->cap_cps, cx->n_cps + 1, 4);
    cx->cps[cx->n_cps++] = cx->e.save(cx->e.self);
    return true;
}

bool rudder_cx_accepting(rudder_cx *cx) { return cx->e.accepting(cx->e.self); }

bool rudder_cx_follow(rudder_cx *cx, const uint32_t *tokens, uint32_t n, uint32_t kept, uint32_t *bad, bool *ended) {
    *ended = false;
    rudder_cx_rewind(cx, kept < n ? kept : n);
    for (uint32_t i = cx->n_cps - 1; i < n; i++) {
        if (tokens[i] == cx->eos && rudder_cx_accepting(cx)) {
            *ended = true;   /* the output ended (EOS is allowed only where it may) */
            return true;
        }
        if (!rudder_cx_push(cx, tokens[i])) {
            uint32_t len;
            const uint8_t *bytes = rudder_token_bytes(tokens[i], &len);
            rudder_logf("%s: token %u (%.*s) after %u generated tokens does not continue %s\n", cx->e.name, tokens[i],
                        (int)len, bytes ? (const char *)bytes : "", i, cx->e.what);
            *bad = i;
            return false;
        }
    }
    return true;
}

/* Is there a token longer than the one at trie node `node` that continues from here? */
static bool extends(rudder_cx *cx, uint32_t node) {
    const uint32_t *nodes = rudder_trie_get()->nodes;
    if (!node || nodes[2 * node + 1] < 2)
        return false;
    rudder_mask_clear_all(cx->walk_mask);
    return cx->e.walk(cx->e.self, cx->walk_mask, node + 1, node + nodes[2 * node + 1]) > 0;
}

/* The canonical tokens of forced text (NULL when it is not valid UTF-8), remembered per text.
 * The result stays valid until the slot is reused (TEXT_SLOTS later). */
static const uint32_t *tokens_of(rudder_cx *cx, const uint8_t *text, uint32_t n, uint32_t *nt) {
    for (uint32_t i = 0; i < TEXT_SLOTS; i++)
        if (cx->texts[i].text && cx->texts[i].n_text == n && !memcmp(cx->texts[i].text, text, n)) {
            *nt = cx->texts[i].n_toks;
            return cx->texts[i].toks;
        }
    uint32_t *toks = rudder_tokenize(text, n, nt);
    if (!toks)
        return NULL;
    uint32_t k = cx->next_text;
    cx->next_text = (k + 1) % TEXT_SLOTS;
    rudder_free(cx->texts[k].text);
    rudder_free(cx->texts[k].toks);
    cx->texts[k].text = rudder_xalloc(n);
    memcpy(cx->texts[k].text, text, n);
    cx->texts[k].n_text = n;
    cx->texts[k].toks = toks;
    cx->texts[k].n_toks = *nt;
    return toks;
}

/* The forced bytes from here as tokens, appended to e->toks: whole characters, tokenized
 * canonically (none if the tokenizer cannot write them exactly), the last one held back when
 * a longer token starting with it could follow. Returns how many. */
static uint32_t forced_tokens(rudder_cx *cx, entry *en) {
    const rudder_engine *e = &cx->e;
    uint32_t n = e->forced(e->self, cx->run, MAX_FORCED), nt;
    while (n && !rudder_utf8_valid(cx->run, n))   /* ends inside a character: cut it */
        n--;
    const uint32_t *toks = n ? tokens_of(cx, cx->run, n, &nt) : NULL;
    if (!toks)
        return 0;
    uint32_t total = 0, last_len = 0;
    for (uint32_t i = 0; i < nt; i++)   /* the tokenizer may drop bytes it has no token for */
        rudder_token_bytes(toks[i], &last_len), total += last_len;
    if (total != n || nt == 0)
        return 0;
    uint32_t cp = e->save(e->self);
    if (e->push(e->self, cx->run, n) && extends(cx, rudder_trie_node(cx->run + n - last_len, last_len)))
        nt--;
    e->restore(e->self, cp);
    en->toks = rudder_grow(en->toks, &en->cap_toks, en->n_toks + nt + 1, 4);
    memcpy(en->toks + en->n_toks, toks, nt * 4);
    en->n_toks += nt;
    return nt;
}

/* For each allowed token after which bytes are forced: the list [token, forced tokens...]. */
static void add_lists(rudder_cx *cx, entry *en) {
    const rudder_engine *e = &cx->e;
    rudder_cx_info *in = &en->info;
    uint32_t budget = cx->ff_budget < LIST_BUDGET ? cx->ff_budget : LIST_BUDGET, words = rudder_mask_words();
    for (uint32_t w = 0; w < words; w++)
        for (uint32_t bits = en->mask[w]; bits; bits &= bits - 1) {
            uint32_t t = w * 32 + (uint32_t)__builtin_ctz(bits), len;
            const uint8_t *b = rudder_token_bytes(t, &len);
            uint32_t start = en->n_toks, cp = e->save(e->self);
            en->toks = rudder_grow(en->toks, &en->cap_toks, start + 1, 4);
            en->toks[en->n_toks++] = t;
            uint32_t k = e->push(e->self, b, len) ? forced_tokens(cx, en) : 0;
            e->restore(e->self, cp);
            if (!k || k + 1 > budget) {
                en->n_toks = start;
                continue;
            }
            budget -= k + 1;
            en->lists = rudder_grow(en->lists, &en->cap_lists, 2 * in->n_lists + 2, 4);
            en->lists[2 * in->n_lists] = start;
            en->lists[2 * in->n_lists + 1] = k + 1;
            in->n_lists++;
        }
    in->lists = en->lists;
    in->list_tokens = en->toks;
}

static void build(rudder_cx *cx, entry *en) {
    const rudder_engine *e = &cx->e;
    rudder_cx_info *in = &en->info;
    *in = (rudder_cx_info){0};
    en->n_toks = 0;
    in->accepting = e->accepting(e->self);
    if (cx->ff) {
        uint32_t k = forced_tokens(cx, en);
        if (k) {
            in->ff = en->toks;
            in->n_ff = k < cx->ff_budget ? k : cx->ff_budget;   /* the rest comes next step */
            return;
        }
    }
    rudder_mask_clear_all(en->mask);
    in->n_tokens = e->walk(e->self, en->mask, 1, rudder_trie_get()->n_nodes);
    in->mask = en->mask;
    if (in->n_tokens && cx->ff && in->n_tokens <= LIST_MAX_TOKENS)
        add_lists(cx, en);
    if (in->accepting && in->n_tokens && cx->eos != RUDDER_NO_TOKEN)
        rudder_mask_set(en->mask, cx->eos);
}

static uint32_t hash_bytes(const uint8_t *p, uint32_t n) {
    uint32_t h = 2166136261u;
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

const rudder_cx_info *rudder_cx_info_now(rudder_cx *cx) {
    const rudder_engine *e = &cx->e;
    uint32_t len = e->key(e->self, cx->keybuf, MAX_KEY);
    if (len == 0 || len > MAX_KEY) {
        cx->misses++;
        build(cx, &cx->scratch);
        return &cx->scratch.info;
    }
    uint32_t h = hash_bytes(cx->keybuf, len);
    for (uint32_t i = 0; i < CACHE_SLOTS; i++) {
        entry *en = &cx->cache[i];
        if (en->used && en->hash == h && en->key_len == len && memcmp(en->key, cx->keybuf, len) == 0) {
            cx->hits++;
            return &en->info;
        }
    }
    cx->misses++;
    entry *en = &cx->cache[cx->next_slot];
    cx->next_slot = (cx->next_slot + 1) % CACHE_SLOTS;
    if (len > en->key_cap) {
        rudder_free(en->key);
        en->key_cap = len;
        en->key = rudder_xalloc(len);
    }
    en->used = true;
    en->hash = h;
    en->key_len = len;
    memcpy(en->key, cx->keybuf, len);
    build(cx, en);
    return &en->info;
}

/* "<name>: <middle> <what>", for a failure message. */
static const char *say(rudder_cx *cx, const char *middle) {
    uint32_t n = 0;
    const char *parts[] = {cx->e.name, ": ", middle, " ", cx->e.what};
    for (uint32_t p = 0; p < 5; p++)
        for (const char *s = parts[p]; *s && n + 1 < sizeof cx->why; s++)
            cx->why[n++] = *s;
    cx->why[n] = 0;
    return cx->why;
}

rudder_branch *rudder_cx_answer(rudder_cx *cx, const rudder_cx_info *in, rudder_out *out) {
    if (in->n_ff) {
        rudder_out_ff(out, in->ff, in->n_ff);
        return NULL;
    }
    if (!in->n_tokens) {
        if (!in->accepting)
            rudder_out_fail(out, say(cx, "no token of the vocabulary continues"));
        return NULL;   /* complete, and nothing can follow: stop */
    }
    rudder_branch *b = rudder_out_sample(out, in->mask);
    for (uint32_t i = 0; i < in->n_lists; i++)
        rudder_out_ff_list(out, b, in->list_tokens + in->lists[2 * i], in->lists[2 * i + 1]);
    return b;
}

void rudder_cx_step(rudder_cx *cx, const rudder_step *step, rudder_out *out) {
    uint32_t n_gen = step->n_seq - step->n_prompt, had = rudder_cx_count(cx), bad;
    uint32_t kept = step->index == 0 || step->backtrack > had ? 0 : had - step->backtrack;
    bool ended;
    if (!rudder_cx_follow(cx, step->seq + step->n_prompt, n_gen, kept, &bad, &ended)) {
        rudder_out_fail(out, say(cx, "a generated token does not continue"));
        return;
    }
    if (!ended)
        rudder_cx_answer(cx, rudder_cx_info_now(cx), out);
}
