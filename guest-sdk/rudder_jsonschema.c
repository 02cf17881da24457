/* rudder_jsonschema.c - JSON Schema as a byte-level pushdown automaton, with masks from the
 * token trie. See rudder_jsonschema.h and docs/json-schema.md.
 *
 * Layout: (1) the compiled schema: nodes; (2) the compiler: JSON document -> nodes; (3) the
 * automaton: one byte at a time; (4) masks: the trie walk, a fast path for free strings, and a
 * per-state cache of everything a step needs. */
#include "rudder_jsonschema.h"
#include "rudder_json.h"
#include "rudder_regex.h"

#define NONE 0xffffffffu
#define MAX_PROPS 64u         /* per object: key sets are 64-bit bitsets */
#define INT_DIGITS 15u        /* digits generated before / after the point, in the exponent */
#define FRAC_DIGITS 15u
#define EXP_DIGITS 3u
#define MAX_FORCED 64u        /* forced bytes looked ahead per step */
#define LIST_MAX_ALLOWED 16u  /* ff lists are computed for masks allowing at most this many */
#define CACHE_SLOTS 64u

/* ------------------------------------------------------------------ (1) compiled schema */

enum { K_PENDING, K_UNION, K_OBJECT, K_ARRAY, K_STRING, K_NUMBER, K_LITS, K_NEVER };

/* A byte trie (object keys, literal sets). term: property index / 1 at a literal's end. */
typedef struct {
    uint32_t child, sibling, term;
    uint64_t below;   /* object keys: properties whose key passes through this node */
    uint8_t byte;
} tnode;

typedef struct {
    uint8_t kind;
    bool integer, has_lo, has_hi, lo_excl, hi_excl;
    uint32_t a, n;       /* union: alternatives at idx[a..a+n); object: props[a..a+n); array: prefix idx[a..a+n) */
    uint32_t trie;       /* object: key trie; literals: their trie */
    uint32_t extra;      /* object: additionalProperties node; array: items node; NONE: none allowed */
    uint32_t min, max;   /* string length in code points; array items (max NONE: unbounded) */
    uint32_t cap;        /* counters saturate here (equal states then repeat: cache hits) */
    uint64_t req;        /* object: required properties */
    double lo, hi;
    rudder_rx *rx;       /* string: pattern/format over the decoded characters */
    char *path;          /* union: where it came from (for the overlap error) */
    uint32_t first[8];   /* bytes a value can start with */
    uint32_t need;       /* frames a value needs at least (nesting): opened only where they fit */
} jnode;

typedef struct {
    uint32_t value;
    bool required;
} prop;

typedef struct {
    uint32_t hash;
    bool used;
    uint32_t key_size;
    rudder_js_state key;
    rudder_js_info info;
    uint32_t *mask;
    uint32_t *toks, n_toks, cap_toks;   /* ff tokens, then list tokens */
    uint32_t *lists, cap_lists;
} entry;

struct rudder_js {
    jnode *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t *idx, n_idx, cap_idx;
    prop *props;
    uint32_t n_props, cap_props;
    tnode *trie;
    uint32_t n_trie, cap_trie;
    uint32_t root, any;
    bool flexible, ff;
    uint32_t ff_budget;
    entry *cache;
    uint32_t next_slot, hits, misses;
    rudder_js_state *walk;   /* one state per trie depth */
    uint32_t *walk_sets;     /* and its candidate bytes (8 words each) */
};

static inline bool bit(const uint32_t *set, uint8_t b) { return (set[b >> 5] >> (b & 31)) & 1; }
static inline void set_bit(uint32_t *set, uint8_t b) { set[b >> 5] |= 1u << (b & 31); }

static uint32_t new_node(rudder_js *js, uint8_t kind) {
    js->nodes = rudder_grow(js->nodes, &js->cap_nodes, js->n_nodes + 1, sizeof(jnode));
    js->nodes[js->n_nodes] = (jnode){.kind = kind, .extra = NONE, .max = NONE};
    return js->n_nodes++;
}

static uint32_t new_tnode(rudder_js *js, uint8_t byte) {
    js->trie = rudder_grow(js->trie, &js->cap_trie, js->n_trie + 1, sizeof(tnode));
    js->trie[js->n_trie] = (tnode){.child = NONE, .sibling = NONE, .term = NONE, .byte = byte};
    return js->n_trie++;
}

static inline uint32_t tchild(const rudder_js *js, uint32_t at, uint8_t b) {
    for (uint32_t c = js->trie[at].child; c != NONE; c = js->trie[c].sibling)
        if (js->trie[c].byte == b)
            return c;
    return NONE;
}

/* Add bytes as a path below `root`; returns the end node. `mark` ORs into every node's below. */
static uint32_t trie_add(rudder_js *js, uint32_t root, const uint8_t *s, uint32_t n, uint64_t mark) {
    uint32_t at = root;
    js->trie[at].below |= mark;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t c = tchild(js, at, s[i]);
        if (c == NONE) {
            c = new_tnode(js, s[i]);
            js->trie[c].sibling = js->trie[at].child;
            js->trie[at].child = c;
        }
        at = c;
        js->trie[at].below |= mark;
    }
    return at;
}

/* ------------------------------------------------------------------ (2) the compiler */

typedef struct {
    rudder_js *js;
    const rudder_jv *doc;
    char *err;
    uint32_t cap;
    bool failed;
    char path[512];
    uint32_t plen;
    const rudder_jv **memo_src;
    uint32_t *memo_id, n_memo, cap_memo, cap_memo2;
    uint32_t ref_depth;
} comp;

static void err_append(char *dst, uint32_t cap, uint32_t *n, const char *s, uint32_t len) {
    for (uint32_t i = 0; i < len && *n + 1 < cap; i++)
        dst[(*n)++] = s[i];
    dst[*n] = 0;
}

/* Fail with "<what> at <path>" (the first failure wins). */
static uint32_t cfail(comp *c, const char *what, const char *name, uint32_t name_len) {
    if (!c->failed) {
        uint32_t n = 0;
        err_append(c->err, c->cap, &n, what, (uint32_t)strlen(what));
        if (name) {
            err_append(c->err, c->cap, &n, " \"", 2);
            err_append(c->err, c->cap, &n, name, name_len);
            err_append(c->err, c->cap, &n, "\"", 1);
        }
        err_append(c->err, c->cap, &n, " at ", 4);
        err_append(c->err, c->cap, &n, c->plen ? c->path : "#", c->plen ? c->plen : 1);
        c->failed = true;
    }
    return NONE;
}

static uint32_t path_push(comp *c, const char *a, const uint8_t *b, uint32_t blen) {
    uint32_t saved = c->plen;
    if (!c->plen)
        c->path[c->plen++] = '#';
    uint32_t n = c->plen;
    err_append(c->path, sizeof c->path, &n, "/", 1);
    err_append(c->path, sizeof c->path, &n, a, (uint32_t)strlen(a));
    if (b) {
        err_append(c->path, sizeof c->path, &n, "/", 1);
        err_append(c->path, sizeof c->path, &n, (const char *)b, blen);
    }
    c->plen = n;
    return saved;
}

static void path_pop(comp *c, uint32_t saved) {
    c->plen = saved;
    c->path[saved] = 0;
}

static void path_index(comp *c, const char *a, uint32_t i, uint32_t *saved) {
    char num[12];
    uint32_t k = sizeof num;
    do {
        num[--k] = (char)('0' + i % 10);
        i /= 10;
    } while (i);
    *saved = path_push(c, a, (const uint8_t *)num + k, sizeof num - k);
}

static const char *const ANNOTATIONS[] = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
    "writeOnly", "deprecated", "$defs", "definitions", "contentMediaType", "contentEncoding",
    "x-rudder-whitespace", "x-rudder-ff", NULL,
};
static const char *const SUPPORTED[] = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum",
    "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", NULL,
};

static bool in_list(const char *const *list, const rudder_str *k) {
    for (uint32_t i = 0; list[i]; i++)
        if (strlen(list[i]) == k->len && memcmp(list[i], k->ptr, k->len) == 0)
            return true;
    return false;
}

static bool is_annotation(const rudder_str *k) {
    return in_list(ANNOTATIONS, k) || (k->len > 2 && k->ptr[0] == 'x' && k->ptr[1] == '-');
}

static uint32_t compile(comp *c, const rudder_jv *s);
static uint32_t rudder_js_max_token(void);
static uint32_t rx_min_bytes(rudder_rx *rx, uint32_t state, uint32_t limit);

static uint32_t memo_get(comp *c, const rudder_jv *s) {
    for (uint32_t i = 0; i < c->n_memo; i++)
        if (c->memo_src[i] == s)
            return c->memo_id[i];
    return NONE;
}

static void memo_put(comp *c, const rudder_jv *s, uint32_t id) {
    c->memo_src = rudder_grow(c->memo_src, &c->cap_memo, c->n_memo + 1, sizeof *c->memo_src);
    c->memo_id = rudder_grow(c->memo_id, &c->cap_memo2, c->n_memo + 1, sizeof *c->memo_id);
    c->memo_src[c->n_memo] = s;
    c->memo_id[c->n_memo++] = id;
}

/* "#", "#/$defs/a", any JSON pointer into this document (~0 ~1 escapes). */
static const rudder_jv *resolve_ref(comp *c, const rudder_jv *ref) {
    if (ref->type != RUDDER_JV_STRING || ref->n == 0 || ref->str[0] != '#')
        return cfail(c, "only local $ref (\"#...\") is supported, not", ref->type == RUDDER_JV_STRING ? (const char *)ref->str : "?",
                     ref->type == RUDDER_JV_STRING ? ref->n : 1), NULL;
    const rudder_jv *at = c->doc;
    uint32_t i = 1;
    while (i < ref->n) {
        if (ref->str[i] != '/')
            return cfail(c, "unsupported $ref", (const char *)ref->str, ref->n), NULL;
        uint32_t j = ++i;
        uint8_t seg[256];
        uint32_t k = 0;
        while (j < ref->n && ref->str[j] != '/' && k < sizeof seg) {
            uint8_t ch = ref->str[j++];
            if (ch == '~' && j < ref->n && (ref->str[j] == '0' || ref->str[j] == '1'))
                ch = ref->str[j++] == '0' ? '~' : '/';
            seg[k++] = ch;
        }
        i = j;
        const rudder_jv *next = NULL;
        if (at->type == RUDDER_JV_OBJECT) {
            for (uint32_t m = 0; m < at->n; m++)
                if (at->keys[m].len == k && memcmp(at->keys[m].ptr, seg, k) == 0) {
                    next = &at->items[m];
                    break;
                }
        } else if (at->type == RUDDER_JV_ARRAY) {
            uint32_t idx;
            if (rudder_parse_uint((const char *)seg, k, &idx) && idx < at->n)
                next = &at->items[idx];
        }
        if (!next)
            return cfail(c, "$ref points to nothing:", (const char *)ref->str, ref->n), NULL;
        at = next;
    }
    return at;
}

