/* rudder_jsonschema_compile.c - JSON Schema text -> the node graph of rudder_jsonschema_nodes.h.
 *
 * Three stages:
 * 1. Bundles. A schema object with its combinators becomes a disjunction of *bundles* (its
 *    DNF): a bundle is a set of allowed types with, per type, the constraints of plain keywords
 *    (properties, items, lengths, bounds, patterns, enum...). Subschemas below (a property's
 *    value, the items) are kept as *conjunctions* of schema objects, compiled later. allOf, $ref
 *    with siblings and keywords beside a combinator merge bundles; anyOf/oneOf distribute over
 *    them. Every schema object's DNF is computed once.
 * 2. Lowering. A conjunction becomes a node: a union of one node per (bundle, type), each built
 *    from the bundle's constraints; its subschemas become nodes in turn (memoized per
 *    conjunction, so $ref recursion is a cycle in the graph).
 * 3. Finishing: the bytes each node can start with, and the nesting each needs at least.
 * Enum/const values are checked against the rest of their schema by a small validator.
 * Keyword policy (docs/json-schema.md): assertions are honoured or refused with their JSON
 * path; unknown keywords and annotations are ignored; a few assertions are documented relaxed.
 */
#include "rudder_jsonschema_nodes.h"
#include "rudder_json.h"

#define MAX_ALTERNATIVES 256u   /* bundles one schema expands to, at most */
#define WORK_BUDGET 3000000u    /* merges, nodes and validator steps of one compile, at most */
#define MAX_NODES 65535u
#define MAX_LOWER_DEPTH 160u    /* nesting of subschemas compiled inside each other */

enum { T_OBJECT = 1, T_ARRAY = 2, T_STRING = 4, T_NUMBER = 8, T_INTEGER = 16, T_BOOLEAN = 32, T_NULL = 64, T_ALL = 127 };

/* ------------------------------------------------------------------ arena */

typedef struct ablock {
    struct ablock *prev;
    uint32_t used, cap;
} ablock;

/* ------------------------------------------------------------------ bundles */

typedef struct {
    const rudder_jv **s;   /* schema objects that all apply; n == 0: anything */
    uint32_t n;
} conj;

typedef struct {
    rudder_str name;
    conj value;
} bprop;

typedef struct {
    rudder_str name;
    const rudder_jv *list;   /* a JSON array of property names */
} bdep;

typedef struct {
    const rudder_jv *pattern;
    conj value;
} bpat;

enum { RX_PATTERN, RX_FORMAT, RX_EXACT };

typedef struct {
    const rudder_jv *src;    /* a pattern (searched), a format name, or a regex matched whole */
    uint8_t kind;
    bool negated;            /* the string must not match it */
} bregex;

typedef struct bundle {
    uint32_t types;
    /* object */
    bprop *props;
    uint32_t n_props;
    rudder_str *req;
    uint32_t n_req;
    bdep *deps;
    uint32_t n_deps;
    conj add;                /* extra keys (matching no pattern): their values */
    bool no_add, add_set;    /* no extra keys; some part set additionalProperties */
    bpat *pats;
    uint32_t n_pats;
    conj pats_add;           /* what extra keys matching a pattern must also meet (allOf merges) */
    conj names;              /* propertyNames */
    rudder_str *forbid;      /* keys that must not be there (not: {required: [...]}) */
    uint32_t n_forbid;
    uint32_t min_props, max_props;
    /* array */
    conj *prefix;
    uint32_t n_prefix;
    conj items;
    bool no_items, items_set, has_contains;   /* items_set: some part set items (after a prefix) */
    conj contains;
    uint32_t min_contains, min_items, max_items;
    /* string */
    uint32_t min_len, max_len;
    bregex rx[STRING_RX];
    uint32_t n_rx;
    /* number */
    bool has_lo, has_hi, lo_excl, hi_excl;
    double lo, hi, mult;
    /* enum / const */
    bool has_enum;
    const rudder_jv **enums;
    uint32_t n_enum;
    /* schemas a value must not be valid against, with no finite form here: only checked on
     * enum/const values (by the validator); without an enum they are refused */
    const rudder_jv **nots;
    uint32_t n_nots;
} bundle;

typedef struct {
    bundle **b;
    uint32_t n;
} dnf;

typedef struct {
    const rudder_jv *key;
    dnf d;
    uint8_t state;   /* 1: being computed, 2: done */
} dnf_slot;

typedef struct {
    uint32_t hash, node;
    conj c;
} term_slot;

typedef struct {
    const uint8_t *text;   /* a pattern, a format's name or a whole-match regex, by content */
    uint32_t len;
    uint8_t kind;
    rudder_rx *rx;
} rx_slot;

typedef struct {
    char *buf;
    uint32_t n, cap;
} sbuf;

typedef struct comp {
    rudder_js *js;
    const rudder_jv *doc;
    char *err;
    uint32_t cap;
    bool failed;
    ablock *arena;
    dnf_slot *dnfs;
    uint32_t dnf_mask, n_dnfs;
    term_slot *terms;
    uint32_t term_mask, n_terms;
    rx_slot *rxs;
    uint32_t n_rxs, cap_rxs;
    uint32_t work, depth;
    bool old_ref;            /* draft 4-7: $ref ignores its siblings */
    bool forbid;             /* "x-rudder-undeclared": "forbid": objects and tuples generate what they name */
    bool strict;             /* "x-rudder-strict": what is relaxed is refused */
    const rudder_jv *root_id;
    bundle any;
    sbuf *enum_pats;         /* the regex sources of enums of strings (jnode.enum_pat) */
    uint32_t n_enum_pats, cap_enum_pats;
} comp;

static void *aalloc(comp *c, uint32_t bytes) {
    bytes = (bytes + 7u) & ~7u;
    ablock *b = c->arena;
    if (!b || b->cap - b->used < bytes) {
        uint32_t cap = bytes > 32768 ? bytes : 32768;
        b = rudder_xalloc(sizeof(ablock) + cap);
        b->prev = c->arena;
        b->used = 0;
        b->cap = cap;
        c->arena = b;
    }
    void *p = (uint8_t *)(b + 1) + b->used;
    b->used += bytes;
    return p;
}

static void *acopy(comp *c, const void *src, uint32_t bytes) {
    void *p = aalloc(c, bytes ? bytes : 1);
    if (bytes)
        memcpy(p, src, bytes);
    return p;
}

/* ------------------------------------------------------------------ errors and paths */

static void put(char *dst, uint32_t cap, uint32_t *n, const char *s, uint32_t len) {
    for (uint32_t i = 0; i < len && *n + 1 < cap; i++)
        dst[(*n)++] = s[i];
    if (cap)
        dst[*n] = 0;
}

static void put_uint(char *dst, uint32_t cap, uint32_t *n, uint32_t v) {
    char d[12];
    uint32_t k = 0;
    do
        d[k++] = (char)('0' + v % 10);
    while ((v /= 10));
    while (k)
        put(dst, cap, n, &d[--k], 1);
}

/* The JSON pointer of `target` inside the document, written to dst ("#" for the root). An
 * iterative depth-first search: paths are only needed for error messages. */
static void path_of(const rudder_jv *doc, const rudder_jv *target, char *dst, uint32_t cap, uint32_t *n) {
    enum { MAXD = 520 };
    static const rudder_jv *stack[MAXD];
    static uint32_t index[MAXD];
    uint32_t sp = 0, start = *n;
    put(dst, cap, n, "#", 1);
    if (!target || doc == target)
        return;
    stack[0] = doc;
    index[0] = 0;
    sp = 1;
    while (sp) {
        const rudder_jv *v = stack[sp - 1];
        uint32_t i = index[sp - 1]++;
        bool container = v->type == RUDDER_JV_OBJECT || v->type == RUDDER_JV_ARRAY;
        if (!container || i >= v->n || sp == MAXD) {
            sp--;
            continue;
        }
        const rudder_jv *child = &v->items[i];
        if (child == target) {
            stack[sp] = child;
            index[sp - 1] = i + 1;
            for (uint32_t d = 0; d < sp; d++) {   /* write the path: the step taken at each depth */
                const rudder_jv *p = stack[d];
                uint32_t k = index[d] - 1;
                put(dst, cap, n, "/", 1);
                if (p->type == RUDDER_JV_ARRAY) {
                    put_uint(dst, cap, n, k);
                } else {
                    const rudder_str *key = &p->keys[k];
                    for (uint32_t j = 0; j < key->len; j++) {
                        char ch = (char)key->ptr[j];
                        put(dst, cap, n, ch == '~' ? "~0" : ch == '/' ? "~1" : &ch, ch == '~' || ch == '/' ? 2 : 1);
                    }
                }
            }
            return;
        }
        stack[sp] = child;
        index[sp] = 0;
        sp++;
    }
    *n = start;
    put(dst, cap, n, "#?", 2);
}

/* Fail with "<what> "<name>" at <path of where>[/<name>]" (the first failure wins). */
static bool fail_at(comp *c, const rudder_jv *where, const char *what, const char *name, uint32_t name_len, bool name_in_path) {
    if (c->failed)
        return false;
    c->failed = true;
    uint32_t n = 0;
    put(c->err, c->cap, &n, what, (uint32_t)strlen(what));
    if (name) {
        put(c->err, c->cap, &n, " \"", 2);
        put(c->err, c->cap, &n, name, name_len);
        put(c->err, c->cap, &n, "\"", 1);
    }
    put(c->err, c->cap, &n, " at ", 4);
    path_of(c->doc, where, c->err, c->cap, &n);
    if (name && name_in_path) {
        put(c->err, c->cap, &n, "/", 1);
        put(c->err, c->cap, &n, name, name_len);
    }
    return false;
}

static bool fail(comp *c, const rudder_jv *where, const char *what) { return fail_at(c, where, what, NULL, 0, false); }
static bool fail_kw(comp *c, const rudder_jv *where, const char *what, const char *kw) {
    return fail_at(c, where, what, kw, (uint32_t)strlen(kw), false);
}

/* Strict mode's refusal of what it would otherwise relax: "strict: "<kw>"[ <value>] <why> at
 * <path>" (value: the keyword's string value, e.g. the format's name). */
static bool fail_strict(comp *c, const rudder_jv *where, const char *kw, const rudder_jv *value, const char *why) {
    if (c->failed)
        return false;
    c->failed = true;
    uint32_t n = 0;
    put(c->err, c->cap, &n, "strict: \"", 9);
    put(c->err, c->cap, &n, kw, (uint32_t)strlen(kw));
    put(c->err, c->cap, &n, "\" ", 2);
    if (value && value->type == RUDDER_JV_STRING) {
        put(c->err, c->cap, &n, "\"", 1);
        put(c->err, c->cap, &n, (const char *)value->str, value->n);
        put(c->err, c->cap, &n, "\" ", 2);
    }
    put(c->err, c->cap, &n, why, (uint32_t)strlen(why));
    put(c->err, c->cap, &n, " at ", 4);
    path_of(c->doc, where, c->err, c->cap, &n);
    return false;
}

static bool spend(comp *c, const rudder_jv *where, uint32_t units) {
    c->work += units;
    if (c->work > WORK_BUDGET && !c->failed)
        return fail(c, where, "the schema is too complex to compile (its combinators and references expand past the work limit)");
    return !c->failed;
}

/* ------------------------------------------------------------------ keywords */

/* Assertions refused (with their path); everything not listed here or handled below is an
 * annotation or unknown, and ignored. */
static const char *const REFUSED[] = {
    "$dynamicRef", "$recursiveRef", "unevaluatedItems", "maxContains", NULL,
};

static bool key_is(const rudder_str *k, const char *s) { return k->len == strlen(s) && memcmp(k->ptr, s, k->len) == 0; }

static const rudder_jv *get(const rudder_jv *s, const char *k) { return rudder_jv_get(s, k); }

static bool jv_equal(const rudder_jv *a, const rudder_jv *b) {
    if (a->type != b->type)
        return false;
    switch (a->type) {
    case RUDDER_JV_NUMBER:
        return a->num == b->num;
    case RUDDER_JV_STRING:
        return a->n == b->n && memcmp(a->str, b->str, a->n) == 0;
    case RUDDER_JV_ARRAY:
        if (a->n != b->n)
            return false;
        for (uint32_t i = 0; i < a->n; i++)
            if (!jv_equal(&a->items[i], &b->items[i]))
                return false;
        return true;
    case RUDDER_JV_OBJECT:
        if (a->n != b->n)
            return false;
        for (uint32_t i = 0; i < a->n; i++) {
            bool found = false;
            for (uint32_t j = 0; j < b->n && !found; j++)
                if (a->keys[i].len == b->keys[j].len && memcmp(a->keys[i].ptr, b->keys[j].ptr, a->keys[i].len) == 0)
                    found = jv_equal(&a->items[i], &b->items[j]);
            if (!found)
                return false;
        }
        return true;
    default:
        return true;
    }
}

static bool str_eq(const rudder_str *a, const rudder_str *b) { return a->len == b->len && memcmp(a->ptr, b->ptr, a->len) == 0; }

/* ------------------------------------------------------------------ regexes */

static const struct {
    const char *name, *rx;
} FORMATS[] = {
    {"date", "[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"},
    {"time", "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"},
    {"date-time", "[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
                  "[Tt](?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"},
    {"duration", "P(?:[0-9]+W|(?:[0-9]+Y(?:[0-9]+M)?(?:[0-9]+D)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)(?:T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S))?"
                 "|T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S))"},
    {"email", "[A-Za-z0-9_.+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\\.[A-Za-z0-9-]{1,63}){0,4}\\.[A-Za-z]{2,12}"},
    {"hostname", "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?){0,8}"},
    {"ipv4", "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(?:\\.(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}"},
    {"ipv6", "(?:(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}|(?:[0-9A-Fa-f]{1,4}:){1,7}:|(?:[0-9A-Fa-f]{1,4}:){1,6}:[0-9A-Fa-f]{1,4}"
             "|(?:[0-9A-Fa-f]{1,4}:){1,5}(?::[0-9A-Fa-f]{1,4}){1,2}|(?:[0-9A-Fa-f]{1,4}:){1,4}(?::[0-9A-Fa-f]{1,4}){1,3}"
             "|(?:[0-9A-Fa-f]{1,4}:){1,3}(?::[0-9A-Fa-f]{1,4}){1,4}|(?:[0-9A-Fa-f]{1,4}:){1,2}(?::[0-9A-Fa-f]{1,4}){1,5}"
             "|[0-9A-Fa-f]{1,4}:(?::[0-9A-Fa-f]{1,4}){1,6}|:(?:(?::[0-9A-Fa-f]{1,4}){1,7}|:))"},
    {"uri", "[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9._~:/?#\\[\\]@!$&'()*+,;=%-]+"},
    {"uri-reference", "[A-Za-z0-9._~:/?#\\[\\]@!$&'()*+,;=%-]*"},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {NULL, NULL},
};

