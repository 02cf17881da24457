/* triggers: free text, until the output ends with a trigger string; then a constraint (a JSON
 * Schema, a regex or a grammar) until its text is complete; then an optional end string
 * (fast-forwarded), then free text again - or the end of the output. "Think, then answer in
 * JSON"; tool calls inside free text. The argument (docs/constraints.md, "Triggered
 * constraints"):
 *
 *   {"reasoning": {"end": "</think>", "budget": 200},      (optional: free thinking first)
 *    "start": {"json": {...schema...}, "stop": true},       (optional: constrained from the start)
 *    "triggers": [{"begin": "<tool_call>", "json": {...schema...}, "end": "</tool_call>"},
 *                 {"begin": "Answer: ", "regex": "(yes|no)", "stop": true}],
 *    "at_least_one": false}
 *
 * One of "json" (a schema), "regex" or "grammar" per trigger; "end" and "stop" are optional.
 * The phases come in order: the thinking (until its end string; fast-forwarded once `budget`
 * tokens are generated), the start constraint, then free text with triggers.
 * The constrained text is followed by the token layer (rudder_constraint.h) of its engine. */
#include "rudder.h"
#include "rudder_constraint.h"
#include "rudder_grammar.h"
#include "rudder_json.h"
#include "rudder_jsonschema.h"
#include "rudder_regex.h"

#define MAX_TRIGGERS 16u
#define MAX_BEGIN 64u     /* bytes of a trigger string */
#define MAX_END 256u      /* bytes of an end string */
#define START MAX_TRIGGERS  /* triggers[START]: the "start" constraint (no begin string) */

typedef struct {
    uint8_t begin[MAX_BEGIN];
    uint32_t n_begin;
    uint8_t end[MAX_END];
    uint32_t n_end;
    uint32_t *end_tokens, n_end_tokens;   /* the end string, tokenized */
    bool stop;
    rudder_cx *cx;
    uint32_t cx_start;   /* the segment its layer follows now (its first whole token), NONE: none */
} trigger;

/* Where the output stands after a token. */
enum { FREE, SEG, END, STOPPED, THINK };
typedef struct {
    uint8_t mode, t;      /* SEG, END: the trigger */
    uint8_t fired;        /* some trigger has fired (at_least_one) */
    uint32_t start;       /* SEG: the index of the segment's first whole token */
    uint32_t k;           /* END: bytes of the end string written; FREE, THINK: bytes in tail */
    uint8_t tail[MAX_BEGIN];   /* FREE, THINK: the last bytes of free text (a trigger may span tokens) */
} rec;

static trigger triggers[MAX_TRIGGERS + 1];
static uint32_t n_triggers;
static bool has_start, at_least_one;
static uint8_t think_end[MAX_BEGIN];   /* the thinking's end string; 0 bytes: no thinking */
static uint32_t n_think_end, think_budget = 0xffffffffu;
static uint32_t *no_eos;               /* every text token (no EOS, no special token): text that may not end yet */
static rec *recs;                 /* recs[i]: after i generated tokens */
static uint32_t n_recs, cap_recs;

static int refuse(const char *why) {
    rudder_logf("triggers: %s\n", why);
    return 1;
}

static bool copy_string(const rudder_jv *v, uint8_t *dst, uint32_t cap, uint32_t *n) {
    if (!v || v->type != RUDDER_JV_STRING || v->n > cap)
        return false;
    memcpy(dst, v->str, v->n);
    *n = v->n;
    return true;
}