static uint32_t any_node(comp *c);

static void add_lit(comp *c, uint32_t node, const rudder_jv *v) {
    rudder_js *js = c->js;
    uint32_t n = rudder_jv_write(v, NULL, 0);
    uint8_t *buf = rudder_xalloc(n + 1);
    rudder_jv_write(v, buf, n);
    uint32_t end = trie_add(js, js->nodes[node].trie, buf, n, 0);
    js->trie[end].term = 1;
    rudder_free(buf);
}

static uint32_t lits_node(comp *c) {
    uint32_t id = new_node(c->js, K_LITS);
    uint32_t t = new_tnode(c->js, 0);
    c->js->nodes[id].trie = t;
    return id;
}

/* Type bits */
enum { T_OBJECT = 1, T_ARRAY = 2, T_STRING = 4, T_NUMBER = 8, T_INTEGER = 16, T_BOOLEAN = 32, T_NULL = 64, T_ALL = 127 };

static uint32_t type_bit(const rudder_jv *t) {
    static const char *const names[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    if (t->type == RUDDER_JV_STRING)
        for (uint32_t i = 0; i < 7; i++)
            if (rudder_jv_equal_str(t, names[i]))
                return 1u << i;
    return 0;
}

static uint32_t value_type(const rudder_jv *v) {
    switch (v->type) {
    case RUDDER_JV_OBJECT: return T_OBJECT;
    case RUDDER_JV_ARRAY: return T_ARRAY;
    case RUDDER_JV_STRING: return T_STRING;
    case RUDDER_JV_NUMBER: return v->integral ? T_NUMBER | T_INTEGER : T_NUMBER;
    case RUDDER_JV_NULL: return T_NULL;
    default: return T_BOOLEAN;
    }
}

static const char *const OBJECT_KW[] = {"properties", "required", "additionalProperties", NULL};
static const char *const ARRAY_KW[] = {"items", "prefixItems", "minItems", "maxItems", NULL};
static const char *const STRING_KW[] = {"minLength", "maxLength", "pattern", "format", NULL};
static const char *const NUMBER_KW[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};

static bool has_any(const rudder_jv *s, const char *const *kw) {
    for (uint32_t i = 0; kw[i]; i++)
        if (rudder_jv_get(s, kw[i]))
            return true;
    return false;
}

static bool get_count(comp *c, const rudder_jv *s, const char *kw, uint32_t *out) {
    const rudder_jv *v = rudder_jv_get(s, kw);
    if (!v)
        return true;
    if (v->type != RUDDER_JV_NUMBER || !v->integral || v->num < 0 || v->num > 1e9)
        return cfail(c, "must be a non-negative integer:", kw, (uint32_t)strlen(kw)), false;
    *out = (uint32_t)v->num;
    return true;
}

static uint32_t compile_object(comp *c, uint32_t id, const rudder_jv *s) {
    rudder_js *js = c->js;
    const rudder_jv *props = rudder_jv_get(s, "properties"), *req = rudder_jv_get(s, "required");
    const rudder_jv *addl = rudder_jv_get(s, "additionalProperties");
    if (props && props->type != RUDDER_JV_OBJECT)
        return cfail(c, "must be an object:", "properties", 10);
    if (req && req->type != RUDDER_JV_ARRAY)
        return cfail(c, "must be an array:", "required", 8);
    uint32_t n = props ? props->n : 0;
    if (n > MAX_PROPS)
        return cfail(c, "too many properties (at most 64 per object) in", "properties", 10);
    uint32_t first = js->n_props;
    js->props = rudder_grow(js->props, &js->cap_props, first + n, sizeof(prop));
    js->n_props += n;
    uint32_t trie = new_tnode(js, 0);
    uint64_t required = 0;
    for (uint32_t i = 0; req && i < req->n; i++) {
        const rudder_jv *r = &req->items[i];
        uint32_t k = NONE;
        for (uint32_t j = 0; r->type == RUDDER_JV_STRING && j < n; j++)
            if (props->keys[j].len == r->n && memcmp(props->keys[j].ptr, r->str, r->n) == 0)
                k = j;
        if (k == NONE)
            return cfail(c, "a required property is not in properties:", r->type == RUDDER_JV_STRING ? (const char *)r->str : "?",
                         r->type == RUDDER_JV_STRING ? r->n : 1);
        required |= 1ull << k;
    }
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t j = 0; j < i; j++)
            if (props->keys[j].len == props->keys[i].len && memcmp(props->keys[j].ptr, props->keys[i].ptr, props->keys[i].len) == 0)
                return cfail(c, "duplicate property", (const char *)props->keys[i].ptr, props->keys[i].len);
        /* the key as generated, after its opening quote: escaped text and the closing quote */
        rudder_jv key = {.type = RUDDER_JV_STRING, .n = props->keys[i].len, .str = props->keys[i].ptr};
        uint32_t len = rudder_jv_write(&key, NULL, 0);
        uint8_t *buf = rudder_xalloc(len);
        rudder_jv_write(&key, buf, len);
        uint32_t end = trie_add(js, trie, buf + 1, len - 1, 1ull << i);
        js->trie[end].term = i;
        rudder_free(buf);
        uint32_t saved = path_push(c, "properties", props->keys[i].ptr, props->keys[i].len);
        uint32_t v = compile(c, &props->items[i]);
        path_pop(c, saved);
        if (c->failed)
            return NONE;
        js->props[first + i] = (prop){v, (required >> i) & 1};
    }
    /* absent: no extra keys when properties are listed, any keys when none are (documented) */
    uint32_t extra = n == 0 && !addl ? any_node(c) : NONE;
    if (addl) {
        uint32_t saved = path_push(c, "additionalProperties", NULL, 0);
        extra = addl->type == RUDDER_JV_FALSE ? NONE : compile(c, addl);
        path_pop(c, saved);
        if (c->failed)
            return NONE;
    }
    jnode *node = &js->nodes[id];
    node->kind = K_OBJECT;
    node->a = first;
    node->n = n;
    node->trie = trie;
    node->req = required;
    node->extra = extra;
    return id;
}

static uint32_t compile_array(comp *c, uint32_t id, const rudder_jv *s) {
    rudder_js *js = c->js;
    const rudder_jv *items = rudder_jv_get(s, "items"), *prefix = rudder_jv_get(s, "prefixItems");
    uint32_t min = 0, max = NONE;
    if (!get_count(c, s, "minItems", &min) || !get_count(c, s, "maxItems", &max))
        return NONE;
    if (max != NONE && min > max)
        return cfail(c, "minItems is larger than maxItems", NULL, 0);
    if (items && items->type == RUDDER_JV_ARRAY)
        return cfail(c, "items as an array is draft-04 style: use prefixItems instead of", "items", 5);
    if (prefix && prefix->type != RUDDER_JV_ARRAY)
        return cfail(c, "must be an array:", "prefixItems", 11);
    uint32_t n = prefix ? prefix->n : 0, first = js->n_idx;
    js->idx = rudder_grow(js->idx, &js->cap_idx, first + n, 4);
    js->n_idx += n;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t saved;
        path_index(c, "prefixItems", i, &saved);
        uint32_t v = compile(c, &prefix->items[i]);
        path_pop(c, saved);
        if (c->failed)
            return NONE;
        js->idx[first + i] = v;
    }
    uint32_t it;
    if (!items) {
        it = any_node(c);
    } else if (items->type == RUDDER_JV_FALSE) {
        it = NONE;
    } else {
        uint32_t saved = path_push(c, "items", NULL, 0);
        it = compile(c, items);
        path_pop(c, saved);
        if (c->failed)
            return NONE;
    }
    if (it == NONE && min > n)
        return cfail(c, "minItems needs more items than prefixItems allows (items: false)", NULL, 0);
    jnode *node = &js->nodes[id];
    node->kind = K_ARRAY;
    node->a = first;
    node->n = n;
    node->extra = it;
    node->min = min;
    node->max = max;
    uint32_t cap = n > min ? n : min;
    node->cap = max != NONE && max > cap ? max : cap;
    return id;
}