static int32_t format_index(const rudder_jv *f) {
    for (int32_t i = 0; FORMATS[i].name; i++)
        if (rudder_jv_equal_str(f, FORMATS[i].name))
            return i;
    return -1;
}

static void sb_put(sbuf *b, const char *s, uint32_t len) {
    b->buf = rudder_grow(b->buf, &b->cap, b->n + len + 1, 1);
    memcpy(b->buf + b->n, s, len);
    b->n += len;
    b->buf[b->n] = 0;
}

static void sb_literal(sbuf *b, const uint8_t *s, uint32_t n);

/* A JSON Schema pattern as one of our regexes: ECMA-262 searches (unanchored unless ^/$), and
 * writes named groups as (?<name>...); each top-level alternative keeps its own anchors.
 * Returns whether no alternative is anchored at the start: then the regex never dies on
 * valid text (its leading .* takes anything), only its match at the end matters. *open_end
 * (when given): none is anchored at the end, so a match stays one whatever follows. */
static bool pattern_regex(const rudder_jv *p, sbuf *out, bool *open_end) {
    const char *src = (const char *)p->str;
    uint32_t n = p->n, start = 0, depth = 0;
    bool in_class = false, free = true;
    const char *any = "(?:.|\n)*";
    sb_put(out, "(?:", 3);
    for (uint32_t i = 0; i <= n; i++) {
        bool split = i == n;
        if (!split) {
            if (src[i] == '\\') {
                i++;
                continue;
            }
            if (in_class) {
                in_class = src[i] != ']';
                continue;
            }
            if (src[i] == '[')
                in_class = true;
            else if (src[i] == '(')
                depth++;
            else if (src[i] == ')' && depth)
                depth--;
            else if (src[i] == '|' && depth == 0)
                split = true;
        }
        if (!split)
            continue;
        const char *a = src + start;
        uint32_t len = i - start;
        bool head = len && a[0] == '^', tail = len > head && a[len - 1] == '$' && (len < 2 || a[len - 2] != '\\');
        if (start)
            sb_put(out, "|", 1);
        free &= !head;
        if (open_end)
            *open_end &= !tail;
        if (!head)
            sb_put(out, any, (uint32_t)strlen(any));
        sb_put(out, "(?:", 3);
        for (uint32_t k = head; k < len - tail; k++) {   /* (?<name> -> (?P<name> */
            if (a[k] == '\\' && k + 1 < len - tail) {
                sb_put(out, a + k, 2);
                k++;
                continue;
            }
            if (a[k] == '(' && k + 2 < len && a[k + 1] == '?' && a[k + 2] == '<' && k + 3 < len && a[k + 3] != '=' && a[k + 3] != '!') {
                sb_put(out, "(?P<", 4);
                k += 2;
                continue;
            }
            sb_put(out, a + k, 1);
        }
        sb_put(out, ")", 1);
        if (!tail)
            sb_put(out, any, (uint32_t)strlen(any));
        start = i + 1;
    }
    sb_put(out, ")", 1);
    return free;
}

/* The compiled regex of a pattern or format (cached per source: lowering and the validator
 * share them). NULL after failing with the regex engine's message. */
static rudder_rx *regex_of(comp *c, const rudder_jv *where, bregex r) {
    for (uint32_t i = 0; i < c->n_rxs; i++)
        if (c->rxs[i].kind == r.kind && c->rxs[i].len == r.src->n && !memcmp(c->rxs[i].text, r.src->str, r.src->n))
            return c->rxs[i].rx;
    char msg[200];
    rudder_rx *rx;
    if (r.kind == RX_FORMAT) {
        const char *text = FORMATS[format_index(r.src)].rx;
        rx = rudder_rx_compile(text, (uint32_t)strlen(text), msg, sizeof msg);
    } else if (r.kind == RX_EXACT) {
        rx = rudder_rx_compile((const char *)r.src->str, r.src->n, msg, sizeof msg);
    } else {
        sbuf b = {0};
        pattern_regex(r.src, &b, NULL);
        rx = rudder_rx_compile(b.buf, b.n, msg, sizeof msg);
        rudder_free(b.buf);
    }
    if (!rx) {
        uint32_t n = 0;
        char what[260];
        put(what, sizeof what, &n, "unsupported pattern (", 21);
        put(what, sizeof what, &n, msg, (uint32_t)strlen(msg));
        put(what, sizeof what, &n, "):", 2);
        fail_at(c, where, what, (const char *)r.src->str, r.src->n, false);
        return NULL;
    }
    c->rxs = rudder_grow(c->rxs, &c->cap_rxs, c->n_rxs + 1, sizeof *c->rxs);
    c->rxs[c->n_rxs++] = (rx_slot){r.src->str, r.src->n, r.kind, rx};
    return rx;
}

static bool rx_matches(rudder_rx *rx, const uint8_t *s, uint32_t n) {
    return rudder_rx_accepting(rx, rudder_rx_push_bytes(rx, rudder_rx_start(rx, NULL), s, n));
}

/* ------------------------------------------------------------------ conjunctions */

static conj conj_one(comp *c, const rudder_jv *s) {
    if (s->type == RUDDER_JV_TRUE)
        return (conj){0};
    const rudder_jv **p = aalloc(c, sizeof *p);
    *p = s;
    return (conj){p, 1};
}

static conj conj_and(comp *c, conj a, conj b) {
    if (!a.n)
        return b;
    if (!b.n)
        return a;
    const rudder_jv **p = aalloc(c, (a.n + b.n) * sizeof *p);
    uint32_t n = 0;
    for (uint32_t i = 0; i < a.n; i++)
        p[n++] = a.s[i];
    for (uint32_t i = 0; i < b.n; i++) {
        bool dup = false;
        for (uint32_t j = 0; j < a.n && !dup; j++)
            dup = a.s[j] == b.s[i];
        if (!dup)
            p[n++] = b.s[i];
    }
    return (conj){p, n};
}

static const rudder_jv FALSE_SCHEMA = {.type = RUDDER_JV_FALSE};
static conj conj_false(comp *c) { return conj_one(c, &FALSE_SCHEMA); }

/* ------------------------------------------------------------------ bundles from keywords */

static bundle *bundle_new(comp *c) {
    bundle *b = acopy(c, &c->any, sizeof *b);
    return b;
}

static bool get_count(comp *c, const rudder_jv *s, const char *kw, uint32_t *out) {
    const rudder_jv *v = get(s, kw);
    if (!v)
        return true;
    if (v->type != RUDDER_JV_NUMBER || v->num < 0 || v->num != (double)(uint64_t)v->num)
        return fail_kw(c, s, "must be a non-negative integer:", kw);
    *out = v->num > 4e9 ? 4000000000u : (uint32_t)v->num;
    return true;
}

