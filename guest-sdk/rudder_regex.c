/* rudder_regex.c - the regex engine of rudder_regex.h.
 *
 * Pipeline: pattern text -> syntax tree (parse) -> Thompson NFA over bytes (compile; code point
 * classes become alternatives of UTF-8 byte-range sequences, counted repetition is expanded)
 * -> DFA built lazily (a DFA state is the sorted set of the NFA's byte and match states
 * reachable by epsilon moves, hash-consed, with transitions per byte equivalence class).
 */
#include "rudder_regex.h"

/* Limits: a pattern that needs more is refused with a clear error (or, for the DFA, traps
 * with a clear message: the request fails instead of exhausting memory). */
#define RX_MAX_NFA 400000u       /* NFA states, after expanding counted repetition */
#define RX_MAX_DFA 200000u       /* DFA states */
#define RX_MAX_COUNT 10000u      /* n and m of {n,m} */
#define RX_MAX_DEPTH 200u        /* nesting of groups */

/* ------------------------------------------------------------------------------------------
 * Small helpers: a growable array and an arena whose blocks never move.
 * ------------------------------------------------------------------------------------------ */

typedef struct arena_block {
    struct arena_block *prev;
    uint32_t used, cap;
} arena_block;

static void *arena_alloc(arena_block **top, uint32_t bytes) {
    bytes = (bytes + 7u) & ~7u;
    arena_block *b = *top;
    if (!b || b->cap - b->used < bytes) {
        uint32_t cap = bytes > 16384 ? bytes : 16384;
        b = rudder_xalloc(sizeof(arena_block) + cap);
        b->prev = *top;
        b->used = 0;
        b->cap = cap;
        *top = b;
    }
    void *p = (uint8_t *)(b + 1) + b->used;
    b->used += bytes;
    return p;
}

static void arena_free(arena_block *b) {
    while (b) {
        arena_block *prev = b->prev;
        rudder_free(b);
        b = prev;
    }
}

/* ------------------------------------------------------------------------------------------
 * Syntax tree.
 * ------------------------------------------------------------------------------------------ */

enum { N_BYTES, N_CLASS, N_CAT, N_ALT, N_REP };

typedef struct rx_node {
    uint8_t kind;
    uint8_t lo, hi;           /* N_BYTES: one byte range */
    uint32_t first, next;     /* N_CAT (children in reverse order) / N_ALT / N_REP (first): children; next: sibling */
    uint32_t a, b;            /* N_CLASS: ranges [a, a+b) in the range pool; N_REP: min, max (UINT32_MAX: no max) */
} rx_node;

#define NONE 0xffffffffu

typedef struct parser {
    const uint8_t *s;
    uint32_t len, pos, depth, pattern;
    rx_node *nodes;
    uint32_t n_nodes, cap_nodes;
    uint32_t *ranges;          /* pairs of code points */
    uint32_t n_ranges, cap_ranges;
    char *err;
    uint32_t err_cap;
    bool failed;
} parser;

static void put_str(char *dst, uint32_t cap, uint32_t *at, const char *s) {
    while (*s && *at + 1 < cap)
        dst[(*at)++] = *s++;
}

static void put_uint(char *dst, uint32_t cap, uint32_t *at, uint32_t v) {
    char tmp[12];
    int n = 0;
    do
        tmp[n++] = (char)('0' + v % 10);
    while ((v /= 10));
    while (n > 0 && *at + 1 < cap)
        dst[(*at)++] = tmp[--n];
}

static uint32_t fail_at(parser *p, uint32_t pos, const char *msg) {
    if (!p->failed && p->err && p->err_cap) {
        uint32_t at = 0;
        put_str(p->err, p->err_cap, &at, "pattern ");
        put_uint(p->err, p->err_cap, &at, p->pattern);
        put_str(p->err, p->err_cap, &at, " at byte ");
        put_uint(p->err, p->err_cap, &at, pos);
        put_str(p->err, p->err_cap, &at, ": ");
        put_str(p->err, p->err_cap, &at, msg);
        p->err[at] = 0;
    }
    p->failed = true;
    return NONE;
}

static uint32_t fail(parser *p, const char *msg) { return fail_at(p, p->pos, msg); }

static uint32_t new_node(parser *p, uint8_t kind) {
    p->nodes = rudder_grow(p->nodes, &p->cap_nodes, p->n_nodes + 1, sizeof(rx_node));
    p->nodes[p->n_nodes] = (rx_node){.kind = kind, .first = NONE, .next = NONE};
    return p->n_nodes++;
}

static void add_range(parser *p, uint32_t lo, uint32_t hi) {
    p->ranges = rudder_grow(p->ranges, &p->cap_ranges, p->n_ranges + 2, sizeof(uint32_t));
    p->ranges[p->n_ranges++] = lo;
    p->ranges[p->n_ranges++] = hi;
}

/* Sort and merge n ranges (pairs) in place; returns the new number of pairs. */
static uint32_t normalize_ranges(uint32_t *r, uint32_t n) {
    for (uint32_t i = 1; i < n; i++) {   /* insertion sort: classes are small */
        uint32_t lo = r[2 * i], hi = r[2 * i + 1], j = i;
        while (j > 0 && r[2 * (j - 1)] > lo) {
            r[2 * j] = r[2 * (j - 1)];
            r[2 * j + 1] = r[2 * (j - 1) + 1];
            j--;
        }
        r[2 * j] = lo;
        r[2 * j + 1] = hi;
    }
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (m > 0 && r[2 * i] <= r[2 * (m - 1) + 1] + 1) {
            if (r[2 * i + 1] > r[2 * (m - 1) + 1])
                r[2 * (m - 1) + 1] = r[2 * i + 1];
        } else {
            r[2 * m] = r[2 * i];
            r[2 * m + 1] = r[2 * i + 1];
            m++;
        }
    }
    return m;
}