/* The constraint of one trigger: its engine and token layer. */
static bool make_constraint(trigger *t, const rudder_jv *spec, const char *what) {
    static char err[400];
    const rudder_jv *json = rudder_jv_get(spec, "json"), *regex = rudder_jv_get(spec, "regex");
    const rudder_jv *grammar = rudder_jv_get(spec, "grammar");
    if (!!json + !!regex + !!grammar != 1) {
        rudder_logf("triggers: %s needs exactly one of \"json\", \"regex\", \"grammar\"\n", what);
        return false;
    }
    rudder_engine e;
    if (json) {
        uint32_t n = rudder_jv_write(json, NULL, 0);
        char *text = rudder_xalloc(n + 1);
        rudder_jv_write(json, (uint8_t *)text, n);
        rudder_js *js = rudder_js_compile(text, n, err, sizeof err);
        rudder_free(text);
        if (!js) {
            rudder_logf("triggers: %s: json: %s\n", what, err);
            return false;
        }
        e = rudder_js_engine(js);
    } else if (regex) {
        rudder_rx *rx = regex->type == RUDDER_JV_STRING ? rudder_rx_compile((const char *)regex->str, regex->n, err, sizeof err) : NULL;
        if (!rx) {
            rudder_logf("triggers: %s: regex: %s\n", what, regex->type == RUDDER_JV_STRING ? err : "must be a string");
            return false;
        }
        e = rudder_rx_engine(rx);
    } else {
        rudder_grammar *g = grammar->type == RUDDER_JV_STRING ? rudder_gm_new((const char *)grammar->str, grammar->n, err, sizeof err) : NULL;
        if (!g) {
            rudder_logf("triggers: %s: grammar: %s\n", what, grammar->type == RUDDER_JV_STRING ? err : "must be a string");
            return false;
        }
        e = rudder_gm_engine(g);
    }
    t->cx = rudder_cx_new(&e);
    return true;
}

int controller_init(void) {
    rudder_js_init_tables();
    return 0;
}

/* Does object `v` have only keys among `known` (NULL-terminated)? Else logs the first other. */
static bool known_keys(const rudder_jv *v, const char *what, const char *const *known) {
    for (uint32_t i = 0; i < v->n; i++) {
        bool ok = false;
        for (const char *const *k = known; *k && !ok; k++)
            ok = v->keys[i].len == strlen(*k) && !memcmp(v->keys[i].ptr, *k, v->keys[i].len);
        if (!ok) {
            rudder_logf("triggers: unknown key \"%.*s\" in %s\n", (int)v->keys[i].len, (const char *)v->keys[i].ptr, what);
            return false;
        }
    }
    return true;
}

/* A trigger (begin, constraint, end, stop) or the start constraint (no begin). */
static bool read_segment(trigger *t, const rudder_jv *spec, const char *what) {
    static const char *const keys[] = {"begin", "json", "regex", "grammar", "end", "stop", NULL};
    if (spec->type != RUDDER_JV_OBJECT)
        return refuse(t == &triggers[START] ? "\"start\" must be an object" : "each trigger must be an object"), false;
    if (!known_keys(spec, what, t == &triggers[START] ? keys + 1 : keys))
        return false;
    if (t != &triggers[START] && (!copy_string(rudder_jv_get(spec, "begin"), t->begin, MAX_BEGIN, &t->n_begin) || t->n_begin == 0))
        return refuse("each trigger needs \"begin\": a string of 1 to 64 bytes"), false;
    const rudder_jv *end = rudder_jv_get(spec, "end"), *stop = rudder_jv_get(spec, "stop");
    if (end && !copy_string(end, t->end, MAX_END, &t->n_end))
        return refuse("\"end\" must be a string of at most 256 bytes"), false;
    if (stop && stop->type != RUDDER_JV_TRUE && stop->type != RUDDER_JV_FALSE)
        return refuse("\"stop\" must be true or false"), false;
    t->stop = stop && stop->type == RUDDER_JV_TRUE;
    if (t->n_end && !(t->end_tokens = rudder_tokenize(t->end, t->n_end, &t->n_end_tokens)))
        return refuse("\"end\" is not valid UTF-8"), false;
    if (!make_constraint(t, spec, what))
        return false;
    t->cx_start = 0xffffffffu;
    return true;
}

static bool read_reasoning(const rudder_jv *v) {
    static const char *const keys[] = {"end", "budget", NULL};
    if (v->type != RUDDER_JV_OBJECT || !known_keys(v, "\"reasoning\"", keys))
        return v->type == RUDDER_JV_OBJECT ? false : (refuse("\"reasoning\" must be an object"), false);
    if (!copy_string(rudder_jv_get(v, "end"), think_end, MAX_BEGIN, &n_think_end) || n_think_end == 0)
        return refuse("\"reasoning\" needs \"end\": a string of 1 to 64 bytes"), false;
    const rudder_jv *budget = rudder_jv_get(v, "budget");
    if (budget && budget->type != RUDDER_JV_NULL) {
        if (budget->type != RUDDER_JV_NUMBER || !budget->integral || budget->num < 0 || budget->num > 1e9)
            return refuse("\"budget\" must be a whole number of tokens (or null)"), false;
        think_budget = (uint32_t)budget->num;
    }
    return true;
}