static uint32_t type_bits(const rudder_jv *t) {
    static const char *const names[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    static const uint32_t bits[] = {T_OBJECT, T_ARRAY, T_STRING, T_NUMBER | T_INTEGER, T_INTEGER, T_BOOLEAN, T_NULL};
    if (t->type == RUDDER_JV_STRING)
        for (uint32_t i = 0; i < 7; i++)
            if (rudder_jv_equal_str(t, names[i]))
                return bits[i];
    return 0;
}

static uint32_t value_type(const rudder_jv *v) {
    switch (v->type) {
    case RUDDER_JV_OBJECT: return T_OBJECT;
    case RUDDER_JV_ARRAY: return T_ARRAY;
    case RUDDER_JV_STRING: return T_STRING;
    case RUDDER_JV_NUMBER: return v->integral ? T_INTEGER : T_NUMBER;
    case RUDDER_JV_NULL: return T_NULL;
    default: return T_BOOLEAN;
    }
}

static bool is_schema(const rudder_jv *v) {
    return v->type == RUDDER_JV_OBJECT || v->type == RUDDER_JV_TRUE || v->type == RUDDER_JV_FALSE;
}

/* The bound keywords, draft 4 (exclusiveMinimum: true beside minimum) and later (a number). */
static bool bounds(comp *c, const rudder_jv *s, bundle *b) {
    const char *kws[4] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    for (uint32_t k = 0; k < 4; k++) {
        const rudder_jv *v = get(s, kws[k]);
        if (!v || v->type == RUDDER_JV_FALSE)
            continue;
        bool lower = k < 2, excl = k & 1;
        double x;
        if (v->type == RUDDER_JV_TRUE) {   /* draft 4: the plain bound is exclusive */
            const rudder_jv *plain = get(s, lower ? "minimum" : "maximum");
            if (!plain || plain->type != RUDDER_JV_NUMBER)
                continue;
            x = plain->num;
        } else if (v->type == RUDDER_JV_NUMBER) {
            x = v->num;
        } else {
            return fail_kw(c, s, "must be a number:", kws[k]);
        }
        if (lower && (!b->has_lo || x > b->lo || (x == b->lo && excl)))
            b->has_lo = true, b->lo = x, b->lo_excl = excl;
        if (!lower && (!b->has_hi || x < b->hi || (x == b->hi && excl)))
            b->has_hi = true, b->hi = x, b->hi_excl = excl;
    }
    return true;
}

static bool conj_list(comp *c, const rudder_jv *s, const char *kw, const rudder_jv *list, conj **out, uint32_t *n) {
    if (list->type != RUDDER_JV_ARRAY)
        return fail_kw(c, s, "must be an array:", kw);
    *out = aalloc(c, (list->n ? list->n : 1) * sizeof(conj));
    for (uint32_t i = 0; i < list->n; i++) {
        if (!is_schema(&list->items[i]))
            return fail_kw(c, s, "must be an array of schemas:", kw);
        (*out)[i] = conj_one(c, &list->items[i]);
    }
    *n = list->n;
    return true;
}

static bool names_list(comp *c, const rudder_jv *s, const char *kw, const rudder_jv *v, rudder_str **out, uint32_t *n) {
    if (v->type != RUDDER_JV_ARRAY)
        return fail_kw(c, s, "must be an array of strings:", kw);
    *out = aalloc(c, (v->n ? v->n : 1) * sizeof(rudder_str));
    for (uint32_t i = 0; i < v->n; i++) {
        if (v->items[i].type != RUDDER_JV_STRING)
            return fail_kw(c, s, "must be an array of strings:", kw);
        (*out)[i] = (rudder_str){v->items[i].str, v->items[i].n};
    }
    *n = v->n;
    return true;
}

/* The bundle of a schema object's own keywords (combinators aside). */
static bundle *base_bundle(comp *c, const rudder_jv *s) {
    bundle *b = bundle_new(c);
    for (uint32_t i = 0; i < s->n; i++)
        for (uint32_t k = 0; REFUSED[k]; k++)
            if (key_is(&s->keys[i], REFUSED[k]))
                return fail_at(c, s, "unsupported keyword", REFUSED[k], (uint32_t)strlen(REFUSED[k]), false), NULL;
    const rudder_jv *v;
    if ((v = get(s, "type"))) {
        uint32_t t = 0;
        if (v->type == RUDDER_JV_ARRAY) {
            for (uint32_t i = 0; i < v->n; i++) {
                uint32_t bit = type_bits(&v->items[i]);
                if (!bit)
                    return fail_kw(c, s, "unknown type in", "type"), NULL;
                t |= bit;
            }
        } else if (!(t = type_bits(v))) {
            return fail_kw(c, s, "unknown type in", "type"), NULL;
        }
        b->types = t;
    }
    const rudder_jv *en = get(s, "enum"), *cn = get(s, "const");
    if (en && en->type != RUDDER_JV_ARRAY)
        return fail_kw(c, s, "must be an array:", "enum"), NULL;
    if (en || cn) {
        b->has_enum = true;
        b->n_enum = 0;
        b->enums = aalloc(c, ((en ? en->n : 0) + 1) * sizeof *b->enums);
        for (uint32_t i = 0; en && i < en->n; i++) {
            bool dup = false;   /* duplicates would make alternatives that start alike */
            for (uint32_t j = 0; j < b->n_enum && !dup; j++)
                dup = jv_equal(b->enums[j], &en->items[i]);
            if (!dup && (!cn || jv_equal(cn, &en->items[i])))
                b->enums[b->n_enum++] = &en->items[i];
        }
        if (cn && !en)
            b->enums[b->n_enum++] = cn;
    }
    /* object */
    if ((v = get(s, "properties"))) {
        if (v->type != RUDDER_JV_OBJECT)
            return fail_kw(c, s, "must be an object:", "properties"), NULL;
        b->props = aalloc(c, (v->n ? v->n : 1) * sizeof(bprop));
        for (uint32_t i = 0; i < v->n; i++) {
            if (!is_schema(&v->items[i]))
                return fail_kw(c, s, "must be an object of schemas:", "properties"), NULL;
            bool dup = false;
            for (uint32_t j = 0; j < b->n_props && !dup; j++)
                dup = str_eq(&b->props[j].name, &v->keys[i]);
            if (dup)
                return fail_at(c, v, "duplicate property", (const char *)v->keys[i].ptr, v->keys[i].len, false), NULL;
            b->props[b->n_props++] = (bprop){v->keys[i], conj_one(c, &v->items[i])};
        }
    }
    if ((v = get(s, "required")) && !names_list(c, s, "required", v, &b->req, &b->n_req))
        return NULL;
    if ((v = get(s, "additionalProperties"))) {
        if (!is_schema(v))
            return fail_kw(c, s, "must be a schema:", "additionalProperties"), NULL;
        b->add_set = true;
        if (v->type == RUDDER_JV_FALSE)
            b->no_add = true;
        else
            b->add = conj_one(c, v);
    }
    if ((v = get(s, "patternProperties"))) {
        if (v->type != RUDDER_JV_OBJECT)
            return fail_kw(c, s, "must be an object:", "patternProperties"), NULL;
        b->pats = aalloc(c, (v->n ? v->n : 1) * sizeof(bpat));
        for (uint32_t i = 0; i < v->n; i++) {
            if (!is_schema(&v->items[i]))
                return fail_kw(c, s, "must be an object of schemas:", "patternProperties"), NULL;
            /* the key as a JSON string value: the pattern's source (keys are decoded) */
            rudder_jv *pat = aalloc(c, sizeof *pat);
            *pat = (rudder_jv){.type = RUDDER_JV_STRING, .n = v->keys[i].len, .str = v->keys[i].ptr};
            b->pats[b->n_pats++] = (bpat){pat, conj_one(c, &v->items[i])};
            if (!regex_of(c, v, (bregex){pat, RX_PATTERN, false}))
                return NULL;
        }
    }
    if ((v = get(s, "propertyNames"))) {
        if (!is_schema(v))
            return fail_kw(c, s, "must be a schema:", "propertyNames"), NULL;
        b->names = conj_one(c, v);
    }
    if (!get_count(c, s, "minProperties", &b->min_props) || !get_count(c, s, "maxProperties", &b->max_props))
        return NULL;
    const rudder_jv *deps[2] = {get(s, "dependentRequired"), get(s, "dependencies")};
    for (uint32_t d = 0; d < 2; d++) {
        if (!deps[d])
            continue;
        const char *kw = d ? "dependencies" : "dependentRequired";
        if (deps[d]->type != RUDDER_JV_OBJECT)
            return fail_kw(c, s, "must be an object:", kw), NULL;
        bdep *all = aalloc(c, (b->n_deps + deps[d]->n + 1) * sizeof(bdep));
        memcpy(all, b->deps, b->n_deps * sizeof(bdep));
        b->deps = all;
        for (uint32_t i = 0; i < deps[d]->n; i++) {
            const rudder_jv *list = &deps[d]->items[i];
            if (list->type != RUDDER_JV_ARRAY)
                continue;   /* the schema form (dependentSchemas): a union, in dnf_of */
            for (uint32_t j = 0; j < list->n; j++)
                if (list->items[j].type != RUDDER_JV_STRING)
                    return fail_kw(c, s, "must list property names:", kw), NULL;
            b->deps[b->n_deps++] = (bdep){deps[d]->keys[i], list};
        }
    }
    /* array */
    const rudder_jv *items = get(s, "items"), *prefix = get(s, "prefixItems"), *more = get(s, "additionalItems");
    if (items && items->type == RUDDER_JV_ARRAY) {   /* drafts 4-2019: items as a list, then additionalItems */
        if (!conj_list(c, s, "items", items, &b->prefix, &b->n_prefix))
            return NULL;
        items = more;
    } else if (prefix && !conj_list(c, s, "prefixItems", prefix, &b->prefix, &b->n_prefix)) {
        return NULL;
    }
    if (items) {
        if (!is_schema(items))
            return fail_kw(c, s, "must be a schema:", "items"), NULL;
        b->items_set = true;
        if (items->type == RUDDER_JV_FALSE)
            b->no_items = true;
        else
            b->items = conj_one(c, items);
    }
    if ((v = get(s, "contains"))) {
        if (!is_schema(v))
            return fail_kw(c, s, "must be a schema:", "contains"), NULL;
        b->has_contains = true;
        b->contains = conj_one(c, v);
        b->min_contains = 1;
        if (!get_count(c, s, "minContains", &b->min_contains))
            return NULL;
        if (b->min_contains > 8)
            return fail_kw(c, s, "more than 8 items for contains are not supported:", "minContains"), NULL;
        if (b->min_contains == 0)
            b->has_contains = false;
    }
    if (!get_count(c, s, "minItems", &b->min_items) || !get_count(c, s, "maxItems", &b->max_items))
        return NULL;
    if (c->strict && (v = get(s, "uniqueItems")) && v->type == RUDDER_JV_TRUE && b->max_items > 1)
        return fail_strict(c, s, "uniqueItems", NULL, "is not enforced (an array with duplicates could be generated)"), NULL;
    /* string */
    if (!get_count(c, s, "minLength", &b->min_len) || !get_count(c, s, "maxLength", &b->max_len))
        return NULL;
    if ((v = get(s, "pattern"))) {
        if (v->type != RUDDER_JV_STRING)
            return fail_kw(c, s, "must be a string:", "pattern"), NULL;
        b->rx[b->n_rx++] = (bregex){v, RX_PATTERN, false};
        if (!regex_of(c, s, b->rx[0]))
            return NULL;
    }
    if ((v = get(s, "format"))) {
        if (v->type == RUDDER_JV_STRING && format_index(v) >= 0)
            b->rx[b->n_rx++] = (bregex){v, RX_FORMAT, false};
        else if (c->strict)   /* (otherwise an annotation, as 2020-12 reads an unknown format) */
            return fail_strict(c, s, "format", v, "is not enforced (not one of the formats docs/json-schema.md lists)"), NULL;
    }
    /* number */
    if (!bounds(c, s, b))
        return NULL;
    if ((v = get(s, "multipleOf"))) {
        if (v->type != RUDDER_JV_NUMBER || !(v->num > 0))
            return fail_kw(c, s, "must be a positive number:", "multipleOf"), NULL;
        b->mult = v->num;
    }
    return b;
}

/* ------------------------------------------------------------------ merging bundles */

/* What the bundle says about the value of key `k`: its property, else its matching patterns,
 * else its additionalProperties (false: the key cannot be there). */
static conj value_of(comp *c, const bundle *b, const rudder_str *k, bool declared_only) {
    for (uint32_t i = 0; i < b->n_props; i++)
        if (str_eq(&b->props[i].name, k))
            return b->props[i].value;
    if (declared_only)
        return (conj){0};
    conj out = {0};
    bool matched = false;
    for (uint32_t i = 0; i < b->n_pats; i++) {
        rudder_rx *rx = regex_of(c, b->pats[i].pattern, (bregex){b->pats[i].pattern, RX_PATTERN, false});
        if (rx && rx_matches(rx, k->ptr, k->len)) {
            out = conj_and(c, out, b->pats[i].value);
            matched = true;
        }
    }
    if (matched)
        return conj_and(c, out, b->pats_add);
    return b->no_add ? conj_false(c) : b->add;
}

static bool has_prop(const bundle *b, const rudder_str *k) {
    for (uint32_t i = 0; i < b->n_props; i++)
        if (str_eq(&b->props[i].name, k))
            return true;
    return false;
}

/* Both bundles' constraints; NULL when no value can meet both (or after a failure). */
static bundle *merge(comp *c, const rudder_jv *where, const bundle *a, const bundle *b) {
    if (!spend(c, where, 1 + a->n_props + b->n_props))
        return NULL;
    uint32_t types = a->types & b->types;
    if (!types)
        return NULL;
    bundle *m = acopy(c, a, sizeof *m);
    m->types = types;
    /* object: declared keys of both, in order of appearance */
    if (types & T_OBJECT) {
        if (a->n_pats && b->n_pats)
            return fail(c, where, "patternProperties in two schemas that apply together (allOf, $ref, siblings) are not supported"), NULL;
        m->props = aalloc(c, (a->n_props + b->n_props + 1) * sizeof(bprop));
        m->n_props = 0;
        for (uint32_t i = 0; i < a->n_props; i++)
            m->props[m->n_props++] = (bprop){a->props[i].name, conj_and(c, a->props[i].value, value_of(c, b, &a->props[i].name, false))};
        for (uint32_t i = 0; i < b->n_props; i++)
            if (!has_prop(a, &b->props[i].name))
                m->props[m->n_props++] = (bprop){b->props[i].name, conj_and(c, value_of(c, a, &b->props[i].name, false), b->props[i].value)};
        m->req = aalloc(c, (a->n_req + b->n_req + 1) * sizeof(rudder_str));
        memcpy(m->req, a->req, a->n_req * sizeof(rudder_str));
        memcpy(m->req + a->n_req, b->req, b->n_req * sizeof(rudder_str));
        m->n_req = a->n_req + b->n_req;
        m->deps = aalloc(c, (a->n_deps + b->n_deps + 1) * sizeof(bdep));
        memcpy(m->deps, a->deps, a->n_deps * sizeof(bdep));
        memcpy(m->deps + a->n_deps, b->deps, b->n_deps * sizeof(bdep));
        m->n_deps = a->n_deps + b->n_deps;
        m->forbid = aalloc(c, (a->n_forbid + b->n_forbid + 1) * sizeof(rudder_str));
        memcpy(m->forbid, a->forbid, a->n_forbid * sizeof(rudder_str));
        memcpy(m->forbid + a->n_forbid, b->forbid, b->n_forbid * sizeof(rudder_str));
        m->n_forbid = a->n_forbid + b->n_forbid;
        /* extra keys: what both sides say about them */
        const bundle *p = b->n_pats ? b : a, *o = b->n_pats ? a : b;   /* p: the side with patterns, if any */
        m->add_set = a->add_set || b->add_set;
        if (o->no_add) {
            m->no_add = true;
            m->n_pats = 0;
            m->add = (conj){0};
        } else {
            m->no_add = p->no_add;
            m->add = conj_and(c, a->add, b->add);
            m->n_pats = p->n_pats;
            m->pats = p->pats;
            m->pats_add = conj_and(c, p->pats_add, o->add);
        }
        m->names = conj_and(c, a->names, b->names);
        m->min_props = a->min_props > b->min_props ? a->min_props : b->min_props;
        m->max_props = a->max_props < b->max_props ? a->max_props : b->max_props;
    }
    /* array: position by position, then the rest */
    if (types & T_ARRAY) {
        uint32_t n = a->n_prefix > b->n_prefix ? a->n_prefix : b->n_prefix;
        m->prefix = aalloc(c, (n + 1) * sizeof(conj));
        m->n_prefix = n;
        m->max_items = a->max_items < b->max_items ? a->max_items : b->max_items;
        for (uint32_t i = 0; i < n; i++) {
            const bundle *s[2] = {a, b};
            conj x = {0};
            for (uint32_t k = 0; k < 2; k++) {
                if (i < s[k]->n_prefix)
                    x = conj_and(c, x, s[k]->prefix[i]);
                else if (s[k]->no_items)
                    x = conj_false(c);
                else
                    x = conj_and(c, x, s[k]->items);
            }
            m->prefix[i] = x;
        }
        m->items = conj_and(c, a->items, b->items);
        m->no_items = a->no_items || b->no_items;
        m->items_set = a->items_set || b->items_set;
        if (a->has_contains && b->has_contains)
            return fail(c, where, "contains in two schemas that apply together is not supported"), NULL;
        if (b->has_contains)
            m->has_contains = true, m->contains = b->contains, m->min_contains = b->min_contains;
        m->min_items = a->min_items > b->min_items ? a->min_items : b->min_items;
    }
    if (types & T_STRING) {
        m->min_len = a->min_len > b->min_len ? a->min_len : b->min_len;
        m->max_len = a->max_len < b->max_len ? a->max_len : b->max_len;
        for (uint32_t i = 0; i < b->n_rx; i++) {
            bool dup = false;
            for (uint32_t j = 0; j < m->n_rx && !dup; j++)
                dup = m->rx[j].src == b->rx[i].src && m->rx[j].negated == b->rx[i].negated;
            if (dup)
                continue;
            if (m->n_rx == STRING_RX)
                return fail(c, where, "more than 4 patterns and formats on one string are not supported"), NULL;
            m->rx[m->n_rx++] = b->rx[i];
        }
    }
    if (types & (T_NUMBER | T_INTEGER)) {
        if (b->has_lo && (!m->has_lo || b->lo > m->lo || (b->lo == m->lo && b->lo_excl)))
            m->has_lo = true, m->lo = b->lo, m->lo_excl = b->lo_excl;
        if (b->has_hi && (!m->has_hi || b->hi < m->hi || (b->hi == m->hi && b->hi_excl)))
            m->has_hi = true, m->hi = b->hi, m->hi_excl = b->hi_excl;
        if (a->mult && b->mult && a->mult != b->mult) {
            double x = a->mult, y = b->mult;   /* two integer divisors: their least common multiple */
            if (x != (double)(uint64_t)x || y != (double)(uint64_t)y)
                return fail(c, where, "two different multipleOf that are not integers are not supported"), NULL;
            uint64_t p = (uint64_t)x, q = (uint64_t)y, g = p, h = q;
            while (h)
                g %= h, g ^= h, h ^= g, g ^= h;
            m->mult = (double)(p / g * q);
        } else if (b->mult) {
            m->mult = b->mult;
        }
    }
    if (b->n_nots) {
        m->nots = aalloc(c, (a->n_nots + b->n_nots) * sizeof *m->nots);
        memcpy(m->nots, a->nots, a->n_nots * sizeof *m->nots);
        memcpy(m->nots + a->n_nots, b->nots, b->n_nots * sizeof *m->nots);
        m->n_nots = a->n_nots + b->n_nots;
    }
    if (b->has_enum) {
        if (!a->has_enum) {
            m->has_enum = true, m->enums = b->enums, m->n_enum = b->n_enum;
        } else {
            m->enums = aalloc(c, (a->n_enum + 1) * sizeof *m->enums);
            m->n_enum = 0;
            for (uint32_t i = 0; i < a->n_enum; i++)
                for (uint32_t j = 0; j < b->n_enum; j++)
                    if (jv_equal(a->enums[i], b->enums[j])) {
                        m->enums[m->n_enum++] = a->enums[i];
                        break;
                    }
        }
        if (!m->n_enum)
            return NULL;
    }
    return m;
}

/* ------------------------------------------------------------------ DNF of a schema object */

static dnf dnf_of(comp *c, const rudder_jv *s);

/* Every pair of alternatives merged (the unsatisfiable ones dropped). */
static dnf product(comp *c, const rudder_jv *where, dnf x, dnf y) {
    dnf out = {aalloc(c, (x.n * y.n + 1) * sizeof(bundle *)), 0};
    if ((uint64_t)x.n * y.n > 64ull * MAX_ALTERNATIVES) {
        fail(c, where, "the schema is too complex: its combinators (anyOf/oneOf inside allOf, $ref, siblings) expand to too many alternatives");
        return out;
    }
    for (uint32_t i = 0; i < x.n && !c->failed; i++)
        for (uint32_t j = 0; j < y.n && !c->failed; j++) {
            bundle *m = x.b[i] == &c->any ? y.b[j] : y.b[j] == &c->any ? x.b[i] : merge(c, where, x.b[i], y.b[j]);
            if (m)
                out.b[out.n++] = m;
        }
    if (out.n > MAX_ALTERNATIVES)
        fail(c, where, "the schema is too complex: its combinators (anyOf/oneOf inside allOf, $ref, siblings) expand past 256 alternatives");
    return out;
}

static dnf dnf_union(comp *c, const rudder_jv *where, const rudder_jv *list, const char *kw) {
    dnf out = {0};
    if (list->type != RUDDER_JV_ARRAY || list->n == 0) {
        fail_kw(c, where, "must be a non-empty array:", kw);
        return out;
    }
    for (uint32_t i = 0; i < list->n && !c->failed; i++) {
        dnf d = dnf_of(c, &list->items[i]);
        bundle **all = aalloc(c, (out.n + d.n + 1) * sizeof(bundle *));
        memcpy(all, out.b, out.n * sizeof(bundle *));
        memcpy(all + out.n, d.b, d.n * sizeof(bundle *));
        out.b = all;
        out.n += d.n;
        if (out.n > MAX_ALTERNATIVES)
            fail(c, where, "the schema is too complex: its combinators expand past 256 alternatives");
    }
    return out;
}

/* "#", "#/$defs/a", any JSON pointer into this document (~0 ~1 escapes); an absolute ref to
 * the document's own $id first drops the id. */
static const rudder_jv *resolve_ref(comp *c, const rudder_jv *where, const rudder_jv *ref) {
    if (ref->type != RUDDER_JV_STRING)
        return fail_kw(c, where, "must be a string:", "$ref"), NULL;
    const uint8_t *r = ref->str;
    uint32_t n = ref->n;
    const rudder_jv *id = c->root_id;
    if (n && r[0] != '#' && id && id->type == RUDDER_JV_STRING) {
        uint32_t idn = id->n;
        while (idn && id->str[idn - 1] == '#')
            idn--;
        if (n >= idn && memcmp(r, id->str, idn) == 0)
            r += idn, n -= idn;
    }
    if (n == 0 || r[0] != '#')
        return fail_at(c, where, "only references into this document (\"#...\") are supported, not the $ref", (const char *)ref->str, ref->n, false), NULL;
    const rudder_jv *at = c->doc;
    uint32_t i = 1;
    while (i < n) {
        if (r[i] != '/')
            return fail_at(c, where, "unsupported $ref (an anchor, not a JSON pointer)", (const char *)ref->str, ref->n, false), NULL;
        uint32_t j = ++i;
        uint8_t seg[256];
        uint32_t k = 0;
        while (j < n && r[j] != '/' && k < sizeof seg) {
            uint8_t ch = r[j++];
            if (ch == '~' && j < n && (r[j] == '0' || r[j] == '1'))
                ch = r[j++] == '0' ? '~' : '/';
            else if (ch == '%' && j + 1 < n) {   /* percent-encoded (URI fragment) */
                int hi = r[j] <= '9' ? r[j] - '0' : (r[j] | 0x20) - 'a' + 10, lo = r[j + 1] <= '9' ? r[j + 1] - '0' : (r[j + 1] | 0x20) - 'a' + 10;
                if (hi >= 0 && hi < 16 && lo >= 0 && lo < 16)
                    ch = (uint8_t)(hi * 16 + lo), j += 2;
            }
            seg[k++] = ch;
        }
        i = j;
        const rudder_jv *next = NULL;
        if (at->type == RUDDER_JV_OBJECT) {
            for (uint32_t m = 0; m < at->n && !next; m++)
                if (at->keys[m].len == k && memcmp(at->keys[m].ptr, seg, k) == 0)
                    next = &at->items[m];
        } else if (at->type == RUDDER_JV_ARRAY) {
            uint32_t idx;
            if (rudder_parse_uint((const char *)seg, k, &idx) && idx < at->n)
                next = &at->items[idx];
        }
        if (!next)
            return fail_at(c, where, "$ref points to nothing:", (const char *)ref->str, ref->n, false), NULL;
        at = next;
    }
    return at;
}

static dnf_slot *dnf_slot_of(comp *c, const rudder_jv *s) {
    if (2 * (c->n_dnfs + 1) > c->dnf_mask + 1) {
        uint32_t old = c->dnf_mask + 1;
        dnf_slot *prev = c->dnfs;
        c->dnf_mask = 2 * old - 1;
        c->dnfs = rudder_zalloc((c->dnf_mask + 1) * sizeof(dnf_slot));
        if (!c->dnfs)
            rudder_panic("jsonschema: out of memory");
        for (uint32_t i = 0; i < old; i++)
            if (prev[i].key) {
                uint32_t h = ((uint32_t)(uintptr_t)prev[i].key * 2654435761u) & c->dnf_mask;
                while (c->dnfs[h].key)
                    h = (h + 1) & c->dnf_mask;
                c->dnfs[h] = prev[i];
            }
        rudder_free(prev);
    }
    uint32_t h = ((uint32_t)(uintptr_t)s * 2654435761u) & c->dnf_mask;
    while (c->dnfs[h].key && c->dnfs[h].key != s)
        h = (h + 1) & c->dnf_mask;
    if (!c->dnfs[h].key) {
        c->dnfs[h].key = s;
        c->n_dnfs++;
    }
    return &c->dnfs[h];
}

static dnf one(comp *c, bundle *b);

static bundle *typed(comp *c, uint32_t types) {
    bundle *b = bundle_new(c);
    b->types = types;
    return b;
}

static dnf cat(comp *c, dnf x, dnf y) {
    if (!x.n)
        return y;
    if (!y.n)
        return x;
    bundle **all = aalloc(c, (x.n + y.n) * sizeof(bundle *));
    memcpy(all, x.b, x.n * sizeof(bundle *));
    memcpy(all + x.n, y.b, y.n * sizeof(bundle *));
    return (dnf){all, x.n + y.n};
}

static const rudder_jv *not_schema(comp *c, const rudder_jv *s) {   /* {"not": s} */
    rudder_jv *n = aalloc(c, sizeof *n);
    rudder_str *key = aalloc(c, sizeof *key);
    *key = (rudder_str){(const uint8_t *)"not", 3};
    *n = (rudder_jv){.type = RUDDER_JV_OBJECT, .n = 1, .items = (rudder_jv *)s, .keys = key};
    return n;
}

static const rudder_jv FALSE_VALUE = {.type = RUDDER_JV_FALSE}, TRUE_VALUE = {.type = RUDDER_JV_TRUE};

/* Strings other than the listed ones: a negated regex of them. */
static bundle *strings_except(comp *c, const rudder_jv *values, uint32_t n) {
    sbuf text = {0};
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        if (values[i].type == RUDDER_JV_STRING) {
            sb_put(&text, k ? "|" : "(?:", k ? 1 : 3);
            k++;
            sb_literal(&text, values[i].str, values[i].n);
        }
    sb_put(&text, ")", 1);
    rudder_jv *src = aalloc(c, sizeof *src);
    *src = (rudder_jv){.type = RUDDER_JV_STRING, .n = text.n, .str = acopy(c, text.buf, text.n + 1)};
    rudder_free(text.buf);
    bundle *b = typed(c, T_STRING);
    b->rx[b->n_rx++] = (bregex){src, RX_EXACT, true};
    return b;
}

/* The values that are not valid against schema N, as a DNF, when there is a finite form here
 * (*ok false otherwise). Each keyword of N is a condition; a value fails N when it fails one of
 * them, and a type-specific keyword fails only on values of its type (minLength 3: strings
 * shorter than 3). */
static dnf negate(comp *c, const rudder_jv *where, const rudder_jv *N, uint32_t depth, bool *ok) {
    dnf out = {0};
    if (!*ok || c->failed)
        return out;
    if (++depth > 32) {
        *ok = false;
        return out;
    }
    if (N->type == RUDDER_JV_TRUE)
        return out;
    if (N->type == RUDDER_JV_FALSE)
        return one(c, &c->any);
    if (N->type != RUDDER_JV_OBJECT) {
        fail_kw(c, where, "must be a schema:", "not");
        return out;
    }
    bundle bounds_of = c->any;   /* numeric bounds go together (draft 4 pairs) */
    if (!bounds(c, N, &bounds_of))
        return out;
    if (bounds_of.has_lo) {
        bundle *b = typed(c, T_NUMBER | T_INTEGER);
        b->has_hi = true, b->hi = bounds_of.lo, b->hi_excl = !bounds_of.lo_excl;
        out = cat(c, out, one(c, b));
    }
    if (bounds_of.has_hi) {
        bundle *b = typed(c, T_NUMBER | T_INTEGER);
        b->has_lo = true, b->lo = bounds_of.hi, b->lo_excl = !bounds_of.hi_excl;
        out = cat(c, out, one(c, b));
    }
    for (uint32_t i = 0; i < N->n && *ok && !c->failed; i++) {
        const rudder_str *k = &N->keys[i];
        const rudder_jv *v = &N->items[i];
        uint32_t count;
        if (key_is(k, "not")) {
            out = cat(c, out, dnf_of(c, v));
        } else if (key_is(k, "allOf") && v->type == RUDDER_JV_ARRAY) {
            for (uint32_t j = 0; j < v->n && *ok; j++)
                out = cat(c, out, negate(c, N, &v->items[j], depth, ok));
        } else if (key_is(k, "anyOf") && v->type == RUDDER_JV_ARRAY) {
            dnf all = one(c, &c->any);
            for (uint32_t j = 0; j < v->n && *ok && all.n; j++)
                all = product(c, N, all, negate(c, N, &v->items[j], depth, ok));
            out = cat(c, out, all);
        } else if (key_is(k, "$ref")) {
            const rudder_jv *target = resolve_ref(c, N, v);
            if (target)
                out = cat(c, out, negate(c, N, target, depth, ok));
        } else if (key_is(k, "type")) {
            uint32_t t = 0;
            if (v->type == RUDDER_JV_ARRAY)
                for (uint32_t j = 0; j < v->n; j++)
                    t |= type_bits(&v->items[j]);
            else
                t = type_bits(v);
            if ((t & T_INTEGER) && !(t & T_NUMBER))
                *ok = false;   /* numbers with a fraction only: no such node */
            else if (T_ALL & ~t)
                out = cat(c, out, one(c, typed(c, T_ALL & ~t)));
        } else if (key_is(k, "enum") || key_is(k, "const")) {
            const rudder_jv *vals = key_is(k, "const") ? v : v->items;
            uint32_t n = key_is(k, "const") ? 1 : v->type == RUDDER_JV_ARRAY ? v->n : 0, present = 0;
            bool t = false, f = false;
            for (uint32_t j = 0; j < n; j++) {
                uint32_t vt = value_type(&vals[j]);
                present |= vt == T_INTEGER ? T_NUMBER | T_INTEGER : vt;
                t |= vals[j].type == RUDDER_JV_TRUE, f |= vals[j].type == RUDDER_JV_FALSE;
                if (vals[j].type == RUDDER_JV_NUMBER || vals[j].type == RUDDER_JV_OBJECT || vals[j].type == RUDDER_JV_ARRAY)
                    *ok = false;   /* "any number but 6": no such node */
            }
            if (!*ok)
                break;
            if (T_ALL & ~present)
                out = cat(c, out, one(c, typed(c, T_ALL & ~present)));
            if (present & T_STRING)
                out = cat(c, out, one(c, strings_except(c, vals, n)));
            if (t != f) {
                bundle *b = typed(c, T_BOOLEAN);
                b->has_enum = true;
                b->enums = aalloc(c, sizeof *b->enums);
                b->enums[0] = t ? &FALSE_VALUE : &TRUE_VALUE;
                b->n_enum = 1;
                out = cat(c, out, one(c, b));
            }
        } else if (key_is(k, "required")) {
            rudder_str *names;
            if (!names_list(c, N, "required", v, &names, &count))
                break;
            for (uint32_t j = 0; j < count; j++) {
                bundle *b = typed(c, T_OBJECT);
                b->forbid = &names[j];
                b->n_forbid = 1;
                out = cat(c, out, one(c, b));
            }
        } else if (key_is(k, "properties") && v->type == RUDDER_JV_OBJECT) {
            for (uint32_t j = 0; j < v->n; j++) {   /* the key is there, and its value fails */
                if (v->items[j].type == RUDDER_JV_TRUE)
                    continue;
                bundle *b = typed(c, T_OBJECT);
                b->props = aalloc(c, sizeof(bprop));
                b->props[0] = (bprop){v->keys[j], conj_one(c, not_schema(c, &v->items[j]))};
                b->n_props = 1;
                b->req = &v->keys[j];
                b->n_req = 1;
                out = cat(c, out, one(c, b));
            }
        } else if (key_is(k, "items") && is_schema(v)) {   /* some item fails */
            bundle *b = typed(c, T_ARRAY);
            b->has_contains = true;
            b->contains = conj_one(c, not_schema(c, v));
            b->min_contains = 1;
            out = cat(c, out, one(c, b));
        } else if ((key_is(k, "pattern") && v->type == RUDDER_JV_STRING) || (key_is(k, "format") && format_index(v) >= 0)) {
            bundle *b = typed(c, T_STRING);
            b->rx[b->n_rx++] = (bregex){v, key_is(k, "format") ? RX_FORMAT : RX_PATTERN, true};
            if (!regex_of(c, N, b->rx[0]))
                break;
            out = cat(c, out, one(c, b));
        } else if (key_is(k, "minLength") || key_is(k, "maxLength") || key_is(k, "minItems") || key_is(k, "maxItems") ||
                   key_is(k, "minProperties") || key_is(k, "maxProperties")) {
            char kw[16];
            memcpy(kw, k->ptr, k->len);
            kw[k->len] = 0;
            count = 0;
            if (!get_count(c, N, kw, &count))
                break;
            bool min = kw[1] == 'i';
            if (min && count == 0)
                continue;   /* every value has at least 0 */
            uint32_t t = kw[3] == 'L' ? T_STRING : kw[3] == 'I' ? T_ARRAY : T_OBJECT;
            bundle *b = typed(c, t);
            uint32_t *lo = t == T_STRING ? &b->min_len : t == T_ARRAY ? &b->min_items : &b->min_props;
            uint32_t *hi = t == T_STRING ? &b->max_len : t == T_ARRAY ? &b->max_items : &b->max_props;
            if (min)
                *hi = count - 1;
            else
                *lo = count + 1;
            out = cat(c, out, one(c, b));
        } else if (key_is(k, "minimum") || key_is(k, "maximum") || key_is(k, "exclusiveMinimum") || key_is(k, "exclusiveMaximum")) {
            continue;   /* (above) */
        } else {
            for (uint32_t j = 0; REFUSED[j] && *ok; j++)
                *ok = !key_is(k, REFUSED[j]);
            static const char *const ASSERTIONS[] = {
                "oneOf", "additionalProperties", "patternProperties", "propertyNames", "dependencies", "dependentRequired",
                "contains", "prefixItems", "additionalItems", "multipleOf", "uniqueItems", "unevaluatedProperties", NULL};
            for (uint32_t j = 0; ASSERTIONS[j] && *ok; j++)
                *ok = !key_is(k, ASSERTIONS[j]);
        }
    }
    if (out.n > MAX_ALTERNATIVES)
        fail(c, where, "the schema is too complex: a \"not\" expands past 256 alternatives");
    return out;
}

/* A bundle that excludes the values valid against N, checked by the validator on enum/const
 * values only (lowering refuses it elsewhere). */
static dnf deferred_not(comp *c, const rudder_jv *N) {
    bundle *b = bundle_new(c);
    b->nots = aalloc(c, sizeof *b->nots);
    b->nots[0] = N;
    b->n_nots = 1;
    return one(c, b);
}

static dnf not_of(comp *c, const rudder_jv *where, const rudder_jv *N) {
    bool ok = true;
    dnf d = negate(c, where, N, 0, &ok);
    return ok || c->failed ? d : deferred_not(c, N);
}

static dnf one(comp *c, bundle *b) {
    bundle **p = aalloc(c, sizeof *p);
    *p = b;
    return (dnf){p, 1};
}

/* The JSON types a bundle's values can have (T_NUMBER: numbers with a fraction, T_INTEGER:
 * integral ones). */
static uint32_t value_types(const bundle *b) {
    if (!b->has_enum)
        return b->types;
    uint32_t t = 0;
    for (uint32_t i = 0; i < b->n_enum; i++)
        t |= value_type(b->enums[i]);
    return t & b->types;
}

static bool enums_apart(const bundle *x, const bundle *y) {
    for (uint32_t i = 0; i < x->n_enum; i++)
        for (uint32_t j = 0; j < y->n_enum; j++)
            if (jv_equal(x->enums[i], y->enums[j]))
                return false;
    return true;
}

static dnf dnf_conj(comp *c, conj x);

/* Can no value match both bundles, provably: different types, disjoint enums, or objects that
 * both require a key whose values are enums/consts with nothing in common (a tagged union). */
static bool bundles_apart(comp *c, const bundle *x, const bundle *y) {
    uint32_t common = value_types(x) & value_types(y);
    if (!common)
        return true;
    if (x->has_enum && y->has_enum)
        return enums_apart(x, y);
    if (common != T_OBJECT)
        return false;
    for (uint32_t i = 0; i < x->n_req; i++) {
        bool both = false;
        for (uint32_t j = 0; j < y->n_req && !both; j++)
            both = str_eq(&x->req[i], &y->req[j]);
        if (!both)
            continue;
        dnf dx = dnf_conj(c, value_of(c, x, &x->req[i], false)), dy = dnf_conj(c, value_of(c, y, &x->req[i], false));
        bool apart = dx.n && dy.n;
        for (uint32_t a = 0; a < dx.n && apart; a++)
            for (uint32_t b = 0; b < dy.n && apart; b++)
                apart = dx.b[a]->has_enum && dy.b[b]->has_enum && enums_apart(dx.b[a], dy.b[b]);
        if (apart)
            return true;
    }
    return false;
}

/* Strict mode: oneOf is generated like anyOf, which is exact only when no value can match two
 * alternatives (each one taken with what applies beside it, `d`); otherwise refused. */
static void one_of_apart(comp *c, const rudder_jv *s, dnf d, const rudder_jv *list) {
    if (list->type != RUDDER_JV_ARRAY)
        return;   /* (dnf_union says so) */
    dnf *alts = aalloc(c, (list->n + 1) * sizeof(dnf));
    for (uint32_t i = 0; i < list->n && !c->failed; i++)
        alts[i] = product(c, s, d, dnf_of(c, &list->items[i]));
    for (uint32_t i = 0; i < list->n && !c->failed; i++)
        for (uint32_t j = i + 1; j < list->n && !c->failed; j++)
            for (uint32_t a = 0; a < alts[i].n && !c->failed; a++)
                for (uint32_t b = 0; b < alts[j].n && spend(c, s, 1); b++)
                    if (!bundles_apart(c, alts[i].b[a], alts[j].b[b])) {
                        fail_strict(c, s, "oneOf", NULL, "alternatives may overlap (neither their types nor a required const/enum key tells them apart)");
                        return;
                    }
}

static dnf dnf_of(comp *c, const rudder_jv *s) {
    dnf none = {0};
    if (c->failed || s->type == RUDDER_JV_FALSE)
        return none;
    if (s->type == RUDDER_JV_TRUE)
        return one(c, &c->any);
    if (s->type != RUDDER_JV_OBJECT) {
        fail(c, s, "a schema must be an object or a boolean");
        return none;
    }
    dnf_slot *slot = dnf_slot_of(c, s);
    if (slot->state == 2)
        return slot->d;
    if (slot->state == 1) {
        fail(c, s, "a $ref cycle (a schema that refers to itself without nesting, through $ref/allOf/anyOf)");
        return none;
    }
    slot->state = 1;
    /* What the schema builds on ($ref, then allOf) comes before its own keywords: merged
     * properties are generated in that order (as llguidance does; docs/json-schema.md). */
    bundle *base = base_bundle(c, s);
    dnf d = one(c, &c->any);
    bool own = true;
    const rudder_jv *v;
    if ((v = get(s, "$ref"))) {
        const rudder_jv *target = resolve_ref(c, s, v);
        if (target) {
            d = dnf_of(c, target);
            own = !c->old_ref;   /* drafts 4-7: siblings of $ref are ignored */
        }
    }
    if ((v = get(s, "allOf")) && !c->failed) {
        if (v->type != RUDDER_JV_ARRAY || v->n == 0)
            fail_kw(c, s, "must be a non-empty array:", "allOf");
        for (uint32_t i = 0; i < v->n && !c->failed; i++)
            d = product(c, s, d, dnf_of(c, &v->items[i]));
    }
    if (own && !c->failed)
        d = product(c, s, d, base ? one(c, base) : none);
    if ((v = get(s, "anyOf")) && !c->failed)
        d = product(c, s, d, dnf_union(c, s, v, "anyOf"));
    if ((v = get(s, "oneOf")) && !c->failed) {   /* generated like anyOf (documented) */
        if (c->strict)
            one_of_apart(c, s, d, v);
        d = product(c, s, d, dnf_union(c, s, v, "oneOf"));
    }
    if ((v = get(s, "not")) && !c->failed)
        d = product(c, s, d, not_of(c, s, v));
    if ((v = get(s, "if")) && !c->failed) {   /* (if and then) or (not if and else) */
        const rudder_jv *then = get(s, "then"), *other = get(s, "else");
        dnf yes = product(c, s, dnf_of(c, v), then ? dnf_of(c, then) : one(c, &c->any));
        dnf no = product(c, s, not_of(c, s, v), other ? dnf_of(c, other) : one(c, &c->any));
        d = product(c, s, d, cat(c, yes, no));
    }
    const rudder_jv *dep[2] = {get(s, "dependentSchemas"), get(s, "dependencies")};
    for (uint32_t k = 0; k < 2 && !c->failed; k++)
        for (uint32_t i = 0; dep[k] && dep[k]->type == RUDDER_JV_OBJECT && i < dep[k]->n && !c->failed; i++) {
            const rudder_jv *ds = &dep[k]->items[i];
            if (ds->type == RUDDER_JV_ARRAY)
                continue;   /* dependentRequired (in the bundle) */
            /* not an object, or an object without the key, or with it and meeting the schema */
            bundle *without = typed(c, T_OBJECT), *with = typed(c, T_OBJECT);
            without->forbid = &dep[k]->keys[i];
            without->n_forbid = 1;
            with->req = &dep[k]->keys[i];
            with->n_req = 1;
            dnf alt = cat(c, one(c, typed(c, T_ALL & ~T_OBJECT)), one(c, without));
            d = product(c, s, d, cat(c, alt, product(c, s, one(c, with), dnf_of(c, ds))));
        }
    if ((v = get(s, "unevaluatedProperties")) && !c->failed) {
        if (!is_schema(v))
            fail_kw(c, s, "must be a schema:", "unevaluatedProperties");
        for (uint32_t i = 0; i < d.n && !c->failed; i++) {   /* keys no part declared or matched */
            if (d.b[i]->add_set)
                continue;
            bundle *b = d.b[i] = acopy(c, d.b[i], sizeof(bundle));
            b->add_set = true;
            if (v->type == RUDDER_JV_FALSE)
                b->no_add = true;
            else
                b->add = conj_and(c, b->add, conj_one(c, v));
        }
    }
    slot = dnf_slot_of(c, s);   /* (the table may have grown) */
    slot->state = 2;
    slot->d = c->failed ? none : d;
    return slot->d;
}

/* The DNF of a conjunction: every member's, merged. */
static dnf dnf_conj(comp *c, conj x) {
    dnf d = one(c, &c->any);
    for (uint32_t i = 0; i < x.n && !c->failed && d.n; i++)
        d = product(c, x.s[i], d, dnf_of(c, x.s[i]));
    return d;
}

/* ------------------------------------------------------------------ the validator (for enum/const values and key names) */

static bool valid_conj(comp *c, conj x, const rudder_jv *v, uint32_t depth);

static bool valid_string(comp *c, const bundle *b, const uint8_t *s, uint32_t n) {
    uint32_t chars = 0;
    for (uint32_t i = 0; i < n; i++)
        chars += (s[i] & 0xc0) != 0x80;
    if (chars < b->min_len || chars > b->max_len)
        return false;
    for (uint32_t i = 0; i < b->n_rx; i++) {
        rudder_rx *rx = regex_of(c, b->rx[i].src, b->rx[i]);
        if (!rx || rx_matches(rx, s, n) == b->rx[i].negated)
            return false;
    }
    return true;
}

static bool valid_bundle(comp *c, const bundle *b, const rudder_jv *v, uint32_t depth) {
    if (!spend(c, v, 1) || depth > 64)
        return false;
    uint32_t t = value_type(v);
    if (!(b->types & t) && !(t == T_INTEGER && (b->types & T_NUMBER)))
        return false;
    if (b->has_enum) {
        bool found = false;
        for (uint32_t i = 0; i < b->n_enum && !found; i++)
            found = jv_equal(b->enums[i], v);
        if (!found)
            return false;
    }
    for (uint32_t i = 0; i < b->n_nots; i++)
        if (valid_conj(c, conj_one(c, b->nots[i]), v, depth + 1))
            return false;
    switch (v->type) {
    case RUDDER_JV_STRING:
        return valid_string(c, b, v->str, v->n);
    case RUDDER_JV_NUMBER: {
        double x = v->num;
        if ((b->has_lo && (x < b->lo || (x == b->lo && b->lo_excl))) || (b->has_hi && (x > b->hi || (x == b->hi && b->hi_excl))))
            return false;
        if (b->mult) {
            double q = x / b->mult;
            if (q != (double)(int64_t)q)
                return false;
        }
        return true;
    }
    case RUDDER_JV_ARRAY:
        if (v->n < b->min_items || v->n > b->max_items)
            return false;
        for (uint32_t i = 0; i < v->n; i++) {
            if (i >= b->n_prefix && b->no_items)
                return false;
            if (!valid_conj(c, i < b->n_prefix ? b->prefix[i] : b->items, &v->items[i], depth + 1))
                return false;
        }
        if (b->has_contains) {
            uint32_t hits = 0;
            for (uint32_t i = 0; i < v->n; i++)
                hits += valid_conj(c, b->contains, &v->items[i], depth + 1);
            if (hits < b->min_contains)
                return false;
        }
        return true;
    case RUDDER_JV_OBJECT:
        if (v->n < b->min_props || v->n > b->max_props)
            return false;
        for (uint32_t i = 0; i < b->n_req; i++)
            if (!rudder_jv_get(v, (const char *)b->req[i].ptr))
                return false;
        for (uint32_t i = 0; i < b->n_forbid; i++)
            if (rudder_jv_get(v, (const char *)b->forbid[i].ptr))
                return false;
        for (uint32_t i = 0; i < b->n_deps; i++)
            if (rudder_jv_get(v, (const char *)b->deps[i].name.ptr))
                for (uint32_t j = 0; j < b->deps[i].list->n; j++)
                    if (!rudder_jv_get(v, (const char *)b->deps[i].list->items[j].str))
                        return false;
        for (uint32_t i = 0; i < v->n; i++) {
            rudder_jv name = {.type = RUDDER_JV_STRING, .n = v->keys[i].len, .str = v->keys[i].ptr};
            if (b->names.n && !valid_conj(c, b->names, &name, depth + 1))
                return false;
            if (!valid_conj(c, value_of(c, b, &v->keys[i], false), &v->items[i], depth + 1))
                return false;
        }
        return true;
    default:
        return true;
    }
}

static bool valid_conj(comp *c, conj x, const rudder_jv *v, uint32_t depth) {
    for (uint32_t i = 0; i < x.n; i++) {
        dnf d = dnf_of(c, x.s[i]);
        bool ok = false;
        for (uint32_t k = 0; k < d.n && !ok && !c->failed; k++)
            ok = valid_bundle(c, d.b[k], v, depth);
        if (!ok)
            return false;
    }
    return true;
}

/* ------------------------------------------------------------------ nodes */

static uint32_t new_node(comp *c, const rudder_jv *where, uint8_t kind) {
    rudder_js *js = c->js;
    if (js->n_nodes >= MAX_NODES) {
        fail(c, where, "the schema is too large (more than 65535 nodes)");
        return NONE;
    }
    js->nodes = rudder_grow(js->nodes, &js->cap_nodes, js->n_nodes + 1, sizeof(jnode));
    js->nodes[js->n_nodes] = (jnode){.kind = kind, .extra = NONE, .max = NONE, .trie = NONE, .pvals = NONE,
                                     .kmax = NONE, .frac = 255, .tags = NONE, .enum_pat = NONE};
    return js->n_nodes++;
}

static uint32_t new_tnode(rudder_js *js, uint8_t byte) {
    js->trie = rudder_grow(js->trie, &js->cap_trie, js->n_trie + 1, sizeof(tnode));
    js->trie[js->n_trie] = (tnode){.child = NONE, .sibling = NONE, .term = NONE, .byte = byte};
    return js->n_trie++;
}

/* Add bytes as a path below `root`; returns the end node. Property `mark` (NONE: none) goes
 * into every node's below. */
static uint32_t trie_add(rudder_js *js, uint32_t root, const uint8_t *s, uint32_t n, uint32_t mark) {
    uint32_t at = root;
    if (mark != NONE)
        ps_add(&js->trie[at].below, mark);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t ch = js_tchild(js, at, s[i]);
        if (ch == NONE) {
            ch = new_tnode(js, s[i]);
            js->trie[ch].sibling = js->trie[at].child;
            js->trie[at].child = ch;
        }
        at = ch;
        if (mark != NONE)
            ps_add(&js->trie[at].below, mark);
    }
    return at;
}