/* Decode one UTF-8 code point of the pattern; NONE (and an error) if invalid. */
static uint32_t next_cp(parser *p) {
    uint32_t len;
    uint8_t c = p->s[p->pos];
    if (c < 0x80) {
        p->pos++;
        return c;
    }
    len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (!len || p->pos + len > p->len || !rudder_utf8_valid(p->s + p->pos, len))
        return fail(p, "the pattern is not valid UTF-8");
    uint32_t cp = c & (0x7fu >> len);
    for (uint32_t i = 1; i < len; i++)
        cp = (cp << 6) | (p->s[p->pos + i] & 0x3fu);
    p->pos += len;
    return cp;
}

static int hex_value(uint8_t c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The class escapes \d \w \s (ASCII) and their complements. */
static bool class_escape(parser *p, uint8_t c) {
    switch (c | 0x20) {
    case 'd':
        add_range(p, '0', '9');
        return true;
    case 'w':
        add_range(p, '0', '9');
        add_range(p, 'A', 'Z');
        add_range(p, '_', '_');
        add_range(p, 'a', 'z');
        return true;
    case 's':
        add_range(p, '\t', '\r');
        add_range(p, ' ', ' ');
        return true;
    }
    return false;
}

/* Complement the ranges from pair `from` on, within code points (surrogates excluded). */
static void complement_ranges(parser *p, uint32_t from) {
    uint32_t n = normalize_ranges(p->ranges + 2 * from, (p->n_ranges / 2) - from);
    uint32_t *old = rudder_xalloc((n ? n : 1) * 2 * sizeof(uint32_t));
    memcpy(old, p->ranges + 2 * from, n * 2 * sizeof(uint32_t));
    p->n_ranges = 2 * from;
    uint32_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (old[2 * i] > at)
            add_range(p, at, old[2 * i] - 1);
        at = old[2 * i + 1] + 1;
    }
    if (at <= 0x10ffff)
        add_range(p, at, 0x10ffff);
    rudder_free(old);
}

/* After a backslash: a single code point (returned), or a class escape (ranges added,
 * *is_class set). Errors return NONE. */
static uint32_t escape(parser *p, bool in_class, bool *is_class) {
    *is_class = false;
    if (p->pos >= p->len)
        return fail(p, "a trailing backslash");
    uint8_t c = p->s[p->pos];
    uint32_t start = p->pos - 1;
    if (c == 'd' || c == 'w' || c == 's' || c == 'D' || c == 'W' || c == 'S') {
        p->pos++;
        uint32_t from = p->n_ranges / 2;
        class_escape(p, c);
        if (c < 'a')
            complement_ranges(p, from);
        *is_class = true;
        return 0;
    }
    p->pos++;
    switch (c) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case 'a': return '\a';
    case 'b':
        if (in_class)
            return '\b';
        return fail_at(p, start, "\\b (word boundary) is not supported");
    case '0': {   /* \0, \0o, \0oo: octal */
        uint32_t v = 0;
        for (int i = 0; i < 2 && p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '7'; i++)
            v = v * 8 + (p->s[p->pos++] - '0');
        return v;
    }
    case 'x':
    case 'u':
    case 'U': {
        int n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        uint32_t v = 0;
        for (int i = 0; i < n; i++) {
            int h = p->pos < p->len ? hex_value(p->s[p->pos]) : -1;
            if (h < 0)
                return fail_at(p, start, c == 'x' ? "\\x needs 2 hex digits" : c == 'u' ? "\\u needs 4 hex digits" : "\\U needs 8 hex digits");
            v = v * 16 + (uint32_t)h;
            p->pos++;
        }
        if (v > 0x10ffff)
            return fail_at(p, start, "a code point past U+10FFFF");
        return v;
    }
    }
    if (c >= '1' && c <= '9')
        return fail_at(p, start, "backreferences are not supported");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        return fail_at(p, start, "an unknown escape (\\b, \\B, \\A, \\Z and letters other than n t r f v a x u U d w s D W S)");
    p->pos--;
    return next_cp(p);   /* an escaped punctuation mark or any other code point: itself */
}

static uint32_t class_node(parser *p, uint32_t from) {
    uint32_t n = normalize_ranges(p->ranges + 2 * from, p->n_ranges / 2 - from);
    p->n_ranges = 2 * (from + n);
    uint32_t id = new_node(p, N_CLASS);
    p->nodes[id].a = from;
    p->nodes[id].b = n;
    return id;
}

static uint32_t parse_class(parser *p) {   /* after '[' */
    uint32_t start = p->pos - 1, from = p->n_ranges / 2;
    bool negate = false;
    if (p->pos < p->len && p->s[p->pos] == '^') {
        negate = true;
        p->pos++;
    }
    bool first = true;
    for (;;) {
        if (p->pos >= p->len)
            return fail_at(p, start, "an unterminated character class");
        if (p->s[p->pos] == ']' && !first) {
            p->pos++;
            break;
        }
        first = false;
        bool is_class = false;
        uint32_t lo;
        if (p->s[p->pos] == '\\') {
            p->pos++;
            lo = escape(p, true, &is_class);
        } else {
            lo = next_cp(p);
        }
        if (p->failed)
            return NONE;
        if (is_class)
            continue;
        uint32_t hi = lo;
        if (p->pos + 1 < p->len && p->s[p->pos] == '-' && p->s[p->pos + 1] != ']') {
            uint32_t dash = p->pos++;
            if (p->s[p->pos] == '\\') {
                p->pos++;
                hi = escape(p, true, &is_class);
                if (is_class)
                    return fail_at(p, dash, "a range ends in a class escape");
            } else {
                hi = next_cp(p);
            }
            if (p->failed)
                return NONE;
            if (hi < lo)
                return fail_at(p, dash, "a bad character range (its end is before its start)");
        }
        add_range(p, lo, hi);
    }
    if (negate)
        complement_ranges(p, from);
    return class_node(p, from);
}

static uint32_t parse_alt(parser *p);

/* {n}, {n,}, {,m}, {n,m} at p->pos (on the '{'): true and the counts if it is one; else the
 * brace is a literal, as in Python. */
