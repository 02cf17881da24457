/* rudder_constraint.c - the token layer of rudder_constraint.h. */
#include "rudder_constraint.h"

#define MAX_FORCED 256u       /* forced bytes looked ahead per step (a longer run goes on next step) */
#define LIST_MAX_TOKENS 16u   /* ff lists are offered when a mask allows at most this many tokens */
#define LIST_BUDGET 64u       /* tokens in all the lists of one step, at most */
#define TEXT_SLOTS 64u        /* tokenizations of forced text kept (the same runs come back: `,"`) */
/* The answer cache. Positions are many and masks few (JSONSchemaBench requests, median: 94
 * positions, 28 distinct masks; at most 1088 and 86), so answers are found by key in a hash
 * table and share their masks, each kept once. When a bound is reached the cache starts over. */
#define TABLE_SLOTS 4096u     /* open addressing; a power of two */
#define MAX_ENTRIES 2048u     /* the table at most half full */
#define MASK_SLOTS 128u       /* distinct masks (preallocated: growing memory mid-step costs milliseconds) */
#define MAX_KEY 8192u         /* positions with longer keys are not cached */
#define ARENA_BYTES (1u << 20) /* keys; and (in 4-byte words) ff and list tokens */
#define NO_MASK 0xffffffffu

/* One cached answer; its key, tokens and lists live in the arenas. */
typedef struct {
    uint32_t hash, key_at, key_len;
    uint32_t mask;                  /* pool slot, NO_MASK when the answer has none */
    uint32_t toks_at, n_ff, n_tokens, n_lists, lists_at;
    bool accepting;
} entry;

/* An answer being built: its tokens (ff, then the lists') and lists grow here. */
typedef struct {
    uint32_t *toks, n_toks, cap_toks;
    uint32_t *lists, cap_lists;
    rudder_cx_info info;
} building;

struct rudder_cx {
    rudder_engine e;                  /* no functions: no constraint */
    uint32_t origin;                  /* the checkpoint the layer started at */
    uint32_t *cps, n_cps, cap_cps;    /* cps[k]: the checkpoint after k tokens (cps[0]: the start) */
    /* token healing: the taken-back prompt bytes, and healed[k]: how many of them k tokens wrote */
    uint8_t *heal;
    uint32_t n_heal, *healed, cap_healed;
    bool ff;
    uint32_t ff_budget, eos, words;
    /* the cache */
    uint32_t *table;                  /* TABLE_SLOTS entry indices + 1 (0: empty) */
    entry *entries;
    uint32_t n_entries;
    uint32_t *pool, *pool_hash, n_masks;   /* MASK_SLOTS masks */
    uint8_t *keys;
    uint32_t n_keys, cap_keys;
    uint32_t *words_arena, n_words, cap_words;
    rudder_cx_info info;              /* a cached answer, as rudder_cx_info_now returns it */
    uint32_t hits, misses;
    /* building an answer */
    building b;
    uint32_t *build_mask;             /* the mask being built (and a keyless position's) */
    uint32_t *walk_mask;              /* for walks whose tokens are only counted */
    uint8_t *keybuf;
    char why[160];
    uint8_t run[MAX_FORCED];
    struct {
        uint8_t *text;
        uint32_t n_text, *toks, n_toks;
    } texts[TEXT_SLOTS];   /* forced text -> its tokens (the tokenize import takes the host's GIL) */
    uint32_t next_text;
};

static void cache_clear(rudder_cx *cx) {
    memset(cx->table, 0, TABLE_SLOTS * 4);
    cx->n_entries = cx->n_masks = cx->n_keys = cx->n_words = 0;
}