static uint32_t idx_add(rudder_js *js, const uint32_t *v, uint32_t n) {
    uint32_t first = js->n_idx;
    js->idx = rudder_grow(js->idx, &js->cap_idx, first + n + 1, 4);
    if (n)
        memcpy(js->idx + first, v, n * 4);
    js->n_idx += n;
    return first;
}

static uint32_t lower(comp *c, conj x, const rudder_jv *where);

static uint32_t lits_node(comp *c, const rudder_jv *where, const char *words) {
    uint32_t id = new_node(c, where, K_LITS);
    if (id == NONE)
        return NONE;
    uint32_t root = new_tnode(c->js, 0);
    c->js->nodes[id].trie = root;
    for (const char *w = words; *w; w += strlen(w) + 1) {
        uint32_t end = trie_add(c->js, root, (const uint8_t *)w, (uint32_t)strlen(w), NONE);
        c->js->trie[end].term = 1;
    }
    return id;
}

/* An escaped copy of bytes for a regex literal. */
static void sb_literal(sbuf *b, const uint8_t *s, uint32_t n) {
    uint32_t need = rudder_rx_escape((const char *)s, n, NULL, 0);
    b->buf = rudder_grow(b->buf, &b->cap, b->n + need + 1, 1);
    rudder_rx_escape((const char *)s, n, b->buf + b->n, need);
    b->n += need;
    b->buf[b->n] = 0;
}