static const struct {
    const char *name, *rx;
} FORMATS[] = {
    {"date", "[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"},
    {"time", "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"},
    {"date-time", "[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
                  "T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"},
    {"email", "[A-Za-z0-9_.+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\\.[A-Za-z0-9-]{1,63}){0,4}\\.[A-Za-z]{2,12}"},
    {"uuid", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"},
    {"ipv4", "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(?:\\.(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}"},
    {"hostname", "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?){0,8}"},
    {"uri", "[A-Za-z][A-Za-z0-9+.-]{0,15}:[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]{1,200}"},
    {NULL, NULL},
};

/* A JSON Schema pattern matches anywhere (ECMA-262 search); our regexes match whole strings. */
static rudder_rx *compile_pattern(comp *c, const rudder_jv *p) {
    const char *src = (const char *)p->str;
    uint32_t n = p->n;
    bool start = n && src[0] == '^';
    bool end = n > start && src[n - 1] == '$' && (n < 2 || src[n - 2] != '\\');
    bool alt = false;
    uint32_t depth = 0;
    bool in_class = false;
    for (uint32_t i = 0; i < n; i++) {   /* a top-level | with anchors would change meaning */
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
        else if (src[i] == ')')
            depth--;
        else if (src[i] == '|' && depth == 0)
            alt = true;
    }
    if (alt && (start || end))
        return cfail(c, "a pattern with ^ or $ and a top-level | is not supported:", src, n), NULL;
    const char *any = "(?:.|\n)*";
    uint32_t cap = n + 32, k = 0;
    char *buf = rudder_xalloc(cap);
    if (!start)
        err_append(buf, cap, &k, any, (uint32_t)strlen(any));
    err_append(buf, cap, &k, "(?:", 3);
    err_append(buf, cap, &k, src + start, n - start - end);
    err_append(buf, cap, &k, ")", 1);
    if (!end)
        err_append(buf, cap, &k, any, (uint32_t)strlen(any));
    char msg[200];
    rudder_rx *rx = rudder_rx_compile(buf, k, msg, sizeof msg);
    rudder_free(buf);
    if (!rx)
        return cfail(c, msg, "pattern", 7), NULL;
    return rx;
}

static uint32_t compile_string(comp *c, uint32_t id, const rudder_jv *s) {
    uint32_t min = 0, max = NONE;
    if (!get_count(c, s, "minLength", &min) || !get_count(c, s, "maxLength", &max))
        return NONE;
    if (max != NONE && min > max)
        return cfail(c, "minLength is larger than maxLength", NULL, 0);
    const rudder_jv *pat = rudder_jv_get(s, "pattern"), *fmt = rudder_jv_get(s, "format");
    rudder_rx *rx = NULL;
    if (pat && fmt)
        return cfail(c, "pattern and format together are not supported", NULL, 0);
    if (pat) {
        if (pat->type != RUDDER_JV_STRING)
            return cfail(c, "must be a string:", "pattern", 7);
        uint32_t saved = path_push(c, "pattern", NULL, 0);
        rx = compile_pattern(c, pat);
        path_pop(c, saved);
        if (!rx)
            return NONE;
    }
    if (fmt) {
        uint32_t i = 0;
        while (FORMATS[i].name && !rudder_jv_equal_str(fmt, FORMATS[i].name))
            i++;
        if (!FORMATS[i].name)
            return cfail(c, "unsupported format (supported: date, time, date-time, email, uuid, ipv4, hostname, uri):",
                         fmt->type == RUDDER_JV_STRING ? (const char *)fmt->str : "?", fmt->type == RUDDER_JV_STRING ? fmt->n : 1);
        char msg[200];
        rx = rudder_rx_compile(FORMATS[i].rx, (uint32_t)strlen(FORMATS[i].rx), msg, sizeof msg);
        if (!rx)
            return cfail(c, msg, "format", 6);
    }
    if (rx && min > 0)
        return cfail(c, "minLength with pattern/format is not supported", NULL, 0);
    if (rx && max != NONE && rx_min_bytes(rx, rudder_rx_start(rx, NULL), max) > max)
        return cfail(c, "no string within maxLength matches the pattern/format", NULL, 0);
    jnode *node = &c->js->nodes[id];
    node->kind = K_STRING;
    node->min = min;
    node->max = max;
    node->cap = max != NONE ? max : min;
    node->rx = rx;
    return id;
}

static bool get_bound(comp *c, const rudder_jv *s, const char *kw, bool *has, double *v, bool *excl, bool lower, bool exclusive) {
    const rudder_jv *b = rudder_jv_get(s, kw);
    if (!b)
        return true;
    if (b->type != RUDDER_JV_NUMBER)
        return cfail(c, exclusive ? "must be a number (draft 2020-12):" : "must be a number:", kw, (uint32_t)strlen(kw)), false;
    /* keep the stricter of minimum / exclusiveMinimum (and the same for the maximum) */
    if (!*has || (lower ? b->num > *v || (b->num == *v && exclusive) : b->num < *v || (b->num == *v && exclusive))) {
        *has = true;
        *v = b->num;
        *excl = exclusive;
    }
    return true;
}

static uint32_t compile_number(comp *c, uint32_t id, const rudder_jv *s, bool integer) {
    jnode *node = &c->js->nodes[id];
    node->kind = K_NUMBER;
    node->integer = integer;
    if (!get_bound(c, s, "minimum", &node->has_lo, &node->lo, &node->lo_excl, true, false) ||
        !get_bound(c, s, "exclusiveMinimum", &node->has_lo, &node->lo, &node->lo_excl, true, true) ||
        !get_bound(c, s, "maximum", &node->has_hi, &node->hi, &node->hi_excl, false, false) ||
        !get_bound(c, s, "exclusiveMaximum", &node->has_hi, &node->hi, &node->hi_excl, false, true))
        return NONE;
    if (node->has_lo && node->has_hi && (node->lo > node->hi || (node->lo == node->hi && (node->lo_excl || node->hi_excl))))
        return cfail(c, "no number satisfies the bounds", NULL, 0);
    if (integer && node->has_lo && node->has_hi) {
        double a = node->lo, b = node->hi;   /* some integer must lie between them */
        double fa = (double)(int64_t)a;
        if (fa < a || (fa == a && node->lo_excl))
            fa += 1;
        if (fa > b || (fa == b && node->hi_excl))
            return cfail(c, "no integer satisfies the bounds", NULL, 0);
    }
    /* generated numbers have at most 15 integer digits: bounds past that do not restrict them */
    if (node->has_lo && node->lo < -1e15)
        node->has_lo = false;
    if (node->has_hi && node->hi > 1e15)
        node->has_hi = false;
    if ((node->has_lo && node->lo >= 1e15) || (node->has_hi && node->hi <= -1e15))
        return cfail(c, "numbers beyond 15 digits are not supported (bounds)", NULL, 0);
    return id;
}

static uint32_t make_union(comp *c, uint32_t id, const uint32_t *alts, uint32_t n) {
    rudder_js *js = c->js;
    uint32_t first = js->n_idx;
    js->idx = rudder_grow(js->idx, &js->cap_idx, first + n, 4);
    js->n_idx += n;
    memcpy(js->idx + first, alts, n * 4);
    jnode *node = &js->nodes[id];
    node->kind = K_UNION;
    node->a = first;
    node->n = n;
    node->path = rudder_xalloc(c->plen + 2);
    memcpy(node->path, c->plen ? c->path : "#", c->plen ? c->plen : 1);
    node->path[c->plen ? c->plen : 1] = 0;
    return id;
}

/* Any JSON value: a union of an object and an array of any values, strings, numbers, literals. */
static uint32_t any_node(comp *c) {
    rudder_js *js = c->js;
    if (js->any != NONE)
        return js->any;
    uint32_t id = js->any = new_node(js, K_PENDING);
    uint32_t alts[5];
    alts[0] = new_node(js, K_OBJECT);
    js->nodes[alts[0]].trie = new_tnode(js, 0);
    js->nodes[alts[0]].extra = id;
    alts[1] = new_node(js, K_ARRAY);
    js->nodes[alts[1]].extra = id;
    alts[2] = new_node(js, K_STRING);
    alts[3] = new_node(js, K_NUMBER);
    alts[4] = lits_node(c);
    static const char *const words[] = {"true", "false", "null"};
    for (uint32_t i = 0; i < 3; i++) {
        uint32_t end = trie_add(js, js->nodes[alts[4]].trie, (const uint8_t *)words[i], (uint32_t)strlen(words[i]), 0);
        js->trie[end].term = 1;
    }
    return make_union(c, id, alts, 5);
}

static uint32_t compile_typed(comp *c, uint32_t id, const rudder_jv *s, uint32_t types) {
    if (types & T_NUMBER)
        types &= ~(uint32_t)T_INTEGER;   /* integers are numbers */
    uint32_t alts[7], n = 0;
    for (uint32_t t = 1; t <= T_NULL; t <<= 1)
        if (types & t)
            alts[n++] = t;
    if (n == 0)
        return cfail(c, "no type left to generate", NULL, 0);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t = alts[i], at = n == 1 ? id : new_node(c->js, K_PENDING), r;
        switch (t) {
        case T_OBJECT: r = compile_object(c, at, s); break;
        case T_ARRAY: r = compile_array(c, at, s); break;
        case T_STRING: r = compile_string(c, at, s); break;
        case T_NUMBER: r = compile_number(c, at, s, false); break;
        case T_INTEGER: r = compile_number(c, at, s, true); break;
        default: {   /* boolean, null: a literal set */
            uint32_t root = new_tnode(c->js, 0);
            c->js->nodes[at].kind = K_LITS;
            c->js->nodes[at].trie = root;
            const char *words = t == T_BOOLEAN ? "true\0false\0" : "null\0";
            for (const char *w = words; *w; w += strlen(w) + 1) {
                uint32_t end = trie_add(c->js, root, (const uint8_t *)w, (uint32_t)strlen(w), 0);
                c->js->trie[end].term = 1;
            }
            r = at;
        }
        }
        if (c->failed)
            return NONE;
        alts[i] = r;
    }
    return n == 1 ? id : make_union(c, id, alts, n);
}

static uint32_t compile(comp *c, const rudder_jv *s) {
    if (c->failed)
        return NONE;
    if (s->type == RUDDER_JV_TRUE)
        return any_node(c);
    if (s->type == RUDDER_JV_FALSE) {
        uint32_t id = new_node(c->js, K_NEVER);
        return id;
    }
    if (s->type != RUDDER_JV_OBJECT)
        return cfail(c, "a schema must be an object or a boolean", NULL, 0);
    uint32_t id = memo_get(c, s);
    if (id != NONE)
        return id;
    for (uint32_t i = 0; i < s->n; i++)
        if (!is_annotation(&s->keys[i]) && !in_list(SUPPORTED, &s->keys[i]))
            return cfail(c, "unsupported keyword", (const char *)s->keys[i].ptr, s->keys[i].len);
    const rudder_jv *ref = rudder_jv_get(s, "$ref");
    const rudder_jv *any_of = rudder_jv_get(s, "anyOf");
    const char *union_kw = "anyOf";
    if (!any_of && (any_of = rudder_jv_get(s, "oneOf")))
        union_kw = "oneOf";
    const rudder_jv *all_of = rudder_jv_get(s, "allOf");
    const rudder_jv *en = rudder_jv_get(s, "enum"), *cn = rudder_jv_get(s, "const");
    const char *combinator = ref ? "$ref" : any_of ? union_kw : all_of ? "allOf" : NULL;
    if (combinator) {   /* no validation keywords next to a combinator: that would be an intersection */
        for (uint32_t i = 0; i < s->n; i++)
            if (!is_annotation(&s->keys[i]) && !(s->keys[i].len == strlen(combinator) && memcmp(s->keys[i].ptr, combinator, s->keys[i].len) == 0))
                return cfail(c, combinator[0] == '$' ? "$ref with a sibling keyword is not supported:" : "a combinator with a sibling keyword is not supported:",
                             (const char *)s->keys[i].ptr, s->keys[i].len);
    }
    if (ref) {
        if (++c->ref_depth > 64)
            return cfail(c, "$ref cycle (a $ref that only leads to $refs)", NULL, 0);
        const rudder_jv *target = resolve_ref(c, ref);
        id = target ? compile(c, target) : NONE;
        c->ref_depth--;
        if (!c->failed)
            memo_put(c, s, id);
        return id;
    }
    id = new_node(c->js, K_PENDING);
    memo_put(c, s, id);
    if (any_of || all_of) {
        const rudder_jv *list = any_of ? any_of : all_of;
        if (list->type != RUDDER_JV_ARRAY || list->n == 0)
            return cfail(c, "must be a non-empty array:", combinator, (uint32_t)strlen(combinator));
        if (all_of && list->n != 1)
            return cfail(c, "allOf with more than one schema is not supported", NULL, 0);
        uint32_t *alts = rudder_xalloc(list->n * 4);
        for (uint32_t i = 0; i < list->n && !c->failed; i++) {
            uint32_t saved;
            path_index(c, combinator, i, &saved);
            alts[i] = compile(c, &list->items[i]);
            path_pop(c, saved);
        }
        if (!c->failed)
            make_union(c, id, alts, list->n);
        rudder_free(alts);
        return c->failed ? NONE : id;
    }
    const rudder_jv *type = rudder_jv_get(s, "type");
    uint32_t types = 0;
    if (type) {
        if (type->type == RUDDER_JV_ARRAY) {
            for (uint32_t i = 0; i < type->n; i++)
                types |= type_bit(&type->items[i]);
            if (type->n == 0 || (type->n && !types))
                return cfail(c, "unknown type in", "type", 4);
        } else if (!(types = type_bit(type))) {
            return cfail(c, "unknown type in", "type", 4);
        }
    }
    if (en || cn) {
        for (uint32_t i = 0; i < s->n; i++)
            if (!is_annotation(&s->keys[i]) && !in_list((const char *const[]){"enum", "const", "type", NULL}, &s->keys[i]))
                return cfail(c, "enum/const with a validation keyword is not supported:", (const char *)s->keys[i].ptr, s->keys[i].len);
        if (en && cn)
            return cfail(c, "enum and const together are not supported", NULL, 0);
        if (en && (en->type != RUDDER_JV_ARRAY || en->n == 0))
            return cfail(c, "must be a non-empty array:", "enum", 4);
        rudder_js *js = c->js;
        uint32_t t = new_tnode(js, 0), kept = 0;
        js->nodes[id].kind = K_LITS;
        js->nodes[id].trie = t;
        const rudder_jv *vals = en ? en->items : cn;
        for (uint32_t i = 0; i < (en ? en->n : 1); i++) {
            uint32_t vt = value_type(&vals[i]);
            if (types && !(vt & types))
                continue;   /* a value the type excludes can never validate */
            add_lit(c, id, &vals[i]);
            kept++;
        }
        if (!kept)
            return cfail(c, "no enum/const value has the given type", NULL, 0);
        return id;
    }
    if (!types) {   /* no type: the types whose keywords appear (all if none do) */
        types |= has_any(s, OBJECT_KW) ? T_OBJECT : 0;
        types |= has_any(s, ARRAY_KW) ? T_ARRAY : 0;
        types |= has_any(s, STRING_KW) ? T_STRING : 0;
        types |= has_any(s, NUMBER_KW) ? T_NUMBER : 0;
        if (!types) {
            uint32_t a = any_node(c);
            c->js->nodes[id] = c->js->nodes[a];   /* a copy of the any-union (same alternatives) */
            return id;
        }
    }
    return compile_typed(c, id, s, types);
}