static bool parse_count(parser *p, uint32_t *min, uint32_t *max) {
    uint32_t i = p->pos + 1, n = 0, m = 0;
    bool has_n = false, has_m = false, comma = false, big = false;
    while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') {
        n = n * 10 + (p->s[i++] - '0');
        big |= n > RX_MAX_COUNT;
        has_n = true;
    }
    if (i < p->len && p->s[i] == ',') {
        comma = true;
        i++;
        while (i < p->len && p->s[i] >= '0' && p->s[i] <= '9') {
            m = m * 10 + (p->s[i++] - '0');
            big |= m > RX_MAX_COUNT;
            has_m = true;
        }
    }
    if (i >= p->len || p->s[i] != '}' || (!has_n && !has_m) || (!has_n && !comma))
        return false;
    if (big) {
        fail(p, "a repetition count over 10000");
        return true;
    }
    *min = has_n ? n : 0;
    *max = !comma ? n : has_m ? m : NONE;
    if (*max < *min) {
        fail(p, "a repetition {n,m} with m < n");
        return true;
    }
    p->pos = i + 1;
    return true;
}

static uint32_t parse_atom(parser *p) {
    uint32_t start = p->pos;
    uint8_t c = p->s[p->pos];
    if (c == '(') {
        p->pos++;
        if (p->pos < p->len && p->s[p->pos] == '?') {
            p->pos++;
            uint8_t k = p->pos < p->len ? p->s[p->pos] : 0;
            if (k == ':') {
                p->pos++;
            } else if (k == 'P' && p->pos + 1 < p->len && p->s[p->pos + 1] == '<') {
                p->pos += 2;   /* (?P<name>...): the name does not matter */
                while (p->pos < p->len && p->s[p->pos] != '>')
                    p->pos++;
                if (p->pos >= p->len)
                    return fail_at(p, start, "an unterminated group name");
                p->pos++;
            } else if (k == '=' || k == '!' || k == '<') {
                return fail_at(p, start, "lookaround is not supported");
            } else {
                return fail_at(p, start, "this group syntax (?...) is not supported (only (?:...) and (?P<name>...))");
            }
        }
        if (++p->depth > RX_MAX_DEPTH)
            return fail_at(p, start, "groups nested too deeply");
        uint32_t inner = parse_alt(p);
        p->depth--;
        if (p->failed)
            return NONE;
        if (p->pos >= p->len || p->s[p->pos] != ')')
            return fail_at(p, start, "a missing ')'");
        p->pos++;
        return inner;
    }
    if (c == '[') {
        p->pos++;
        return parse_class(p);
    }
    uint32_t from = p->n_ranges / 2;
    if (c == '.') {
        p->pos++;
        add_range(p, 0, '\n' - 1);
        add_range(p, '\n' + 1, 0x10ffff);
        return class_node(p, from);
    }
    if (c == '*' || c == '+' || c == '?')
        return fail(p, "nothing to repeat");
    if (c == ')')
        return fail(p, "an unbalanced ')'");
    if (c == '^' || c == '$')
        return fail(p, "^ and $ are only supported at the very start and end of the pattern");
    if (c == '{') {
        uint32_t mn, mx;
        uint32_t save = p->pos;
        if (parse_count(p, &mn, &mx)) {
            if (p->failed)
                return NONE;
            p->pos = save;
            return fail(p, "nothing to repeat");
        }
    }
    uint32_t cp;
    if (c == '\\') {
        bool is_class;
        p->pos++;
        cp = escape(p, false, &is_class);
        if (p->failed)
            return NONE;
        if (is_class)
            return class_node(p, from);
    } else {
        cp = next_cp(p);
        if (p->failed)
            return NONE;
    }
    if (cp < 0x80) {
        uint32_t id = new_node(p, N_BYTES);
        p->nodes[id].lo = p->nodes[id].hi = (uint8_t)cp;
        return id;
    }
    add_range(p, cp, cp);
    return class_node(p, from);
}

static uint32_t parse_repeat(parser *p) {
    uint32_t atom = parse_atom(p);
    while (!p->failed && p->pos < p->len) {
        uint8_t c = p->s[p->pos];
        uint32_t mn, mx;
        if (c == '*')
            mn = 0, mx = NONE, p->pos++;
        else if (c == '+')
            mn = 1, mx = NONE, p->pos++;
        else if (c == '?')
            mn = 0, mx = 1, p->pos++;
        else if (c == '{' && parse_count(p, &mn, &mx)) {
            if (p->failed)
                return NONE;
        } else
            break;
        if (p->pos < p->len && p->s[p->pos] == '?')
            p->pos++;   /* lazy: the same set of strings */
        else if (p->pos < p->len && p->s[p->pos] == '+')
            return fail(p, "possessive quantifiers are not supported");
        if (p->pos < p->len && (p->s[p->pos] == '*' || p->s[p->pos] == '+' || p->s[p->pos] == '?'))
            return fail_at(p, p->pos, "multiple repeat");
        uint32_t id = new_node(p, N_REP);
        p->nodes[id].first = atom;
        p->nodes[id].a = mn;
        p->nodes[id].b = mx;
        atom = id;
    }
    return atom;
}

static uint32_t parse_cat(parser *p) {
    uint32_t id = new_node(p, N_CAT), last = NONE;
    while (!p->failed && p->pos < p->len && p->s[p->pos] != '|' && p->s[p->pos] != ')') {
        if (p->s[p->pos] == '$' && p->pos + 1 == p->len && p->depth == 0) {
            p->pos++;   /* an anchor at the very end: every pattern is anchored */
            break;
        }
        uint32_t child = parse_repeat(p);
        if (p->failed)
            return NONE;
        p->nodes[child].next = last;   /* reverse order: compilation goes right to left */
        last = child;
    }
    p->nodes[id].first = last;
    return id;
}