static uint32_t lower_object(comp *c, uint32_t id, const bundle *b, const rudder_jv *where);
static uint32_t lower_array(comp *c, uint32_t id, const bundle *b, const rudder_jv *where);

/* {"const": v} as a schema object (for the items of a structural constant). */
static conj const_schema(comp *c, const rudder_jv *v) {
    rudder_jv *k = aalloc(c, sizeof *k);
    rudder_str *key = aalloc(c, sizeof *key);
    *key = (rudder_str){(const uint8_t *)"const", 5};
    *k = (rudder_jv){.type = RUDDER_JV_OBJECT, .n = 1, .items = (rudder_jv *)v, .keys = key};
    return conj_one(c, k);
}

/* A node for an object or array constant: a structural node of constants (so that whitespace
 * works inside it, and a key order is the constant's). */
static uint32_t const_container(comp *c, const rudder_jv *v, const rudder_jv *where) {
    bundle *b = bundle_new(c);
    if (v->type == RUDDER_JV_OBJECT) {
        b->types = T_OBJECT;
        b->no_add = true;
        b->props = aalloc(c, (v->n + 1) * sizeof(bprop));
        b->req = aalloc(c, (v->n + 1) * sizeof(rudder_str));
        for (uint32_t i = 0; i < v->n; i++) {
            b->props[b->n_props++] = (bprop){v->keys[i], const_schema(c, &v->items[i])};
            b->req[b->n_req++] = v->keys[i];
        }
    } else {
        b->types = T_ARRAY;
        b->no_items = true;
        b->min_items = b->max_items = v->n;
        b->prefix = aalloc(c, (v->n + 1) * sizeof(conj));
        for (uint32_t i = 0; i < v->n; i++)
            b->prefix[b->n_prefix++] = const_schema(c, &v->items[i]);
    }
    uint32_t id = new_node(c, where, K_PENDING);
    if (id == NONE)
        return NONE;
    return v->type == RUDDER_JV_OBJECT ? lower_object(c, id, b, where) : lower_array(c, id, b, where);
}