/* First-byte sets (to a fixpoint: unions can refer to unions, recursively), then check that
 * the alternatives of every union start differently: one byte then picks the alternative. */
static bool finish_nodes(rudder_js *js, char *err, uint32_t cap) {
    for (uint32_t i = 0; i < js->n_nodes; i++) {
        jnode *n = &js->nodes[i];
        memset(n->first, 0, sizeof n->first);
        switch (n->kind) {
        case K_OBJECT: set_bit(n->first, '{'); break;
        case K_ARRAY: set_bit(n->first, '['); break;
        case K_STRING: set_bit(n->first, '"'); break;
        case K_NUMBER:
            set_bit(n->first, '-');
            for (uint8_t d = '0'; d <= '9'; d++)
                set_bit(n->first, d);
            break;
        case K_LITS:
            for (uint32_t t = js->trie[n->trie].child; t != NONE; t = js->trie[t].sibling)
                set_bit(n->first, js->trie[t].byte);
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
    /* need: the least nesting a complete value takes (to a fixpoint: recursion) */
    for (uint32_t i = 0; i < js->n_nodes; i++)
        js->nodes[i].need = js->nodes[i].kind == K_STRING || js->nodes[i].kind == K_NUMBER || js->nodes[i].kind == K_LITS ? 1 : 1000;
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
                    uint32_t v = n->kind == K_OBJECT ? (((n->req >> k) & 1) ? js->props[n->a + k].value : NONE)
                                                     : (k < n->min ? js->idx[n->a + k] : NONE);
                    if (v != NONE && js->nodes[v].need > inner)
                        inner = js->nodes[v].need;
                }
                if (n->kind == K_ARRAY && n->min > n->n && n->extra != NONE && js->nodes[n->extra].need > inner)
                    inner = js->nodes[n->extra].need;
                if (1 + inner < need)
                    need = 1 + inner;
            }
            if (need < n->need)
                n->need = need, changed = true;
        }
    }
    if (js->nodes[js->root].need + 1 > RUDDER_JS_MAX_DEPTH) {
        uint32_t m = 0;
        err_append(err, cap, &m, "the schema nests deeper than 31 levels", 38);
        return false;
    }
    for (uint32_t i = 0; i < js->n_nodes; i++) {
        jnode *n = &js->nodes[i];
        if (n->kind != K_UNION)
            continue;
        uint32_t seen[8] = {0};
        for (uint32_t k = 0; k < n->n; k++) {
            const jnode *alt = &js->nodes[js->idx[n->a + k]];
            for (uint32_t w = 0; w < 8; w++) {
                if (seen[w] & alt->first[w]) {
                    uint32_t m = 0;
                    uint8_t b = (uint8_t)(w * 32 + __builtin_ctz(seen[w] & alt->first[w]));
                    const char *msg = "anyOf/oneOf/type alternatives that can start alike are not supported (two of them can start with '";
                    err_append(err, cap, &m, msg, (uint32_t)strlen(msg));
                    err_append(err, cap, &m, (const char *)&b, 1);
                    err_append(err, cap, &m, "') at ", 6);
                    err_append(err, cap, &m, n->path, (uint32_t)strlen(n->path));
                    return false;
                }
                seen[w] |= alt->first[w];
            }
        }
    }
    return true;
}

rudder_js *rudder_js_compile(const char *text, uint32_t len, char *err, uint32_t cap) {
    char perr[160];
    rudder_jv *doc = rudder_jv_parse(text, len, perr, sizeof perr);
    if (!doc) {
        uint32_t n = 0;
        err_append(err, cap, &n, "the schema is not valid JSON: ", 30);
        err_append(err, cap, &n, perr, (uint32_t)strlen(perr));
        return NULL;
    }
    rudder_js *js = rudder_zalloc(sizeof *js);
    if (!js)
        rudder_panic("jsonschema: out of memory");
    js->any = NONE;
    js->ff = true;
    comp c = {.js = js, .doc = doc, .err = err, .cap = cap};
    if (doc->type == RUDDER_JV_OBJECT) {
        const rudder_jv *ws = rudder_jv_get(doc, "x-rudder-whitespace"), *ff = rudder_jv_get(doc, "x-rudder-ff");
        if (ws && !rudder_jv_equal_str(ws, "compact") && !rudder_jv_equal_str(ws, "flexible"))
            cfail(&c, "x-rudder-whitespace must be \"compact\" or \"flexible\"", NULL, 0);
        js->flexible = ws && rudder_jv_equal_str(ws, "flexible");
        if (ff && ff->type != RUDDER_JV_TRUE && ff->type != RUDDER_JV_FALSE)
            cfail(&c, "x-rudder-ff must be true or false", NULL, 0);
        js->ff = !ff || ff->type == RUDDER_JV_TRUE;
    }
    rudder_js_init_tables();
    js->root = compile(&c, doc);
    if (!c.failed && js->n_nodes > 0xffff)
        cfail(&c, "the schema is too large (more than 65535 nodes)", NULL, 0);
    bool ok = !c.failed && finish_nodes(js, err, cap);
    rudder_free(c.memo_src);
    rudder_free(c.memo_id);
    rudder_jv_free(doc);
    if (!ok)
        return NULL;   /* the request fails; its memory goes with it */
    int32_t budget = rudder_config(RUDDER_CONFIG_MAX_FF);
    js->ff_budget = budget > 0 ? (uint32_t)budget : 0;
    js->cache = rudder_zalloc(CACHE_SLOTS * sizeof(entry));
    /* every slot's mask up front: growing memory in the middle of a step costs milliseconds */
    uint32_t words = rudder_mask_words();
    uint32_t *masks = rudder_xalloc((size_t)CACHE_SLOTS * words * 4);
    for (uint32_t i = 0; i < CACHE_SLOTS; i++) {
        js->cache[i].mask = masks + (size_t)i * words;
        js->cache[i].toks = rudder_xalloc(64 * 4);
        js->cache[i].cap_toks = 64;
    }
    js->walk = rudder_xalloc((rudder_js_max_token() + 2) * sizeof(rudder_js_state));
    js->walk_sets = rudder_xalloc((rudder_js_max_token() + 2) * 32);
    if (!js->cache)
        rudder_panic("jsonschema: out of memory");
    return js;
}

/* ------------------------------------------------------------------ (3) the automaton */

/* Frame phases. 0 is "nothing read yet" for every value. */
enum { V_START = 0 };
enum { D_START = 0, D_VALUE, D_DONE };                                 /* the document (frame 0) */
enum { O_KEY_OR_END = 1, O_KEY, O_IN_KEY, O_COLON, O_VALUE, O_AFTER };  /* objects */
enum { A_ITEM_OR_END = 1, A_ITEM, A_VALUE, A_AFTER };                  /* arrays */
enum { S_IN = 1, N_IN = 1, L_IN = 1 };                                 /* strings, numbers, literals */
/* String lexer phases (lphase) */
enum { SL_CHAR = 1, SL_UTF8, SL_ESC, SL_U0, SL_U1, SL_U2, SL_U3 };
/* Number lexer phases */
enum { NL_START = 1, NL_SIGN, NL_ZERO, NL_INT, NL_DOT, NL_FRAC, NL_E, NL_ESIGN, NL_EXP };

enum { DEAD = 0, OK = 1, RETRY = 2, CLOSED = 3 };

typedef rudder_js_state st;

static inline uint32_t state_size(const st *s) {
    return (uint32_t)__builtin_offsetof(st, f) + s->sp * (uint32_t)sizeof(rudder_js_frame);
}

static inline void copy_state(st *dst, const st *src) { memcpy(dst, src, state_size(src)); }

static inline void lex_reset(st *s) {
    s->lphase = s->u8need = s->u8lo = s->u8hi = s->neg = 0;
    s->len = s->hex = s->rx = 0;
    s->num = 0;
}

/* Does a value of `node` fit as a child of the top frame? */
static inline bool fits(const rudder_js *js, const st *s, uint32_t node) {
    return s->sp + js->nodes[node].need <= RUDDER_JS_MAX_DEPTH;
}

static inline bool push_frame(const rudder_js *js, st *s, uint32_t node) {
    if (!fits(js, s, node))
        return false;
    s->f[s->sp++] = (rudder_js_frame){(uint16_t)node, V_START, 0, 0, 0};
    return true;
}

/* The value on top is complete: pop it and move its parent on. */
static void child_done(const rudder_js *js, st *s) {
    s->sp--;
    lex_reset(s);
    rudder_js_frame *p = &s->f[s->sp - 1];
    if (s->sp == 1) {
        p->phase = D_DONE;
    } else if (p->phase == O_VALUE) {
        p->phase = O_AFTER;
    } else {   /* A_VALUE */
        const jnode *n = &js->nodes[p->node];
        if (p->aux < n->cap)
            p->aux++;
        p->phase = A_AFTER;
    }
}