static uint32_t parse_alt(parser *p) {
    uint32_t first = parse_cat(p);
    if (p->failed || p->pos >= p->len || p->s[p->pos] != '|')
        return first;
    uint32_t id = new_node(p, N_ALT), last = first;
    p->nodes[id].first = first;
    while (!p->failed && p->pos < p->len && p->s[p->pos] == '|') {
        p->pos++;
        uint32_t child = parse_cat(p);
        if (p->failed)
            return NONE;
        p->nodes[last].next = child;
        last = child;
    }
    return id;
}

/* ------------------------------------------------------------------------------------------
 * NFA (Thompson): built backwards, each piece compiled with its continuation state known.
 * ------------------------------------------------------------------------------------------ */

enum { S_BYTE, S_SPLIT, S_MATCH, S_FAIL };

typedef struct nfa_state {
    uint8_t kind, lo, hi;
    uint32_t out, out2;        /* S_BYTE: out; S_SPLIT: out, out2 (NONE: absent); S_MATCH: out = pattern */
} nfa_state;

typedef struct state_extra {
    uint32_t *mask;
    uint32_t live[8];
    bool has_live;
} state_extra;

struct rudder_rx {
    rudder_rx_dfa dfa;         /* first: the inline rudder_rx_push reads it */
    uint32_t n_patterns, n_words;
    /* NFA */
    nfa_state *nfa;
    uint32_t n_nfa, cap_nfa;
    uint32_t *pattern_start;   /* per pattern */
    uint32_t *owner;           /* per NFA state: its pattern */
    bool too_big;
    /* DFA states */
    uint32_t n_dfa, cap_dfa, cap_next;
    uint32_t **sets;           /* per state: [len, nfa ids...] in the arena */
    uint32_t *hashes;
    uint32_t **accept, **alive;
    uint8_t *flags;
    int16_t *forced;
    struct state_extra **extra;   /* per state, built on use: its mask, the bytes that keep it alive */
    uint32_t *table;           /* hash table of state ids (NONE: empty) */
    uint32_t table_cap;
    uint32_t start_all;
    arena_block *arena;
    /* closure scratch */
    uint32_t *mark, generation, *stack, cap_stack, *buf, cap_buf;
};

#define F_ACCEPT 1u
#define F_EXTEND 2u

static uint32_t nfa_add(rudder_rx *rx, uint8_t kind, uint8_t lo, uint8_t hi, uint32_t out, uint32_t out2) {
    if (rx->n_nfa >= RX_MAX_NFA) {
        rx->too_big = true;
        return 0;
    }
    rx->nfa = rudder_grow(rx->nfa, &rx->cap_nfa, rx->n_nfa + 1, sizeof(nfa_state));
    rx->nfa[rx->n_nfa] = (nfa_state){.kind = kind, .lo = lo, .hi = hi, .out = out, .out2 = out2};
    return rx->n_nfa++;
}

static uint32_t split(rudder_rx *rx, uint32_t a, uint32_t b) {
    if (a == NONE)
        return b;
    if (b == NONE)
        return a;
    return nfa_add(rx, S_SPLIT, 0, 0, a, b);
}

/* One UTF-8 byte sequence [lo[i], hi[i]] for i < n, leading to `next`. */
static uint32_t utf8_seq(rudder_rx *rx, const uint8_t *lo, const uint8_t *hi, int n, uint32_t next) {
    for (int i = n - 1; i >= 0; i--)
        next = nfa_add(rx, S_BYTE, lo[i], hi[i], next, NONE);
    return next;
}

/* Code points lo..hi (same UTF-8 length, no surrogates) as alternatives of byte-range
 * sequences: split until every byte position but the first spans whole sub-ranges, then each
 * piece is one sequence of ranges. Returns the entry state (NONE: nothing). */
static uint32_t utf8_range(rudder_rx *rx, uint32_t lo, uint32_t hi, uint32_t next) {
    static const uint32_t limits[] = {0x7f, 0x7ff, 0xffff};
    for (int i = 0; i < 3; i++)   /* split at UTF-8 length boundaries */
        if (lo <= limits[i] && hi > limits[i])
            return split(rx, utf8_range(rx, lo, limits[i], next), utf8_range(rx, limits[i] + 1, hi, next));
    if (lo <= 0xdfff && hi >= 0xd800) {   /* surrogates have no UTF-8 form */
        uint32_t a = lo < 0xd800 ? utf8_range(rx, lo, 0xd7ff, next) : NONE;
        uint32_t b = hi > 0xdfff ? utf8_range(rx, 0xe000, hi, next) : NONE;
        return split(rx, a, b);
    }
    if (hi >= 0x80) {
        for (int i = 1; i < 4; i++) {
            uint32_t m = (1u << (6 * i)) - 1;
            if ((lo & ~m) != (hi & ~m)) {
                if ((lo & m) != 0)
                    return split(rx, utf8_range(rx, lo, lo | m, next), utf8_range(rx, (lo | m) + 1, hi, next));
                if ((hi & m) != m)
                    return split(rx, utf8_range(rx, lo, (hi & ~m) - 1, next), utf8_range(rx, hi & ~m, hi, next));
            }
        }
    }
    uint8_t a[4], b[4];
    int n = (int)rudder_utf8_encode(lo, a);
    rudder_utf8_encode(hi, b);
    return utf8_seq(rx, a, b, n, next);
}