int controller_start(const char *arg, uint32_t len) {
    static const char *const keys[] = {"triggers", "start", "reasoning", "at_least_one", NULL};
    static char err[160], what[32];
    rudder_jv *doc = rudder_jv_parse(arg, len, err, sizeof err);
    if (!doc)
        return rudder_logf("triggers: the argument is not valid JSON: %s\n", err), 1;
    if (doc->type != RUDDER_JV_OBJECT)
        return refuse("the argument must be an object: {\"triggers\": [...]}");
    if (!known_keys(doc, "the argument", keys))
        return 1;
    const rudder_jv *list = rudder_jv_get(doc, "triggers"), *start = rudder_jv_get(doc, "start");
    const rudder_jv *reasoning = rudder_jv_get(doc, "reasoning"), *least = rudder_jv_get(doc, "at_least_one");
    uint32_t n = list && list->type == RUDDER_JV_ARRAY ? list->n : 0;
    if ((list && list->type != RUDDER_JV_ARRAY) || n > MAX_TRIGGERS || (n == 0 && !start && !reasoning))
        return refuse("the argument must be {\"triggers\": [...]} with 1 to 16 triggers (or a \"start\" or \"reasoning\")");
    if (least && least->type != RUDDER_JV_TRUE && least->type != RUDDER_JV_FALSE)
        return refuse("\"at_least_one\" must be true or false");
    at_least_one = least && least->type == RUDDER_JV_TRUE;
    if (at_least_one && n == 0)
        return refuse("\"at_least_one\" needs triggers");
    if (reasoning && !read_reasoning(reasoning))
        return 1;
    if (start && !read_segment(&triggers[START], start, "\"start\""))
        return 1;
    has_start = start != NULL;
    for (uint32_t i = 0; i < n; i++) {
        memcpy(what, "trigger ", 8);   /* "trigger <i>" (i < 16) */
        what[8] = i < 10 ? (char)('0' + i) : '1';
        what[9] = i < 10 ? 0 : (char)('0' + i - 10);
        what[10] = 0;
        if (!read_segment(&triggers[n_triggers++], &list->items[i], what))
            return 1;
    }
    rudder_jv_free(doc);
    if (has_start || at_least_one) {   /* the end waits for what must come: text tokens only */
        no_eos = rudder_mask_new();
        for (uint32_t t = 0, n_vocab = rudder_vocab_size(), len; t < n_vocab; t++)
            if (rudder_token_bytes(t, &len) && len)
                rudder_mask_set(no_eos, t);
    }
    cap_recs = 64;
    recs = rudder_xalloc(cap_recs * sizeof(rec));
    memset(&recs[0], 0, sizeof(rec));
    recs[0].mode = n_think_end ? THINK : has_start ? SEG : FREE;
    recs[0].t = has_start && !n_think_end ? START : 0;
    n_recs = 1;
    return 0;
}

/* Free text goes on with one byte (kept in r's tail: a string may span tokens). */
static void tail_byte(rec *r, uint8_t b) {
    if (r->k == MAX_BEGIN) {
        memmove(r->tail, r->tail + 1, MAX_BEGIN - 1);
        r->k--;
    }
    r->tail[r->k++] = b;
}

static bool tail_ends_with(const rec *r, const uint8_t *s, uint32_t n) {
    return r->k >= n && !memcmp(r->tail + r->k - n, s, n);
}

/* Free text goes on with one byte: the trigger whose begin it completes, or -1. */
static int32_t free_byte(rec *r, uint8_t b) {
    tail_byte(r, b);
    for (uint32_t i = 0; i < n_triggers; i++)
        if (tail_ends_with(r, triggers[i].begin, triggers[i].n_begin))
            return (int32_t)i;
    return -1;
}

/* After the segment of trigger t: its end string, or the end of the output, or free text. */
static rec after_segment(rec from) {
    rec r = {0};
    r.mode = triggers[from.t].n_end ? END : triggers[from.t].stop ? STOPPED : FREE;
    r.t = from.t;
    r.fired = from.fired;
    return r;
}

/* Bytes of thinking, free text or an end string; SEG when a segment begins (the bytes after
 * its trigger begin it: *rest, *n_rest). */