static const double P10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16};

/* Some value in the interval (open ends as flagged) meets the node's bounds? */
static bool hits(const jnode *n, double a, double b, bool a_open, bool b_open) {
    if (n->has_lo && (b < n->lo || (b == n->lo && (b_open || n->lo_excl))))
        return false;
    if (n->has_hi && (a > n->hi || (a == n->hi && (a_open || n->hi_excl))))
        return false;
    return true;
}

static bool mag_hits(const jnode *n, bool neg, double a, double b, bool b_open) {
    return neg ? hits(n, -b, -a, b_open, false) : hits(n, a, b, false, b_open);
}

/* Can the number read so far still end inside the bounds? s->num holds all its digits as an
 * integer (exact: at most 15 of them), the fraction's digit count is in s->len. */
static bool feasible(const jnode *n, const st *s) {
    if (!n->has_lo && !n->has_hi)
        return true;
    uint32_t id = s->len & 0xff, fd = (s->len >> 8) & 0xff;
    double x = s->num;
    bool neg = s->neg;
    switch (s->lphase) {
    case NL_SIGN:
        return mag_hits(n, true, 0, P10[INT_DIGITS], true);
    case NL_ZERO:
        return n->integer ? mag_hits(n, neg, 0, 0, false) : mag_hits(n, neg, 0, 1, true);
    case NL_INT:
        if (n->integer ? mag_hits(n, neg, x, x, false) : mag_hits(n, neg, x, x + 1, true))
            return true;
        for (uint32_t j = 1; id + j <= INT_DIGITS; j++)
            if (n->integer ? mag_hits(n, neg, x * P10[j], (x + 1) * P10[j] - 1, false)
                           : mag_hits(n, neg, x * P10[j], (x + 1) * P10[j], true))
                return true;
        return false;
    case NL_DOT:
        return mag_hits(n, neg, x, x + 1, true);
    default:   /* NL_FRAC */
        if (id + fd >= INT_DIGITS)
            return mag_hits(n, neg, x / P10[fd], x / P10[fd], false);
        return mag_hits(n, neg, x / P10[fd], (x + 1) / P10[fd], true);
    }
}

static bool number_complete(const jnode *n, const st *s) {
    uint8_t p = s->lphase;
    if (p != NL_ZERO && p != NL_INT && p != NL_FRAC && p != NL_EXP)
        return false;
    if (!n->has_lo && !n->has_hi)
        return true;
    double v = s->num / P10[p == NL_FRAC ? (s->len >> 8) & 0xff : 0];
    if (s->neg)
        v = -v;
    return hits(n, v, v, false, false);
}

static int num_byte(const rudder_js *js, st *s, const jnode *n, uint8_t b) {
    bool bounded = n->has_lo || n->has_hi, digit = b >= '0' && b <= '9';
    uint32_t id = s->len & 0xff, fd = (s->len >> 8) & 0xff, ed = s->len >> 16;
    bool e = (b == 'e' || b == 'E') && !n->integer && !bounded;
    switch (s->lphase) {
    case NL_START:
        if (b == '-') {
            s->neg = 1;
            s->lphase = NL_SIGN;
            return feasible(n, s) ? OK : DEAD;
        }
        /* fall through */
    case NL_SIGN:
        if (!digit)
            return DEAD;
        s->lphase = b == '0' ? NL_ZERO : NL_INT;
        s->len = 1;
        if (bounded)
            s->num = b - '0';
        return feasible(n, s) ? OK : DEAD;
    case NL_ZERO:
        if (b == '.' && !n->integer) {
            s->lphase = NL_DOT;
            return feasible(n, s) ? OK : DEAD;
        }
        if (e) {
            s->lphase = NL_E;
            return OK;
        }
        break;
    case NL_INT:
        if (digit && id < INT_DIGITS) {
            s->len++;
            if (bounded)
                s->num = s->num * 10 + (b - '0');
            return feasible(n, s) ? OK : DEAD;
        }
        if (b == '.' && !n->integer) {
            s->lphase = NL_DOT;
            return feasible(n, s) ? OK : DEAD;
        }
        if (e) {
            s->lphase = NL_E;
            return OK;
        }
        break;
    case NL_DOT:
        if (!digit)
            return DEAD;
        /* fall through */
    case NL_FRAC:
        if (digit && (bounded ? id + fd < INT_DIGITS : fd < FRAC_DIGITS)) {
            s->lphase = NL_FRAC;
            s->len += 1u << 8;
            if (bounded)
                s->num = s->num * 10 + (b - '0');
            return feasible(n, s) ? OK : DEAD;
        }
        if (e) {
            s->lphase = NL_E;
            return OK;
        }
        break;
    case NL_E:
        if (b == '+' || b == '-') {
            s->lphase = NL_ESIGN;
            return OK;
        }
        /* fall through */
    case NL_ESIGN:
        if (!digit)
            return DEAD;
        s->lphase = NL_EXP;
        s->len = (s->len & 0xffff) | 1u << 16;
        return OK;
    case NL_EXP:
        if (digit && ed < EXP_DIGITS) {
            s->len += 1u << 16;
            return OK;
        }
        break;
    }
    /* `b` does not continue the number: it ends here, if complete and in range */
    if (!number_complete(n, s))
        return DEAD;
    child_done(js, s);
    return RETRY;
}

static inline bool rx_push(const jnode *n, st *s, uint8_t b) {
    if (!n || !n->rx)
        return true;
    s->rx = rudder_rx_push(n->rx, s->rx, b);
    return s->rx != RUDDER_DEAD;
}

/* The fewest bytes that take the pattern from `state` to a match, if at most `limit` (else
 * limit + 1): a breadth-first search over the DFA, one representative byte per byte class,
 * cached per state. With maxLength, a character is allowed only if a match stays in reach. */
#define DIST_SLOTS 512u
#define BFS_MAX 2048u
static struct {
    const rudder_rx *rx;
    uint32_t state, limit, dist;
} g_dist[DIST_SLOTS];

static uint32_t rx_min_bytes(rudder_rx *rx, uint32_t state, uint32_t limit) {
    uint32_t h = (state * 2654435761u ^ (uint32_t)(uintptr_t)rx) % DIST_SLOTS;
    if (g_dist[h].rx == rx && g_dist[h].state == state && (g_dist[h].dist <= g_dist[h].limit || g_dist[h].limit >= limit))
        return g_dist[h].dist <= limit ? g_dist[h].dist : limit + 1;
    const rudder_rx_dfa *d = (const rudder_rx_dfa *)rx;
    uint8_t reps[256];
    uint32_t n_reps = 0, seen_class[8] = {0};
    for (uint32_t b = 0; b < 256; b++)
        if (!bit(seen_class, d->classes[b]))
            set_bit(seen_class, d->classes[b]), reps[n_reps++] = (uint8_t)b;
    static uint32_t queue[BFS_MAX];
    uint32_t head = 0, tail = 0, level_end, dist = 0, found = limit + 1;
    queue[tail++] = state;
    if (rudder_rx_accepting(rx, state))
        found = 0;
    while (found > limit && head < tail && dist < limit) {
        level_end = tail;
        dist++;
        for (; head < level_end && found > limit; head++)
            for (uint32_t r = 0; r < n_reps; r++) {
                uint32_t nx = rudder_rx_push(rx, queue[head], reps[r]);
                if (nx == RUDDER_DEAD)
                    continue;
                if (rudder_rx_accepting(rx, nx)) {
                    found = dist;
                    break;
                }
                bool seen = false;
                for (uint32_t k = 0; k < tail && !seen; k++)
                    seen = queue[k] == nx;
                if (!seen) {
                    if (tail == BFS_MAX) {   /* too many states to search: assume reachable */
                        found = dist;
                        break;
                    }
                    queue[tail++] = nx;
                }
            }
    }
    g_dist[h].rx = rx, g_dist[h].state = state, g_dist[h].limit = limit, g_dist[h].dist = found;
    return found;
}

static int count_char(const jnode *n, st *s, uint8_t b) {
    if (n) {
        if (n->max != NONE && s->len >= n->max)
            return DEAD;
        if (s->len < n->cap)
            s->len++;
        if (!rx_push(n, s, b))
            return DEAD;
        if (n->rx && n->max != NONE) {   /* the rest of this character is free: u8need bytes */
            uint32_t room = n->max - s->len + s->u8need;
            if (rx_min_bytes(n->rx, s->rx, room) > room)
                return DEAD;
        }
    }
    return OK;
}

static inline int hexval(uint8_t b) {
    return b >= '0' && b <= '9' ? b - '0' : b >= 'a' && b <= 'f' ? b - 'a' + 10 : b >= 'A' && b <= 'F' ? b - 'A' + 10 : -1;
}

static const char ESC_FROM[] = "\"\\/bfnrt", ESC_TO[] = "\"\\/\b\f\n\r\t";

static bool escape_possible(const jnode *n, const st *s) {
    if (!n->rx)
        return true;
    st t;
    for (uint32_t i = 0; ESC_TO[i]; i++) {
        copy_state(&t, s);
        if (count_char(n, &t, (uint8_t)ESC_TO[i]) == OK)
            return true;
    }
    return false;
}

/* One byte inside a string. `n` is the string's node, or NULL for a free object key (plain
 * characters only: no escapes, so that equal keys are equal bytes). */