/* The nodes of an enum's values that pass the rest of the bundle: one string node matching
 * exactly the string values (whatever their escaping), one literal trie of the numbers,
 * booleans and null as written, and a structural node per object or array. */
static bool lower_enum(comp *c, const bundle *b, const rudder_jv *where, uint32_t *alts, uint32_t *n) {
    rudder_js *js = c->js;
    bundle plain = *b;
    plain.has_enum = false;
    sbuf strings = {0};
    uint32_t lits = NONE, n_strings = 0;
    for (uint32_t i = 0; i < b->n_enum && !c->failed; i++) {
        const rudder_jv *v = b->enums[i];
        if (!valid_bundle(c, &plain, v, 0))
            continue;   /* a value the rest of the schema excludes */
        if (v->type == RUDDER_JV_STRING) {
            sb_put(&strings, n_strings ? "|" : "(?:", n_strings ? 1 : 3);
            n_strings++;
            sb_literal(&strings, v->str, v->n);
        } else if (v->type == RUDDER_JV_OBJECT || v->type == RUDDER_JV_ARRAY) {
            uint32_t id = const_container(c, v, where);
            if (id != NONE)
                alts[(*n)++] = id;
        } else {
            if (lits == NONE) {
                lits = new_node(c, where, K_LITS);
                if (lits == NONE)
                    break;
                js->nodes[lits].trie = new_tnode(js, 0);
                alts[(*n)++] = lits;
            }
            uint32_t len = rudder_jv_write(v, NULL, 0);
            uint8_t *buf = rudder_xalloc(len + 1);
            rudder_jv_write(v, buf, len);
            uint32_t end = trie_add(js, js->nodes[lits].trie, buf, len, NONE);   /* (trie_add may move js->trie) */
            js->trie[end].term = 1;
            rudder_free(buf);
        }
    }
    if (n_strings && !c->failed) {
        sb_put(&strings, ")", 1);
        char msg[160];
        rudder_rx *rx = rudder_rx_compile(strings.buf, strings.n, msg, sizeof msg);
        uint32_t id = rx ? new_node(c, where, K_STRING) : NONE;
        if (!rx)
            fail(c, where, msg);
        if (id != NONE) {
            js->nodes[id].rx[0] = rx;
            js->nodes[id].n_rx = 1;
            alts[(*n)++] = id;
            c->enum_pats = rudder_grow(c->enum_pats, &c->cap_enum_pats, c->n_enum_pats + 1, sizeof(sbuf));
            js->nodes[id].enum_pat = c->n_enum_pats;
            c->enum_pats[c->n_enum_pats++] = strings;   /* (a tagged union's tag: see tagged_union) */
            strings.buf = NULL;
        }
    }
    rudder_free(strings.buf);
    return !c->failed;
}

static uint32_t lower_object(comp *c, uint32_t id, const bundle *b, const rudder_jv *where) {
    rudder_js *js = c->js;
    /* declared keys: the bundle's, then required/dependent names it does not declare (their
     * values are what the extra keys allow), less those propertyNames or not-required exclude */
    uint32_t cap = b->n_props + b->n_req + b->n_forbid + 1;
    for (uint32_t i = 0; i < b->n_deps; i++)
        cap += 1 + b->deps[i].list->n;
    bprop *props = aalloc(c, cap * sizeof(bprop));
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->n_props; i++)
        props[n++] = b->props[i];
    rudder_str *extra_names = aalloc(c, cap * sizeof(rudder_str));
    uint32_t n_extra = 0;
    for (uint32_t i = 0; i < b->n_req; i++)
        extra_names[n_extra++] = b->req[i];
    for (uint32_t i = 0; i < b->n_deps; i++) {
        extra_names[n_extra++] = b->deps[i].name;
        for (uint32_t j = 0; j < b->deps[i].list->n; j++)
            extra_names[n_extra++] = (rudder_str){b->deps[i].list->items[j].str, b->deps[i].list->items[j].n};
    }
    for (uint32_t i = 0; i < b->n_forbid; i++)
        extra_names[n_extra++] = b->forbid[i];
    for (uint32_t i = 0; i < n_extra; i++) {
        bool known = false;
        for (uint32_t j = 0; j < n && !known; j++)
            known = str_eq(&props[j].name, &extra_names[i]);
        if (!known)
            props[n++] = (bprop){extra_names[i], value_of(c, b, &extra_names[i], false)};
    }
    /* propertyNames as a list of names: those keys only, as declared ones */
    dnf names = b->names.n ? dnf_conj(c, b->names) : (dnf){0};
    if (c->failed)
        return NONE;
    bool names_enum = names.n == 1 && names.b[0]->has_enum;
    if (names_enum) {
        bprop *more = aalloc(c, (n + names.b[0]->n_enum + 1) * sizeof(bprop));
        memcpy(more, props, n * sizeof(bprop));
        props = more;
        for (uint32_t i = 0; i < names.b[0]->n_enum; i++) {
            const rudder_jv *e = names.b[0]->enums[i];
            rudder_str k = {e->str, e->n};
            bool known = e->type != RUDDER_JV_STRING;
            for (uint32_t j = 0; j < n && !known; j++)
                known = str_eq(&props[j].name, &k);
            if (!known)
                props[n++] = (bprop){k, value_of(c, b, &k, false)};
        }
    }
    pset required = {{0}};
    uint32_t kept = 0;
    for (uint32_t i = 0; i < n; i++) {
        bprop p = props[i];
        bool req = false, out = false;
        for (uint32_t k = 0; k < b->n_req && !req; k++)
            req = str_eq(&b->req[k], &p.name);
        for (uint32_t k = 0; k < b->n_forbid && !out; k++)
            out = str_eq(&b->forbid[k], &p.name);
        if (!out && b->names.n) {
            rudder_jv name = {.type = RUDDER_JV_STRING, .n = p.name.len, .str = p.name.ptr};
            out = !valid_conj(c, b->names, &name, 0);
        }
        if (out) {   /* kept, with no possible value: so that no extra key takes its name */
            if (req)
                return js->nodes[id].kind = K_NEVER, id;   /* a required key that cannot be there */
            p.value = conj_false(c);
        }
        if (has_prop(b, &p.name))   /* patternProperties apply to declared keys too */
            for (uint32_t k = 0; k < b->n_pats; k++) {
                rudder_rx *rx = regex_of(c, b->pats[k].pattern, (bregex){b->pats[k].pattern, RX_PATTERN, false});
                if (rx && rx_matches(rx, p.name.ptr, p.name.len))
                    p.value = conj_and(c, p.value, b->pats[k].value);
            }
        props[kept] = p;
        if (req) {
            if (kept >= MAX_PROPS)
                return fail(c, where, "more than 256 properties in one object are not supported"), NONE;
            ps_add(&required, kept);
        }
        kept++;
    }
    n = kept;
    if (n > MAX_PROPS)
        return fail(c, where, "more than 256 properties in one object are not supported"), NONE;
    if (b->n_deps && n > MAX_DEP_PROPS)
        return fail(c, where, "dependentRequired in an object of more than 32 properties is not supported"), NONE;
    uint32_t first = js->n_props;
    js->props = rudder_grow(js->props, &js->cap_props, first + n + 1, sizeof(jprop));
    js->n_props += n;
    uint32_t trie = new_tnode(js, 0);
    for (uint32_t i = 0; i < n; i++) {
        rudder_jv key = {.type = RUDDER_JV_STRING, .n = props[i].name.len, .str = props[i].name.ptr};
        uint32_t len = rudder_jv_write(&key, NULL, 0);
        uint8_t *buf = rudder_xalloc(len);
        rudder_jv_write(&key, buf, len);   /* the key as generated: after the opening quote */
        uint32_t end = trie_add(js, trie, buf + 1, len - 1, i);   /* the key as generated, from after its quote */
        js->trie[end].term = i;
        rudder_free(buf);
        js->props[first + i] = (jprop){NONE, 0};
    }
    for (uint32_t i = 0; i < b->n_deps; i++)
        for (uint32_t k = 0; k < n; k++)
            if (str_eq(&props[k].name, &b->deps[i].name))
                for (uint32_t j = 0; j < b->deps[i].list->n; j++)
                    for (uint32_t q = 0; q < n; q++)
                        if (props[q].name.len == b->deps[i].list->items[j].n &&
                            memcmp(props[q].name.ptr, b->deps[i].list->items[j].str, props[q].name.len) == 0)
                            js->props[first + k].deps |= 1u << q;
    js->psets = rudder_grow(js->psets, &js->cap_psets, js->n_psets + 2, sizeof(pset));
    js->psets[js->n_psets] = required;
    memset(&js->psets[js->n_psets + 1], 0, sizeof(pset));   /* (filled in js_finish_nodes) */
    jnode *node = &js->nodes[id];
    node->sets = js->n_psets;
    js->n_psets += 2;
    node->kind = K_OBJECT;
    node->a = first;
    node->n = n;
    node->trie = trie;
    node->has_deps = b->n_deps > 0;
    node->min = b->min_props;
    node->max = b->max_props;
    uint32_t n_req = 0;
    for (uint32_t w = 0; w < MAX_PROPS / 64; w++)
        n_req += (uint32_t)__builtin_popcountll(required.w[w]);
    if (node->max != NONE && n_req > node->max)
        return node->kind = K_NEVER, id;
    /* extra keys: their names (propertyNames), patterns and values */
    if (names.n > 1)
        return fail(c, where, "propertyNames with alternatives (anyOf) is not supported"), NONE;
    /* forbid mode: an object that names keys, where no merged part said what other keys take,
     * has those keys only (and keys matching its patterns), unless minProperties asks for more
     * keys than it names */
    bool closed = b->no_add || (c->forbid && !b->add_set && (b->n_props || b->n_pats || b->n_req) && b->min_props <= n);
    bool extras = !names_enum && (!closed || b->n_pats);
    if (b->names.n && (names.n == 0 || !(names.b[0]->types & T_STRING)))
        extras = false;   /* no name can be a key */
    if (extras && names.n == 1) {
        const bundle *nb = names.b[0];
        if (nb->n_rx > 1)
            return fail(c, where, "propertyNames with more than one pattern/format is not supported"), NONE;
        js->nodes[id].kmin = nb->min_len;
        js->nodes[id].kmax = nb->max_len;
        if (nb->n_rx) {
            rudder_rx *rx = regex_of(c, nb->rx[0].src, nb->rx[0]);
            if (!rx)
                return NONE;
            js->nodes[id].rx[1] = rx;
            bool open_end = nb->rx[0].kind == RX_PATTERN && !nb->rx[0].negated;
            if (open_end) {
                sbuf tmp = {0};
                pattern_regex(nb->rx[0].src, &tmp, &open_end);
                rudder_free(tmp.buf);
            }
            if (open_end)
                js->nodes[id].rx_free |= 2;
        }
    }
    if (extras) {
        if (b->n_pats > MAX_PATTERNS)
            return fail(c, where, "more than 4 patternProperties in one object are not supported"), NONE;
        uint32_t subsets = 1u << b->n_pats, vals[1u << MAX_PATTERNS];
        for (uint32_t s = 0; s < subsets; s++) {
            conj v = s == 0 ? b->add : b->pats_add;
            if (s == 0 && closed) {
                vals[s] = NONE;
                continue;
            }
            for (uint32_t k = 0; k < b->n_pats; k++)
                if (s >> k & 1)
                    v = conj_and(c, v, b->pats[k].value);
            vals[s] = lower(c, v, where);
            if (c->failed)
                return NONE;
        }
        js->nodes[id].extra = vals[0];
        if (b->n_pats) {
            rudder_rx_pattern pats[MAX_PATTERNS];
            sbuf bufs[MAX_PATTERNS] = {{0}};
            bool open_end = true;
            for (uint32_t k = 0; k < b->n_pats; k++) {
                pattern_regex(b->pats[k].pattern, &bufs[k], &open_end);
                pats[k] = (rudder_rx_pattern){bufs[k].buf, bufs[k].n, false};
            }
            if (open_end)
                js->nodes[id].rx_free |= 1;
            char msg[200];
            rudder_rx *rx = rudder_rx_new(pats, b->n_pats, msg, sizeof msg);
            for (uint32_t k = 0; k < b->n_pats; k++)
                rudder_free(bufs[k].buf);
            if (!rx)
                return fail_kw(c, where, msg, "patternProperties"), NONE;
            js->nodes[id].rx[0] = rx;
            js->nodes[id].n_rx = 1;
            js->nodes[id].pvals = idx_add(js, vals, subsets);
        }
    }
    for (uint32_t i = 0; i < n && !c->failed; i++) {
        uint32_t v = lower(c, props[i].value, where);
        js->props[first + i].value = v;
    }
    return c->failed ? NONE : id;
}

