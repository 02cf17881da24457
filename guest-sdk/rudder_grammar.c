/* rudder_grammar.c - grammar text -> terminals (one rudder_rx, and a JSON Schema engine per
 * %json element) + BNF rules -> Earley parse. See rudder_grammar.h and docs/grammar.md.
 *
 * Layout of the parse: Earley sets live in one array; set i of a committed parse is the set at
 * lexeme position i, so restoring a position is truncating the arrays. While a mask is being
 * computed, lexemes that end *inside* a token are parsed tentatively: their sets are appended
 * after the committed ones (linked to their parent set), cached by (parent set, lexer state) so
 * a boundary reached from many trie nodes is parsed once, and dropped when the walk is done. */
#include "rudder_grammar.h"
#include "rudder_jsonschema.h"
#include "rudder_regex.h"

#define NONE 0xffffffffu
#define END_BIT 0x80000000u    /* syms[]: end of a rule body, | rule id */
#define NT_BIT 0x40000000u     /* while building: a nonterminal id, | nonterminal */

static void *xrealloc(void *p, size_t n) {
    void *q = rudder_realloc(p, n ? n : 1);
    if (!q)
        rudder_panic("grammar: out of memory");
    return q;
}
#define GROW(ptr, count, cap, need)                                                   \
    do {                                                                              \
        if ((need) > (cap)) {                                                         \
            (cap) = (cap) * 2 > (need) ? (cap) * 2 : (need) + 16;                     \
            (ptr) = xrealloc((ptr), (size_t)(cap) * sizeof(*(ptr)));                  \
        }                                                                             \
    } while (0)

static inline bool bit(const uint32_t *set, uint32_t i) { return (set[i >> 5] >> (i & 31)) & 1u; }
static inline void setbit(uint32_t *set, uint32_t i) { set[i >> 5] |= 1u << (i & 31); }

/* ------------------------------------------------------------------ messages */

typedef struct {
    char *buf;
    uint32_t cap, n;
} msg;

static void msg_put(msg *m, const char *s, uint32_t len) {
    for (uint32_t i = 0; i < len && m->n + 1 < m->cap; i++)
        m->buf[m->n++] = s[i];
    if (m->cap)
        m->buf[m->n] = 0;
}

static void msg_uint(msg *m, uint32_t v) {
    char d[10];
    uint32_t n = 0;
    do
        d[n++] = (char)('0' + v % 10);
    while ((v /= 10));
    while (n)
        msg_put(m, &d[--n], 1);
}

/* ------------------------------------------------------------------ grammar text -> tokens */

typedef enum {
    K_EOF, K_NAME, K_COLON, K_PIPE, K_LPAR, K_RPAR, K_LBRK, K_RBRK, K_QMARK, K_STAR, K_PLUS,
    K_BANG, K_STRING, K_REGEX, K_DIRECTIVE, K_ARROW, K_DOT, K_JSON,
} kind;

typedef struct {
    kind k;
    uint32_t off, len, line, col;
    bool bol;   /* first on its line */
} gtok;

typedef enum { N_ALT, N_SEQ, N_OPT, N_STAR, N_PLUS, N_NAME, N_LIT, N_RE, N_JSON } nkind;

typedef struct {
    nkind k;
    uint32_t first, next;   /* children (ALT, SEQ, OPT...), siblings; NONE-terminated */
    uint32_t off, len;      /* NAME / LIT / RE / JSON: the text (LIT, RE: inside the quotes / slashes) */
    uint32_t line, col;
} node;

typedef struct {
    uint32_t off, len, line, col, root;
    bool terminal;
    uint32_t id;           /* rule: nonterminal id; terminal: lexer pattern or NONE (macro only) */
    uint8_t state;         /* terminal expansion: 0 new, 1 in progress, 2 done */
    bool used;
} def;

typedef struct {
    const char *text;
    uint32_t len;
    gtok *toks;
    uint32_t n_toks, cap_toks, at;
    node *nodes;
    uint32_t n_nodes, cap_nodes;
    def *defs;
    uint32_t n_defs, cap_defs;
    uint32_t *ignores;     /* nodes after %ignore */
    uint32_t n_ignores, cap_ignores;
    msg err;
    bool failed;
    uint32_t depth;        /* nesting of groups (parse) or of terminals (expansion) */
} front;

/* Deeper nesting is refused: the recursion over it must fit the controller's stack. */
#define MAX_NESTING 64u

static bool fail_at(front *f, uint32_t line, uint32_t col, const char *what, const char *name, uint32_t name_len) {
    if (f->failed)
        return false;
    f->failed = true;
    if (line) {
        msg_uint(&f->err, line);
        msg_put(&f->err, ":", 1);
        msg_uint(&f->err, col);
        msg_put(&f->err, ": ", 2);
    }
    msg_put(&f->err, what, (uint32_t)strlen(what));
    if (name) {
        msg_put(&f->err, " '", 2);
        msg_put(&f->err, name, name_len);
        msg_put(&f->err, "'", 1);
    }
    return false;
}

static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

static bool lex_text(front *f) {
    const char *s = f->text;
    uint32_t i = 0, line = 1, line_start = 0;
    bool bol = true;
    while (true) {
        while (i < f->len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n' ||
                              (s[i] == '/' && i + 1 < f->len && s[i + 1] == '/'))) {
            if (s[i] == '/')
                while (i < f->len && s[i] != '\n')
                    i++;
            else if (s[i++] == '\n')
                line++, line_start = i, bol = true;
        }
        GROW(f->toks, f->n_toks, f->cap_toks, f->n_toks + 1);
        gtok *t = &f->toks[f->n_toks++];
        *t = (gtok){.k = K_EOF, .off = i, .line = line, .col = i - line_start + 1, .bol = bol};
        bol = false;
        if (i >= f->len)
            return true;
        char c = s[i];
        uint32_t start = i;
        if (is_name_char(c)) {   /* names, and the numbers of `name.2:` */
            while (i < f->len && is_name_char(s[i]))
                i++;
            t->k = K_NAME;
        } else if (c == '"' || c == '/') {
            i++;
            while (i < f->len && s[i] != c && s[i] != '\n')
                i += s[i] == '\\' && i + 1 < f->len ? 2 : 1;
            if (i >= f->len || s[i] != c)
                return fail_at(f, t->line, t->col, c == '"' ? "unterminated string" : "unterminated regex", 0, 0);
            i++;
            if (i < f->len && s[i] >= 'a' && s[i] <= 'z')
                return fail_at(f, line, i - line_start + 1, "flags after a string or regex are not supported", 0, 0);
            t->k = c == '"' ? K_STRING : K_REGEX;
            t->off = start + 1;
            t->len = i - start - 2;
            continue;
        } else if (c == '%') {
            i++;
            while (i < f->len && is_name_char(s[i]))
                i++;
            t->k = K_DIRECTIVE;
            if (i - start == 5 && memcmp(s + start, "%json", 5) == 0) {
                /* `%json {...}`: the schema is the balanced object that follows (JSON strings may
                 * hold braces) */
                while (i < f->len && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n'))
                    if (s[i++] == '\n')
                        line++, line_start = i;
                if (i >= f->len || s[i] != '{')
                    return fail_at(f, t->line, t->col, "expected a JSON Schema object after %json", 0, 0);
                uint32_t open = i, depth = 0;
                bool in_string = false;
                for (; i < f->len; i++) {
                    if (s[i] == '\n')
                        line++, line_start = i + 1;
                    if (in_string)
                        in_string = s[i] == '\\' ? (i++, true) : s[i] != '"';
                    else if (s[i] == '"')
                        in_string = true;
                    else if (s[i] == '{' || s[i] == '[')
                        depth++;
                    else if ((s[i] == '}' || s[i] == ']') && --depth == 0)
                        break;
                }
                if (i >= f->len)
                    return fail_at(f, t->line, t->col, "unterminated %json schema", 0, 0);
                t->k = K_JSON;
                t->off = open;
                t->len = ++i - open;
                continue;
            }
        } else if (c == '-' && i + 1 < f->len && s[i + 1] == '>') {
            i += 2;
            t->k = K_ARROW;
        } else {
            static const char punct[] = ":|()[]?*+!.";
            static const kind kinds[] = {K_COLON, K_PIPE, K_LPAR, K_RPAR, K_LBRK, K_RBRK, K_QMARK, K_STAR, K_PLUS, K_BANG, K_DOT};
            uint32_t p = 0;
            while (punct[p] && punct[p] != c)
                p++;
            if (!punct[p])
                return fail_at(f, t->line, t->col, "unexpected character", c > 0x20 && c < 0x7f ? &s[i] : 0, 1);
            t->k = kinds[p];
            i++;
        }
        t->len = i - start;
    }
}

/* ------------------------------------------------------------------ tokens -> definitions */

static gtok *peek(front *f, uint32_t ahead) {
    uint32_t i = f->at + ahead;
    return &f->toks[i < f->n_toks ? i : f->n_toks - 1];
}

/* A definition starts on a new line: `name:`, `?name:`, `!name:`, `name.2:` or a directive. */
static bool at_definition(front *f) {
    gtok *t = peek(f, 0);
    if (!t->bol)
        return false;
    if (t->k == K_DIRECTIVE)
        return true;
    uint32_t a = t->k == K_QMARK || t->k == K_BANG ? 1 : 0;
    return peek(f, a)->k == K_NAME && (peek(f, a + 1)->k == K_COLON || peek(f, a + 1)->k == K_DOT);
}

static uint32_t new_node(front *f, nkind k, gtok *t) {
    GROW(f->nodes, f->n_nodes, f->cap_nodes, f->n_nodes + 1);
    f->nodes[f->n_nodes] = (node){.k = k, .first = NONE, .next = NONE, .off = t->off, .len = t->len,
                                  .line = t->line, .col = t->col};
    return f->n_nodes++;
}

static uint32_t parse_alts(front *f);

static uint32_t parse_atom(front *f) {
    gtok *t = peek(f, 0);
    uint32_t n;
    switch (t->k) {
    case K_NAME:
        f->at++;
        return new_node(f, N_NAME, t);
    case K_STRING:
        f->at++;
        if (t->len == 0)
            return fail_at(f, t->line, t->col, "empty string literal", 0, 0), NONE;
        return new_node(f, N_LIT, t);
    case K_REGEX:
        f->at++;
        return new_node(f, N_RE, t);
    case K_JSON:
        f->at++;
        return new_node(f, N_JSON, t);
    case K_LPAR:
    case K_LBRK:
        f->at++;
        n = parse_alts(f);
        if (n == NONE)
            return NONE;
        if (peek(f, 0)->k != (t->k == K_LPAR ? K_RPAR : K_RBRK))
            return fail_at(f, peek(f, 0)->line, peek(f, 0)->col, t->k == K_LPAR ? "expected ')'" : "expected ']'", 0, 0), NONE;
        f->at++;
        if (t->k == K_LBRK) {
            uint32_t o = new_node(f, N_OPT, t);
            f->nodes[o].first = n;
            return o;
        }
        return n;
    default:
        return fail_at(f, t->line, t->col, "expected a name, a \"string\", a /regex/, %json or '('", 0, 0), NONE;
    }
}

static uint32_t parse_seq(front *f) {
    uint32_t seq = new_node(f, N_SEQ, peek(f, 0)), last = NONE;
    while (true) {
        gtok *t = peek(f, 0);
        if (t->k == K_EOF || t->k == K_PIPE || t->k == K_RPAR || t->k == K_RBRK || at_definition(f))
            break;
        if (t->k == K_ARROW) {   /* an alias names the tree node; the language is the same */
            if (peek(f, 1)->k != K_NAME)
                return fail_at(f, t->line, t->col, "expected a name after '->'", 0, 0), NONE;
            f->at += 2;
            break;
        }
        uint32_t item = parse_atom(f);
        if (item == NONE)
            return NONE;
        for (gtok *q = peek(f, 0); q->k == K_QMARK || q->k == K_STAR || q->k == K_PLUS; q = peek(f, 0)) {
            uint32_t w = new_node(f, q->k == K_QMARK ? N_OPT : q->k == K_STAR ? N_STAR : N_PLUS, q);
            f->nodes[w].first = item;
            item = w;
            f->at++;
        }
        if (last == NONE)
            f->nodes[seq].first = item;
        else
            f->nodes[last].next = item;
        last = item;
    }
    return seq;
}