static int str_byte(st *s, const jnode *n, uint8_t b) {
    switch (s->lphase) {
    case SL_CHAR:
        if (b == '"') {
            if (n && (s->len < n->min || (n->rx && !rudder_rx_accepting(n->rx, s->rx))))
                return DEAD;
            return CLOSED;
        }
        if (b == '\\') {   /* an escape must have room and, under a pattern, a character it may write */
            if (!n || (n->max != NONE && s->len >= n->max) || !escape_possible(n, s))
                return DEAD;
            s->lphase = SL_ESC;
            return OK;
        }
        if (b < 0x20)
            return DEAD;
        if (b < 0x80)
            return count_char(n, s, b);
        if (b >= 0xc2 && b <= 0xdf) {
            s->u8need = 1, s->u8lo = 0x80, s->u8hi = 0xbf;
        } else if (b >= 0xe0 && b <= 0xef) {
            s->u8need = 2, s->u8lo = b == 0xe0 ? 0xa0 : 0x80, s->u8hi = b == 0xed ? 0x9f : 0xbf;
        } else if (b >= 0xf0 && b <= 0xf4) {
            s->u8need = 3, s->u8lo = b == 0xf0 ? 0x90 : 0x80, s->u8hi = b == 0xf4 ? 0x8f : 0xbf;
        } else {
            return DEAD;
        }
        s->lphase = SL_UTF8;
        return count_char(n, s, b);
    case SL_UTF8:
        if (b < s->u8lo || b > s->u8hi || !rx_push(n, s, b))
            return DEAD;
        if (--s->u8need == 0)
            s->lphase = SL_CHAR, s->u8lo = s->u8hi = 0;
        else
            s->u8lo = 0x80, s->u8hi = 0xbf;
        return OK;
    case SL_ESC: {
        if (b == 'u' && !n->rx) {   /* (under a pattern only short escapes: decided at once) */
            s->lphase = SL_U0;
            s->hex = 0;
            return OK;
        }
        for (uint32_t i = 0; ESC_FROM[i]; i++)
            if (b == (uint8_t)ESC_FROM[i]) {
                s->lphase = SL_CHAR;
                return count_char(n, s, (uint8_t)ESC_TO[i]);
            }
        return DEAD;
    }
    default: {   /* SL_U0..SL_U3 */
        int h = hexval(b);
        if (h < 0 || (s->lphase == SL_U1 && s->hex == 0xd && h >= 8))   /* no surrogates */
            return DEAD;
        s->hex = s->hex * 16 + (uint32_t)h;
        if (s->lphase != SL_U3) {
            s->lphase++;
            return OK;
        }
        uint32_t cp = s->hex;
        s->hex = 0;
        s->lphase = SL_CHAR;
        uint8_t u[4];
        uint32_t k = rudder_utf8_encode(cp, u);   /* cp <= 0xffff: a \uXXXX escape */
        if (count_char(n, s, u[0]) == DEAD)
            return DEAD;
        for (uint32_t i = 1; i < k; i++)
            if (!rx_push(n, s, u[i]))
                return DEAD;
        return OK;
    }
    }
}

/* The first required property at or after `next` (NONE: all required ones are done). */
static inline uint32_t next_required(const jnode *n, uint32_t next) {
    uint64_t r = next < 64 ? n->req & (~0ull << next) : 0;
    return r ? (uint32_t)__builtin_ctzll(r) : NONE;
}

/* Properties that may come next: from `next` up to the first required one (no skipping it). */
static inline uint64_t key_range(const jnode *n, uint32_t next) {
    if (next >= n->n)
        return 0;
    uint32_t r = next_required(n, next), hi = r == NONE ? n->n - 1 : r;
    uint64_t upto = hi >= 63 ? ~0ull : (1ull << (hi + 1)) - 1;
    return upto & (~0ull << next);
}

/* key_range, less the properties whose value would not fit here (nesting) */
static uint64_t key_range_fit(const rudder_js *js, const st *s, const jnode *n, uint32_t next) {
    uint64_t range = key_range(n, next), fit = range;
    for (uint64_t r = range; r; r &= r - 1) {
        uint32_t k = (uint32_t)__builtin_ctzll(r);
        if (!fits(js, s, js->props[n->a + k].value))
            fit &= ~(1ull << k);
    }
    return fit;
}

static void key_done(st *s, rudder_js_frame *f, const jnode *n, uint32_t cur) {
    f->phase = O_COLON;
    f->aux = 0;
    f->flags = 0;
    f->aux2 = (cur == 0xff ? n->n : cur + 1) | cur << 8;
    lex_reset(s);
}

static int key_byte(const rudder_js *js, st *s, rudder_js_frame *f, const jnode *n, uint8_t b) {
    uint64_t range = key_range_fit(js, s, n, f->aux2 & 0xff);
    bool extras = f->flags & 1;
    uint32_t c = f->aux != NONE ? tchild(js, f->aux, b) : NONE;
    if (extras && b == '"' && s->lphase == SL_CHAR) {   /* the key ends */
        if (c != NONE && js->trie[c].term != NONE) {    /* it is a declared key */
            if (!((range >> js->trie[c].term) & 1))
                return DEAD;   /* written already, or a required one comes first */
            key_done(s, f, n, js->trie[c].term);
        } else {
            key_done(s, f, n, 0xff);
        }
        return OK;
    }
    if (extras && b == '\\') {   /* only a declared key (escaped in the schema) goes on */
        if (c == NONE || !(js->trie[c].below & range))
            return DEAD;
        f->flags = 0;
        lex_reset(s);
    }
    if (!(f->flags & 1)) {
        if (c == NONE || !(js->trie[c].below & range))
            return DEAD;
        if (js->trie[c].term != NONE)
            key_done(s, f, n, js->trie[c].term);
        else
            f->aux = c;
        return OK;
    }
    if (str_byte(s, NULL, b) != OK)
        return DEAD;
    f->aux = c;   /* NONE once it left every declared key */
    return OK;
}

static int obj_byte(const rudder_js *js, st *s, rudder_js_frame *f, const jnode *n, uint8_t b, bool ws) {
    if (f->phase == O_IN_KEY)
        return key_byte(js, s, f, n, b);
    if (ws)
        return OK;
    uint32_t next = f->aux2 & 0xff;
    bool can_end = next_required(n, next) == NONE;
    bool extras = n->extra != NONE && can_end && fits(js, s, n->extra);
    bool more = key_range_fit(js, s, n, next) != 0 || extras;
    switch (f->phase) {
    case O_KEY_OR_END:
        if (b == '}') {
            if (!can_end)
                return DEAD;
            child_done(js, s);
            return OK;
        }
        /* fall through */
    case O_KEY:
        if (b != '"' || !more)
            return DEAD;
        f->phase = O_IN_KEY;
        f->aux = n->n ? n->trie : NONE;   /* followed even past `next`: no duplicate keys */
        f->flags = extras;
        lex_reset(s);
        s->lphase = SL_CHAR;
        return OK;
    case O_COLON: {
        if (b != ':')
            return DEAD;
        uint32_t cur = f->aux2 >> 8;
        f->phase = O_VALUE;
        return push_frame(js, s, cur == 0xff ? n->extra : js->props[n->a + cur].value) ? OK : DEAD;
    }
    case O_AFTER:
        if (b == ',' && more) {
            f->phase = O_KEY;
            return OK;
        }
        if (b == '}' && can_end) {
            child_done(js, s);
            return OK;
        }
        return DEAD;
    }
    return DEAD;
}

static int arr_byte(const rudder_js *js, st *s, rudder_js_frame *f, const jnode *n, uint8_t b, bool ws) {
    if (ws)
        return OK;
    uint32_t count = f->aux;
    uint32_t item = count < n->n ? js->idx[n->a + count] : n->extra;
    bool can_end = count >= n->min;
    bool more = item != NONE && (n->max == NONE || count < n->max) && fits(js, s, item);
    switch (f->phase) {
    case A_ITEM_OR_END:
        if (b == ']') {
            if (!can_end)
                return DEAD;
            child_done(js, s);
            return OK;
        }
        /* fall through */
    case A_ITEM:
        if (!more)
            return DEAD;
        f->phase = A_VALUE;
        return push_frame(js, s, item) ? RETRY : DEAD;
    case A_AFTER:
        if (b == ',' && more) {
            f->phase = A_ITEM;
            return OK;
        }
        if (b == ']' && can_end) {
            child_done(js, s);
            return OK;
        }
        return DEAD;
    }
    return DEAD;
}

static int step(const rudder_js *js, st *s, uint8_t b) {
    rudder_js_frame *f = &s->f[s->sp - 1];
    bool ws = js->flexible && (b == ' ' || b == '\n' || b == '\t' || b == '\r');
    if (s->sp == 1) {
        if (f->phase == D_START) {
            if (ws)
                return OK;
            f->phase = D_VALUE;
            return push_frame(js, s, js->root) ? RETRY : DEAD;
        }
        return ws && f->phase == D_DONE ? OK : DEAD;
    }
    const jnode *n = &js->nodes[f->node];
    if (f->phase == V_START) {
        if (ws)
            return OK;
        switch (n->kind) {
        case K_UNION:
            for (uint32_t k = 0; k < n->n; k++) {
                uint32_t alt = js->idx[n->a + k];
                if (bit(js->nodes[alt].first, b) && s->sp - 1 + js->nodes[alt].need <= RUDDER_JS_MAX_DEPTH) {
                    f->node = (uint16_t)alt;
                    return RETRY;
                }
            }
            return DEAD;
        case K_OBJECT:
            if (b != '{')
                return DEAD;
            f->phase = O_KEY_OR_END;
            f->aux = f->aux2 = 0;
            return OK;
        case K_ARRAY:
            if (b != '[')
                return DEAD;
            f->phase = A_ITEM_OR_END;
            f->aux = 0;
            return OK;
        case K_STRING:
            if (b != '"')
                return DEAD;
            f->phase = S_IN;
            lex_reset(s);
            s->lphase = SL_CHAR;
            if (n->rx)
                s->rx = rudder_rx_start(n->rx, NULL);
            return OK;
        case K_NUMBER:
            f->phase = N_IN;
            lex_reset(s);
            s->lphase = NL_START;
            return num_byte(js, s, n, b);
        case K_LITS: {
            uint32_t c = tchild(js, n->trie, b);
            if (c == NONE)
                return DEAD;
            f->phase = L_IN;
            f->aux = c;
            return OK;
        }
        default:
            return DEAD;
        }
    }
    switch (n->kind) {
    case K_OBJECT:
        return obj_byte(js, s, f, n, b, ws);
    case K_ARRAY:
        return arr_byte(js, s, f, n, b, ws);
    case K_STRING: {
        int r = str_byte(s, n, b);
        if (r == CLOSED) {
            child_done(js, s);
            return OK;
        }
        return r;
    }
    case K_NUMBER:
        return num_byte(js, s, n, b);
    case K_LITS: {
        uint32_t c = tchild(js, f->aux, b);
        if (c != NONE) {
            f->aux = c;
            return OK;
        }
        if (js->trie[f->aux].term == NONE)
            return DEAD;
        child_done(js, s);
        return RETRY;
    }
    }
    return DEAD;
}

static inline bool push_byte(const rudder_js *js, st *s, uint8_t b) {
    int r;
    while ((r = step(js, s, b)) == RETRY) {
    }
    return r == OK;
}

void rudder_js_start(rudder_js *js, st *s) {
    (void)js;
    memset(s, 0, sizeof *s);
    s->sp = 1;
}

bool rudder_js_push(rudder_js *js, st *s, const uint8_t *bytes, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (!push_byte(js, s, bytes[i]))
            return false;
    return true;
}

static bool accepting(const rudder_js *js, const st *s0) {
    st s;
    copy_state(&s, s0);
    for (;;) {
        rudder_js_frame *f = &s.f[s.sp - 1];
        if (s.sp == 1)
            return f->phase == D_DONE;
        const jnode *n = &js->nodes[f->node];
        if (n->kind == K_NUMBER && f->phase == N_IN && number_complete(n, &s))
            child_done(js, &s);
        else if (n->kind == K_LITS && f->phase == L_IN && js->trie[f->aux].term != NONE)
            child_done(js, &s);
        else
            return false;
    }
}

bool rudder_js_accepting(rudder_js *js, const st *s) { return accepting(js, s); }