static rec text_bytes(rec r, const uint8_t *b, uint32_t n, uint32_t next_token, const uint8_t **rest, uint32_t *n_rest) {
    *n_rest = 0;
    for (uint32_t j = 0; j < n; j++) {
        if (r.mode == THINK) {
            tail_byte(&r, b[j]);
            if (!tail_ends_with(&r, think_end, n_think_end))
                continue;
            if (has_start) {
                r = (rec){.mode = SEG, .t = START, .start = next_token, .fired = r.fired};
                *rest = b + j + 1;
                *n_rest = n - j - 1;
                return r;
            }
            r = (rec){.mode = FREE, .fired = r.fired};
            continue;
        }
        if (r.mode == END) {
            const trigger *t = &triggers[r.t];
            if (b[j] != t->end[r.k]) {   /* (the model left the end string: free text) */
                r = (rec){.mode = FREE, .fired = r.fired};
                j--;
            } else if (++r.k == t->n_end) {
                r = (rec){.mode = t->stop ? STOPPED : FREE, .fired = r.fired};
            }
            continue;
        }
        if (r.mode != FREE)
            break;
        int32_t fired = free_byte(&r, b[j]);
        if (fired >= 0) {
            r = (rec){.mode = SEG, .t = (uint8_t)fired, .start = next_token, .fired = 1};
            *rest = b + j + 1;
            *n_rest = n - j - 1;
            return r;
        }
    }
    return r;
}

/* The layer of segment r, back to after its first `k` tokens. A trigger's layer serves one
 * segment at a time: after a backtrack into an earlier segment of the same trigger it begins
 * that one again (from the trigger's token) and follows its tokens. */
static bool segment_at(const uint32_t *gen, rec r, uint32_t k) {
    trigger *t = &triggers[r.t];
    if (t->cx_start != r.start && r.start == 0) {   /* the start constraint, from the first byte */
        if (!rudder_cx_begin(t->cx, NULL, 0))
            return false;
        t->cx_start = 0;
        for (uint32_t j = 0; j < k; j++)
            if (!rudder_cx_push(t->cx, gen[j]))
                return false;
    } else if (t->cx_start != r.start) {
        uint32_t len, n_rest;
        const uint8_t *b = rudder_token_bytes(gen[r.start - 1], &len), *rest = NULL;
        rec fired = text_bytes(recs[r.start - 1], b, len, r.start, &rest, &n_rest);
        if (fired.mode != SEG || !rudder_cx_begin(t->cx, rest, n_rest))
            return false;
        t->cx_start = r.start;
        for (uint32_t j = 0; j < k; j++)
            if (!rudder_cx_push(t->cx, gen[r.start + j]))
                return false;
    }
    rudder_cx_rewind(t->cx, k);
    return rudder_cx_count(t->cx) == k;
}

static void save(uint32_t i, rec r) {
    recs = rudder_grow(recs, &cap_recs, i + 1, sizeof(rec));
    recs[i] = r;
    n_recs = i + 1;
}

/* The answer inside a segment: the constraint's, and where it may be complete, the end string. */
static void answer_segment(trigger *t, const rudder_cx_info *in, rudder_out *out) {
    rudder_branch *b = rudder_cx_answer(t->cx, in, out);
    if (!b || !in->accepting || !t->n_end_tokens || rudder_mask_test(in->mask, t->end_tokens[0]))
        return;
    uint32_t *mask = rudder_out_mask(out);   /* (the layer's mask is cached: a copy) */
    memcpy(mask, in->mask, rudder_mask_words() * 4);
    rudder_mask_set(mask, t->end_tokens[0]);
    b->mask = mask;
    rudder_out_ff_list(out, b, t->end_tokens, t->n_end_tokens);
}