static uint32_t compile_node(rudder_rx *rx, const parser *p, uint32_t id, uint32_t next) {
    if (rx->too_big)
        return 0;
    const rx_node *nd = &p->nodes[id];
    switch (nd->kind) {
    case N_BYTES:
        return nfa_add(rx, S_BYTE, nd->lo, nd->hi, next, NONE);
    case N_CLASS: {
        uint32_t entry = NONE;
        for (uint32_t i = 0; i < nd->b; i++)
            entry = split(rx, entry, utf8_range(rx, p->ranges[2 * (nd->a + i)], p->ranges[2 * (nd->a + i) + 1], next));
        return entry == NONE ? nfa_add(rx, S_FAIL, 0, 0, NONE, NONE) : entry;
    }
    case N_CAT:
        for (uint32_t c = nd->first; c != NONE && !rx->too_big; c = p->nodes[c].next)
            next = compile_node(rx, p, c, next);
        return next;
    case N_ALT: {
        uint32_t entry = NONE;
        for (uint32_t c = nd->first; c != NONE && !rx->too_big; c = p->nodes[c].next)
            entry = split(rx, entry, compile_node(rx, p, c, next));
        return entry;
    }
    case N_REP: {
        uint32_t mn = nd->a, mx = nd->b, sub = nd->first;
        if (mx == NONE) {   /* a loop: L = split(body -> L, next) */
            uint32_t loop = nfa_add(rx, S_SPLIT, 0, 0, NONE, next);
            uint32_t body = compile_node(rx, p, sub, loop);
            if (rx->too_big)
                return 0;
            rx->nfa[loop].out = body;
            next = loop;
        } else {   /* optional copies, nested: (x(x(x)?)?)? */
            uint32_t after = next;
            for (uint32_t i = mn; i < mx && !rx->too_big; i++)
                next = split(rx, compile_node(rx, p, sub, next), after);
        }
        for (uint32_t i = 0; i < mn && !rx->too_big; i++)
            next = compile_node(rx, p, sub, next);
        return next;
    }
    }
    return next;
}

/* States that can reach a match; the others are dropped from DFA states, so that a DFA state
 * is dead exactly when no pattern can match any more. */
static void prune_useless(rudder_rx *rx) {
    uint8_t *useful = rudder_zalloc(rx->n_nfa ? rx->n_nfa : 1);
    if (!useful)
        rudder_panic("regex: out of memory");
    bool changed = true;
    while (changed) {
        changed = false;
        for (uint32_t i = 0; i < rx->n_nfa; i++) {
            if (useful[i])
                continue;
            const nfa_state *s = &rx->nfa[i];
            bool u = s->kind == S_MATCH || (s->kind == S_BYTE && useful[s->out]) ||
                     (s->kind == S_SPLIT && ((s->out != NONE && useful[s->out]) || (s->out2 != NONE && useful[s->out2])));
            if (u)
                useful[i] = 1, changed = true;
        }
    }
    for (uint32_t i = 0; i < rx->n_nfa; i++)
        if (!useful[i])
            rx->nfa[i].kind = S_FAIL;
    rudder_free(useful);
}

/* Byte classes: bytes that no NFA transition tells apart share a class. */
static void byte_classes(rudder_rx *rx) {
    uint8_t boundary[257] = {0};
    for (uint32_t i = 0; i < rx->n_nfa; i++)
        if (rx->nfa[i].kind == S_BYTE) {
            boundary[rx->nfa[i].lo] = 1;
            boundary[rx->nfa[i].hi + 1] = 1;
        }
    uint32_t c = 0;
    for (uint32_t b = 0; b < 256; b++) {
        if (b > 0 && boundary[b])
            c++;
        rx->dfa.classes[b] = (uint8_t)c;
    }
    rx->dfa.n_classes = c + 1;
}

/* Owner pattern of each NFA state: walk from each pattern's start. */
static void owners(rudder_rx *rx) {
    rx->owner = rudder_xalloc((rx->n_nfa ? rx->n_nfa : 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i < rx->n_nfa; i++)
        rx->owner[i] = NONE;
    uint32_t *stack = rudder_xalloc((rx->n_nfa ? rx->n_nfa : 1) * sizeof(uint32_t)), n = 0;
    for (uint32_t k = 0; k < rx->n_patterns; k++) {
        uint32_t s0 = rx->pattern_start[k];
        if (rx->owner[s0] != NONE)
            continue;
        rx->owner[s0] = k;
        stack[n++] = s0;
        while (n) {
            const nfa_state *s = &rx->nfa[stack[--n]];
            uint32_t outs[2] = {s->kind == S_BYTE || s->kind == S_SPLIT ? s->out : NONE, s->kind == S_SPLIT ? s->out2 : NONE};
            for (int j = 0; j < 2; j++)
                if (outs[j] != NONE && rx->owner[outs[j]] == NONE) {
                    rx->owner[outs[j]] = k;
                    stack[n++] = outs[j];
                }
        }
    }
    rudder_free(stack);
}

/* ------------------------------------------------------------------------------------------
 * DFA: closure, hash-consing, lazy transitions.
 * ------------------------------------------------------------------------------------------ */

/* Add the epsilon closure of NFA state s: byte and match states go to buf[*n]. */
static void closure(rudder_rx *rx, uint32_t s, uint32_t *n) {
    uint32_t sp = 0;
    if (s == NONE || rx->mark[s] == rx->generation)
        return;
    rx->mark[s] = rx->generation;
    rx->stack[sp++] = s;
    while (sp) {
        uint32_t i = rx->stack[--sp];
        const nfa_state *st = &rx->nfa[i];
        if (st->kind == S_BYTE || st->kind == S_MATCH) {
            rx->buf[(*n)++] = i;
        } else if (st->kind == S_SPLIT) {
            if (st->out2 != NONE && rx->mark[st->out2] != rx->generation) {
                rx->mark[st->out2] = rx->generation;
                rx->stack[sp++] = st->out2;
            }
            if (st->out != NONE && rx->mark[st->out] != rx->generation) {
                rx->mark[st->out] = rx->generation;
                rx->stack[sp++] = st->out;
            }
        }
    }
}

static void sort_u32(uint32_t *a, uint32_t n) {   /* shell sort: sets are small, no recursion */
    static const uint32_t gaps[] = {701, 301, 132, 57, 23, 10, 4, 1};
    for (int g = 0; g < 8; g++) {
        uint32_t gap = gaps[g];
        for (uint32_t i = gap; i < n; i++) {
            uint32_t v = a[i], j = i;
            while (j >= gap && a[j - gap] > v) {
                a[j] = a[j - gap];
                j -= gap;
            }
            a[j] = v;
        }
    }
}

static uint32_t hash_set(const uint32_t *a, uint32_t n) {
    uint32_t h = 2166136261u ^ n;
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ a[i]) * 16777619u;
    return h ^ (h >> 15);
}