/* A superset of the bytes that can come next, from the top frame alone; false when it could
 * be almost anything (inside strings, numbers, extra keys, after a complete literal). */
static bool candidates(const rudder_js *js, const st *s, uint32_t set[8]) {
    const rudder_js_frame *f = &s->f[s->sp - 1];
    memset(set, 0, 32);
    bool between = true;   /* between tokens of JSON: whitespace may come (flexible) */
    if (s->sp == 1) {
        if (f->phase == D_START)
            memcpy(set, js->nodes[js->root].first, 32);
    } else if (f->phase == V_START) {
        memcpy(set, js->nodes[f->node].first, 32);
    } else {
        const jnode *n = &js->nodes[f->node];
        switch (n->kind) {
        case K_OBJECT:
            switch (f->phase) {
            case O_KEY_OR_END: set_bit(set, '}'); /* fall through */
            case O_KEY: set_bit(set, '"'); break;
            case O_COLON: set_bit(set, ':'); break;
            case O_AFTER: set_bit(set, ','), set_bit(set, '}'); break;
            default:   /* O_IN_KEY */
                if ((f->flags & 1) || f->aux == NONE)
                    return false;
                for (uint32_t c = js->trie[f->aux].child; c != NONE; c = js->trie[c].sibling)
                    set_bit(set, js->trie[c].byte);
                between = false;
            }
            break;
        case K_ARRAY: {
            uint32_t item = f->aux < n->n ? js->idx[n->a + f->aux] : n->extra;
            if (f->phase == A_AFTER) {
                set_bit(set, ','), set_bit(set, ']');
                break;
            }
            if (f->phase == A_ITEM_OR_END)
                set_bit(set, ']');
            if (item != NONE)
                for (uint32_t w = 0; w < 8; w++)
                    set[w] |= js->nodes[item].first[w];
            break;
        }
        case K_LITS:
        case K_NUMBER: {   /* its own next bytes, and when it may end here, the parent's */
            bool may_end;
            if (n->kind == K_LITS) {
                for (uint32_t c = js->trie[f->aux].child; c != NONE; c = js->trie[c].sibling)
                    set_bit(set, js->trie[c].byte);
                may_end = js->trie[f->aux].term != NONE;
            } else if (f->phase == N_IN) {
                for (const char *c = "0123456789.eE+-"; *c; c++)
                    set_bit(set, (uint8_t)*c);
                may_end = number_complete(n, s);
            } else {
                return false;
            }
            if (may_end) {
                st up;
                uint32_t more[8];
                copy_state(&up, s);
                child_done(js, &up);
                if (!candidates(js, &up, more))
                    return false;
                for (uint32_t w = 0; w < 8; w++)
                    set[w] |= more[w];
            }
            return true;
        }
        default:
            return false;
        }
    }
    if (js->flexible && between) {
        set_bit(set, ' '), set_bit(set, '\n'), set_bit(set, '\t'), set_bit(set, '\r');
    }
    return true;
}

/* How many bytes can follow `s` (0, 1 or 2 = "several"); the byte when it is one. */
static uint32_t next_bytes(const rudder_js *js, const st *s, int *only) {
    uint32_t set[8], found = 0;
    bool narrow = candidates(js, s, set);
    st t;
    for (uint32_t b = 0; b < 256; b++) {
        if (narrow && !bit(set, (uint8_t)b))
            continue;
        copy_state(&t, s);
        if (push_byte(js, &t, (uint8_t)b)) {
            *only = (int)b;
            if (++found == 2)
                break;
        }
    }
    return found;
}

/* The one byte the schema allows here, or -1 (several, none, or the document may end here).
 * With flexible whitespace, whitespace is a choice: little is forced then (inside keys). */
static int forced_byte(const rudder_js *js, const st *s) {
    int only = -1;
    if (accepting(js, s) || next_bytes(js, s, &only) != 1)
        return -1;
    return only;
}


/* ------------------------------------------------------------------ (4) masks and steps */

/* Token classes (request-independent). "Plain" tokens are UTF-8 (the last character may be cut
 * short) with no quote, backslash or control byte: inside a string, at a character boundary,
 * every one of them is allowed as long as its characters fit (maxLength) and, under a pattern,
 * the pattern's own mask allows it; only the other ("special") tokens need checking one by
 * one, and tokens that are not UTF-8 at all are never allowed there.
 * g_plain_upto[k]: the plain tokens of at most k characters (k <= SHORT); longer plain tokens
 * are few and listed apart. */
#define SHORT 24u
static uint32_t *g_plain_upto[SHORT + 1], *g_special, g_n_special, *g_long, g_n_long, g_max_token;
static uint32_t *g_special_lcp;   /* bytes shared with the previous special token (sorted) */
static uint8_t *g_chars;   /* characters of each plain token (capped at 255) */
static uint8_t *g_tail;    /* bytes its last character lacks (a token cut inside a character) */
static uint32_t g_first[256], g_n_first;   /* the trie's first-level nodes, and their bytes */
static uint8_t g_first_byte[256];

/* Valid UTF-8 whose last character may be cut short (a token can end inside a character). */
static bool utf8_prefix(const uint8_t *b, uint32_t len) {
    uint32_t i = 0;
    while (i < len) {
        uint32_t more = b[i] < 0x80 ? 0 : b[i] >= 0xc2 && b[i] <= 0xdf ? 1 : b[i] >= 0xe0 && b[i] <= 0xef ? 2 : b[i] >= 0xf0 && b[i] <= 0xf4 ? 3 : 99;
        if (more == 99)
            return false;
        uint32_t have = len - i - 1 < more ? len - i - 1 : more;
        if (!rudder_utf8_valid(b + i, 1 + more) && have == more)
            return false;
        if (have < more) {   /* cut short: check the bytes there are against a completed copy */
            uint8_t full[4] = {b[i], 0x80, 0x80, 0x80};
            for (uint32_t k = 1; k <= have; k++)
                full[k] = b[i + k];
            bool ok = false;
            for (uint32_t fill = 0x80; fill <= 0xbf && !ok; fill++) {   /* some completion is valid */
                for (uint32_t k = have + 1; k <= more; k++)
                    full[k] = (uint8_t)fill;
                ok = rudder_utf8_valid(full, 1 + more);
            }
            return ok;
        }
        i += 1 + more;
    }
    return true;
}

static int token_cmp(uint32_t x, uint32_t y) {
    uint32_t lx, ly;
    const uint8_t *a = rudder_token_bytes(x, &lx), *b = rudder_token_bytes(y, &ly);
    for (uint32_t k = 0; k < lx && k < ly; k++)
        if (a[k] != b[k])
            return a[k] < b[k] ? -1 : 1;
    return lx < ly ? -1 : lx > ly;
}

void rudder_js_init_tables(void) {
    if (g_special)
        return;
    uint32_t vocab = rudder_vocab_size(), words = rudder_mask_words();
    for (uint32_t k = 0; k <= SHORT; k++)
        g_plain_upto[k] = rudder_mask_new();
    g_special = rudder_xalloc(4 * (vocab + 1));
    g_long = rudder_xalloc(4 * (vocab + 1));
    g_chars = rudder_zalloc(vocab + 1);
    g_tail = rudder_zalloc(vocab + 1);
    for (uint32_t t = 0; t < vocab; t++) {
        uint32_t len, chars = 0;
        const uint8_t *b = rudder_token_bytes(t, &len);
        if (!b || !len)
            continue;
        if (len > g_max_token)
            g_max_token = len;
        if (!utf8_prefix(b, len))
            continue;   /* never inside a string at a character boundary */
        bool plain = true;
        for (uint32_t i = 0; i < len; i++) {
            plain &= b[i] >= 0x20 && b[i] != '"' && b[i] != '\\';
            chars += (b[i] & 0xc0) != 0x80;
        }
        if (!plain) {
            g_special[g_n_special++] = t;
            continue;
        }
        g_chars[t] = (uint8_t)(chars < 255 ? chars : 255);
        uint32_t last = len;   /* continuation bytes the last character still lacks */
        while (last > 0 && (b[last - 1] & 0xc0) == 0x80)
            last--;
        if (last > 0 && b[last - 1] >= 0xc0) {
            uint32_t want = b[last - 1] >= 0xf0 ? 3 : b[last - 1] >= 0xe0 ? 2 : 1;
            g_tail[t] = (uint8_t)(want - (len - last));
        }
        if (chars <= SHORT)
            rudder_mask_set(g_plain_upto[chars], t);
        else
            g_long[g_n_long++] = t;
    }
    /* special tokens in byte order (insertion sort: a few hundred), and their shared prefixes */
    g_special_lcp = rudder_xalloc(4 * (g_n_special + 1));
    for (uint32_t i = 1; i < g_n_special; i++) {
        uint32_t t = g_special[i], j = i;
        while (j > 0 && token_cmp(g_special[j - 1], t) > 0) {
            g_special[j] = g_special[j - 1];
            j--;
        }
        g_special[j] = t;
    }
    for (uint32_t i = 0; i < g_n_special; i++) {
        uint32_t la, lb, k = 0;
        const uint8_t *a = i ? rudder_token_bytes(g_special[i - 1], &la) : NULL, *b = rudder_token_bytes(g_special[i], &lb);
        while (a && k < la && k < lb && a[k] == b[k])
            k++;
        g_special_lcp[i] = k;
    }
    const rudder_trie *tr = rudder_trie_get();
    for (uint32_t i = 1; i < tr->n_nodes && g_n_first < 256; i += tr->nodes[2 * i + 1]) {
        g_first_byte[g_n_first] = (uint8_t)tr->nodes[2 * i];
        g_first[g_n_first++] = i;
    }
    for (uint32_t k = 1; k <= SHORT; k++)   /* cumulative */
        for (uint32_t w = 0; w < words; w++)
            g_plain_upto[k][w] |= g_plain_upto[k - 1][w];
}

static uint32_t rudder_js_max_token(void) { return g_max_token; }

/* Inside a string (a value, or a free object key), at a character boundary: returns the room
 * left in characters (NONE: unbounded), or 0 when the fast path does not apply; *rx is the
 * string's pattern (NULL: none). */
static uint32_t free_string_room(const rudder_js *js, const st *s, const jnode **rx) {
    const rudder_js_frame *f = &s->f[s->sp - 1];
    *rx = NULL;
    if (s->sp < 2 || s->lphase != SL_CHAR)
        return 0;
    const jnode *n = &js->nodes[f->node];
    if (n->kind == K_STRING && f->phase == S_IN) {
        *rx = n->rx ? n : NULL;
        return n->max == NONE ? NONE : n->max - s->len;
    }
    /* an extra key takes any plain characters (whether it still follows a declared key only
     * matters at its closing quote, a special token) */
    return n->kind == K_OBJECT && f->phase == O_IN_KEY && (f->flags & 1) ? NONE : 0;
}

