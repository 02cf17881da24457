/* rudder_jsonschema_nodes.h - the compiled form of a JSON Schema (internal to the JSON engine): a graph
 * of nodes that the byte automaton (rudder_jsonschema_match.c) runs on. The compiler
 * (rudder_jsonschema_compile.c) builds it; docs/json-schema.md describes both. */
#ifndef RUDDER_JS_NODES_H
#define RUDDER_JS_NODES_H

#include "rudder_jsonschema.h"
#include "rudder_regex.h"

#define NONE 0xffffffffu
#define RUDDER_JS_MAX_DEPTH 32  /* nesting of objects and arrays (incl. the document) */
#define MAX_PROPS 256u       /* declared properties per object: key sets are 256-bit sets (pset) */
#define MAX_DEP_PROPS 32u    /* objects with dependentRequired: written keys are a 32-bit set */
#define MAX_PATTERNS 4u      /* patternProperties per object: a value node per subset of them */
#define STRING_RX 4u         /* regexes on one string (pattern, format, enum, their negations) */
#define INT_DIGITS 15u       /* digits generated before / after the point, in the exponent */
#define FRAC_DIGITS 15u
#define EXP_DIGITS 3u

/* A set of property indices. */
typedef struct {
    uint64_t w[MAX_PROPS / 64];
} pset;

static inline bool ps_has(const pset *s, uint32_t i) { return (s->w[i >> 6] >> (i & 63)) & 1; }
static inline void ps_add(pset *s, uint32_t i) { s->w[i >> 6] |= 1ull << (i & 63); }

enum { K_PENDING, K_UNION, K_OBJECT, K_ARRAY, K_STRING, K_NUMBER, K_LITS, K_NEVER };

/* A byte trie (object keys, literal sets). term: property index / 1 at a literal's end. */
typedef struct {
    uint32_t child, sibling, term;
    pset below;       /* object keys: properties whose key passes through this node */
    uint8_t byte;
} tnode;

typedef struct {
    uint32_t value;   /* the value's node */
    uint32_t deps;    /* properties that become required once this one is written */
} jprop;

typedef struct {
    uint8_t kind;
    bool integer, has_lo, has_hi, lo_excl, hi_excl;
    uint8_t n_rx;        /* string: regexes in rx[] it must match; object: 1 when extra keys have patterns */
    uint8_t n_neg;       /* string: regexes after those that it must not match */
    uint8_t rx_free;     /* string: bit k: rx[k] never dies on valid text (an unanchored pattern); object:
                          * bit k: a match of rx[k] stays one whatever follows (no `$`) */
    uint8_t frac;        /* number: at most this many fraction digits (multipleOf 0.01: 2), 255: free */
    uint32_t a, n;       /* union: alternatives idx[a..a+n); object: props[a..a+n); array: prefix idx[a..a+n) */
    uint32_t trie;       /* object: key trie; literals: their trie */
    uint32_t extra;      /* object: value of extra keys that match no pattern; array: items (NONE: none allowed) */
    uint32_t min, max;   /* string length in code points; array items; object properties (max NONE: unbounded) */
    uint32_t cap;        /* counters saturate here (equal states then repeat: cache hits) */
    uint32_t sets;       /* object: psets[sets] = required properties, psets[sets + 1] = those with no
                          * possible value */
    uint32_t deepest;    /* object: the most nesting a property's value needs (finite ones) */
    double lo, hi;
    uint32_t mult;       /* number: multipleOf an integer >= 2 (0: none) */
    rudder_rx *rx[STRING_RX];   /* string: its regexes; object: [0] patternProperties (one pattern each), [1] propertyNames */
    uint32_t pvals;      /* object with patterns: idx[pvals + S] is the value node of an extra key matching
                          * the patterns in the set S (S > 0); `extra` is S = 0 */
    uint32_t kmin, kmax; /* object: length of extra keys (propertyNames) */
    uint32_t contains;   /* array: items needed that match `contains` (0: none) */
    uint32_t counting;   /* union: alternatives [0, counting) are items that match `contains` */
    bool has_deps;       /* object: some property has dependentRequired */
    char *path;          /* union: where it came from */
    uint32_t tags;       /* object that reads a tagged union's tag: idx[tags + k] is the alternative whose
                          * tag is pattern k of its first property's regex (NONE: not one) */
    uint32_t enum_pat;   /* string from an enum (while compiling): its regex's source (NONE: other) */
    uint32_t first[8];   /* bytes a value can start with */
    uint32_t need;       /* frames a value needs at least (nesting): opened only where they fit */
} jnode;

struct rudder_js {
    jnode *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t *idx, n_idx, cap_idx;
    jprop *props;
    uint32_t n_props, cap_props;
    tnode *trie;
    uint32_t n_trie, cap_trie;
    pset *psets;
    uint32_t n_psets, cap_psets;
    uint32_t root, any;
    bool flexible, ff;
    struct js_matcher *m;   /* the automaton's working memory (rudder_jsonschema_match.c) */
};

static inline bool js_bit(const uint32_t *set, uint8_t b) { return (set[b >> 5] >> (b & 31)) & 1; }
static inline void js_set_bit(uint32_t *set, uint8_t b) { set[b >> 5] |= 1u << (b & 31); }

static inline uint32_t js_tchild(const rudder_js *js, uint32_t at, uint8_t b) {
    for (uint32_t c = js->trie[at].child; c != NONE; c = js->trie[c].sibling)
        if (js->trie[c].byte == b)
            return c;
    return NONE;
}

/* The matcher's set-up once the nodes are final (rudder_jsonschema_match.c). */
void js_matcher_init(rudder_js *js);
/* Can any string value meet the string node's length and regexes (rudder_jsonschema_match.c)? */
bool js_string_possible(const rudder_js *js, uint32_t node);
/* Bytes a value of a fresh node can start with, and its nesting need (rudder_jsonschema_compile.c). */
bool js_finish_nodes(rudder_js *js, char *err, uint32_t cap);

#endif /* RUDDER_JS_NODES_H */