static uint32_t lower_array(comp *c, uint32_t id, const bundle *b, const rudder_jv *where) {
    rudder_js *js = c->js;
    uint32_t n = b->n_prefix < b->max_items ? b->n_prefix : b->max_items;
    uint32_t *vals = aalloc(c, (n + 1) * 4);
    for (uint32_t i = 0; i < n && !c->failed; i++)
        vals[i] = lower(c, b->prefix[i], where);
    /* forbid mode: a tuple (prefixItems) where no merged part set `items` ends after its
     * prefix, unless minItems asks for more items than it lists */
    bool closed = b->no_items || (c->forbid && !b->items_set && b->n_prefix && b->min_items <= b->n_prefix);
    uint32_t items = closed ? NONE : lower(c, b->items, where);
    if (c->failed)
        return NONE;
    if (b->has_contains) {   /* each item: (items and contains), counted, or items */
        uint32_t hit = lower(c, conj_and(c, b->items, b->contains), where);
        if (c->failed)
            return NONE;
        if (n || items == NONE)
            return fail(c, where, "contains with prefixItems or items: false is not supported"), NONE;
        const jnode *h = &js->nodes[hit], *it = &js->nodes[items];
        if (h->kind == K_PENDING || it->kind == K_PENDING)
            return fail(c, where, "contains on a recursive schema is not supported"), NONE;
        uint32_t na = h->kind == K_UNION ? h->n : 1, nb = it->kind == K_UNION ? it->n : 1;
        uint32_t *alts = aalloc(c, (na + nb) * 4);
        for (uint32_t k = 0; k < na; k++)
            alts[k] = h->kind == K_UNION ? js->idx[h->a + k] : hit;
        for (uint32_t k = 0; k < nb; k++)
            alts[na + k] = it->kind == K_UNION ? js->idx[it->a + k] : items;
        uint32_t u = new_node(c, where, K_UNION);
        if (u == NONE)
            return NONE;
        js->nodes[u].a = idx_add(js, alts, na + nb);
        js->nodes[u].n = na + nb;
        js->nodes[u].counting = na;
        items = u;
    }
    jnode *node = &js->nodes[id];
    node->kind = K_ARRAY;
    node->a = idx_add(js, vals, n);
    node->n = n;
    node->extra = items;
    node->min = b->min_items;
    node->max = b->max_items;
    node->contains = b->has_contains ? b->min_contains : 0;
    if (node->max != NONE && node->min > node->max)
        return node->kind = K_NEVER, id;
    if (items == NONE && node->min > n)
        return node->kind = K_NEVER, id;
    uint32_t cap = n > node->min ? n : node->min;
    node->cap = node->max != NONE && node->max > cap ? node->max : cap;
    return id;
}

static uint32_t lower_string(comp *c, uint32_t id, const bundle *b, const rudder_jv *where) {
    jnode *node = &c->js->nodes[id];
    node->kind = K_STRING;
    node->min = b->min_len;
    node->max = b->max_len == NONE || b->max_len > 1000000 ? NONE : b->max_len;
    if (node->max != NONE && node->min > node->max)
        return node->kind = K_NEVER, id;
    for (uint32_t pass = 0; pass < 2; pass++)   /* the regexes it must match, then those it must not */
        for (uint32_t i = 0; i < b->n_rx; i++) {
            if (b->rx[i].negated != (pass == 1))
                continue;
            rudder_rx *rx = regex_of(c, b->rx[i].src, b->rx[i]);
            if (!rx)
                return NONE;
            node = &c->js->nodes[id];
            if (!pass && b->rx[i].kind == RX_PATTERN) {   /* does it never die? (see pattern_regex) */
                sbuf tmp = {0};
                if (pattern_regex(b->rx[i].src, &tmp, NULL))
                    node->rx_free |= (uint8_t)(1u << node->n_rx);
                rudder_free(tmp.buf);
            }
            node->rx[node->n_rx + node->n_neg] = rx;
            if (pass)
                node->n_neg++;
            else
                node->n_rx++;
        }
    node->cap = node->max != NONE ? node->max : node->min;
    (void)where;
    return id;
}

static uint32_t lower_number(comp *c, uint32_t id, const bundle *b, bool integer, const rudder_jv *where) {
    jnode *node = &c->js->nodes[id];
    node->kind = K_NUMBER;
    node->integer = integer;
    node->has_lo = b->has_lo, node->lo = b->lo, node->lo_excl = b->lo_excl;
    node->has_hi = b->has_hi, node->hi = b->hi, node->hi_excl = b->hi_excl;
    if (b->mult) {
        double m = b->mult;
        if (m == (double)(uint64_t)m && m < 1e9) {
            if (m >= 2)
                node->mult = (uint32_t)m;
            node->integer = true;   /* (a multiple written with a fraction, 4.0, is not generated) */
        } else {
            uint32_t k = 0;   /* 0.1, 0.01...: that many fraction digits at most */
            double p = 1;
            while (k < 9 && m * p != 1)
                k++, p *= 10;
            if (m * p != 1 && !(m * p > 0.999999999 && m * p < 1.000000001))
                return fail_kw(c, where, "multipleOf that is neither an integer nor a power of ten (0.1, 0.01...) is not supported:", "multipleOf"), NONE;
            node->frac = (uint8_t)k;
        }
    }
    if (node->has_lo && node->has_hi && (node->lo > node->hi || (node->lo == node->hi && (node->lo_excl || node->hi_excl))))
        return node->kind = K_NEVER, id;
    if (node->integer && node->has_lo && node->has_hi) {
        double fa = (double)(int64_t)node->lo;   /* some integer must lie between them */
        if (fa < node->lo || (fa == node->lo && node->lo_excl))
            fa += 1;
        if (fa > node->hi || (fa == node->hi && node->hi_excl))
            return node->kind = K_NEVER, id;
    }
    /* generated numbers have at most 15 integer digits: bounds past that do not restrict them */
    if (node->has_lo && node->lo < -1e15)
        node->has_lo = false;
    if (node->has_hi && node->hi > 1e15)
        node->has_hi = false;
    if ((node->has_lo && node->lo >= 1e15) || (node->has_hi && node->hi <= -1e15))
        return node->kind = K_NEVER, id;
    return id;
}

/* The nodes of one bundle (one per type, or per enum value), appended to alts. */
static bool lower_bundle(comp *c, const bundle *b, const rudder_jv *where, uint32_t *alts, uint32_t *n, uint32_t into) {
    rudder_js *js = c->js;
    uint32_t types = b->types;
    if (b->has_enum)
        return lower_enum(c, b, where, alts, n);
    if (b->n_nots)   /* a not (or if) without a finite negation: only enum/const values can be checked */
        return fail(c, b->nots[0], "unsupported \"not\" (or \"if\"): no generator for the values outside this schema (it is checked only on enum/const values)");
    bool any = b == &c->any || (types == T_ALL && !memcmp(b, &c->any, sizeof *b));
    if (any && js->any != NONE) {   /* the any-union's alternatives */
        const jnode *u = &js->nodes[js->any];
        for (uint32_t k = 0; k < u->n; k++)
            alts[(*n)++] = js->idx[u->a + k];
        return true;
    }
    static const uint32_t order[] = {T_OBJECT, T_ARRAY, T_STRING, T_NUMBER, T_INTEGER, T_BOOLEAN, T_NULL};
    for (uint32_t k = 0; k < 7 && !c->failed; k++) {
        uint32_t t = order[k];
        if (!(types & t) || (t == T_INTEGER && (types & T_NUMBER)))
            continue;
        uint32_t id = into != NONE ? into : new_node(c, where, K_PENDING);
        into = NONE;
        if (id == NONE)
            return false;
        switch (t) {
        case T_OBJECT: id = lower_object(c, id, b, where); break;
        case T_ARRAY: id = lower_array(c, id, b, where); break;
        case T_STRING: id = lower_string(c, id, b, where); break;
        case T_NUMBER: id = lower_number(c, id, b, false, where); break;
        case T_INTEGER: id = lower_number(c, id, b, true, where); break;
        default: {
            const char *w = t == T_BOOLEAN ? "true\0false\0" : "null\0";
            uint32_t root = new_tnode(js, 0);
            js->nodes[id].kind = K_LITS;
            js->nodes[id].trie = root;
            for (; *w; w += strlen(w) + 1)
            {
                uint32_t end = trie_add(js, root, (const uint8_t *)w, (uint32_t)strlen(w), NONE);
                js->trie[end].term = 1;
            }
        }
        }
        if (id == NONE)
            return false;
        alts[(*n)++] = id;
    }
    return !c->failed;
}

static uint32_t hash_conj(conj x) {
    uint32_t h = 2166136261u ^ x.n;
    for (uint32_t i = 0; i < x.n; i++)
        h = (h ^ (uint32_t)(uintptr_t)x.s[i]) * 16777619u;
    return h;
}

static conj sorted(comp *c, conj x) {
    const rudder_jv **p = acopy(c, x.s, x.n * sizeof *p);
    for (uint32_t i = 1; i < x.n; i++) {
        const rudder_jv *v = p[i];
        uint32_t j = i;
        while (j > 0 && (uintptr_t)p[j - 1] > (uintptr_t)v)
            p[j] = p[j - 1], j--;
        p[j] = v;
    }
    return (conj){p, x.n};
}

static term_slot *term_slot_of(comp *c, conj x, uint32_t h) {
    if (2 * (c->n_terms + 1) > c->term_mask + 1) {
        uint32_t old = c->term_mask + 1;
        term_slot *prev = c->terms;
        c->term_mask = 2 * old - 1;
        c->terms = rudder_xalloc((c->term_mask + 1) * sizeof(term_slot));
        for (uint32_t i = 0; i <= c->term_mask; i++)
            c->terms[i].node = NONE;
        for (uint32_t i = 0; i < old; i++)
            if (prev[i].node != NONE) {
                uint32_t k = prev[i].hash & c->term_mask;
                while (c->terms[k].node != NONE)
                    k = (k + 1) & c->term_mask;
                c->terms[k] = prev[i];
            }
        rudder_free(prev);
    }
    uint32_t k = h & c->term_mask;
    for (; c->terms[k].node != NONE; k = (k + 1) & c->term_mask) {
        term_slot *t = &c->terms[k];
        if (t->hash == h && t->c.n == x.n && memcmp(t->c.s, x.s, x.n * sizeof *x.s) == 0)
            return t;
    }
    return &c->terms[k];
}

/* The key of property `prop` of an object (its trie path: the key as generated, with its
 * closing quote) into buf; its length, or 0 when longer than cap. */
static uint32_t key_of(const rudder_js *js, const jnode *o, uint32_t prop, uint8_t *buf, uint32_t cap) {
    uint32_t at = o->trie, n = 0;
    while (js->trie[at].term != prop) {
        uint32_t c = js->trie[at].child;
        while (c != NONE && !ps_has(&js->trie[c].below, prop))
            c = js->trie[c].sibling;
        if (c == NONE || n == cap)
            return 0;
        buf[n++] = js->trie[c].byte;
        at = c;
    }
    return n;
}