static void table_insert(rudder_rx *rx, uint32_t id) {
    uint32_t mask = rx->table_cap - 1, i = rx->hashes[id] & mask;
    while (rx->table[i] != NONE)
        i = (i + 1) & mask;
    rx->table[i] = id;
}

/* The DFA state for the set buf[0..n) (sorted here); RUDDER_DEAD for the empty set. */
static uint32_t intern(rudder_rx *rx, uint32_t n) {
    if (n == 0)
        return RUDDER_DEAD;
    uint32_t *set = rx->buf;
    sort_u32(set, n);
    uint32_t h = hash_set(set, n), mask = rx->table_cap - 1;
    for (uint32_t i = h & mask; rx->table[i] != NONE; i = (i + 1) & mask) {
        uint32_t id = rx->table[i];
        if (rx->hashes[id] == h && rx->sets[id][0] == n && memcmp(rx->sets[id] + 1, set, n * sizeof(uint32_t)) == 0)
            return id;
    }
    if (rx->n_dfa >= RX_MAX_DFA)
        rudder_panic("regex: the DFA grew past 200000 states (the pattern is too complex)");
    uint32_t id = rx->n_dfa++, nc = rx->dfa.n_classes, w = rx->n_words;
    if (id >= rx->cap_dfa) {
        uint32_t cap = rx->cap_dfa;
        rx->sets = rudder_grow(rx->sets, &cap, id + 1, sizeof(uint32_t *));
        cap = rx->cap_dfa;
        rx->hashes = rudder_grow(rx->hashes, &cap, id + 1, sizeof(uint32_t));
        cap = rx->cap_dfa;
        rx->accept = rudder_grow(rx->accept, &cap, id + 1, sizeof(uint32_t *));
        cap = rx->cap_dfa;
        rx->alive = rudder_grow(rx->alive, &cap, id + 1, sizeof(uint32_t *));
        cap = rx->cap_dfa;
        rx->flags = rudder_grow(rx->flags, &cap, id + 1, 1);
        cap = rx->cap_dfa;
        rx->forced = rudder_grow(rx->forced, &cap, id + 1, sizeof(int16_t));
        cap = rx->cap_dfa;
        rx->extra = rudder_grow(rx->extra, &cap, id + 1, sizeof(struct state_extra *));
        rx->cap_dfa = cap;
    }
    if ((id + 1) * nc > rx->cap_next) {
        uint32_t old = rx->cap_next;
        rx->dfa.next = rudder_grow(rx->dfa.next, &rx->cap_next, (id + 1) * nc, sizeof(uint32_t));
        for (uint32_t i = old; i < rx->cap_next; i++)
            rx->dfa.next[i] = RUDDER_RX_UNKNOWN;
    }
    uint32_t *stored = arena_alloc(&rx->arena, (n + 1 + 2 * w) * sizeof(uint32_t));
    stored[0] = n;
    memcpy(stored + 1, set, n * sizeof(uint32_t));
    uint32_t *acc = stored + 1 + n, *alv = acc + w;
    memset(acc, 0, 2 * w * sizeof(uint32_t));
    uint8_t flags = 0;
    for (uint32_t i = 0; i < n; i++) {
        const nfa_state *s = &rx->nfa[set[i]];
        uint32_t k = rx->owner[set[i]];
        if (k != NONE)
            alv[k >> 5] |= 1u << (k & 31);
        if (s->kind == S_MATCH) {
            acc[s->out >> 5] |= 1u << (s->out & 31);
            flags |= F_ACCEPT;
        } else {
            flags |= F_EXTEND;
        }
    }
    rx->sets[id] = stored;
    rx->hashes[id] = h;
    rx->accept[id] = acc;
    rx->alive[id] = alv;
    rx->flags[id] = flags;
    rx->forced[id] = -2;
    rx->extra[id] = NULL;
    if (2 * rx->n_dfa > rx->table_cap) {   /* rehash at half load */
        rudder_free(rx->table);
        rx->table_cap *= 2;
        rx->table = rudder_xalloc(rx->table_cap * sizeof(uint32_t));
        memset(rx->table, 0xff, rx->table_cap * sizeof(uint32_t));
        for (uint32_t i = 0; i < rx->n_dfa; i++)
            table_insert(rx, i);
    } else {
        table_insert(rx, id);
    }
    return id;
}

static void scratch(rudder_rx *rx, uint32_t need) {
    rx->buf = rudder_grow(rx->buf, &rx->cap_buf, need, sizeof(uint32_t));
}

uint32_t rudder_rx_push_slow(rudder_rx *rx, uint32_t state, uint8_t byte) {
    if (state == RUDDER_DEAD || state >= rx->n_dfa)
        return RUDDER_DEAD;
    uint32_t cls = rx->dfa.classes[byte];
    uint32_t *next = &rx->dfa.next[state * rx->dfa.n_classes + cls];
    if (*next != RUDDER_RX_UNKNOWN)
        return *next;
    const uint32_t *set = rx->sets[state];
    uint32_t n = 0;
    rx->generation++;
    for (uint32_t i = 1; i <= set[0]; i++) {
        const nfa_state *s = &rx->nfa[set[i]];
        if (s->kind == S_BYTE && s->lo <= byte && byte <= s->hi)
            closure(rx, s->out, &n);
    }
    uint32_t to = intern(rx, n);
    rx->dfa.next[state * rx->dfa.n_classes + cls] = to;   /* `next` may have moved */
    return to;
}

uint32_t rudder_rx_push_bytes(rudder_rx *rx, uint32_t state, const uint8_t *bytes, uint32_t len) {
    for (uint32_t i = 0; i < len && state != RUDDER_DEAD; i++)
        state = rudder_rx_push(rx, state, bytes[i]);
    return state;
}