static uint32_t fill_mask(rudder_js *js, const st *s0, uint32_t *mask) {
    uint32_t count = 0;
    const jnode *rx;
    uint32_t room = free_string_room(js, s0, &rx);
    if (room) {
        uint32_t words = rudder_mask_words();
        memcpy(mask, g_plain_upto[room < SHORT ? room : SHORT], 4 * words);
        for (uint32_t i = 0; room > SHORT && i < g_n_long; i++)
            if (g_chars[g_long[i]] <= room)
                rudder_mask_set(mask, g_long[i]);
        if (rx) {   /* plain tokens are their own characters: the pattern's cached mask filters them */
            const uint32_t *allowed = rudder_rx_mask(rx->rx, s0->rx);
            for (uint32_t w = 0; w < words; w++)
                mask[w] &= allowed[w];
            if (rx->max != NONE)   /* and with maxLength, a match must stay within reach after each */
                for (uint32_t w = 0; w < words; w++)
                    for (uint32_t bits = mask[w]; bits; bits &= bits - 1) {
                        uint32_t t = w * 32 + (uint32_t)__builtin_ctz(bits), len;
                        const uint8_t *b = rudder_token_bytes(t, &len);
                        uint32_t r = s0->rx;
                        for (uint32_t k = 0; k < len && r != RUDDER_DEAD; k++)
                            r = rudder_rx_push(rx->rx, r, b[k]);
                        uint32_t left = room - g_chars[t] + g_tail[t];
                        if (r == RUDDER_DEAD || rx_min_bytes(rx->rx, r, left) > left)
                            mask[w] &= ~(1u << (t & 31));
                    }
        }
        /* the special tokens in byte order: a shared prefix is pushed once, and a dead one
         * kills every token that starts with it */
        st *J = js->walk;
        copy_state(&J[0], s0);
        uint32_t dead = NONE;   /* the byte index that failed in the previous token */
        for (uint32_t i = 0; i < g_n_special; i++) {
            uint32_t tok = g_special[i], len, k = g_special_lcp[i];
            if (dead != NONE && k > dead)
                continue;
            const uint8_t *b = rudder_token_bytes(tok, &len);
            dead = NONE;
            for (; k < len; k++) {
                copy_state(&J[k + 1], &J[k]);
                if (!push_byte(js, &J[k + 1], b[k])) {
                    dead = k;
                    break;
                }
            }
            if (dead == NONE)
                rudder_mask_set(mask, tok);
        }
        return rudder_mask_count(mask);
    }
    /* The trie walk, one state per depth; a dead byte skips its whole subtree. The first
     * level comes from a compact copy (most states kill most first bytes, and the first-level
     * nodes are spread over the whole trie). */
    const rudder_trie *tr = rudder_trie_get();
    const uint32_t *nodes = tr->nodes;
    uint32_t *ends = tr->ends;
    st *J = js->walk;
    copy_state(&J[0], s0);
    uint32_t *sets = js->walk_sets;   /* per depth: candidate next bytes (all ones: any) */
    if (!candidates(js, s0, sets))
        memset(sets, 0xff, 32);
    for (uint32_t r = 0; r < g_n_first; r++) {
        if (!bit(sets, g_first_byte[r]))
            continue;
        uint32_t at = g_first[r], w0 = nodes[2 * at], end = at + nodes[2 * at + 1];
        copy_state(&J[1], &J[0]);
        if (!push_byte(js, &J[1], (uint8_t)g_first_byte[r]))
            continue;
        if (w0 >> 8) {
            mask[((w0 >> 8) - 1) >> 5] |= 1u << (((w0 >> 8) - 1) & 31);
            count++;
        }
        uint32_t depth = 1, i = at + 1;
        ends[1] = end;
        if (end > i && !candidates(js, &J[1], sets + 8))
            memset(sets + 8, 0xff, 32);
        while (i < end) {
            while (i >= ends[depth])
                depth--;
            uint32_t w = nodes[2 * i], size = nodes[2 * i + 1];
            if (!bit(sets + 8 * depth, (uint8_t)w)) {   /* the state cannot take this byte */
                i += size;
                continue;
            }
            st *child = &J[depth + 1];
            copy_state(child, &J[depth]);
            if (!push_byte(js, child, (uint8_t)w)) {
                i += size;
                continue;
            }
            uint32_t tok1 = w >> 8;
            if (tok1) {
                mask[(tok1 - 1) >> 5] |= 1u << ((tok1 - 1) & 31);
                count++;
            }
            if (size > 1) {
                ends[++depth] = i + size;
                if (!candidates(js, child, sets + 8 * depth))
                    memset(sets + 8 * depth, 0xff, 32);
            }
            i++;
        }
    }
    return count;
}

static uint32_t state_hash(const st *s) {
    const uint8_t *p = (const uint8_t *)s;
    uint32_t h = 2166136261u, n = state_size(s);
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

/* Could the token spelling `b` be the start of a longer token that continues validly from
 * `s` (the state after `b`)? Then the model may want that longer token: `b` is not forced as
 * a token, only as text. Walks the trie below b's node, stopping at the first live token. */
static bool extends(const rudder_js *js, const st *s, const uint8_t *b, uint32_t len) {
    const rudder_trie *tr = rudder_trie_get();
    const uint32_t *nodes = tr->nodes;
    uint32_t at = 0;
    for (uint32_t k = 0; k < len; k++) {   /* descend: children of i lie in (i, i + size) */
        uint32_t c = at + 1, end = at + nodes[2 * at + 1];
        while (c < end && (uint8_t)nodes[2 * c] != b[k])
            c += nodes[2 * c + 1];
        if (c >= end)
            return false;
        at = c;
    }
    uint32_t end = at + nodes[2 * at + 1], depth = 0, i = at + 1;
    uint32_t *ends = tr->ends;
    st *J = js->walk;
    copy_state(&J[0], s);
    ends[0] = end;
    while (i < end) {
        while (i >= ends[depth])
            depth--;
        uint32_t w0 = nodes[2 * i], size = nodes[2 * i + 1];
        st *child = &J[depth + 1];
        copy_state(child, &J[depth]);
        if (!push_byte(js, child, (uint8_t)w0)) {
            i += size;
            continue;
        }
        if (w0 >> 8)
            return true;
        if (size > 1)
            ends[++depth] = i + size;
        i++;
    }
    return false;
}

/* The forced bytes from `s` (whole characters), as tokens: all of them, except the last when
 * it could merge with what the model writes next (a longer token starting with it could
 * follow validly). Appends to e->toks; returns how many. */
static uint32_t forced_tokens(rudder_js *js, const st *s, entry *e) {
    uint8_t run[MAX_FORCED];
    uint32_t n = 0, whole = 0;
    st cur, at_whole;
    copy_state(&cur, s);
    copy_state(&at_whole, s);
    int b;
    while (n < MAX_FORCED && (b = forced_byte(js, &cur)) >= 0) {
        run[n++] = (uint8_t)b;
        push_byte(js, &cur, (uint8_t)b);
        if (rudder_utf8_valid(run + whole, n - whole))
            whole = n, copy_state(&at_whole, &cur);
    }
    if (!whole)
        return 0;
    uint32_t nt;
    uint32_t *toks = rudder_tokenize(run, whole, &nt);
    uint8_t check[MAX_FORCED];
    if (!toks || rudder_detokenize(toks, nt, check, sizeof check) != whole || memcmp(check, run, whole) != 0) {
        rudder_free(toks);
        return 0;
    }
    uint32_t last_len;
    const uint8_t *last = rudder_token_bytes(toks[nt - 1], &last_len);
    if (extends(js, &at_whole, last, last_len))
        nt--;
    e->toks = rudder_grow(e->toks, &e->cap_toks, e->n_toks + nt + 1, 4);
    memcpy(e->toks + e->n_toks, toks, nt * 4);
    e->n_toks += nt;
    rudder_free(toks);
    return nt;
}

static void build(rudder_js *js, const st *s, entry *e) {
    rudder_js_info *in = &e->info;
    *in = (rudder_js_info){0};
    e->n_toks = 0;
    in->accepting = accepting(js, s);
    if (js->ff && js->ff_budget) {
        uint32_t k = forced_tokens(js, s, e);
        if (k > js->ff_budget)
            k = js->ff_budget;   /* the host's limit per step: the rest comes next step */
        if (k) {
            in->ff = e->toks;
            in->n_ff = k;
            return;
        }
    }
    rudder_mask_clear_all(e->mask);
    uint32_t count = fill_mask(js, s, e->mask);
    uint32_t eos = rudder_eos_token();
    in->mask = e->mask;
    if (count && js->ff && js->ff_budget && count <= LIST_MAX_ALLOWED) {   /* a choice that forces what follows */
        uint32_t budget = js->ff_budget, words = rudder_mask_words();
        for (uint32_t w = 0; w < words; w++)
            for (uint32_t bits = e->mask[w]; bits; bits &= bits - 1) {
                uint32_t t = w * 32 + (uint32_t)__builtin_ctz(bits), len;
                const uint8_t *b = rudder_token_bytes(t, &len);
                st after;
                copy_state(&after, s);
                rudder_js_push(js, &after, b, len);
                uint32_t start = e->n_toks;
                e->toks = rudder_grow(e->toks, &e->cap_toks, start + 1, 4);
                e->toks[e->n_toks++] = t;
                uint32_t k = forced_tokens(js, &after, e);
                if (!k || k + 1 > budget) {
                    e->n_toks = start;
                    continue;
                }
                budget -= k + 1;
                e->lists = rudder_grow(e->lists, &e->cap_lists, 2 * in->n_lists + 2, 4);
                e->lists[2 * in->n_lists] = start;
                e->lists[2 * in->n_lists + 1] = k + 1;
                in->n_lists++;
            }
        in->lists = e->lists;
        in->list_tokens = e->toks;
    }
    if (in->accepting && eos != RUDDER_NO_TOKEN && count) {
        rudder_mask_set(e->mask, eos);
        count++;
    }
    in->n_allowed = count;
}

const rudder_js_info *rudder_js_info_of(rudder_js *js, const st *s) {
    uint32_t h = state_hash(s), size = state_size(s);
    for (uint32_t i = 0; i < CACHE_SLOTS; i++) {
        entry *e = &js->cache[i];
        if (e->used && e->hash == h && e->key_size == size && memcmp(&e->key, s, size) == 0) {
            js->hits++;
            return &e->info;
        }
    }
    js->misses++;
    entry *e = &js->cache[js->next_slot];
    js->next_slot = (js->next_slot + 1) % CACHE_SLOTS;
    e->used = true;
    e->hash = h;
    e->key_size = size;
    copy_state(&e->key, s);
    build(js, s, e);
    return &e->info;
}

void rudder_js_stats(const rudder_js *js, uint32_t *hits, uint32_t *misses) {
    *hits = js->hits;
    *misses = js->misses;
}