static uint32_t parse_alts(front *f) {
    uint32_t alt = new_node(f, N_ALT, peek(f, 0)), last = NONE;
    if (++f->depth > MAX_NESTING)
        return fail_at(f, peek(f, 0)->line, peek(f, 0)->col, "groups nested too deeply", 0, 0), NONE;
    while (true) {
        uint32_t s = parse_seq(f);
        if (s == NONE)
            return NONE;
        if (last == NONE)
            f->nodes[alt].first = s;
        else
            f->nodes[last].next = s;
        last = s;
        if (peek(f, 0)->k != K_PIPE) {
            f->depth--;
            return alt;
        }
        f->at++;
    }
}

static bool name_is_terminal(const char *s, uint32_t len) {
    uint32_t i = 0;
    while (i < len && s[i] == '_')
        i++;
    return i < len && s[i] >= 'A' && s[i] <= 'Z';
}

static uint32_t find_def(front *f, uint32_t off, uint32_t len) {
    for (uint32_t i = 0; i < f->n_defs; i++)
        if (f->defs[i].len == len && memcmp(f->text + f->defs[i].off, f->text + off, len) == 0)
            return i;
    return NONE;
}

static bool parse_definitions(front *f) {
    while (peek(f, 0)->k != K_EOF) {
        gtok *t = peek(f, 0);
        if (!at_definition(f))
            return fail_at(f, t->line, t->col, t->bol ? "expected a definition 'name: ...'" : "unexpected text (a definition ends at the end of its line; continue alternatives with '|')", 0, 0);
        if (t->k == K_DIRECTIVE) {
            if (t->len != 7 || memcmp(f->text + t->off, "%ignore", 7) != 0)
                return fail_at(f, t->line, t->col, "unsupported directive (only %ignore is)", f->text + t->off, t->len);
            f->at++;
            uint32_t n = parse_alts(f);
            if (n == NONE)
                return false;
            GROW(f->ignores, f->n_ignores, f->cap_ignores, f->n_ignores + 1);
            f->ignores[f->n_ignores++] = n;
            continue;
        }
        if (t->k == K_QMARK || t->k == K_BANG)   /* Lark's tree-shaping prefixes: same language */
            t = peek(f, 1), f->at++;
        if (peek(f, 1)->k == K_DOT)
            return fail_at(f, t->line, t->col, "priorities are not supported", f->text + t->off, t->len);
        if (find_def(f, t->off, t->len) != NONE)
            return fail_at(f, t->line, t->col, "defined twice:", f->text + t->off, t->len);
        f->at += 2;
        uint32_t root = parse_alts(f);
        if (root == NONE)
            return false;
        GROW(f->defs, f->n_defs, f->cap_defs, f->n_defs + 1);
        f->defs[f->n_defs++] = (def){.off = t->off, .len = t->len, .line = t->line, .col = t->col, .root = root,
                                     .terminal = name_is_terminal(f->text + t->off, t->len), .id = NONE};
    }
    return true;
}

/* ------------------------------------------------------------------ terminals -> lexer patterns */

typedef struct {
    char *buf;
    uint32_t n, cap;
} sbuf;

static void sb_put(sbuf *b, const char *s, uint32_t len) {
    GROW(b->buf, b->n, b->cap, b->n + len + 1);
    memcpy(b->buf + b->n, s, len);
    b->n += len;
    b->buf[b->n] = 0;
}