uint32_t rudder_rx_start(rudder_rx *rx, const uint32_t *subset) {
    if (!subset && rx->start_all != NONE)
        return rx->start_all;
    uint32_t n = 0;
    rx->generation++;
    for (uint32_t k = 0; k < rx->n_patterns; k++)
        if (!subset || (subset[k >> 5] >> (k & 31)) & 1u)
            closure(rx, rx->pattern_start[k], &n);
    uint32_t s = intern(rx, n);
    if (!subset)
        rx->start_all = s;
    return s;
}

/* ------------------------------------------------------------------------------------------
 * Public API.
 * ------------------------------------------------------------------------------------------ */

rudder_rx *rudder_rx_new(const rudder_rx_pattern *patterns, uint32_t n, char *err, uint32_t err_cap) {
    if (err && err_cap)
        err[0] = 0;
    parser p = {.err = err, .err_cap = err_cap};
    if (n == 0) {
        fail_at(&p, 0, "no patterns");
        return NULL;
    }
    rudder_rx *rx = rudder_xalloc(sizeof(rudder_rx));
    memset(rx, 0, sizeof *rx);
    rx->n_patterns = n;
    rx->n_words = (n + 31) / 32;
    rx->pattern_start = rudder_xalloc(n * sizeof(uint32_t));
    rx->start_all = NONE;
    for (uint32_t k = 0; k < n && !p.failed; k++) {
        uint32_t match = nfa_add(rx, S_MATCH, 0, 0, k, NONE);
        if (patterns[k].literal) {
            const uint8_t *t = (const uint8_t *)patterns[k].text;
            uint32_t next = match;
            for (uint32_t i = patterns[k].len; i-- > 0;)
                next = nfa_add(rx, S_BYTE, t[i], t[i], next, NONE);
            rx->pattern_start[k] = next;
        } else {
            p.s = (const uint8_t *)patterns[k].text;
            p.len = patterns[k].len;
            p.pos = 0;
            p.depth = 0;
            p.pattern = k;
            p.n_nodes = 0;
            p.n_ranges = 0;
            if (p.len > 0 && p.s[0] == '^')
                p.pos = 1;   /* an anchor at the very start: every pattern is anchored */
            uint32_t root = parse_alt(&p);
            if (!p.failed && p.pos < p.len)
                fail(&p, "an unbalanced ')'");
            if (p.failed)
                break;
            rx->pattern_start[k] = compile_node(rx, &p, root, match);
        }
        if (rx->too_big) {
            fail_at(&p, 0, "the pattern is too large (counted repetition expands past 400000 NFA states)");
            break;
        }
    }
    rudder_free(p.nodes);
    rudder_free(p.ranges);
    if (p.failed) {
        rx->n_dfa = 0;
        rudder_rx_free(rx);
        return NULL;
    }
    prune_useless(rx);
    byte_classes(rx);
    owners(rx);
    rx->mark = rudder_zalloc(rx->n_nfa * sizeof(uint32_t));
    rx->stack = rudder_xalloc(rx->n_nfa * sizeof(uint32_t));
    if (!rx->mark)
        rudder_panic("regex: out of memory");
    scratch(rx, rx->n_nfa);
    rx->table_cap = 64;
    rx->table = rudder_xalloc(rx->table_cap * sizeof(uint32_t));
    memset(rx->table, 0xff, rx->table_cap * sizeof(uint32_t));
    return rx;
}

rudder_rx *rudder_rx_compile(const char *pattern, uint32_t len, char *err, uint32_t err_cap) {
    rudder_rx_pattern p = {.text = pattern, .len = len, .literal = false};
    return rudder_rx_new(&p, 1, err, err_cap);
}

void rudder_rx_free(rudder_rx *rx) {
    if (!rx)
        return;
    for (uint32_t i = 0; i < rx->n_dfa; i++)
        if (rx->extra[i])
            rudder_free(rx->extra[i]->mask), rudder_free(rx->extra[i]);
    rudder_free(rx->dfa.next);
    rudder_free(rx->nfa);
    rudder_free(rx->pattern_start);
    rudder_free(rx->owner);
    rudder_free(rx->sets);
    rudder_free(rx->hashes);
    rudder_free(rx->accept);
    rudder_free(rx->alive);
    rudder_free(rx->flags);
    rudder_free(rx->forced);
    rudder_free(rx->extra);
    rudder_free(rx->table);
    rudder_free(rx->mark);
    rudder_free(rx->stack);
    rudder_free(rx->buf);
    arena_free(rx->arena);
    rudder_free(rx);
}

uint32_t rudder_rx_n_patterns(const rudder_rx *rx) { return rx->n_patterns; }

static bool valid(const rudder_rx *rx, uint32_t state) { return state != RUDDER_DEAD && state < rx->n_dfa; }

bool rudder_rx_accepting(rudder_rx *rx, uint32_t state) {
    return valid(rx, state) && (rx->flags[state] & F_ACCEPT);
}

int32_t rudder_rx_accepted(rudder_rx *rx, uint32_t state) {
    if (!rudder_rx_accepting(rx, state))
        return -1;
    const uint32_t *acc = rx->accept[state];
    for (uint32_t w = 0; w < rx->n_words; w++)
        if (acc[w])
            return (int32_t)(w * 32 + (uint32_t)__builtin_ctz(acc[w]));
    return -1;
}

const uint32_t *rudder_rx_accept_set(rudder_rx *rx, uint32_t state) {
    return valid(rx, state) ? rx->accept[state] : NULL;
}

const uint32_t *rudder_rx_alive_set(rudder_rx *rx, uint32_t state) {
    return valid(rx, state) ? rx->alive[state] : NULL;
}

bool rudder_rx_can_extend(rudder_rx *rx, uint32_t state) {
    return valid(rx, state) && (rx->flags[state] & F_EXTEND);
}