rudder_cx *rudder_cx_new(const rudder_engine *engine) {
    rudder_cx *cx = rudder_zalloc(sizeof *cx);
    if (!cx)
        rudder_panic("constraint: out of memory");
    cx->eos = rudder_eos_token();
    cx->cap_cps = 64;
    cx->cps = rudder_xalloc(cx->cap_cps * 4);
    cx->n_cps = 1;
    if (!engine) {   /* no constraint: no answers to build or cache */
        cx->e.name = "heal";
        cx->e.what = "the taken-back text";
        return cx;
    }
    cx->e = *engine;
    int32_t budget = rudder_config(RUDDER_CONFIG_MAX_FF);
    cx->ff_budget = budget > 0 ? (uint32_t)budget : 0;
    cx->ff = cx->ff_budget > 0;
    cx->words = rudder_mask_words();
    cx->pool = rudder_xalloc((size_t)(MASK_SLOTS + 2) * cx->words * 4);
    cx->build_mask = cx->pool + (size_t)MASK_SLOTS * cx->words;
    cx->walk_mask = cx->build_mask + cx->words;
    cx->pool_hash = rudder_xalloc(MASK_SLOTS * 4);
    cx->table = rudder_xalloc(TABLE_SLOTS * 4);
    cx->entries = rudder_xalloc(MAX_ENTRIES * sizeof(entry));
    cx->keys = rudder_grow(NULL, &cx->cap_keys, 16384, 1);
    cx->words_arena = rudder_grow(NULL, &cx->cap_words, 1024, 4);
    cx->b.toks = rudder_grow(NULL, &cx->b.cap_toks, 64, 4);
    cache_clear(cx);
    cx->keybuf = rudder_xalloc(MAX_KEY);
    cx->origin = cx->cps[0] = cx->e.save(cx->e.self);
    /* the first answer now, at start (its deadline is a second): the first step, which also
     * has the first call of the host's tokenizer (a pool warms up), is then a lookup */
    rudder_cx_info_now(cx);
    return cx;
}

const rudder_engine *rudder_cx_engine(const rudder_cx *cx) { return &cx->e; }

void rudder_cx_disable_ff(rudder_cx *cx) {
    cx->ff = false;
    cache_clear(cx);   /* (answers made with it) */
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
    if (kept >= cx->n_cps - 1)
        return;   /* already there: the engine is at the last checkpoint between calls */
    if (cx->e.restore)
        cx->e.restore(cx->e.self, cx->cps[kept]);
    cx->n_cps = kept + 1;
}

/* Taken-back bytes the tokens followed so far wrote again (token healing). */
static uint32_t healed_now(const rudder_cx *cx) { return cx->n_heal ? cx->healed[cx->n_cps - 1] : 0; }

bool rudder_cx_healing(const rudder_cx *cx) { return healed_now(cx) < cx->n_heal; }

bool rudder_cx_push(rudder_cx *cx, uint32_t token) {
    uint32_t len = 0, done = healed_now(cx), skip = 0;
    const uint8_t *bytes = rudder_token_bytes(token, &len);
    if ((!bytes || !len) && (cx->e.push || done < cx->n_heal))
        return false;   /* a special token continues nothing (free text, with no constraint, takes it) */
    if (done < cx->n_heal) {   /* the taken-back bytes come first; the engine sees what follows them */
        skip = len < cx->n_heal - done ? len : cx->n_heal - done;
        if (memcmp(bytes, cx->heal + done, skip))
            return false;
    }
    if (skip < len && cx->e.push && !cx->e.push(cx->e.self, bytes + skip, len - skip))
        return false;
    cx->cps = rudder_grow(cx->cps, &cx->cap_cps, cx->n_cps + 1, 4);
    cx->cps[cx->n_cps] = cx->e.save ? cx->e.save(cx->e.self) : 0;
    if (cx->n_heal) {
        cx->healed = rudder_grow(cx->healed, &cx->cap_healed, cx->n_cps + 1, 4);
        cx->healed[cx->n_cps] = done + skip;
    }
    cx->n_cps++;
    return true;
}

bool rudder_cx_accepting(rudder_cx *cx) { return !cx->e.accepting || cx->e.accepting(cx->e.self); }