static void sb_utf8(sbuf *b, uint32_t cp) {
    uint8_t u[4];
    uint32_t n = rudder_utf8_encode(cp, u);
    sb_put(b, (const char *)u, n);
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* A "string" literal's bytes: Python-like escapes (\n \t \r \\ \" \xHH \uHHHH); other
 * backslashes stay as they are. */
static void decode_literal(const char *s, uint32_t len, sbuf *out) {
    for (uint32_t i = 0; i < len; i++) {
        if (s[i] != '\\' || i + 1 >= len) {
            sb_put(out, &s[i], 1);
            continue;
        }
        char c = s[++i];
        uint32_t digits = c == 'x' ? 2 : c == 'u' ? 4 : 0, cp = 0, k;
        if (digits) {
            for (k = 0; k < digits && i + 1 + k < len && hexval(s[i + 1 + k]) >= 0; k++)
                cp = cp * 16 + (uint32_t)hexval(s[i + 1 + k]);
            if (k == digits) {
                sb_utf8(out, cp);
                i += digits;
                continue;
            }
        }
        char e = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c == '\\' ? '\\' : c == '"' ? '"' : 0;
        if (e)
            sb_put(out, &e, 1);
        else
            sb_put(out, &s[i - 1], 2);
    }
}

/* A /regex/: the text between the slashes, with \/ meaning /. */
static void regex_text(const char *s, uint32_t len, sbuf *out) {
    for (uint32_t i = 0; i < len; i++) {
        if (s[i] == '\\' && i + 1 < len && s[i + 1] == '/')
            i++;
        sb_put(out, &s[i], 1);
    }
}

typedef struct {
    sbuf text;          /* regex text, the literal's bytes, or a %json schema */
    bool literal, ignore, json;
    uint32_t def;       /* the named definition, or NONE for an inline "literal" or /regex/ */
    uint32_t line, col;
} term;

typedef struct {
    front *f;
    term *terms;
    uint32_t n_terms, cap_terms;
} terms;

static bool expand_terminal(front *f, uint32_t n, sbuf *out);

static bool expand_def(front *f, uint32_t d, sbuf *out) {
    def *df = &f->defs[d];
    if (df->state == 1)
        return fail_at(f, df->line, df->col, "terminal refers to itself:", f->text + df->off, df->len);
    if (++f->depth > 4 * MAX_NESTING)
        return fail_at(f, df->line, df->col, "terminals nested too deeply:", f->text + df->off, df->len);
    df->state = 1;
    sb_put(out, "(?:", 3);
    bool ok = expand_terminal(f, df->root, out);
    sb_put(out, ")", 1);
    f->defs[d].state = 2;
    f->depth--;
    return ok;
}

static bool expand_node(front *f, uint32_t n, sbuf *out);

/* Write a terminal's expression as one regex (its nesting counts against MAX_NESTING). */
static bool expand_terminal(front *f, uint32_t n, sbuf *out) {
    if (++f->depth > 4 * MAX_NESTING)
        return fail_at(f, f->nodes[n].line, f->nodes[n].col, "terminals nested too deeply", 0, 0);
    bool ok = expand_node(f, n, out);
    f->depth--;
    return ok;
}

static bool expand_node(front *f, uint32_t n, sbuf *out) {
    node *nd = &f->nodes[n];
    const char *q = nd->k == N_OPT ? "?" : nd->k == N_STAR ? "*" : "+";
    switch (nd->k) {
    case N_ALT:
    case N_SEQ:
        sb_put(out, "(?:", 3);
        for (uint32_t c = nd->first; c != NONE; c = f->nodes[c].next) {
            if (c != nd->first && nd->k == N_ALT)
                sb_put(out, "|", 1);
            if (!expand_terminal(f, c, out))
                return false;
        }
        sb_put(out, ")", 1);
        return true;
    case N_OPT:
    case N_STAR:
    case N_PLUS:
        sb_put(out, "(?:", 3);
        if (!expand_terminal(f, nd->first, out))
            return false;
        sb_put(out, ")", 1);
        sb_put(out, q, 1);
        return true;
    case N_LIT: {
        sbuf lit = {0};
        decode_literal(f->text + nd->off, nd->len, &lit);
        uint32_t need = rudder_rx_escape(lit.buf, lit.n, 0, 0);
        GROW(out->buf, out->n, out->cap, out->n + need + 1);
        rudder_rx_escape(lit.buf, lit.n, out->buf + out->n, need);
        out->n += need;
        out->buf[out->n] = 0;
        rudder_free(lit.buf);
        return true;
    }
    case N_RE:
        sb_put(out, "(?:", 3);
        regex_text(f->text + nd->off, nd->len, out);
        sb_put(out, ")", 1);
        return true;
    case N_JSON:
        return fail_at(f, nd->line, nd->col, "%json cannot be part of a terminal (uppercase); use it in a rule", 0, 0);
    case N_NAME: {
        uint32_t d = find_def(f, nd->off, nd->len);
        if (d == NONE)
            return fail_at(f, nd->line, nd->col, "undefined terminal", f->text + nd->off, nd->len);
        if (!f->defs[d].terminal)
            return fail_at(f, nd->line, nd->col, "a terminal cannot use the rule", f->text + nd->off, nd->len);
        f->defs[d].used = true;
        return expand_def(f, d, out);
    }
    }
    return false;
}

/* The lexer pattern of an inline item or a named terminal (deduplicated); NONE on error. */
static uint32_t term_of(terms *ts, uint32_t n, uint32_t d, bool ignore) {
    front *f = ts->f;
    node *nd = &f->nodes[n];
    term t = {.def = d, .ignore = ignore, .line = nd->line, .col = nd->col};
    /* a plain literal stays a literal (exact bytes, no escaping round trip) */
    node *lit = nd;
    while ((lit->k == N_ALT || lit->k == N_SEQ) && lit->first != NONE && f->nodes[lit->first].next == NONE)
        lit = &f->nodes[lit->first];
    if (lit->k == N_LIT) {
        t.literal = true;
        decode_literal(f->text + lit->off, lit->len, &t.text);
    } else if (d != NONE) {
        if (!expand_terminal(f, n, &t.text))
            return NONE;
    } else if (nd->k == N_RE) {
        regex_text(f->text + nd->off, nd->len, &t.text);
    } else {
        return fail_at(f, nd->line, nd->col, "expected a terminal", 0, 0), NONE;
    }
    for (uint32_t i = 0; i < ts->n_terms; i++) {
        term *o = &ts->terms[i];
        if (!o->json && o->literal == t.literal && o->text.n == t.text.n && memcmp(o->text.buf, t.text.buf, t.text.n) == 0 &&
            (d == NONE || o->def == NONE || o->def == d)) {
            o->ignore |= ignore;
            if (o->def == NONE)
                o->def = d;
            rudder_free(t.text.buf);
            return i;
        }
    }
    GROW(ts->terms, ts->n_terms, ts->cap_terms, ts->n_terms + 1);
    ts->terms[ts->n_terms] = t;
    return ts->n_terms++;
}

/* The terminal of a `%json {...}` (one per distinct schema text). */
static uint32_t json_term_of(terms *ts, uint32_t n) {
    front *f = ts->f;
    node *nd = &f->nodes[n];
    for (uint32_t i = 0; i < ts->n_terms; i++)
        if (ts->terms[i].json && ts->terms[i].text.n == nd->len && memcmp(ts->terms[i].text.buf, f->text + nd->off, nd->len) == 0)
            return i;
    GROW(ts->terms, ts->n_terms, ts->cap_terms, ts->n_terms + 1);
    term t = {.json = true, .def = NONE, .line = nd->line, .col = nd->col};
    sb_put(&t.text, f->text + nd->off, nd->len);
    ts->terms[ts->n_terms] = t;
    return ts->n_terms++;
}

/* ------------------------------------------------------------------ rules -> BNF */

typedef struct {
    terms *ts;
    uint32_t *syms;        /* bodies, each followed by END_BIT | rule */
    uint32_t n_syms, cap_syms;
    uint32_t *lhs;         /* per rule */
    uint32_t n_rules, cap_rules;
    uint32_t n_nt;
    uint32_t *nt_def;      /* per nonterminal: the definition it came from (for messages) */
    uint32_t cap_nt;
} bnf;

static uint32_t new_nt(bnf *b, uint32_t d) {
    GROW(b->nt_def, b->n_nt, b->cap_nt, b->n_nt + 1);
    b->nt_def[b->n_nt] = d;
    return b->n_nt++;
}

static void add_rule(bnf *b, uint32_t lhs, const uint32_t *body, uint32_t n) {
    GROW(b->syms, b->n_syms, b->cap_syms, b->n_syms + n + 1);
    memcpy(b->syms + b->n_syms, body, n * 4);
    b->n_syms += n;
    GROW(b->lhs, b->n_rules, b->cap_rules, b->n_rules + 1);
    b->syms[b->n_syms++] = END_BIT | b->n_rules;
    b->lhs[b->n_rules++] = lhs;
}

static bool add_alternatives(bnf *b, uint32_t lhs, uint32_t n, uint32_t d);

/* The symbol standing for one item of a sequence (NONE on error). */
static uint32_t symbol_of(bnf *b, uint32_t n, uint32_t d) {
    front *f = b->ts->f;
    node *nd = &f->nodes[n];
    uint32_t x, body[2];
    switch (nd->k) {
    case N_NAME: {
        uint32_t e = find_def(f, nd->off, nd->len);
        if (e == NONE)
            return fail_at(f, nd->line, nd->col, name_is_terminal(f->text + nd->off, nd->len) ? "undefined terminal" : "undefined rule",
                           f->text + nd->off, nd->len), NONE;
        f->defs[e].used = true;
        if (f->defs[e].terminal) {
            if (f->defs[e].id == NONE)
                f->defs[e].id = term_of(b->ts, f->defs[e].root, e, false);
            return f->defs[e].id;
        }
        return NT_BIT | f->defs[e].id;
    }
    case N_LIT:
    case N_RE:
        return term_of(b->ts, n, NONE, false);
    case N_JSON:
        return json_term_of(b->ts, n);
    case N_ALT:
    case N_SEQ:
        x = new_nt(b, d);
        return add_alternatives(b, x, n, d) ? NT_BIT | x : NONE;
    case N_OPT:
    case N_STAR:
    case N_PLUS:
        body[1] = symbol_of(b, nd->first, d);
        if (body[1] == NONE)
            return NONE;
        x = new_nt(b, d);
        body[0] = NT_BIT | x;
        if (nd->k == N_OPT) {            /* x: | item */
            add_rule(b, x, 0, 0);
            add_rule(b, x, body + 1, 1);
        } else {                         /* x: (empty or item) | x item : left recursion suits Earley */
            add_rule(b, x, body + 1, nd->k == N_PLUS ? 1 : 0);
            add_rule(b, x, body, 2);
        }
        return NT_BIT | x;
    }
    return NONE;
}

static bool add_alternatives(bnf *b, uint32_t lhs, uint32_t n, uint32_t d) {
    front *f = b->ts->f;
    if (f->nodes[n].k != N_ALT && f->nodes[n].k != N_SEQ) {
        uint32_t s = symbol_of(b, n, d);
        if (s != NONE)
            add_rule(b, lhs, &s, 1);
        return s != NONE;
    }
    for (uint32_t a = f->nodes[n].k == N_ALT ? f->nodes[n].first : n; a != NONE; a = f->nodes[a].next) {
        uint32_t len = 0, cap = 0, *body = 0;
        if (f->nodes[a].k != N_SEQ) {   /* an ALT of one non-sequence */
            uint32_t s = symbol_of(b, a, d);
            if (s == NONE)
                return false;
            add_rule(b, lhs, &s, 1);
        } else {
            for (uint32_t c = f->nodes[a].first; c != NONE; c = f->nodes[c].next) {
                uint32_t s = symbol_of(b, c, d);
                if (s == NONE) {
                    rudder_free(body);
                    return false;
                }
                GROW(body, len, cap, len + 1);
                body[len++] = s;
            }
            add_rule(b, lhs, body, len);
            rudder_free(body);
        }
        if (f->nodes[n].k == N_SEQ)
            break;
    }
    return true;
}

/* ------------------------------------------------------------------ the compiled grammar + parse */

typedef struct {
    uint32_t pos, origin;   /* pos: index into syms (the dot); origin: the lexeme position */
} item;

typedef struct {
    uint32_t item0, n_items;
    uint32_t parent;        /* the set before (NONE for set 0) */
    uint32_t pos;           /* lexeme position */
    uint32_t start;         /* lexer start state for what may come next (NONE: not computed yet) */
    bool accepts;           /* `start` is complete here, from position 0 */
} eset;

typedef struct {
    uint32_t parent, lexer, child, stamp;
} child_slot;

/* A `%json {...}` element: a terminal whose lexemes are JSON values, matched by the JSON Schema
 * engine (rudder_jsonschema.h). The lexer value JSON_LEX0 + k means "inside a value of element
 * k"; the value's position is held by the element's engine (see fresh_value). */
#define JSON_LEX0 0xf0000000u
#define MAX_JSON 4096u
static inline bool is_json(uint32_t lexer) { return lexer - JSON_LEX0 < MAX_JSON; }

typedef struct {
    uint32_t term, line, col;
    char *text;                   /* the schema (x is compiled from it on first use) */
    uint32_t len;
    rudder_engine m, x;           /* checkpoint 0 of both: the start of a value (see fresh_value) */
    bool has_x, flexible, ff;
    uint32_t epoch;               /* m began a new value this many times: older checkpoints are void */
    uint32_t *bits;               /* tw words: this terminal */
    uint32_t first[8];            /* bytes a value can begin with (never whitespace) */
    uint32_t closers[8];          /* bytes a value can end with */
    uint32_t *cands, n_cands;     /* (trie node, token) of the tokens with a closer before their last
                                   * byte, in trie order: the only ones a value can end inside */
} json_el;

struct rudder_grammar {
    rudder_rx *rx;
    uint32_t n_terms, tw, n_nt, n_rules, start_nt;
    uint32_t *ignore;       /* tw words */
    uint32_t *syms;
    uint32_t *lhs;          /* per rule */
    uint32_t *nt_rules;     /* CSR: rule body starts of nonterminal n at nt_rules[nt_off[n] .. nt_off[n+1]) */
    uint32_t *nt_off;
    uint8_t *nullable;
    /* the parse */
    eset *sets;
    uint32_t n_sets, n_real, cap_sets;
    uint32_t *expect;       /* tw words per set: terminals some item waits for */
    uint32_t cap_expect;
    item *items;
    uint32_t n_items, cap_items;
    uint32_t lexer;         /* state inside the current lexeme, RUDDER_GM_BOUNDARY, or JSON_LEX0 + k */
    uint8_t *hist;          /* the bytes pushed (a %json value's position is replayed from them) */
    uint32_t n_bytes, cap_hist;
    uint32_t json_at;       /* inside a %json value: the offset of its first byte */
    uint32_t jtop;          /* a checkpoint of the current value's engine at its position ... */
    bool jtop_ok;           /* ... when this is set */
    /* %json elements */
    json_el *json;
    uint32_t n_json;
    uint32_t *jbits;        /* tw words: the %json terminals */
    uint32_t jfirst[8];     /* bytes some %json value can begin with */
    /* scratch */
    uint32_t *hash;         /* item dedup: slot -> index into items; valid when hstamp matches */
    uint32_t *hstamp, hmask, stamp;
    uint32_t build0;        /* first item of the set being built */
    uint32_t *pred;         /* per nonterminal: stamp of the set build that predicted it */
    child_slot *children;   /* tentative lexeme cache, valid when its stamp is child_stamp */
    uint32_t cmask, child_stamp;
    uint32_t *tmp;          /* tw words */
    uint32_t *wl, *ws;      /* walk stacks: lexer state and set per depth */
    uint32_t *we;
    uint32_t max_depth;
    struct lexer_info *infos;   /* per (lexer state, restart state): see info_of */
    uint32_t n_infos, cap_infos, info_bytes;
    uint32_t *islots, imask;    /* hash of infos; NONE: free */
    bool skip_ok;               /* no terminal is both ignored and used by a rule */
};

uint32_t rudder_gm_n_terminals(const rudder_grammar *g) { return g->n_terms; }
uint32_t rudder_gm_n_rules(const rudder_grammar *g) { return g->n_rules; }

/* The trie's shape, request-independent: each node's depth (root children: 1) and the root's
 * child per byte. */
static uint8_t *g_depth;
static uint32_t g_root[256];

static void trie_tables(void) {
    if (g_depth)
        return;
    const rudder_trie *t = rudder_trie_get();
    uint32_t ends[256], depth = 0;
    g_depth = rudder_xalloc(t->n_nodes);
    g_depth[0] = 0;
    ends[0] = t->n_nodes;
    for (uint32_t i = 1; i < t->n_nodes; i++) {
        while (i >= ends[depth])
            depth--;
        g_depth[i] = (uint8_t)(depth + 1);
        if (depth == 0)
            g_root[t->nodes[2 * i] & 255] = i;
        if (t->nodes[2 * i + 1] > 1) {
            if (depth + 2 >= 256)
                rudder_panic("grammar: a token longer than 254 bytes");
            ends[++depth] = i + t->nodes[2 * i + 1];
        }
    }
}

/* Per byte a JSON value can end with, the tokens with that byte before their last one, as
 * (trie node, token) in trie order; made for the bytes of `set` not made yet, in one pass. */
static uint32_t *g_with[256], g_n_with[256], g_cap_with[256];
static bool g_with_made[256];

static void make_with(const char *set) {
    uint32_t want[8] = {0}, any = 0;
    for (const char *c = set; *c; c++)
        if (!g_with_made[(uint8_t)*c]) {
            setbit(want, (uint8_t)*c);
            g_with_made[(uint8_t)*c] = true;
            any = 1;
        }
    const rudder_trie *t = rudder_trie_get();
    for (uint32_t i = 1; any && i < t->n_nodes; i++) {
        uint32_t tok1 = t->nodes[2 * i] >> 8, n, seen[8] = {0};
        const uint8_t *b = tok1 ? rudder_token_bytes(tok1 - 1, &n) : 0;
        for (uint32_t j = 0; b && j + 1 < n; j++) {
            uint8_t c = b[j];
            if (!bit(want, c) || bit(seen, c))
                continue;
            setbit(seen, c);
            g_with[c] = rudder_grow(g_with[c], &g_cap_with[c], 2 * g_n_with[c] + 2, 4);
            g_with[c][2 * g_n_with[c]] = i;
            g_with[c][2 * g_n_with[c] + 1] = tok1 - 1;
            g_n_with[c]++;
        }
    }
}

/* The candidates of an element with these closers: the union of the lists above. */
static void closer_tokens(json_el *J) {
    char set[257];
    uint32_t k = 0;
    for (uint32_t b = 1; b < 256; b++)
        if (bit(J->closers, b))
            set[k++] = (char)b;
    set[k] = 0;
    make_with(set);
    for (const char *c = set; *c; c++) {
        uint8_t b = (uint8_t)*c;
        uint32_t nw = g_n_with[b], *w = g_with[b], na = J->n_cands, *a = J->cands, n = 0, i = 0, j = 0;
        if (!nw)
            continue;
        uint32_t *out = rudder_xalloc(8 * (size_t)(na + nw));
        while (i < na || j < nw) {   /* merge by trie node */
            const uint32_t *p;
            if (j == nw || (i < na && a[2 * i] < w[2 * j])) {
                p = &a[2 * i++];
            } else {
                i += i < na && a[2 * i] == w[2 * j];
                p = &w[2 * j++];
            }
            out[2 * n] = p[0];
            out[2 * n + 1] = p[1];
            n++;
        }
        rudder_free(a);
        J->cands = out;
        J->n_cands = n;
    }
}

void rudder_gm_init_tables(void) {
    trie_tables();
    make_with("}]\"0123456789");   /* (short lists; a literal's last letters wait for a literal) */
    rudder_js_init_tables();
}

static inline bool is_ws(uint8_t b) { return b == ' ' || b == '\n' || b == '\t' || b == '\r'; }

/* Make the dedup table twice as large, keeping the items of the set being built (and which
 * nonterminals it predicted). */
static void grow_hash(rudder_grammar *g) {
    uint32_t size = (g->hmask + 1) * 2, old = g->stamp;
    rudder_free(g->hash);
    rudder_free(g->hstamp);
    g->hash = rudder_xalloc(size * 4);
    g->hstamp = rudder_zalloc(size * 4);
    if (!g->hstamp)
        rudder_panic("grammar: out of memory");
    g->hmask = size - 1;
    g->stamp = 1;
    for (uint32_t n = 0; n < g->n_nt; n++)
        g->pred[n] = g->pred[n] == old ? 1 : 0;
    for (uint32_t j = g->build0; j < g->n_items; j++) {
        uint32_t h = (g->items[j].pos * 0x9e3779b1u ^ g->items[j].origin * 0x85ebca77u) & g->hmask;
        while (g->hstamp[h] == 1)
            h = (h + 1) & g->hmask;
        g->hash[h] = j;
        g->hstamp[h] = 1;
    }
}

static void add_item(rudder_grammar *g, uint32_t pos, uint32_t origin) {
    if ((g->n_items - g->build0 + 1) * 2 > g->hmask + 1)
        grow_hash(g);
    uint32_t h = (pos * 0x9e3779b1u ^ origin * 0x85ebca77u) & g->hmask;
    while (g->hstamp[h] == g->stamp) {
        item *it = &g->items[g->hash[h]];
        if (it->pos == pos && it->origin == origin)
            return;
        h = (h + 1) & g->hmask;
    }
    GROW(g->items, g->n_items, g->cap_items, g->n_items + 1);
    g->items[g->n_items] = (item){pos, origin};
    g->hash[h] = g->n_items++;
    g->hstamp[h] = g->stamp;
}

/* The set at lexeme position `pos`, seen from set `from` (committed sets are indexed by position). */
static uint32_t set_at(const rudder_grammar *g, uint32_t from, uint32_t pos) {
    if (pos < g->n_real)
        return pos;
    while (g->sets[from].pos != pos)
        from = g->sets[from].parent;
    return from;
}

/* Build the set after `parent` scanned one lexeme matching the terminals in `scan` (parent NONE:
 * set 0). Returns the new set, or NONE when no item could take the lexeme. */
static uint32_t build_set(rudder_grammar *g, uint32_t parent, const uint32_t *scan) {
    uint32_t si = g->n_sets, P = parent == NONE ? 0 : g->sets[parent].pos + 1, item0 = g->n_items;
    if (++g->stamp == 0) {
        memset(g->hstamp, 0, (g->hmask + 1) * 4);
        memset(g->pred, 0, g->n_nt * 4);
        g->stamp = 1;
    }
    g->build0 = item0;
    if (parent == NONE) {
        for (uint32_t r = g->nt_off[g->start_nt]; r < g->nt_off[g->start_nt + 1]; r++)
            add_item(g, g->nt_rules[r], 0);
        g->pred[g->start_nt] = g->stamp;
    } else {
        const eset *ps = &g->sets[parent];
        for (uint32_t i = ps->item0; i < ps->item0 + ps->n_items; i++) {
            uint32_t s = g->syms[g->items[i].pos];
            if (s < g->n_terms && bit(scan, s))
                add_item(g, g->items[i].pos + 1, g->items[i].origin);
        }
        if (g->n_items == item0)
            return NONE;
    }
    GROW(g->sets, g->n_sets, g->cap_sets, g->n_sets + 1);
    GROW(g->expect, g->n_sets * g->tw, g->cap_expect, (g->n_sets + 1) * g->tw);
    uint32_t *exp = g->expect + si * g->tw;
    memset(exp, 0, g->tw * 4);
    bool accepts = false;
    for (uint32_t i = item0; i < g->n_items; i++) {
        item it = g->items[i];
        uint32_t s = g->syms[it.pos];
        if (s & END_BIT) {
            uint32_t lhs = g->lhs[s & ~END_BIT];
            if (lhs == g->start_nt && it.origin == 0)
                accepts = true;
            if (it.origin == P)
                continue;   /* nullable: the predictions already stepped over it */
            const eset *os = &g->sets[set_at(g, parent, it.origin)];
            uint32_t want = g->n_terms + lhs;
            for (uint32_t j = os->item0; j < os->item0 + os->n_items; j++)
                if (g->syms[g->items[j].pos] == want)
                    add_item(g, g->items[j].pos + 1, g->items[j].origin);
        } else if (s >= g->n_terms) {
            uint32_t n = s - g->n_terms;
            if (g->pred[n] != g->stamp) {
                g->pred[n] = g->stamp;
                for (uint32_t r = g->nt_off[n]; r < g->nt_off[n + 1]; r++)
                    add_item(g, g->nt_rules[r], P);
            }
            if (g->nullable[n])
                add_item(g, it.pos + 1, it.origin);
        } else {
            setbit(exp, s);
        }
    }
    g->sets[si] = (eset){.item0 = item0, .n_items = g->n_items - item0, .parent = parent, .pos = P,
                         .start = NONE, .accepts = accepts};
    g->n_sets++;
    return si;
}

/* The lexer's start state after set `s`: the terminals it expects but %json ones, and the
 * ignored ones except before the first lexeme and when no other lexeme can follow (as
 * llguidance: skipped text is only ever *between* lexemes, the output neither begins nor ends
 * with it). RUDDER_DEAD when only %json values (or nothing) may come. */
static uint32_t set_start(rudder_grammar *g, uint32_t s) {
    if (g->sets[s].start == NONE) {
        const uint32_t *exp = g->expect + s * g->tw;
        uint32_t any = 0;
        for (uint32_t w = 0; w < g->tw; w++)
            any |= exp[w];
        for (uint32_t w = 0; w < g->tw; w++)
            g->tmp[w] = (exp[w] | (g->sets[s].pos && any ? g->ignore[w] : 0)) & ~g->jbits[w];
        g->sets[s].start = rudder_rx_start(g->rx, g->tmp);
    }
    return g->sets[s].start;
}

/* The %json element whose value begins with byte b after set s, or NONE. (At most one: where
 * a value may begin, no other lexeme begins with the same byte; see check_json.) */
static inline uint32_t json_entry(const rudder_grammar *g, uint32_t s, uint8_t b) {
    if (!bit(g->jfirst, b))
        return NONE;
    const uint32_t *exp = g->expect + s * g->tw;
    for (uint32_t k = 0; k < g->n_json; k++)
        if (bit(exp, g->json[k].term) && bit(g->json[k].first, b))
            return k;
    return NONE;
}

static bool json_expected(const rudder_grammar *g, uint32_t s) {
    const uint32_t *exp = g->expect + s * g->tw;
    for (uint32_t w = 0; w < g->tw; w++)
        if (exp[w] & g->jbits[w])
            return true;
    return false;
}

/* The lexeme in `lexer` ends after set `s`: the set after it (s itself for an ignored lexeme),
 * or NONE if it is not a complete lexeme (a %json value's caller has checked it is complete).
 * Tentative sets are cached per (s, lexer). */
static uint32_t lexeme_end(rudder_grammar *g, uint32_t s, uint32_t lexer, bool commit) {
    const uint32_t *acc;
    if (is_json(lexer))
        acc = g->json[lexer - JSON_LEX0].bits;
    else if (!rudder_rx_accepting(g->rx, lexer))
        return NONE;
    else
        acc = rudder_rx_accept_set(g->rx, lexer);
    const uint32_t *exp = g->expect + s * g->tw;
    bool scan = false, ignored = false;
    for (uint32_t w = 0; w < g->tw; w++) {
        scan |= (acc[w] & exp[w]) != 0;
        ignored |= (acc[w] & g->ignore[w]) != 0;
    }
    if (!scan)
        return ignored ? s : NONE;
    if (commit)
        return build_set(g, s, acc);
    uint32_t h = ((s * 0x9e3779b1u) ^ (lexer * 0x85ebca77u)) & g->cmask;
    for (uint32_t probe = 0; probe <= g->cmask; probe++, h = (h + 1) & g->cmask) {
        child_slot *c = &g->children[h];
        if (c->stamp != g->child_stamp) {
            uint32_t child = build_set(g, s, acc);
            c = &g->children[h];
            *c = (child_slot){s, lexer, child, g->child_stamp};
            return child;
        }
        if (c->parent == s && c->lexer == lexer)
            return c->child;
    }
    return build_set(g, s, acc);   /* the cache is full: correct, only slower */
}

/* Byte b begins a lexeme after set c: its lexer state (JSON_LEX0 + k for a %json value, whose
 * engine the caller starts), *s set to c; or RUDDER_DEAD. */
static inline uint32_t begin_lexeme(rudder_grammar *g, uint32_t *s, uint32_t c, uint8_t b) {
    uint32_t k = g->n_json ? json_entry(g, c, b) : NONE;
    if (k != NONE) {
        *s = c;
        return JSON_LEX0 + k;
    }
    uint32_t st = set_start(g, c), n = st == RUDDER_DEAD ? RUDDER_DEAD : rudder_rx_push(g->rx, st, b);
    if (n != RUDDER_DEAD)
        *s = c;
    return n;
}

/* One byte from (lexer, set *s) where lexer is a lexer state or RUDDER_GM_BOUNDARY: the next
 * lexer value (set *s moved past an ended lexeme), or RUDDER_DEAD. */
static inline uint32_t step_byte(rudder_grammar *g, uint32_t *s, uint32_t lexer, uint8_t b, bool commit) {
    if (lexer == RUDDER_GM_BOUNDARY)
        return begin_lexeme(g, s, *s, b);
    uint32_t n = rudder_rx_push(g->rx, lexer, b);
    if (n != RUDDER_DEAD)
        return n;   /* greedy: a lexeme that can go on does */
    uint32_t c = lexeme_end(g, *s, lexer, commit);
    return c == NONE ? RUDDER_DEAD : begin_lexeme(g, s, c, b);
}

static void drop_tentative(rudder_grammar *g) {
    if (g->n_sets > g->n_real) {
        g->n_sets = g->n_real;
        const eset *last = &g->sets[g->n_real - 1];
        g->n_items = last->item0 + last->n_items;
    }
    if (++g->child_stamp == 0) {
        for (uint32_t i = 0; i <= g->cmask; i++)
            g->children[i].stamp = 0;
        g->child_stamp = 1;
    }
}

static uint32_t lexer_now(rudder_grammar *g) {
    return g->lexer == RUDDER_GM_BOUNDARY ? set_start(g, g->n_real - 1) : g->lexer;
}

/* ------------------------------------------------------------------ %json values */

/* An engine at the start of a value of element k, for a value that begins inside a walk or a
 * token's check: the element's own engine when the parse is not inside one of its values (the
 * checkpoints of its earlier values become void: they are replayed if ever restored), else a
 * second engine, compiled on first use. */
static rudder_engine *fresh_value(rudder_grammar *g, uint32_t k) {
    json_el *J = &g->json[k];
    if (g->lexer != JSON_LEX0 + k) {
        J->m.restore(J->m.self, 0);
        J->epoch++;
        return &J->m;
    }
    if (!J->has_x) {
        char err[8];
        rudder_js *js = rudder_js_compile(J->text, J->len, err, sizeof err);
        if (!js)
            rudder_panic("grammar: a %json schema compiled once does not compile again");
        J->x = rudder_js_engine(js);
        J->x.save(J->x.self);
        J->has_x = true;
    }
    J->x.restore(J->x.self, 0);
    return &J->x;
}

/* The committed value's engine begins a new value. */
static void json_reset(rudder_grammar *g, json_el *J) {
    J->m.restore(J->m.self, 0);
    J->epoch++;
    g->jtop_ok = false;
}

/* A checkpoint of the current value's engine at its position (taken once per position). */
static uint32_t json_anchor(rudder_grammar *g) {
    rudder_engine *m = &g->json[g->lexer - JSON_LEX0].m;
    if (!g->jtop_ok) {
        g->jtop = m->save(m->self);
        g->jtop_ok = true;
    }
    return g->jtop;
}

/* Does byte b continue the value in e (whose position is checkpoint cp)? */
static bool json_takes(rudder_engine *e, uint32_t cp, uint8_t b) {
    if (!e->push(e->self, &b, 1))
        return false;
    e->restore(e->self, cp);
    return true;
}

/* The bytes that can extend a complete JSON value (a number's digits, fraction, exponent): all
 * others end it. (Whitespace after it is not the value's: %json values have none around them.) */
static const char EXTENDERS[] = "0123456789.eE+-";

static bool json_can_extend(rudder_engine *e, uint32_t cp) {
    for (const char *c = EXTENDERS; *c; c++)
        if (json_takes(e, cp, (uint8_t)*c))
            return true;
    return false;
}

/* Do bytes b[0..n) continue from (set s, lexer), the current %json value's position (if any)
 * being in engine x? The position moves (the caller restores it). One token's check: values
 * that begin on the way go through fresh_value. */
static bool sim_bytes(rudder_grammar *g, uint32_t s, uint32_t lexer, rudder_engine *x, const uint8_t *b, uint32_t n) {
    uint32_t i = 0;
    while (i < n) {
        if (is_json(lexer)) {
            json_el *J = &g->json[lexer - JSON_LEX0];
            if (!x->accepting(x->self)) {   /* the value cannot end before its next closing byte */
                uint32_t k = i;
                while (k < n && !bit(J->closers, b[k]))
                    k++;
                k = k < n ? k + 1 : n;
                if (!x->push(x->self, b + i, k - i))
                    return false;
                i = k;
                continue;
            }
            if (!(J->flexible && is_ws(b[i])) && x->push(x->self, b + i, 1)) {
                i++;
                continue;
            }
            uint32_t c = lexeme_end(g, s, lexer, false);   /* the value is complete: it ends */
            if (c == NONE)
                return false;
            s = c;
            lexer = RUDDER_GM_BOUNDARY;
        }
        uint32_t l = step_byte(g, &s, lexer, b[i], false);
        if (l == RUDDER_DEAD)
            return false;
        if (is_json(l)) {
            x = fresh_value(g, l - JSON_LEX0);
            x->push(x->self, b + i, 1);
        }
        lexer = l;
        i++;
    }
    return true;
}

/* The first of J's candidate tokens at trie node >= node. */
static uint32_t cands_from(const json_el *J, uint32_t node) {
    uint32_t lo = 0, hi = J->n_cands;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (J->cands[2 * mid] < node)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* A value of element k begins at trie node i, after set c: the tokens of i's subtree. Those
 * the JSON engine allows from the start of a value, but the candidates (a value may end inside
 * them: then what follows is the grammar's, not JSON whitespace) are checked one by one. */
static void json_subtree(rudder_grammar *g, uint32_t *mask, uint32_t k, uint32_t c, uint32_t i) {
    json_el *J = &g->json[k];
    uint32_t end = i + rudder_trie_get()->nodes[2 * i + 1], d = g_depth[i] - 1u;
    rudder_engine *x = fresh_value(g, k);
    x->walk(x->self, mask, i, end);
    for (uint32_t at = cands_from(J, i); at < J->n_cands && J->cands[2 * at] < end; at++) {
        uint32_t t = J->cands[2 * at + 1], len;
        const uint8_t *b = rudder_token_bytes(t, &len);
        rudder_mask_clear(mask, t);
        if (sim_bytes(g, c, RUDDER_GM_BOUNDARY, NULL, b + d, len - d))
            rudder_mask_set(mask, t);
    }
}

/* Tokens that begin a %json value after set c at their first byte (bytes in `skip` excepted:
 * the lexeme before goes on there). */
static void json_roots(rudder_grammar *g, uint32_t *mask, uint32_t c, const uint32_t *skip) {
    const uint32_t *exp = g->expect + c * g->tw;
    for (uint32_t k = 0; k < g->n_json; k++) {
        if (!bit(exp, g->json[k].term))
            continue;
        for (uint32_t b = 0; b < 256; b++)
            if (bit(g->json[k].first, b) && g_root[b] && !(skip && bit(skip, b)))
                json_subtree(g, mask, k, c, g_root[b]);
    }
}

/* ------------------------------------------------------------------ masks */

/* OR into `mask` the tokens of trie nodes [first, end) (a node's subtree follows it) whose bytes
 * continue (lexer, s), lexer a lexer state or RUDDER_GM_BOUNDARY; the walk crosses lexeme
 * boundaries by parsing tentatively, and hands the subtree where a %json value begins over to
 * json_subtree. */
static void walk_range(rudder_grammar *g, uint32_t *mask, uint32_t first, uint32_t end, uint32_t lexer, uint32_t s) {
    const uint32_t *nodes = rudder_trie_get()->nodes;
    uint32_t *ends = g->we, *lexs = g->wl, *sets = g->ws;
    uint32_t depth = 0, i = first;
    ends[0] = end;
    lexs[0] = lexer;
    sets[0] = s;
    while (i < end) {
        while (i >= ends[depth])
            depth--;
        uint32_t w0 = nodes[2 * i], size = nodes[2 * i + 1], s2 = sets[depth];
        uint32_t l = step_byte(g, &s2, lexs[depth], (uint8_t)w0, false);
        if (l == RUDDER_DEAD) {
            i += size;
            continue;
        }
        if (is_json(l)) {
            json_subtree(g, mask, l - JSON_LEX0, s2, i);
            i += size;
            continue;
        }
        uint32_t tok1 = w0 >> 8;
        if (tok1)
            mask[(tok1 - 1) >> 5] |= 1u << ((tok1 - 1) & 31);
        if (size > 1) {
            ends[++depth] = i + size;
            lexs[depth] = l;
            sets[depth] = s2;
        }
        i++;
    }
}

/* What a mask from lexer state L needs that does not depend on the parse, built on first use
 * for the pair (L, restart): restart is the start state of the current set, where the lexer
 * begins again after a lexeme of ignored terminals (the parse does not change there). Kept:
 * the tokens that stay inside this lexeme or continue after ignored ones; their first bytes;
 * the trie nodes below the root where a lexeme of real terminals ends (the node's byte cannot
 * extend the accepting state before it) as pairs (node, state), and those where an ignored one
 * ends before a byte that could begin a %json value (whether one may: the set's to say).
 * Where L itself accepts, every root child it cannot continue is such an end too (not listed:
 * fill_from). */
typedef struct lexer_info {
    uint32_t lexer, restart;
    uint32_t *mask;
    uint32_t *ends;
    uint32_t n_ends;
    uint32_t first[8];    /* bitset of bytes */
} lexer_info;

#define INFO_BUDGET (24u << 20)   /* bytes of cached masks and end lists; past it, walk directly */

/* Does `state` accept only ignored terminals (so the lexeme it ends is skipped)? */
static bool accepts_only_ignored(rudder_grammar *g, uint32_t state) {
    if (!g->skip_ok || !rudder_rx_accepting(g->rx, state))
        return false;
    const uint32_t *acc = rudder_rx_accept_set(g->rx, state);
    for (uint32_t w = 0; w < g->tw; w++)
        if (acc[w] & ~g->ignore[w])
            return false;
    return true;
}

static const lexer_info *info_of(rudder_grammar *g, uint32_t L, uint32_t restart) {
    uint32_t h = (L * 0x9e3779b1u ^ restart * 0x85ebca77u) & g->imask;
    for (; g->islots[h] != NONE; h = (h + 1) & g->imask) {
        const lexer_info *in = &g->infos[g->islots[h]];
        if (in->lexer == L && in->restart == restart)
            return in;
    }
    if (g->info_bytes > INFO_BUDGET || 2 * (g->n_infos + 1) > g->imask + 1)
        return 0;
    const rudder_trie *t = rudder_trie_get();
    const uint32_t *nodes = t->nodes;
    uint32_t *ends = g->we, *lexs = g->wl, n = t->n_nodes, depth = 0, i = 1, first[8] = {0};
    uint32_t *mask = rudder_mask_new(), *list = 0, n_list = 0, cap_list = 0;
    if (!mask)
        rudder_panic("grammar: out of memory");
    ends[0] = n;
    lexs[0] = L;
    while (i < n) {
        while (i >= ends[depth])
            depth--;
        uint32_t w0 = nodes[2 * i], size = nodes[2 * i + 1], p = lexs[depth];
        uint32_t l = rudder_rx_push(g->rx, p, (uint8_t)w0);
        bool end = false;
        if (l == RUDDER_DEAD && accepts_only_ignored(g, p)) {
            if (restart != RUDDER_DEAD)   /* skipped: the next lexeme begins */
                l = rudder_rx_push(g->rx, restart, (uint8_t)w0);
            end = l == RUDDER_DEAD && bit(g->jfirst, w0 & 255);
        } else if (l == RUDDER_DEAD && rudder_rx_accepting(g->rx, p)) {
            end = true;
        }
        if (end && depth > 0) {
            GROW(list, n_list, cap_list, n_list + 2);
            list[n_list++] = i;
            list[n_list++] = p;
        }
        if (l == RUDDER_DEAD) {
            i += size;
            continue;
        }
        if (depth == 0)
            setbit(first, w0 & 255);
        uint32_t tok1 = w0 >> 8;
        if (tok1)
            mask[(tok1 - 1) >> 5] |= 1u << ((tok1 - 1) & 31);
        if (size > 1) {
            ends[++depth] = i + size;
            lexs[depth] = l;
        }
        i++;
    }
    g->info_bytes += rudder_mask_words() * 4 + cap_list * 4 + sizeof(lexer_info);
    GROW(g->infos, g->n_infos, g->cap_infos, g->n_infos + 1);
    lexer_info *info = &g->infos[g->n_infos];
    *info = (lexer_info){L, restart, mask, list, n_list / 2, {0}};
    memcpy(info->first, first, sizeof first);
    g->islots[h] = g->n_infos++;   /* the walk added no infos: slot h is still free */
    return info;
}

/* The tokens continuing the listed ends of `info`, the lexeme before them having come after set s. */
static void fill_ends(rudder_grammar *g, uint32_t *mask, const lexer_info *info, uint32_t s) {
    const uint32_t *nodes = rudder_trie_get()->nodes;
    for (uint32_t k = 0; k < info->n_ends; k++) {
        uint32_t i = info->ends[2 * k], c = lexeme_end(g, s, info->ends[2 * k + 1], false);
        if (c != NONE)
            walk_range(g, mask, i, i + nodes[2 * i + 1], RUDDER_GM_BOUNDARY, c);
    }
}

/* OR in the tokens that continue (L, set s). */
static void fill_from(rudder_grammar *g, uint32_t *mask, uint32_t L, uint32_t s) {
    uint32_t words = rudder_mask_words(), restart = set_start(g, s);
    const lexer_info *info = info_of(g, L, restart);
    if (!info) {
        walk_range(g, mask, 1, rudder_trie_get()->n_nodes, L, s);
        return;
    }
    for (uint32_t w = 0; w < words; w++)
        mask[w] |= info->mask[w];
    fill_ends(g, mask, info, s);
    uint32_t c = lexeme_end(g, s, L, false);   /* (s itself after ignored text) */
    if (c == NONE)
        return;
    if (g->n_json)
        json_roots(g, mask, c, info->first);
    if (accepts_only_ignored(g, L))
        return;   /* the info's walk went on after this lexeme already */
    /* Tokens that end a lexeme of real terminals at their first byte: they begin the next
     * lexeme. When no first byte could do both, that is the next start state's own info. */
    uint32_t st = set_start(g, c);
    if (st == RUDDER_DEAD)
        return;
    uint32_t at = (uint32_t)(info - g->infos);
    const lexer_info *next = info_of(g, st, st);
    info = &g->infos[at];   /* info_of may have moved the array */
    bool disjoint = next != 0;
    for (uint32_t w = 0; w < 8 && disjoint; w++)
        disjoint = (info->first[w] & next->first[w]) == 0;
    if (disjoint) {
        for (uint32_t w = 0; w < words; w++)
            mask[w] |= next->mask[w];
        fill_ends(g, mask, next, c);   /* st does not accept: all its ends are listed */
        return;
    }
    const rudder_trie *t = rudder_trie_get();
    for (uint32_t i = 1; i < t->n_nodes; i += t->nodes[2 * i + 1])
        if (!bit(info->first, t->nodes[2 * i] & 255))
            walk_range(g, mask, i, i + t->nodes[2 * i + 1], st, c);
}

/* OR in the tokens that begin after set c. */
static void fill_boundary(rudder_grammar *g, uint32_t *mask, uint32_t c) {
    uint32_t st = set_start(g, c);
    if (st != RUDDER_DEAD)
        fill_from(g, mask, st, c);
    if (g->n_json)
        json_roots(g, mask, c, NULL);
}

static void clear_subtree(uint32_t *mask, uint32_t i) {
    const uint32_t *nodes = rudder_trie_get()->nodes;
    for (uint32_t end = i + nodes[2 * i + 1]; i < end; i++)
        if (nodes[2 * i] >> 8)
            rudder_mask_clear(mask, (nodes[2 * i] >> 8) - 1);
}

/* Inside a %json value: the tokens of trie nodes [first, end) that continue. Those the JSON
 * engine allows, or, where the value is complete, those that begin after it; then the
 * candidates (the value may end inside them) checked one by one. */
static void json_fill(rudder_grammar *g, uint32_t *mask, uint32_t first, uint32_t end) {
    const rudder_trie *t = rudder_trie_get();
    json_el *J = &g->json[g->lexer - JSON_LEX0];
    rudder_engine *m = &J->m;
    uint32_t s = g->n_real - 1, cp = json_anchor(g), d = g_depth[first] - 1u, c = NONE;
    uint32_t take[8] = {0}, tried[8] = {0};
    bool complete = m->accepting(m->self);
    if (complete) {
        for (const char *e = EXTENDERS; *e; e++)
            if (json_takes(m, cp, (uint8_t)*e))
                setbit(take, (uint8_t)*e);
        c = lexeme_end(g, s, g->lexer, false);
    }
    if (!complete) {
        m->walk(m->self, mask, first, end);
    } else if (first == 1 && end == t->n_nodes) {
        if (c != NONE)
            fill_boundary(g, mask, c);
        for (uint32_t b = 0; b < 256; b++)
            if (bit(take, b) && g_root[b]) {
                uint32_t r = g_root[b];
                clear_subtree(mask, r);
                m->walk(m->self, mask, r, r + t->nodes[2 * r + 1]);
            }
    } else {
        for (uint32_t i = first; i < end; i += t->nodes[2 * i + 1]) {
            uint32_t size = t->nodes[2 * i + 1];
            if (bit(take, t->nodes[2 * i] & 255))
                m->walk(m->self, mask, i, i + size);
            else if (c != NONE)
                walk_range(g, mask, i, i + size, RUDDER_GM_BOUNDARY, c);
        }
    }
    for (uint32_t at = cands_from(J, first); at < J->n_cands && J->cands[2 * at] < end; at++) {
        uint32_t tok = J->cands[2 * at + 1], len;
        const uint8_t *b = rudder_token_bytes(tok, &len);
        uint8_t b0 = b[d];
        if (!complete && !bit(tried, b0)) {   /* (what the value cannot take, nothing allowed) */
            setbit(tried, b0);
            if (json_takes(m, cp, b0))
                setbit(take, b0);
        }
        if (!bit(take, b0))
            continue;   /* the walks above were exact there */
        rudder_mask_clear(mask, tok);
        if (sim_bytes(g, s, g->lexer, m, b + d, len - d))
            rudder_mask_set(mask, tok);
        m->restore(m->self, cp);
    }
}

uint32_t rudder_gm_fill_mask(rudder_grammar *g, uint32_t *mask) {
    drop_tentative(g);
    uint32_t words = rudder_mask_words(), count = 0;
    if (is_json(g->lexer)) {
        json_fill(g, mask, 1, rudder_trie_get()->n_nodes);
    } else {
        uint32_t L = lexer_now(g), s = g->n_real - 1;
        if (L != RUDDER_DEAD)
            fill_from(g, mask, L, s);
        if (g->lexer == RUDDER_GM_BOUNDARY && g->n_json)
            json_roots(g, mask, s, NULL);
    }
    drop_tentative(g);
    for (uint32_t w = 0; w < words; w++)
        count += (uint32_t)__builtin_popcount(mask[w]);
    return count;
}

/* ------------------------------------------------------------------ public: the parse */

rudder_gm_pos rudder_gm_save(rudder_grammar *g) {
    rudder_gm_pos p = {g->lexer, g->n_real, g->n_bytes, 0, NONE, 0};
    if (is_json(g->lexer)) {
        p.json_at = g->json_at;
        p.json_cp = json_anchor(g);
        p.json_epoch = g->json[g->lexer - JSON_LEX0].epoch;
    }
    return p;
}

void rudder_gm_restore(rudder_grammar *g, rudder_gm_pos pos) {
    drop_tentative(g);
    if (pos.n_sets == 0 || pos.n_sets > g->n_real || pos.n_bytes > g->n_bytes)
        rudder_panic("rudder_gm_restore: not a position of this parse");
    g->n_real = g->n_sets = pos.n_sets;
    const eset *last = &g->sets[pos.n_sets - 1];
    g->n_items = last->item0 + last->n_items;
    g->lexer = pos.lexer;
    g->n_bytes = pos.n_bytes;
    g->jtop_ok = false;
    if (is_json(pos.lexer)) {
        json_el *J = &g->json[pos.lexer - JSON_LEX0];
        g->json_at = pos.json_at;
        if (pos.json_epoch == J->epoch) {
            J->m.restore(J->m.self, pos.json_cp);
            g->jtop = pos.json_cp;
            g->jtop_ok = true;
        } else {   /* the engine has begun another value since: replay this one */
            json_reset(g, J);
            if (!J->m.push(J->m.self, g->hist + pos.json_at, pos.n_bytes - pos.json_at))
                rudder_panic("rudder_gm_restore: a %json value does not replay");
        }
    }
}

bool rudder_gm_push(rudder_grammar *g, const uint8_t *bytes, uint32_t len) {
    if (!len)
        return true;
    drop_tentative(g);
    rudder_gm_pos before = rudder_gm_save(g);
    uint32_t s = g->n_real - 1, lex = g->lexer, at = g->n_bytes, i = 0;
    g->hist = rudder_grow(g->hist, &g->cap_hist, at + len, 1);
    memcpy(g->hist + at, bytes, len);
    while (i < len) {
        if (is_json(lex)) {
            json_el *J = &g->json[lex - JSON_LEX0];
            rudder_engine *m = &J->m;
            if (!m->accepting(m->self)) {   /* the value cannot end before its next closing byte */
                uint32_t k = i;
                while (k < len && !bit(J->closers, bytes[k]))
                    k++;
                k = k < len ? k + 1 : len;
                if (!m->push(m->self, bytes + i, k - i))
                    goto fail;
                g->jtop_ok = false;
                i = k;
                continue;
            }
            if (!(J->flexible && is_ws(bytes[i])) && m->push(m->self, bytes + i, 1)) {
                g->jtop_ok = false;
                i++;
                continue;
            }
            uint32_t c = lexeme_end(g, s, lex, true);   /* the value is complete: it ends */
            g->n_real = g->n_sets;
            if (c == NONE)
                goto fail;
            s = c;
            lex = RUDDER_GM_BOUNDARY;
        }
        uint32_t l = step_byte(g, &s, lex, bytes[i], true);
        g->n_real = g->n_sets;   /* sets built while committing are real */
        if (l == RUDDER_DEAD)
            goto fail;
        if (is_json(l)) {
            json_el *J = &g->json[l - JSON_LEX0];
            json_reset(g, J);
            J->m.push(J->m.self, bytes + i, 1);
            g->json_at = at + i;
        }
        lex = l;
        i++;
    }
    g->lexer = lex;
    g->n_bytes = at + len;
    return true;
fail:
    rudder_gm_restore(g, before);
    return false;
}

static bool accepting_at(rudder_grammar *g, uint32_t s, uint32_t lexer) {
    if (lexer == RUDDER_GM_BOUNDARY)
        return g->sets[s].accepts;
    if (is_json(lexer)) {
        rudder_engine *m = &g->json[lexer - JSON_LEX0].m;
        if (!m->accepting(m->self))
            return false;
    }
    uint32_t c = lexeme_end(g, s, lexer, false);
    return c != NONE && g->sets[c].accepts;
}

bool rudder_gm_accepting(rudder_grammar *g) {
    bool ok = accepting_at(g, g->n_real - 1, g->lexer);
    drop_tentative(g);
    return ok;
}

/* The only byte that continues (lexer, s), lexer a lexer state or RUDDER_GM_BOUNDARY, or -1
 * (also when it begins a %json value without fast-forward). */
static int32_t only_byte(rudder_grammar *g, uint32_t s, uint32_t lexer) {
    if (lexer != RUDDER_GM_BOUNDARY && !rudder_rx_accepting(g->rx, lexer))
        return rudder_rx_forced_byte(g->rx, lexer);
    if (lexer == RUDDER_GM_BOUNDARY && !json_expected(g, s)) {
        uint32_t st = set_start(g, s);
        return st == RUDDER_DEAD ? -1 : rudder_rx_forced_byte(g->rx, st);
    }
    int32_t found = -1;
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t s2 = s, l = step_byte(g, &s2, lexer, (uint8_t)b, false);
        if (l != RUDDER_DEAD) {
            if (found >= 0 || (is_json(l) && !g->json[l - JSON_LEX0].ff))
                return -1;
            found = (int32_t)b;
        }
    }
    return found;
}

bool rudder_gm_can_continue(rudder_grammar *g) {
    drop_tentative(g);
    uint32_t s = g->n_real - 1, lex = g->lexer;
    bool any = false;
    if (is_json(lex)) {
        rudder_engine *m = &g->json[lex - JSON_LEX0].m;
        any = !m->accepting(m->self) || json_can_extend(m, json_anchor(g));
        s = any ? s : lexeme_end(g, s, lex, false);
        lex = RUDDER_GM_BOUNDARY;
    }
    for (uint32_t b = 0; b < 256 && !any && s != NONE; b++) {
        uint32_t s2 = s;
        any = step_byte(g, &s2, lex, (uint8_t)b, false) != RUDDER_DEAD;
    }
    drop_tentative(g);
    return any;
}

uint32_t rudder_gm_forced(rudder_grammar *g, uint8_t *dst, uint32_t cap) {
    drop_tentative(g);
    rudder_gm_pos start = rudder_gm_save(g);
    uint32_t n = 0;
    while (n < cap) {   /* forced bytes are pushed, then the parse goes back */
        uint32_t s = g->n_real - 1;
        if (accepting_at(g, s, g->lexer))
            break;
        int32_t b;
        if (is_json(g->lexer)) {
            json_el *J = &g->json[g->lexer - JSON_LEX0];
            rudder_engine *m = &J->m;
            if (!J->ff)
                break;
            if (!m->accepting(m->self)) {
                uint32_t k = m->forced(m->self, dst + n, cap - n);
                if (!k || !rudder_gm_push(g, dst + n, k))
                    break;
                n += k;
                continue;
            }
            if (json_can_extend(m, json_anchor(g)))
                break;
            uint32_t c = lexeme_end(g, s, g->lexer, false);
            b = c == NONE ? -1 : only_byte(g, c, RUDDER_GM_BOUNDARY);
        } else {
            b = only_byte(g, s, g->lexer);
        }
        drop_tentative(g);
        if (b < 0)
            break;
        dst[n] = (uint8_t)b;
        if (!rudder_gm_push(g, dst + n, 1))
            break;
        n++;
    }
    rudder_gm_restore(g, start);
    return n;
}

/* ------------------------------------------------------------------ the engine for the token layer */

typedef struct {
    rudder_grammar *g;
    rudder_gm_pos *pos;   /* checkpoints */
    uint32_t n, cap;
} gm_engine;

static bool e_push(void *self, const uint8_t *bytes, uint32_t n) { return rudder_gm_push(((gm_engine *)self)->g, bytes, n); }

static uint32_t e_save(void *self) {
    gm_engine *e = self;
    e->pos = rudder_grow(e->pos, &e->cap, e->n + 1, sizeof *e->pos);
    e->pos[e->n] = rudder_gm_save(e->g);
    return e->n++;
}

static void e_restore(void *self, uint32_t cp) {
    gm_engine *e = self;
    rudder_gm_restore(e->g, e->pos[cp]);
    e->n = cp + 1;
}

static bool e_accepting(void *self) { return rudder_gm_accepting(((gm_engine *)self)->g); }

static uint32_t e_walk(void *self, uint32_t *mask, uint32_t first, uint32_t end) {
    rudder_grammar *g = ((gm_engine *)self)->g;
    if (first == 1 && end == rudder_trie_get()->n_nodes)
        return rudder_gm_fill_mask(g, mask);
    drop_tentative(g);
    if (is_json(g->lexer))
        json_fill(g, mask, first, end);
    else
        walk_range(g, mask, first, end, g->lexer, g->n_real - 1);
    drop_tentative(g);
    return rudder_mask_count(mask);
}

static uint32_t e_forced(void *self, uint8_t *dst, uint32_t cap) { return rudder_gm_forced(((gm_engine *)self)->g, dst, cap); }

static uint32_t e_key(void *self, uint8_t *dst, uint32_t cap) {
    (void)self, (void)dst, (void)cap;
    return 0;
}

rudder_engine rudder_gm_engine(rudder_grammar *g) {
    gm_engine *e = rudder_zalloc(sizeof *e);
    if (!e)
        rudder_panic("grammar: out of memory");
    e->g = g;
    return (rudder_engine){.name = "grammar", .what = "a sentence of the grammar", .self = e, .push = e_push,
                           .save = e_save, .restore = e_restore, .accepting = e_accepting, .walk = e_walk,
                           .forced = e_forced, .key = e_key};
}
/* ------------------------------------------------------------------ compile */

void rudder_gm_free(rudder_grammar *g) {
    if (!g)
        return;
    rudder_rx_free(g->rx);
    rudder_free(g->islots);
    for (uint32_t i = 0; i < g->n_infos; i++) {
        rudder_free(g->infos[i].mask);
        rudder_free(g->infos[i].ends);
    }
    rudder_free(g->infos);
    for (uint32_t k = 0; k < g->n_json; k++) {   /* (the JSON engines have no free: they go with the instance) */
        rudder_free(g->json[k].text);
        rudder_free(g->json[k].bits);
        rudder_free(g->json[k].cands);
    }
    void *blocks[] = {g->ignore, g->syms, g->lhs, g->nt_rules, g->nt_off, g->nullable, g->sets, g->expect,
                      g->items, g->hash, g->hstamp, g->pred, g->children, g->tmp, g->wl, g->ws, g->we,
                      g->json, g->jbits, g->hist};
    for (uint32_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
        rudder_free(blocks[i]);
    rudder_free(g);
}

static void free_front(front *f, terms *ts, bnf *b) {
    for (uint32_t i = 0; i < ts->n_terms; i++)
        rudder_free(ts->terms[i].text.buf);
    rudder_free(ts->terms);
    rudder_free(f->toks);
    rudder_free(f->nodes);
    rudder_free(f->defs);
    rudder_free(f->ignores);
    rudder_free(b->syms);
    rudder_free(b->lhs);
    rudder_free(b->nt_def);
}

/* Every rule reachable from start, every terminal used, every rule able to finish. */
static bool check_rules(front *f, bnf *b, uint8_t *nullable) {
    uint32_t n_nt = b->n_nt;
    uint8_t *done = rudder_zalloc(n_nt + 1), *reach = rudder_zalloc(n_nt + 1);
    bool changed = true, ok = true;
    /* nullable and productive: fixpoints over the rules */
    for (int pass = 0; pass < 2; pass++) {
        uint8_t *flag = pass == 0 ? nullable : done;
        changed = true;
        while (changed) {
            changed = false;
            for (uint32_t r = 0, at = 0; r < b->n_rules; r++) {
                bool all = true;
                for (; !(b->syms[at] & END_BIT); at++) {
                    uint32_t s = b->syms[at];
                    if (s >= b->ts->n_terms ? !flag[s - b->ts->n_terms] : pass == 0)
                        all = false;
                }
                at++;
                if (all && !flag[b->lhs[r]])
                    flag[b->lhs[r]] = 1, changed = true;
            }
        }
    }
    /* reachable from start (nonterminal 0) */
    reach[0] = 1;
    changed = true;
    while (changed) {
        changed = false;
        for (uint32_t r = 0, at = 0; r < b->n_rules; r++, at++)
            for (; !(b->syms[at] & END_BIT); at++)
                if (reach[b->lhs[r]] && b->syms[at] >= b->ts->n_terms && !reach[b->syms[at] - b->ts->n_terms])
                    reach[b->syms[at] - b->ts->n_terms] = 1, changed = true;
    }
    for (uint32_t d = 0; d < f->n_defs && ok; d++) {
        def *df = &f->defs[d];
        if (df->terminal ? !df->used : !reach[df->id])
            ok = fail_at(f, df->line, df->col, df->terminal ? "terminal is never used:" : "rule is not reachable from start:",
                         f->text + df->off, df->len);
        else if (!df->terminal && !done[df->id])
            ok = fail_at(f, df->line, df->col, "rule can never finish (every alternative recurses forever):",
                         f->text + df->off, df->len);
    }
    rudder_free(done);
    rudder_free(reach);
    return ok;
}

/* Compile each %json element's schema and find what its values may begin and end with, and the
 * tokens inside which a value may end. */
static bool setup_json(front *f, terms *ts, rudder_grammar *g) {
    trie_tables();
    g->json = rudder_zalloc(g->n_json * sizeof(json_el) + 1);
    for (uint32_t i = 0, k = 0; i < ts->n_terms; i++) {
        term *tm = &ts->terms[i];
        if (!tm->json)
            continue;
        json_el *J = &g->json[k];
        char jerr[400];
        rudder_js *js = rudder_js_compile(tm->text.buf, tm->text.n, jerr, sizeof jerr);
        if (!js) {
            fail_at(f, tm->line, tm->col, "%json:", 0, 0);
            msg_put(&f->err, " ", 1);
            msg_put(&f->err, jerr, (uint32_t)strlen(jerr));
            return false;
        }
        *J = (json_el){.term = i, .line = tm->line, .col = tm->col, .m = rudder_js_engine(js), .ff = rudder_js_ff(js)};
        J->text = rudder_xalloc(tm->text.n);
        memcpy(J->text, tm->text.buf, tm->text.n);
        J->len = tm->text.n;
        J->bits = rudder_zalloc(g->tw * 4);
        setbit(J->bits, i);
        setbit(g->jbits, i);
        J->m.save(J->m.self);   /* checkpoint 0: the start of a value */
        J->flexible = json_takes(&J->m, 0, ' ');
        for (const char *c = "{[\"-0123456789tfn"; *c; c++)   /* how JSON values begin */
            if (json_takes(&J->m, 0, (uint8_t)*c))
                setbit(J->first, (uint8_t)*c);
        /* a JSON value ends with the byte that goes with how it begins (a number: a digit) */
        static const char *const ends[] = {"{}", "[]", "\"\"", "te", "fe", "nl"};
        for (uint32_t e = 0; e < 6; e++)
            if (bit(J->first, (uint8_t)ends[e][0]))
                setbit(J->closers, (uint8_t)ends[e][1]);
        for (const char *c = "-0123456789"; *c; c++)
            if (bit(J->first, (uint8_t)*c))
                for (uint32_t d = '0'; d <= '9'; d++)
                    setbit(J->closers, d);
        for (uint32_t w = 0; w < 8; w++)
            g->jfirst[w] |= J->first[w];
        closer_tokens(J);
        k++;
    }
    return true;
}

/* How a terminal reads in a message. */
static void say_term(front *f, terms *ts, uint32_t i) {
    term *t = &ts->terms[i];
    if (t->def != NONE) {
        msg_put(&f->err, "terminal ", 9);
        msg_put(&f->err, f->text + f->defs[t->def].off, f->defs[t->def].len);
    } else if (t->json) {
        msg_put(&f->err, "the %json at ", 13);
        msg_uint(&f->err, t->line);
        msg_put(&f->err, ":", 1);
        msg_uint(&f->err, t->col);
    } else {
        msg_put(&f->err, t->literal ? "\"" : "/", 1);
        msg_put(&f->err, t->text.buf, t->text.n < 40 ? t->text.n : 40);
        msg_put(&f->err, t->literal ? "\"" : "/", 1);
    }
}

/* The first other terminal of `group` that can begin with a byte %json terminal j can, or NONE. */
static uint32_t competitor(const rudder_grammar *g, const uint32_t *group, const uint32_t *bytes, uint32_t j) {
    for (uint32_t o = 0; o < g->n_terms; o++)
        if (o != j && bit(group, o))
            for (uint32_t w = 0; w < 8; w++)
                if (bytes[8 * j + w] & bytes[8 * o + w])
                    return o;
    return NONE;
}

/* May terminals x and y match the same text? (Two regexes might; a literal only what it is.) */
static bool may_share(rudder_grammar *g, terms *ts, uint32_t x, uint32_t y) {
    term *a = &ts->terms[x], *b = &ts->terms[y];
    if (x == y)
        return true;
    if (a->json || b->json)
        return false;   /* (a %json value never competes: check_json) */
    if (a->literal && b->literal)
        return a->text.n == b->text.n && memcmp(a->text.buf, b->text.buf, a->text.n) == 0;
    if (!a->literal && !b->literal)
        return true;
    term *lit = a->literal ? a : b;
    memset(g->tmp, 0, g->tw * 4);
    setbit(g->tmp, a->literal ? y : x);
    uint32_t st = rudder_rx_push_bytes(g->rx, rudder_rx_start(g->rx, g->tmp), (const uint8_t *)lit->text.buf, lit->text.n);
    return st != RUDDER_DEAD && rudder_rx_accepting(g->rx, st);
}

/* Where a %json value may begin, no other lexeme may begin with the same byte: the first byte
 * tells them apart, so the lexer never runs a JSON value beside other readings. Which terminals
 * may be expected at one boundary is over-approximated with FIRST and FOLLOW sets: those that
 * may come first, and those that may come next after a terminal (or after either of two
 * terminals that may match the same text); ignored terminals may come at any boundary but the
 * first. Refused at compile time, naming both. */
static bool check_json(front *f, terms *ts, rudder_grammar *g) {
    uint32_t T = g->n_terms, tw = g->tw, N = g->n_nt;
    uint32_t *fst = rudder_zalloc((size_t)N * tw * 4 + 4), *fol = rudder_zalloc((size_t)N * tw * 4 + 4);
    uint32_t *next = rudder_zalloc((size_t)T * tw * 4), *bytes = rudder_zalloc((size_t)T * 32);
    uint32_t *acc = rudder_xalloc(tw * 4), *group = rudder_xalloc(tw * 4);
    for (uint32_t i = 0; i < T; i++) {   /* the bytes each terminal can begin with */
        memset(g->tmp, 0, tw * 4);
        setbit(g->tmp, i);
        memcpy(bytes + 8 * i, rudder_rx_live_bytes(g->rx, rudder_rx_start(g->rx, g->tmp)), 32);
    }
    for (uint32_t k = 0; k < g->n_json; k++)
        memcpy(bytes + 8 * g->json[k].term, g->json[k].first, 32);
    for (bool changed = true; changed;) {   /* FIRST of each nonterminal */
        changed = false;
        for (uint32_t r = 0, at = 0; r < g->n_rules; r++, at++) {
            uint32_t *to = fst + g->lhs[r] * tw;
            for (bool more = true; !(g->syms[at] & END_BIT); at++) {
                uint32_t x = g->syms[at];
                if (!more)
                    continue;
                if (x < T) {
                    changed |= !bit(to, x);
                    setbit(to, x);
                    more = false;
                    continue;
                }
                for (uint32_t w = 0; w < tw; w++) {
                    changed |= (fst[(x - T) * tw + w] & ~to[w]) != 0;
                    to[w] |= fst[(x - T) * tw + w];
                }
                more = g->nullable[x - T];
            }
        }
    }
    for (bool changed = true; changed;) {   /* FOLLOW of nonterminals, NEXT of terminals */
        changed = false;
        for (uint32_t r = 0, at = 0; r < g->n_rules; r++) {
            uint32_t end = at;
            while (!(g->syms[end] & END_BIT))
                end++;
            memcpy(acc, fol + g->lhs[r] * tw, tw * 4);   /* what may come after the rest of the body */
            for (uint32_t p = end; p-- > at;) {
                uint32_t x = g->syms[p], *to = x < T ? next + x * tw : fol + (x - T) * tw;
                for (uint32_t w = 0; w < tw; w++) {
                    changed |= (acc[w] & ~to[w]) != 0;
                    to[w] |= acc[w];
                }
                if (x < T) {
                    memset(acc, 0, tw * 4);
                    setbit(acc, x);
                } else {
                    for (uint32_t w = 0; w < tw; w++)
                        acc[w] = fst[(x - T) * tw + w] | (g->nullable[x - T] ? acc[w] : 0);
                }
            }
            at = end + 1;
        }
    }
    /* the groups: FIRST(start), then NEXT(x) | NEXT(y) | ignored for x, y that may share a text */
    uint32_t j = NONE, o = NONE;
    for (uint32_t x = 0; x <= T && o == NONE; x++)
        for (uint32_t y = x == T ? 0 : x; y < T && o == NONE; y++) {
            bool any = false;
            for (uint32_t w = 0; w < tw; w++) {
                group[w] = x == T ? fst[g->start_nt * tw + w] : next[x * tw + w] | next[y * tw + w] | g->ignore[w];
                any |= (group[w] & g->jbits[w]) != 0;
            }
            if (!any || (x < T && !may_share(g, ts, x, y)))
                continue;
            for (uint32_t k = 0; k < g->n_json && o == NONE; k++)
                if (bit(group, g->json[k].term))
                    o = competitor(g, group, bytes, j = g->json[k].term);
            if (x == T)
                break;
        }
    if (o != NONE) {
        uint32_t c = 0;
        while (!((bytes[8 * j + c / 32] & bytes[8 * o + c / 32]) >> (c % 32) & 1))
            c++;
        fail_at(f, ts->terms[j].line, ts->terms[j].col, "%json may begin where", 0, 0);
        msg_put(&f->err, " ", 1);
        say_term(f, ts, o);
        msg_put(&f->err, " may too, and both can begin with ", 34);
        if (c > 0x20 && c < 0x7f) {
            char ch = (char)c;
            msg_put(&f->err, "'", 1);
            msg_put(&f->err, &ch, 1);
            msg_put(&f->err, "'", 1);
        } else {
            msg_put(&f->err, "byte ", 5);
            msg_uint(&f->err, c);
        }
        msg_put(&f->err, " (the first byte must tell them apart)", 38);
    }
    void *blocks[] = {fst, fol, next, bytes, acc, group};
    for (uint32_t i = 0; i < 6; i++)
        rudder_free(blocks[i]);
    return o == NONE;
}

rudder_grammar *rudder_gm_new(const char *text, uint32_t len, char *err, uint32_t err_cap) {
    front f = {.text = text, .len = len, .err = {err, err_cap, 0}};
    terms ts = {.f = &f};
    bnf b = {.ts = &ts};
    rudder_grammar *g = 0;
    if (err_cap)
        err[0] = 0;
    if (!lex_text(&f) || !parse_definitions(&f))
        goto out;
    /* nonterminal ids: `start` first, then the rules in order */
    uint32_t start = NONE;
    for (uint32_t d = 0; d < f.n_defs; d++)
        if (!f.defs[d].terminal && f.defs[d].len == 5 && memcmp(text + f.defs[d].off, "start", 5) == 0)
            start = d;
    if (f.n_defs == 0) {
        fail_at(&f, 0, 0, "the grammar is empty", 0, 0);
        goto out;
    }
    if (start == NONE) {
        fail_at(&f, 0, 0, "the grammar has no 'start' rule", 0, 0);
        goto out;
    }
    f.defs[start].id = new_nt(&b, start);
    for (uint32_t d = 0; d < f.n_defs; d++)
        if (!f.defs[d].terminal && d != start)
            f.defs[d].id = new_nt(&b, d);
    for (uint32_t d = 0; d < f.n_defs; d++)
        if (!f.defs[d].terminal && !add_alternatives(&b, f.defs[d].id, f.defs[d].root, d))
            goto out;
    for (uint32_t i = 0; i < f.n_ignores; i++) {
        node *nd = &f.nodes[f.ignores[i]];   /* an ALT of one SEQ of one item, or more */
        for (uint32_t a = nd->first; a != NONE; a = f.nodes[a].next) {
            uint32_t item = f.nodes[a].first;
            if (item == NONE || f.nodes[item].next != NONE) {
                fail_at(&f, f.nodes[a].line, f.nodes[a].col, "%ignore takes a terminal name, a \"string\" or a /regex/", 0, 0);
                goto out;
            }
            node *it = &f.nodes[item];
            if (it->k == N_NAME) {
                uint32_t e = find_def(&f, it->off, it->len);
                if (e == NONE || !f.defs[e].terminal) {
                    fail_at(&f, it->line, it->col, e == NONE ? "undefined terminal" : "%ignore takes a terminal, not the rule",
                            text + it->off, it->len);
                    goto out;
                }
                f.defs[e].used = true;
                uint32_t id = term_of(&ts, f.defs[e].root, e, true);
                if (id == NONE)
                    goto out;
                if (f.defs[e].id == NONE)
                    f.defs[e].id = id;
            } else if (it->k == N_LIT || it->k == N_RE) {
                if (term_of(&ts, item, NONE, true) == NONE)
                    goto out;
            } else {
                fail_at(&f, it->line, it->col, "%ignore takes a terminal name, a \"string\" or a /regex/", 0, 0);
                goto out;
            }
        }
    }
    /* terminals used only inside other terminals were expanded there; still check them */
    for (uint32_t d = 0; d < f.n_defs; d++)
        if (f.defs[d].terminal && f.defs[d].used && f.defs[d].state == 0) {
            sbuf tmp = {0};
            bool ok = expand_def(&f, d, &tmp);
            rudder_free(tmp.buf);
            if (!ok)
                goto out;
        }
    if (ts.n_terms == 0) {
        fail_at(&f, 0, 0, "the grammar has no terminals (its only sentence is empty)", 0, 0);
        goto out;
    }
    /* symbols: terminals keep their ids, nonterminal n becomes n_terms + n */
    for (uint32_t i = 0; i < b.n_syms; i++)
        if (b.syms[i] & NT_BIT && !(b.syms[i] & END_BIT))
            b.syms[i] = ts.n_terms + (b.syms[i] & ~NT_BIT);
    g = rudder_zalloc(sizeof *g);
    if (!g)
        rudder_panic("grammar: out of memory");
    g->n_terms = ts.n_terms;
    g->tw = (ts.n_terms + 31) / 32;
    g->n_nt = b.n_nt;
    g->n_rules = b.n_rules;
    g->start_nt = 0;
    g->nullable = rudder_zalloc(b.n_nt + 1);
    if (!check_rules(&f, &b, g->nullable))
        goto fail;
    /* the lexer: one pattern per terminal, none may match the empty string */
    rudder_rx_pattern *pats = rudder_xalloc(ts.n_terms * sizeof *pats);
    for (uint32_t i = 0; i < ts.n_terms; i++)   /* (a %json terminal's pattern is never started) */
        pats[i] = ts.terms[i].json ? (rudder_rx_pattern){"\xff", 1, true}
                                   : (rudder_rx_pattern){ts.terms[i].text.buf, ts.terms[i].text.n, ts.terms[i].literal};
    char rxerr[160];
    g->rx = rudder_rx_new(pats, ts.n_terms, rxerr, sizeof rxerr);
    rudder_free(pats);
    if (!g->rx) {
        /* name the terminal: the message says "pattern <i>" */
        msg_put(&f.err, "in a terminal: ", 15);
        msg_put(&f.err, rxerr, (uint32_t)strlen(rxerr));
        f.failed = true;
        goto fail;
    }
    g->ignore = rudder_zalloc(g->tw * 4);
    g->tmp = rudder_zalloc(g->tw * 4);
    g->jbits = rudder_zalloc(g->tw * 4);
    for (uint32_t i = 0; i < ts.n_terms; i++) {
        g->n_json += ts.terms[i].json;
        if (ts.terms[i].json)
            continue;
        memset(g->tmp, 0, g->tw * 4);
        setbit(g->tmp, i);
        uint32_t st = rudder_rx_start(g->rx, g->tmp);
        if (st != RUDDER_DEAD && rudder_rx_accepting(g->rx, st)) {
            term *t = &ts.terms[i];
            def *d = t->def != NONE ? &f.defs[t->def] : 0;
            fail_at(&f, d ? d->line : t->line, d ? d->col : t->col, "terminal matches the empty string:",
                    d ? text + d->off : t->text.buf, d ? d->len : t->text.n);
            goto fail;
        }
        if (ts.terms[i].ignore)
            setbit(g->ignore, i);
    }
    g->syms = b.syms, b.syms = 0;
    g->lhs = b.lhs, b.lhs = 0;
    g->nt_off = rudder_zalloc((b.n_nt + 1) * 4);
    g->nt_rules = rudder_xalloc(b.n_rules * 4 + 4);
    for (uint32_t r = 0; r < b.n_rules; r++)
        g->nt_off[g->lhs[r] + 1]++;
    for (uint32_t n = 0; n < b.n_nt; n++)
        g->nt_off[n + 1] += g->nt_off[n];
    uint32_t *fill = rudder_xalloc(b.n_nt * 4 + 4);
    memcpy(fill, g->nt_off, b.n_nt * 4);
    for (uint32_t r = 0, at = 0; r < b.n_rules; r++) {
        g->nt_rules[fill[g->lhs[r]]++] = at;
        while (!(g->syms[at] & END_BIT))
            at++;
        at++;
    }
    rudder_free(fill);
    g->pred = rudder_zalloc(b.n_nt * 4 + 4);
    g->hmask = 255;
    g->hash = rudder_xalloc(256 * 4);
    g->hstamp = rudder_zalloc(256 * 4);
    g->cmask = 1023;
    g->children = rudder_zalloc((g->cmask + 1) * sizeof(child_slot));
    g->child_stamp = 1;
    g->max_depth = 1;
    for (uint32_t tok = 0; tok < rudder_vocab_size(); tok++) {
        uint32_t tl;
        if (rudder_token_bytes(tok, &tl) && tl + 1 > g->max_depth)
            g->max_depth = tl + 1;
    }
    g->wl = rudder_xalloc(4 * (g->max_depth + 2));
    g->ws = rudder_xalloc(4 * (g->max_depth + 2));
    g->we = rudder_xalloc(4 * (g->max_depth + 2));
    if (!g->nullable || !g->ignore || !g->tmp || !g->jbits || !g->nt_off || !g->pred || !g->hstamp || !g->children)
        rudder_panic("grammar: out of memory");
    g->imask = 4095;
    g->islots = rudder_xalloc((g->imask + 1) * 4);
    memset(g->islots, 0xff, (g->imask + 1) * 4);
    g->skip_ok = true;
    for (uint32_t i = 0; i < b.n_syms; i++)
        if (g->syms[i] < g->n_terms && bit(g->ignore, g->syms[i]))
            g->skip_ok = false;
    if (g->n_json > MAX_JSON) {
        fail_at(&f, 0, 0, "too many %json elements", 0, 0);
        goto fail;
    }
    if (g->n_json && (!setup_json(&f, &ts, g) || !check_json(&f, &ts, g)))
        goto fail;
    build_set(g, NONE, 0);
    g->n_real = g->n_sets;
    g->lexer = RUDDER_GM_BOUNDARY;
    goto out;
fail:
    rudder_gm_free(g);
    g = 0;
out:
    free_front(&f, &ts, &b);
    return g;
}