int32_t rudder_rx_forced_byte(rudder_rx *rx, uint32_t state) {
    if (!valid(rx, state))
        return -1;
    if (rx->forced[state] != -2)
        return rx->forced[state];
    int32_t forced = -1;
    if (!(rx->flags[state] & F_ACCEPT)) {
        uint32_t live = 0;
        for (uint32_t b = 0; b < 256 && live < 2; b++)
            if (rudder_rx_push(rx, state, (uint8_t)b) != RUDDER_DEAD)
                live++, forced = (int32_t)b;
        if (live != 1)
            forced = -1;
    }
    rx->forced[state] = (int16_t)forced;
    return forced;
}

static uint32_t push_cb(void *self, uint32_t state, uint8_t byte) { return rudder_rx_push((rudder_rx *)self, state, byte); }

uint32_t rudder_rx_fill_mask(rudder_rx *rx, uint32_t state, uint32_t *mask) {
    if (!valid(rx, state))
        return 0;
    const rudder_recognizer r = {.push = push_cb, .self = rx};
    return rudder_trie_fill_mask(mask, &r, state);
}

static state_extra *extra_of(rudder_rx *rx, uint32_t state) {
    if (!rx->extra[state]) {
        rx->extra[state] = rudder_zalloc(sizeof(state_extra));
        if (!rx->extra[state])
            rudder_panic("regex: out of memory");
    }
    return rx->extra[state];
}

const uint32_t *rudder_rx_mask(rudder_rx *rx, uint32_t state) {
    if (!valid(rx, state))
        return NULL;
    if (!rx->extra[state] || !rx->extra[state]->mask) {
        uint32_t *m = rudder_mask_new();
        if (!m)
            rudder_panic("regex: out of memory");
        rudder_rx_fill_mask(rx, state, m);
        extra_of(rx, state)->mask = m;   /* after the walk: it may add states (and move rx->extra) */
    }
    return rx->extra[state]->mask;
}

const uint32_t *rudder_rx_live_bytes(rudder_rx *rx, uint32_t state) {
    if (!valid(rx, state))
        return NULL;
    if (!rx->extra[state] || !rx->extra[state]->has_live) {
        uint32_t set[8] = {0}, done[8] = {0};
        for (uint32_t b = 0; b < 256; b++) {   /* one push per byte class */
            uint8_t cls = rx->dfa.classes[b];
            if ((done[cls >> 5] >> (cls & 31)) & 1)
                continue;
            done[cls >> 5] |= 1u << (cls & 31);
            if (rudder_rx_push(rx, state, (uint8_t)b) != RUDDER_DEAD)
                for (uint32_t x = b; x < 256; x++)
                    if (rx->dfa.classes[x] == cls)
                        set[x >> 5] |= 1u << (x & 31);
        }
        state_extra *e = extra_of(rx, state);   /* after the pushes: they may add states */
        memcpy(e->live, set, sizeof set);
        e->has_live = true;
    }
    return rx->extra[state]->live;
}

/* ------------------------------------------------------------------------------------------
 * The engine for the token layer.
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    rudder_rx *rx;
    uint32_t state;
} rx_engine;

static bool e_push(void *self, const uint8_t *bytes, uint32_t n) {
    rx_engine *e = self;
    uint32_t s = rudder_rx_push_bytes(e->rx, e->state, bytes, n);
    if (s == RUDDER_DEAD)
        return false;
    e->state = s;
    return true;
}

static uint32_t e_save(void *self) { return ((rx_engine *)self)->state; }
static void e_restore(void *self, uint32_t cp) { ((rx_engine *)self)->state = cp; }
static bool e_accepting(void *self) { return rudder_rx_accepting(((rx_engine *)self)->rx, ((rx_engine *)self)->state); }

static uint32_t e_walk(void *self, uint32_t *mask, uint32_t first, uint32_t end) {
    rx_engine *e = self;
    const rudder_recognizer r = {.push = push_cb, .self = e->rx};
    return rudder_trie_fill_range(mask, &r, e->state, first, end);
}

static uint32_t e_forced(void *self, uint8_t *dst, uint32_t cap) {
    rx_engine *e = self;
    uint32_t s = e->state, n = 0;
    int32_t b;
    while (n < cap && (b = rudder_rx_forced_byte(e->rx, s)) >= 0) {
        dst[n++] = (uint8_t)b;
        s = rudder_rx_push(e->rx, s, (uint8_t)b);
    }
    return n;
}

static uint32_t e_key(void *self, uint8_t *dst, uint32_t cap) {
    if (cap >= 4)
        memcpy(dst, &((rx_engine *)self)->state, 4);
    return 4;
}

rudder_engine rudder_rx_engine(rudder_rx *rx) {
    rx_engine *e = rudder_xalloc(sizeof *e);
    e->rx = rx;
    e->state = rudder_rx_start(rx, NULL);
    return (rudder_engine){.name = "regex", .what = "the match", .self = e, .push = e_push, .save = e_save,
                           .restore = e_restore, .accepting = e_accepting, .walk = e_walk, .forced = e_forced,
                           .key = e_key};
}

uint32_t rudder_rx_escape(const char *text, uint32_t len, char *dst, uint32_t cap) {
    static const char special[] = "\\.^$|?*+()[]{}-";
    uint32_t n = 0;
    for (uint32_t i = 0; i < len; i++) {
        uint8_t c = (uint8_t)text[i];
        bool esc = false;
        for (const char *s = special; *s; s++)
            esc |= c == (uint8_t)*s;
        if (c == '\n' || c == '\t' || c == '\r' || c < 0x20 || c == 0x7f) {
            static const char hex[] = "0123456789abcdef";
            char e[4] = {'\\', 'x', hex[c >> 4], hex[c & 15]};
            for (int j = 0; j < 4; j++, n++)
                if (n < cap)
                    dst[n] = e[j];
            continue;
        }
        if (esc) {
            if (n < cap)
                dst[n] = '\\';
            n++;
        }
        if (n < cap)
            dst[n] = (char)c;
        n++;
    }
    return n;
}