bool rudder_cx_follow(rudder_cx *cx, const uint32_t *tokens, uint32_t n, uint32_t kept, uint32_t *bad, bool *ended) {
    *ended = false;
    rudder_cx_rewind(cx, kept < n ? kept : n);
    for (uint32_t i = cx->n_cps - 1; i < n; i++) {
        if (tokens[i] == cx->eos && !rudder_cx_healing(cx) && rudder_cx_accepting(cx)) {
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

/* The forced bytes from here as tokens, appended to the answer being built: whole characters,
 * tokenized canonically (none if the tokenizer cannot write them exactly), the last one held
 * back when a longer token starting with it could follow. Returns how many. */
static uint32_t forced_tokens(rudder_cx *cx) {
    const rudder_engine *e = &cx->e;
    building *bd = &cx->b;
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
    bd->toks = rudder_grow(bd->toks, &bd->cap_toks, bd->n_toks + nt + 1, 4);
    memcpy(bd->toks + bd->n_toks, toks, nt * 4);
    bd->n_toks += nt;
    return nt;
}

/* For each allowed token of `mask` after which bytes are forced: the list [token, forced
 * tokens...]. (List starts are indices into the answer's tokens.) */
static void add_lists(rudder_cx *cx, const uint32_t *mask) {
    const rudder_engine *e = &cx->e;
    building *bd = &cx->b;
    rudder_cx_info *in = &bd->info;
    uint32_t budget = cx->ff_budget < LIST_BUDGET ? cx->ff_budget : LIST_BUDGET;
    for (uint32_t w = 0; w < cx->words; w++)
        for (uint32_t bits = mask[w]; bits; bits &= bits - 1) {
            uint32_t t = w * 32 + (uint32_t)__builtin_ctz(bits), len;
            const uint8_t *b = rudder_token_bytes(t, &len);
            uint32_t start = bd->n_toks, cp = e->save(e->self);
            bd->toks = rudder_grow(bd->toks, &bd->cap_toks, start + 1, 4);
            bd->toks[bd->n_toks++] = t;
            uint32_t k = e->push(e->self, b, len) ? forced_tokens(cx) : 0;
            e->restore(e->self, cp);
            if (!k || k + 1 > budget) {
                bd->n_toks = start;
                continue;
            }
            budget -= k + 1;
            bd->lists = rudder_grow(bd->lists, &bd->cap_lists, 2 * in->n_lists + 2, 4);
            bd->lists[2 * in->n_lists] = start;
            bd->lists[2 * in->n_lists + 1] = k + 1;
            in->n_lists++;
        }
}

/* The answer at the current position, into cx->b (its mask into cx->build_mask). */
static void build(rudder_cx *cx) {
    const rudder_engine *e = &cx->e;
    building *bd = &cx->b;
    rudder_cx_info *in = &bd->info;
    *in = (rudder_cx_info){0};
    bd->n_toks = 0;
    in->accepting = e->accepting(e->self);
    if (cx->ff) {
        uint32_t k = forced_tokens(cx);
        if (k) {
            in->ff = bd->toks;
            in->n_ff = k < cx->ff_budget ? k : cx->ff_budget;   /* the rest comes next step */
            return;
        }
    }
    rudder_mask_clear_all(cx->build_mask);
    in->n_tokens = e->walk(e->self, cx->build_mask, 1, rudder_trie_get()->n_nodes);
    if (!in->n_tokens)
        return;
    in->mask = cx->build_mask;
    if (cx->ff && in->n_tokens <= LIST_MAX_TOKENS)
        add_lists(cx, cx->build_mask);
    in->lists = bd->lists;
    in->list_tokens = bd->toks;
    if (in->accepting && cx->eos != RUDDER_NO_TOKEN)
        rudder_mask_set(cx->build_mask, cx->eos);
}

/* 32-bit hash of n bytes, 8 at a time (keys run to hundreds of bytes, masks to kilobytes). */
static uint32_t hash_bytes(const uint8_t *p, uint32_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n, w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    if (n) {
        w = 0;
        memcpy(&w, p, n);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
    }
    h ^= h >> 29;
    return (uint32_t)h;
}

/* A mask's fingerprint: four independent sums (a hash's multiply chain over kilobytes costs
 * microseconds); equal masks are then compared whole. */
static uint32_t fingerprint(const uint32_t *mask, uint32_t words) {
    uint32_t a = 0, b = 0, c = 0, d = 0, i = 0;
    for (; i + 4 <= words; i += 4) {
        a += mask[i];
        b ^= mask[i + 1];
        c += mask[i + 2] ^ i;
        d ^= mask[i + 3] + i;
    }
    for (; i < words; i++)
        a ^= mask[i] * 0x9e3779b1u;
    return a ^ (b * 0x85ebca6bu) ^ ((c << 13 | c >> 19) * 0xc2b2ae35u) ^ (d * 0x27d4eb2fu);
}

/* The pool slot of the built mask: an equal mask's, or a new one (there is room). */
static uint32_t pool_slot(rudder_cx *cx) {
    size_t bytes = (size_t)cx->words * 4;
    uint32_t h = fingerprint(cx->build_mask, cx->words);
    for (uint32_t i = 0; i < cx->n_masks; i++)
        if (cx->pool_hash[i] == h && !memcmp(cx->pool + (size_t)i * cx->words, cx->build_mask, bytes))
            return i;
    memcpy(cx->pool + (size_t)cx->n_masks * cx->words, cx->build_mask, bytes);
    cx->pool_hash[cx->n_masks] = h;
    return cx->n_masks++;
}

/* Keep the built answer under the key in keybuf (table slot `slot`, empty). */
static void remember(rudder_cx *cx, uint32_t slot, uint32_t h, uint32_t len) {
    const building *bd = &cx->b;
    const rudder_cx_info *in = &bd->info;
    uint32_t n_words = bd->n_toks + 2 * in->n_lists;
    entry *en = &cx->entries[cx->n_entries];
    *en = (entry){.hash = h, .key_at = cx->n_keys, .key_len = len, .mask = in->mask ? pool_slot(cx) : NO_MASK,
                  .toks_at = cx->n_words, .n_ff = in->n_ff, .n_tokens = in->n_tokens, .n_lists = in->n_lists,
                  .lists_at = cx->n_words + bd->n_toks, .accepting = in->accepting};
    cx->keys = rudder_grow(cx->keys, &cx->cap_keys, cx->n_keys + len, 1);
    memcpy(cx->keys + cx->n_keys, cx->keybuf, len);
    cx->n_keys += len;
    cx->words_arena = rudder_grow(cx->words_arena, &cx->cap_words, cx->n_words + n_words, 4);
    memcpy(cx->words_arena + en->toks_at, bd->toks, bd->n_toks * 4);
    if (in->n_lists)
        memcpy(cx->words_arena + en->lists_at, bd->lists, 2 * in->n_lists * 4);
    cx->n_words += n_words;
    cx->table[slot] = ++cx->n_entries;
}

/* The answer of a cached entry, as rudder_cx_info_now gives it. */
static const rudder_cx_info *info_of(rudder_cx *cx, const entry *en) {
    const uint32_t *toks = cx->words_arena + en->toks_at;
    cx->info = (rudder_cx_info){.accepting = en->accepting, .ff = toks, .n_ff = en->n_ff,
                                .mask = en->mask == NO_MASK ? NULL : cx->pool + (size_t)en->mask * cx->words,
                                .n_tokens = en->n_tokens, .n_lists = en->n_lists,
                                .lists = cx->words_arena + en->lists_at, .list_tokens = toks};
    return &cx->info;
}

const rudder_cx_info *rudder_cx_info_now(rudder_cx *cx) {
    const rudder_engine *e = &cx->e;
    uint32_t len = e->key(e->self, cx->keybuf, MAX_KEY);
    if (len == 0 || len > MAX_KEY) {
        cx->misses++;
        build(cx);
        return &cx->b.info;
    }
    uint32_t h = hash_bytes(cx->keybuf, len), slot = h & (TABLE_SLOTS - 1);
    for (uint32_t i; (i = cx->table[slot]) != 0; slot = (slot + 1) & (TABLE_SLOTS - 1)) {
        const entry *en = &cx->entries[i - 1];
        if (en->hash == h && en->key_len == len && !memcmp(cx->keys + en->key_at, cx->keybuf, len)) {
            cx->hits++;
            return info_of(cx, en);
        }
    }
    cx->misses++;
    if (cx->n_entries == MAX_ENTRIES || cx->n_masks == MASK_SLOTS || cx->n_keys + len > ARENA_BYTES ||
        cx->n_words > ARENA_BYTES / 4) {
        cache_clear(cx);   /* full: start over */
        slot = h & (TABLE_SLOTS - 1);
    }
    build(cx);
    remember(cx, slot, h, len);
    return info_of(cx, &cx->entries[cx->n_entries - 1]);
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

/* -- token healing ---------------------------------------------------------------------------- */

/* Every token of the trie nodes [first, end): what continues when there is no constraint. */
static uint32_t all_tokens(uint32_t *mask, uint32_t first, uint32_t end) {
    const uint32_t *nodes = rudder_trie_get()->nodes;
    uint32_t n = 0;
    for (uint32_t i = first; i < end; i++)
        if (nodes[2 * i] >> 8) {
            rudder_mask_set(mask, (nodes[2 * i] >> 8) - 1);
            n++;
        }
    return n;
}

/* While taken-back bytes remain: sample among the tokens that write all the rest of them (that
 * rest, or the rest and then bytes that continue the constraint), the way the model would write
 * them with what follows; only when none does (a constraint refuses what they would add), among
 * the tokens that write a prefix of the rest. Not EOS. */
static rudder_branch *heal_answer(rudder_cx *cx, rudder_out *out) {
    uint32_t done = healed_now(cx), n = cx->n_heal - done, node = rudder_trie_node(cx->heal + done, n), count = 0;
    const uint32_t *nodes = rudder_trie_get()->nodes;
    uint32_t *mask = rudder_out_mask(out);
    if (node) {   /* the rest's trie node: its token, and the longer ones in its subtree */
        uint32_t first = node + 1, end = node + nodes[2 * node + 1];
        count = cx->e.walk ? cx->e.walk(cx->e.self, mask, first, end) : all_tokens(mask, first, end);
        count += all_tokens(mask, node, node + 1);
    }
    if (!count)   /* none: the tokens that write a prefix of the rest */
        for (uint32_t d = 1, at; d < n && (at = rudder_trie_node(cx->heal + done, d)) != 0; d++)
            count += all_tokens(mask, at, at + 1);
    if (!count) {
        rudder_out_fail(out, "token healing: no token writes the taken-back text again");
        return NULL;
    }
    return rudder_out_sample(out, mask);
}

/* The first step of a healing request: take back the prompt's last k tokens and sample under the
 * healing mask. false when the host asks for no healing. */
static bool heal_first(rudder_cx *cx, const rudder_step *step, rudder_out *out) {
    int32_t k = rudder_config(RUDDER_CONFIG_HEAL);
    if (k <= 0)
        return false;
    if ((uint32_t)k >= step->n_prompt) {
        rudder_out_fail(out, "token healing: the host asks to take back the whole prompt");
        return true;
    }
    uint32_t first = step->n_prompt - (uint32_t)k, n = 0, len;
    for (uint32_t i = first; i < step->n_prompt; i++) {
        if (!rudder_token_bytes(step->seq[i], &len) || !len) {
            rudder_out_fail(out, "token healing: the host asks to take back a special token");
            return true;
        }
        n += len;
    }
    cx->heal = rudder_xalloc(n);
    cx->n_heal = 0;
    for (uint32_t i = first; i < step->n_prompt; i++) {
        const uint8_t *b = rudder_token_bytes(step->seq[i], &len);
        memcpy(cx->heal + cx->n_heal, b, len);
        cx->n_heal += len;
    }
    cx->healed = rudder_grow(cx->healed, &cx->cap_healed, cx->cap_cps, 4);
    rudder_cx_rewind(cx, 0);
    cx->healed[0] = 0;
    rudder_branch *b = heal_answer(cx, out);
    if (b)
        b->backtrack = (uint32_t)k;
    return true;
}

void rudder_cx_step(rudder_cx *cx, const rudder_step *step, rudder_out *out) {
    if (step->index == 0 && heal_first(cx, step, out))
        return;
    uint32_t n_gen = step->n_seq - step->n_prompt, had = rudder_cx_count(cx), bad;
    uint32_t kept = step->index == 0 || step->backtrack > had ? 0 : had - step->backtrack;
    bool ended;
    if (!rudder_cx_follow(cx, step->seq + step->n_prompt, n_gen, kept, &bad, &ended)) {
        rudder_out_fail(out, say(cx, "a generated token does not continue"));
        return;
    }
    if (ended)
        return;
    if (rudder_cx_healing(cx))
        heal_answer(cx, out);
    else if (!cx->e.push)
        rudder_out_sample(out, NULL);   /* no constraint */
    else
        rudder_cx_answer(cx, rudder_cx_info_now(cx), out);
}