void controller_step(const rudder_step *step, rudder_out *out) {
    const uint32_t *gen = step->seq + step->n_prompt;
    uint32_t n_gen = step->n_seq - step->n_prompt, had = n_recs - 1;
    uint32_t kept = step->index == 0 || step->backtrack > had ? 0 : had - step->backtrack;
    if (kept > n_gen)
        kept = n_gen;
    rec r = recs[kept];
    for (uint32_t i = kept; i < n_gen; i++) {
        uint32_t len;
        const uint8_t *b = rudder_token_bytes(gen[i], &len);
        if (gen[i] == rudder_eos_token())
            return;   /* the output ended */
        if (r.mode == SEG) {
            /* the segment's tokens through its layer, one at a time: it may end before this one */
            trigger *t = &triggers[r.t];
            if (!segment_at(gen, r, i - r.start)) {
                rudder_out_fail(out, "triggers: cannot rewind the constrained text");
                return;
            }
            if (rudder_cx_push(t->cx, gen[i])) {
                save(i + 1, r);
                continue;
            }
            if (!rudder_cx_accepting(t->cx)) {
                rudder_logf("triggers: token %u (%.*s) after %u generated tokens does not continue the constrained text\n",
                            gen[i], (int)len, b ? (const char *)b : "", i);
                rudder_out_fail(out, "triggers: a generated token does not continue the constrained text");
                return;
            }
            r = after_segment(r);   /* complete before this token: its bytes come after */
        }
        if (r.mode == STOPPED) {
            rudder_out_fail(out, "triggers: a token after the end of the output");
            return;
        }
        if (!b || !len) {   /* a token without text (a control token) adds nothing to free text */
            save(i + 1, r);
            continue;
        }
        const uint8_t *rest;
        uint32_t n_rest;
        rec next = text_bytes(r, b, len, i + 1, &rest, &n_rest);
        if (next.mode == SEG)
            triggers[next.t].cx_start = next.start;
        if (next.mode == SEG && !rudder_cx_begin(triggers[next.t].cx, rest, n_rest)) {
            triggers[next.t].cx_start = 0xffffffffu;
            if (i + 1 != n_gen) {
                rudder_out_fail(out, "triggers: text after a trigger does not begin its constrained text");
                return;
            }
            /* this token went past its trigger with bytes the constraint refuses: take it back and
             * write the text up to the trigger's end instead */
            uint32_t n;
            uint32_t *toks = rudder_tokenize(b, len - n_rest, &n);
            if (!toks || !n) {
                rudder_out_fail(out, "triggers: cannot write the text before a trigger");
                return;
            }
            save(i + 1, r);   /* (the host holds i + 1 tokens until it takes this one back) */
            rudder_out_ff(out, toks, n)->backtrack = 1;
            rudder_free(toks);
            return;
        }
        r = next;
        save(i + 1, r);
    }
    save(n_gen, r);
    switch (r.mode) {
    case FREE:
        rudder_out_sample(out, at_least_one && !r.fired ? no_eos : NULL);
        return;
    case THINK: {
        if (n_gen < think_budget) {
            rudder_out_sample(out, has_start || at_least_one ? no_eos : NULL);
            return;
        }
        /* the budget is spent: the rest of the end string (some of it may be written) */
        uint32_t k = n_think_end - 1, n;
        while (k && !tail_ends_with(&r, think_end, k))
            k--;
        uint32_t *toks = rudder_tokenize(think_end + k, n_think_end - k, &n);
        if (!toks || !n)
            rudder_out_fail(out, "triggers: cannot write the reasoning's end string");
        else
            rudder_out_ff(out, toks, n);
        rudder_free(toks);
        return;
    }
    case STOPPED:
        return;
    case END: {   /* the rest of the end string */
        const trigger *t = &triggers[r.t];
        uint32_t n;
        uint32_t *toks = rudder_tokenize(t->end + r.k, t->n_end - r.k, &n);
        if (!toks || !n)
            rudder_out_sample(out, NULL);
        else
            rudder_out_ff(out, toks, n);
        rudder_free(toks);
        return;
    }
    default: {
        trigger *t = &triggers[r.t];
        if (!segment_at(gen, r, n_gen - r.start)) {
            rudder_out_fail(out, "triggers: cannot rewind the constrained text");
            return;
        }
        const rudder_cx_info *in = rudder_cx_info_now(t->cx);
        if (in->n_ff || in->n_tokens) {
            answer_segment(t, in, out);
            return;
        }
        if (!in->accepting) {
            rudder_cx_answer(t->cx, in, out);   /* (fails: nothing continues) */
            return;
        }
        r = after_segment(r);   /* complete, nothing can follow */
        save(n_gen, r);
        if (r.mode == END) {
            rudder_out_ff(out, t->end_tokens, t->n_end_tokens);
        } else if (r.mode == FREE) {
            rudder_out_sample(out, NULL);
        }
    }
    }
}