/* A union of objects that all start with the same required key whose value is an enum of
 * strings (a tool call's "name", a tagged union's "type") becomes, in node `id`, one object
 * that reads the key and the tag; at the tag's closing quote the thread goes on in the
 * alternative whose tag it wrote (in each, if tags overlap). Without it every alternative is a
 * thread until the tags differ: 128 tools cost 128 mask walks per step. The alternatives must
 * allow nothing else before the tag: no extra keys, no dependentRequired, no maxProperties.
 * Returns false (and changes nothing) for other unions. */
static bool tagged_union(comp *c, uint32_t id, const uint32_t *alts, uint32_t n, const rudder_jv *where) {
    rudder_js *js = c->js;
    uint8_t key[256], other[256];
    uint32_t len = 0;
    for (uint32_t k = 0; k < n; k++) {
        const jnode *o = &js->nodes[alts[k]];
        if (o->kind != K_OBJECT || !o->n || o->extra != NONE || o->n_rx || o->has_deps || o->max != NONE ||
            o->min > o->n || !ps_has(&js->psets[o->sets], 0))
            return false;
        const jnode *v = &js->nodes[js->props[o->a].value];
        if (v->kind != K_STRING || v->enum_pat == NONE || v->n_rx != 1 || v->n_neg || v->min || v->max != NONE)
            return false;
        uint32_t l = key_of(js, o, 0, k ? other : key, sizeof key);
        if (!l || (k && (l != len || memcmp(key, other, l))))
            return false;
        len = l;
    }
    rudder_rx_pattern *pats = rudder_xalloc(n * sizeof *pats);
    for (uint32_t k = 0; k < n; k++) {
        const sbuf *p = &c->enum_pats[js->nodes[js->props[js->nodes[alts[k]].a].value].enum_pat];
        pats[k] = (rudder_rx_pattern){p->buf, p->n, false};
    }
    char msg[160];
    rudder_rx *rx = rudder_rx_new(pats, n, msg, sizeof msg);
    rudder_free(pats);
    uint32_t tag = rx ? new_node(c, where, K_STRING) : NONE;
    if (tag == NONE)
        return false;
    js->nodes[tag].rx[0] = rx;
    js->nodes[tag].n_rx = 1;
    uint32_t prop = js->n_props;
    js->props = rudder_grow(js->props, &js->cap_props, prop + 2, sizeof(jprop));
    js->props[js->n_props++] = (jprop){tag, 0};
    js->psets = rudder_grow(js->psets, &js->cap_psets, js->n_psets + 2, sizeof(pset));
    memset(&js->psets[js->n_psets], 0, 2 * sizeof(pset));
    ps_add(&js->psets[js->n_psets], 0);
    jnode *t = &js->nodes[id];
    *t = js->nodes[alts[0]];   /* its key trie: only the first key is ever in range */
    t->a = prop;
    t->n = 1;
    t->min = 0;
    t->sets = js->n_psets;
    js->n_psets += 2;
    t->tags = idx_add(js, alts, n);
    return true;
}

/* The node of a conjunction of schema objects (memoized: recursion becomes a cycle). */
static uint32_t lower(comp *c, conj x, const rudder_jv *where) {
    rudder_js *js = c->js;
    if (c->failed)
        return NONE;
    if (x.n == 0 && js->any != NONE)
        return js->any;
    x = sorted(c, x);
    uint32_t h = hash_conj(x);
    term_slot *slot = term_slot_of(c, x, h);
    if (slot->node != NONE)
        return slot->node;
    const rudder_jv *at = x.n ? x.s[0] : where;
    uint32_t id = new_node(c, at, K_PENDING);
    if (id == NONE)
        return NONE;
    *slot = (term_slot){h, id, x};
    c->n_terms++;
    if (++c->depth > MAX_LOWER_DEPTH) {
        fail(c, at, "the schema nests too deeply");
        return NONE;
    }
    dnf d = dnf_conj(c, x);
    if (!spend(c, at, d.n + 1))
        return NONE;
    uint32_t max_alts = 8 * (d.n + 1) + (js->any != NONE ? js->nodes[js->any].n : 0);
    for (uint32_t i = 0; i < d.n; i++)
        max_alts += d.b[i]->has_enum ? d.b[i]->n_enum : 0;
    uint32_t *alts = rudder_xalloc(max_alts * 4), n = 0;
    bool single = d.n == 1 && !d.b[0]->has_enum && d.b[0] != &c->any && __builtin_popcount(d.b[0]->types & ~(d.b[0]->types & T_NUMBER ? T_INTEGER : 0)) == 1;
    for (uint32_t i = 0; i < d.n && !c->failed; i++)
        lower_bundle(c, d.b[i], at, alts, &n, single ? id : NONE);
    c->depth--;
    if (!c->failed && !single) {
        if (n == 0) {
            js->nodes[id].kind = K_NEVER;
        } else if (n == 1 && js->nodes[alts[0]].kind != K_PENDING) {
            js->nodes[id] = js->nodes[alts[0]];   /* the same node under this id */
        } else if (!tagged_union(c, id, alts, n, at)) {
            js->nodes[id].kind = K_UNION;
            js->nodes[id].a = idx_add(js, alts, n);
            js->nodes[id].n = n;
        }
    }
    rudder_free(alts);
    return c->failed ? NONE : id;
}

/* Any JSON value: a union of an object and an array of any values, strings, numbers, literals. */
static void any_node(comp *c) {
    rudder_js *js = c->js;
    uint32_t id = new_node(c, c->doc, K_UNION), alts[5];
    alts[0] = new_node(c, c->doc, K_OBJECT);
    js->nodes[alts[0]].trie = new_tnode(js, 0);
    js->nodes[alts[0]].extra = id;
    alts[1] = new_node(c, c->doc, K_ARRAY);
    js->nodes[alts[1]].extra = id;
    alts[2] = new_node(c, c->doc, K_STRING);
    alts[3] = new_node(c, c->doc, K_NUMBER);
    alts[4] = lits_node(c, c->doc, "true\0false\0null\0");
    js->nodes[id].a = idx_add(js, alts, 5);
    js->nodes[id].n = 5;
    js->any = id;
}

/* ------------------------------------------------------------------ finishing */

bool js_finish_nodes(rudder_js *js, char *err, uint32_t cap) {
    for (uint32_t i = 0; i < js->n_nodes; i++)   /* (a string no value can meet: e.g. a uuid within 10 characters) */
        if (js->nodes[i].kind == K_STRING && !js_string_possible(js, i))
            js->nodes[i].kind = K_NEVER;
    for (uint32_t i = 0; i < js->n_nodes; i++) {
        jnode *n = &js->nodes[i];
        memset(n->first, 0, sizeof n->first);
        switch (n->kind) {
        case K_OBJECT: js_set_bit(n->first, '{'); break;
        case K_ARRAY: js_set_bit(n->first, '['); break;
        case K_STRING: js_set_bit(n->first, '"'); break;
        case K_NUMBER:
            js_set_bit(n->first, '-');
            for (uint8_t d = '0'; d <= '9'; d++)
                js_set_bit(n->first, d);
            break;
        case K_LITS:
            for (uint32_t t = js->trie[n->trie].child; t != NONE; t = js->trie[t].sibling)
                js_set_bit(n->first, js->trie[t].byte);
            break;
        case K_PENDING:
            rudder_panic("jsonschema: a node was left uncompiled");
        }
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t i = 0; i < js->n_nodes; i++) {
            jnode *n = &js->nodes[i];
            if (n->kind != K_UNION)
                continue;
            for (uint32_t k = 0; k < n->n; k++)
                for (uint32_t w = 0; w < 8; w++) {
                    uint32_t add = js->nodes[js->idx[n->a + k]].first[w] & ~n->first[w];
                    if (add)
                        n->first[w] |= add, changed = true;
                }
        }
    }
    /* need: the least nesting a complete value takes (to a fixpoint: recursion); 1000: never */
    for (uint32_t i = 0; i < js->n_nodes; i++) {
        uint8_t k = js->nodes[i].kind;
        js->nodes[i].need = k == K_STRING || k == K_NUMBER || k == K_LITS ? 1 : 1000;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t i = 0; i < js->n_nodes; i++) {
            jnode *n = &js->nodes[i];
            uint32_t need = n->need;
            if (n->kind == K_UNION) {
                for (uint32_t k = 0; k < n->n; k++)
                    if (js->nodes[js->idx[n->a + k]].need < need)
                        need = js->nodes[js->idx[n->a + k]].need;
            } else if (n->kind == K_OBJECT || n->kind == K_ARRAY) {
                uint32_t inner = 0;
                for (uint32_t k = 0; k < n->n; k++) {
                    uint32_t v = n->kind == K_OBJECT ? (ps_has(&js->psets[n->sets], k) ? js->props[n->a + k].value : NONE)
                                                     : (k < n->min ? js->idx[n->a + k] : NONE);
                    if (v != NONE && js->nodes[v].need > inner)
                        inner = js->nodes[v].need;
                }
                if (n->kind == K_ARRAY && (n->min > n->n || n->contains) && n->extra != NONE && js->nodes[n->extra].need > inner)
                    inner = js->nodes[n->extra].need;
                if (1 + inner < need)
                    need = 1 + inner;
            }
            if (need < n->need)
                n->need = need, changed = true;
        }
    }
    for (uint32_t i = 0; i < js->n_nodes; i++) {   /* objects: properties that never fit, the deepest that may */
        jnode *n = &js->nodes[i];
        if (n->kind != K_OBJECT || !n->n)
            continue;
        pset *never = &js->psets[n->sets + 1];
        memset(never, 0, sizeof *never);
        n->deepest = 0;
        for (uint32_t k = 0; k < n->n; k++) {
            uint32_t need = js->nodes[js->props[n->a + k].value].need;
            if (need >= 1000)
                ps_add(never, k);
            else if (need > n->deepest)
                n->deepest = need;
        }
    }
    if (js->nodes[js->root].need + 1 > RUDDER_JS_MAX_DEPTH) {
        uint32_t m = 0;
        const char *msg = js->nodes[js->root].need >= 1000 ? "no JSON value satisfies the schema"
                                                           : "the schema nests deeper than 31 levels";
        put(err, cap, &m, msg, (uint32_t)strlen(msg));
        return false;
    }
    return true;
}

/* ------------------------------------------------------------------ entry */

rudder_js *rudder_js_compile(const char *text, uint32_t len, char *err, uint32_t cap) {
    char perr[160];
    rudder_jv *doc = rudder_jv_parse(text, len, perr, sizeof perr);
    if (!doc) {
        uint32_t n = 0;
        put(err, cap, &n, "the schema is not valid JSON: ", 30);
        put(err, cap, &n, perr, (uint32_t)strlen(perr));
        return NULL;
    }
    rudder_js *js = rudder_zalloc(sizeof *js);
    if (!js)
        rudder_panic("jsonschema: out of memory");
    js->any = NONE;
    js->ff = true;
    comp c = {.js = js, .doc = doc, .err = err, .cap = cap};
    c.any = (bundle){.types = T_ALL, .max_props = NONE, .max_items = NONE, .max_len = NONE};
    c.forbid = true;   /* (the default, also for a schema that is not an object) */
    c.dnf_mask = 63;
    c.dnfs = rudder_zalloc(64 * sizeof(dnf_slot));
    c.term_mask = 63;
    c.terms = rudder_xalloc(64 * sizeof(term_slot));
    for (uint32_t i = 0; i < 64; i++)
        c.terms[i].node = NONE;
    if (doc->type == RUDDER_JV_OBJECT) {
        const rudder_jv *ws = get(doc, "x-rudder-whitespace"), *ff = get(doc, "x-rudder-ff"), *sch = get(doc, "$schema");
        const rudder_jv *und = get(doc, "x-rudder-undeclared"), *strict = get(doc, "x-rudder-strict");
        if (ws && !rudder_jv_equal_str(ws, "compact") && !rudder_jv_equal_str(ws, "flexible"))
            fail(&c, doc, "x-rudder-whitespace must be \"compact\" or \"flexible\"");
        js->flexible = ws && rudder_jv_equal_str(ws, "flexible");
        if (ff && ff->type != RUDDER_JV_TRUE && ff->type != RUDDER_JV_FALSE)
            fail(&c, doc, "x-rudder-ff must be true or false");
        js->ff = !ff || ff->type == RUDDER_JV_TRUE;
        if (und && !rudder_jv_equal_str(und, "forbid") && !rudder_jv_equal_str(und, "allow"))
            fail(&c, doc, "x-rudder-undeclared must be \"forbid\" or \"allow\"");
        if (strict && strict->type != RUDDER_JV_TRUE && strict->type != RUDDER_JV_FALSE)
            fail(&c, doc, "x-rudder-strict must be true or false");
        c.strict = strict && strict->type == RUDDER_JV_TRUE;
        if (c.strict && und && rudder_jv_equal_str(und, "allow"))
            fail(&c, doc, "x-rudder-undeclared \"allow\" contradicts x-rudder-strict (strict generates the declared properties only)");
        c.forbid = !und || !rudder_jv_equal_str(und, "allow");
        if (sch && sch->type == RUDDER_JV_STRING)
            for (uint32_t i = 0; i + 8 <= sch->n && !c.old_ref; i++)
                c.old_ref = !memcmp(sch->str + i, "draft-0", 7) && sch->str[i + 7] >= '4' && sch->str[i + 7] <= '7';
        c.root_id = get(doc, "$id") ? get(doc, "$id") : get(doc, "id");
    }
    rudder_js_init_tables();
    if (!c.failed)
        any_node(&c);
    js->root = c.failed ? NONE : lower(&c, conj_one(&c, doc), doc);
    bool ok = !c.failed && js_finish_nodes(js, err, cap);
    ablock *b = c.arena;
    while (b) {
        ablock *prev = b->prev;
        rudder_free(b);
        b = prev;
    }
    rudder_free(c.dnfs);
    rudder_free(c.terms);
    rudder_free(c.rxs);   /* (the regexes themselves stay: nodes use them) */
    for (uint32_t i = 0; i < c.n_enum_pats; i++)
        rudder_free(c.enum_pats[i].buf);
    rudder_free(c.enum_pats);
    rudder_jv_free(doc);
    if (!ok)
        return NULL;   /* the request fails; its memory goes with it */
    js_matcher_init(js);
    return js;
}

bool rudder_js_ff(const rudder_js *js) { return js->ff; }
