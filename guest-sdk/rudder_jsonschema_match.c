/* rudder_jsonschema_match.c - the JSON Schema engine's byte automaton over the node graph of
 * rudder_jsonschema_nodes.h, and its engine for the token layer (rudder_constraint.h).
 *
 * A *thread* is one pushdown automaton: a stack of frames (node, phase, container progress)
 * and the lexer of the current string or number. A position is a *set* of threads: at a union
 * whose alternatives can take the same byte, the thread splits into one per alternative, and a
 * thread that cannot take a byte dies. Sets are kept sorted and without duplicates (threads
 * that meet again merge), so a set is a canonical key for the token layer's cache.
 *
 * Masks: a token is allowed when some thread takes all its bytes, so a set's mask is the union
 * of its threads' masks. One thread's mask is a walk of the token trie, one thread per depth,
 * a whole subtree skipped at the first dead byte (a split walks the subtree once per thread it
 * became). Inside strings a fast path allows the "plain" tokens (whole UTF-8 characters, no
 * quote, backslash or control byte) as a class and pushes only the few others.
 */
#include "rudder_jsonschema_nodes.h"

#define MAX_THREADS 512u    /* threads of one position; past it the later ones are dropped (documented) */
#define MAX_FORCED 64u

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
/* Frame flags */
#define F_EXTRAS 1u     /* object, in a key: it may be an extra key */
#define F_COUNTS 0x80u  /* an array item that matches `contains` */

enum { DEAD = 0, OK = 1, RETRY = 2, CLOSED = 3 };

typedef struct {
    uint16_t node;
    uint8_t phase, flags;
    uint32_t aux;    /* object: key trie node, then the extra key's value node; array: items; literal: trie node */
    uint32_t aux2;   /* object: next property | current << 9 (EXTRA_KEY: an extra key) | properties written << 18 */
    uint32_t aux3;   /* object: properties written (with dependentRequired); array: items matching contains */
} frame;

typedef struct {
    uint8_t sp, lphase, u8need, u8lo, u8hi, neg;
    uint8_t ktag;              /* kh is the last extra key written, of the object of this frame (0: none) */
    uint8_t pad;
    uint32_t len;              /* string, key: code points (saturated); number: digit counts */
    uint32_t hex;              /* \uXXXX accumulator */
    uint32_t mod;              /* number: value modulo multipleOf */
    uint32_t rx[STRING_RX];    /* string: its regexes' states; extra key: [0] patterns, [1] propertyNames */
    uint32_t keys;             /* the extra keys written in the open objects: a node of the key table (0: none) */
    double num;                /* number magnitude so far (bounded numbers only) */
    uint64_t kh;               /* in an extra key: the hash of its decoded bytes so far; elsewhere (ktag) the
                                * last extra key written, until the next key of an object with extra keys
                                * opens and it joins `keys` */
    frame f[RUDDER_JS_MAX_DEPTH];
} thread;

#define HEAD ((uint32_t)__builtin_offsetof(thread, f))

static inline uint32_t tsize(const thread *s) { return HEAD + s->sp * (uint32_t)sizeof(frame); }
static inline void tcopy(thread *dst, const thread *src) { memcpy(dst, src, tsize(src)); }

/* Threads that split off while one byte is pushed. */
typedef struct {
    thread *t;
    uint32_t n, cap;
} tlist;

static void tlist_add(tlist *l, const thread *s) {
    l->t = rudder_grow(l->t, &l->cap, l->n + 1, sizeof(thread));
    tcopy(&l->t[l->n++], s);
}

/* The extra keys written so far, as a table of nodes shared by every thread of a request: a
 * node is a key (its hash, and the frame index of its object) and the node of the keys
 * written before it. Nodes are interned (equal sets written in the same
 * order are one node), so a thread holds a set in 4 bytes and equal threads stay equal bytes.
 * Nodes are never removed: a checkpoint and a cached answer stay valid. */
typedef struct {
    uint64_t kh;
    uint64_t bloom;   /* a bit per key of its object written up to here (kbit): most lookups stop at it */
    uint32_t up, tag;
} knode;

static inline uint64_t kbit(uint64_t kh) { return 1ull << (kh >> 58); }

#ifndef RUDDER_JS_MAX_KEY_NODES
#define RUDDER_JS_MAX_KEY_NODES (1u << 18)   /* past it the request fails (docs/json-schema.md) */
#endif
/* Keys are hashed as polynomials (mod 2^64), so that the hash of a key and some more bytes is
 * one multiply and add from the key's own (key_dups). */
#define KH_SEED 1ull
#define KH_MUL 0x9e3779b97f4a7c15ull
#define KH_STEP(h, c) ((h) * KH_MUL + (uint64_t)(c) + 1u)

typedef struct rx_shape rx_shape;

typedef struct js_matcher {
    thread *cur;          /* the current position: n_cur threads, sorted, distinct */
    uint32_t n_cur, cap_cur;
    thread *buf[2];       /* scratch sets for pushing */
    uint32_t cap_buf[2];
    uint8_t *hist;        /* checkpoints: serialized sets, back to back */
    uint32_t n_hist, cap_hist, *hist_at, n_cps, cap_cps;
    thread *walk;         /* one thread per trie depth (the walk recurses at splits: deeper) */
    uint32_t *ends, *sets, walk_cap;
    tlist *spill;         /* per walk depth */
    tlist split;          /* for pushes outside walks */
    uint32_t *order, cap_order;   /* normalize's scratch */
    uint32_t *far;        /* per string node with one regex and a maximum: rx_far (NONE - 1: not yet) */
    thread *sorted;
    uint32_t cap_sorted;
    uint32_t dropped;     /* threads dropped at MAX_THREADS (for logs) */
    knode *knodes;        /* the key table: knodes[0] is the empty set */
    uint32_t n_knodes, cap_knodes, *kindex, kmask;
    thread *dfs;          /* key_ahead's threads, one per depth */
    uint16_t *dups;       /* e_key's scratch */
    uint32_t cap_dups;
    struct rx_shape **shapes;   /* per object node, its two key regexes' (key_open_ended) */
    uint8_t *views;       /* e_key's keys_view of each thread */
    uint32_t cap_views;
    uint64_t *ext_h;      /* key_dups' scratch (g_n_ext each) */
    uint16_t *ext_k;
    uint8_t *ext_dup;
    bool in_dfs;
} js_matcher;

static inline const jnode *N(const rudder_js *js, uint32_t id) { return &js->nodes[id]; }

static inline void lex_reset(thread *s) {
    s->lphase = s->u8need = s->u8lo = s->u8hi = s->neg = 0;
    s->len = s->hex = s->mod = 0;
    for (uint32_t i = 0; i < STRING_RX; i++)
        s->rx[i] = 0;
    s->num = 0;
}

/* Does a value of `node` fit as a child of the top frame? */
static inline bool fits(const rudder_js *js, const thread *s, uint32_t node) {
    return node != NONE && s->sp + N(js, node)->need <= RUDDER_JS_MAX_DEPTH;
}

static inline bool push_frame(const rudder_js *js, thread *s, uint32_t node, uint8_t flags) {
    if (!fits(js, s, node))
        return false;
    s->f[s->sp++] = (frame){(uint16_t)node, V_START, flags, 0, 0, 0};
    return true;
}

/* The value on top is complete: pop it and move its parent on. */
static void child_done(const rudder_js *js, thread *s) {
    uint8_t flags = s->f[s->sp - 1].flags;
    s->sp--;
    lex_reset(s);
    frame *p = &s->f[s->sp - 1];
    if (s->sp == 1) {
        p->phase = D_DONE;
    } else if (p->phase == O_VALUE) {
        p->phase = O_AFTER;
        p->aux = 0;   /* (the value's node: no longer needed, and equal states should be equal bytes) */
    } else {   /* A_VALUE */
        const jnode *n = N(js, p->node);
        if (p->aux < n->cap)
            p->aux++;
        if ((flags & F_COUNTS) && p->aux3 < n->contains)
            p->aux3++;
        p->phase = A_AFTER;
    }
}

/* ------------------------------------------------------------------ numbers */

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

static int64_t floor_i64(double x) {
    int64_t i = (int64_t)x;
    return (double)i > x ? i - 1 : i;
}

/* An integer of magnitude in [a, b] (of that sign) inside the bounds and, with multipleOf, a
 * multiple of it? */
static bool int_hits(const jnode *n, bool neg, double a, double b) {
    if (!n->mult)
        return mag_hits(n, neg, a, b, false);
    int64_t lo = neg ? -(int64_t)b : (int64_t)a, hi = neg ? -(int64_t)a : (int64_t)b, m = n->mult;
    if (n->has_lo) {
        int64_t l = -floor_i64(-n->lo);   /* ceil */
        if (n->lo_excl && (double)l == n->lo)
            l++;
        lo = l > lo ? l : lo;
    }
    if (n->has_hi) {
        int64_t h = floor_i64(n->hi);
        if (n->hi_excl && (double)h == n->hi)
            h--;
        hi = h < hi ? h : hi;
    }
    if (lo > hi)
        return false;
    /* The first multiple >= lo, in unsigned arithmetic: |lo| < 10^16 and m > 0, so nothing
     * overflows (and a signed product would need a 128-bit overflow check under UBSan). */
    uint64_t um = (uint64_t)m;
    int64_t first = lo >= 0 ? (int64_t)(((uint64_t)lo + um - 1) / um * um) : -(int64_t)((uint64_t)(-lo) / um * um);
    return first <= hi;
}

/* Can the number read so far still end inside the bounds? s->num holds all its digits as an
 * integer (exact: at most 15 of them), the fraction's digit count is in s->len. */
static bool feasible(const jnode *n, const thread *s) {
    if (!n->has_lo && !n->has_hi)
        return true;
    uint32_t id = s->len & 0xff, fd = (s->len >> 8) & 0xff;
    double x = s->num;
    bool neg = s->neg;
    switch (s->lphase) {
    case NL_SIGN:
        return n->integer ? int_hits(n, true, 1, P10[INT_DIGITS] - 1) : mag_hits(n, true, 0, P10[INT_DIGITS], true);
    case NL_ZERO:
        return n->integer ? int_hits(n, neg, 0, 0) : mag_hits(n, neg, 0, 1, true);
    case NL_INT:
        if (n->integer ? int_hits(n, neg, x, x) : mag_hits(n, neg, x, x + 1, true))
            return true;
        for (uint32_t j = 1; id + j <= INT_DIGITS; j++)
            if (n->integer ? int_hits(n, neg, x * P10[j], (x + 1) * P10[j] - 1)
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

/* With `left` more integer digits at most, can the value modulo mult still become 0? */
static bool mod_reachable(uint32_t mult, uint32_t mod, uint32_t left) {
    uint64_t p = 1;
    for (uint32_t j = 0; j <= left; j++, p *= 10) {
        if (p >= mult)
            return true;
        uint64_t want = (mult - (uint64_t)mod * p % mult) % mult;   /* the digits appended must equal this */
        if (want < p)
            return true;
    }
    return false;
}

static bool number_complete(const jnode *n, const thread *s) {
    uint8_t p = s->lphase;
    if (p != NL_ZERO && p != NL_INT && p != NL_FRAC && p != NL_EXP)
        return false;
    if (n->mult && s->mod)
        return false;
    if (!n->has_lo && !n->has_hi)
        return true;
    double v = s->num / P10[p == NL_FRAC ? (s->len >> 8) & 0xff : 0];
    if (s->neg)
        v = -v;
    return hits(n, v, v, false, false);
}

static int num_byte(const rudder_js *js, thread *s, const jnode *n, uint8_t b) {
    bool bounded = n->has_lo || n->has_hi, digit = b >= '0' && b <= '9';
    uint32_t id = s->len & 0xff, fd = (s->len >> 8) & 0xff, ed = s->len >> 16;
    uint32_t max_frac = n->frac != 255 ? n->frac : FRAC_DIGITS;
    bool e = (b == 'e' || b == 'E') && !n->integer && !bounded && n->frac == 255;
    bool dot = b == '.' && !n->integer && max_frac > 0;
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
        if (n->mult) {
            s->mod = (uint32_t)(b - '0') % n->mult;
            if (!mod_reachable(n->mult, s->mod, b == '0' ? 0 : INT_DIGITS - 1))
                return DEAD;
        }
        return feasible(n, s) ? OK : DEAD;
    case NL_ZERO:
        if (dot) {
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
            if (n->mult) {
                s->mod = (uint32_t)(((uint64_t)s->mod * 10 + (uint64_t)(b - '0')) % n->mult);
                if (!mod_reachable(n->mult, s->mod, INT_DIGITS - id - 1))
                    return DEAD;
            }
            return feasible(n, s) ? OK : DEAD;
        }
        if (dot) {
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
        if (digit && fd < max_frac && (!bounded || id + fd < INT_DIGITS)) {
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

/* ------------------------------------------------------------------ strings */

/* Can a string with these regex states and `len` characters so far still be completed (every
 * regex matching, the length in [min, max])? A 0-1 breadth-first search over the regexes'
 * states together (a character's first byte costs 1, a continuation byte 0), one
 * representative byte per class of the first regex; cached. Needed only where no single
 * regex's own pruning answers it: several regexes, or one with length bounds. */
#define REACH_SLOTS 1024u
#define REACH_MAX 2048u
static struct {
    uint32_t node, len, st[STRING_RX], ok;
} g_reach[REACH_SLOTS];

static bool rx_all_accept(const jnode *n, const uint32_t *st) {
    for (uint32_t k = 0; k < n->n_rx; k++)
        if (!rudder_rx_accepting(n->rx[k], st[k]))
            return false;
    return true;
}

static bool reach(const rudder_js *js, uint32_t node, const uint32_t *st, uint32_t len) {
    const jnode *n = N(js, node);
    uint32_t lo = n->min > len ? n->min - len : 0, hi = n->max == NONE ? NONE : n->max - len;
    uint32_t h = node * 2654435761u ^ len * 40503u;
    for (uint32_t k = 0; k < n->n_rx; k++)
        h = (h ^ st[k]) * 16777619u;
    h %= REACH_SLOTS;
    if (g_reach[h].node == node + 1 && g_reach[h].len == len && !memcmp(g_reach[h].st, st, n->n_rx * 4))
        return g_reach[h].ok;
    /* one representative byte per run of bytes that every regex classes alike */
    uint8_t reps[256];
    uint32_t n_reps = 0;
    for (uint32_t b = 0; b < 256; b++) {
        bool fresh = b == 0 || b == 0x80 || b == 0xc0;   /* (continuation bytes count no character) */
        for (uint32_t k = 0; k < n->n_rx && !fresh; k++) {
            const rudder_rx_dfa *d = (const rudder_rx_dfa *)n->rx[k];
            fresh = d->classes[b] != d->classes[b - 1];
        }
        if (fresh)
            reps[n_reps++] = (uint8_t)b;
    }
    typedef struct {
        uint32_t st[STRING_RX], c;
    } item;
    static item ring[REACH_MAX], done[REACH_MAX / 4];
    uint32_t head = 0, size = 0, n_done = 0;
    bool ok = false, full = false;
    ring[0] = (item){.c = 0};
    memcpy(ring[0].st, st, n->n_rx * 4);
    size = 1;
    while (size && !ok && !full) {
        item it = ring[head];
        head = (head + 1) % REACH_MAX, size--;
        uint32_t cc = it.c < lo ? it.c : lo;
        bool seen = false;   /* popped in order of c: the first visit of (states, cc) is the best */
        for (uint32_t q = 0; q < n_done && !seen; q++)
            seen = done[q].c == cc && !memcmp(done[q].st, it.st, n->n_rx * 4);
        if (seen)
            continue;
        if (n_done == REACH_MAX / 4) {
            full = true;   /* too large to search: assume it can */
            break;
        }
        done[n_done] = it;
        done[n_done++].c = cc;
        if (it.c >= lo && rx_all_accept(n, it.st)) {
            ok = true;
            break;
        }
        for (uint32_t r = 0; r < n_reps; r++) {
            uint32_t cost = reps[r] < 0x80 || reps[r] >= 0xc0;
            item nx = {.c = it.c + cost};
            bool dead = hi != NONE && nx.c > hi;
            for (uint32_t k = 0; k < n->n_rx && !dead; k++)
                dead = (nx.st[k] = rudder_rx_push(n->rx[k], it.st[k], reps[r])) == RUDDER_DEAD;
            if (dead)
                continue;
            if (size == REACH_MAX) {
                full = true;
                break;
            }
            if (cost)
                ring[(head + size) % REACH_MAX] = nx;
            else
                head = (head + REACH_MAX - 1) % REACH_MAX, ring[head] = nx;
            size++;
        }
    }
    ok |= full;
    g_reach[h].node = node + 1;
    g_reach[h].len = len;
    memcpy(g_reach[h].st, st, n->n_rx * 4);
    g_reach[h].ok = ok;
    return ok;
}

/* One regex and a maximum: the fewest characters from a DFA state to a match, cached per
 * (regex, state) (a 0-1 search as above; continuation bytes cost nothing). */
#define DIST_SLOTS 4096u
static struct {
    const rudder_rx *rx;
    uint32_t state, dist;
} g_dist[DIST_SLOTS];

static uint32_t rx_dist(rudder_rx *rx, uint32_t state) {
    uint32_t h = (state * 2654435761u ^ (uint32_t)(uintptr_t)rx * 40503u) % DIST_SLOTS;
    if (g_dist[h].rx == rx && g_dist[h].state == state)
        return g_dist[h].dist;
    const rudder_rx_dfa *d = (const rudder_rx_dfa *)rx;
    uint8_t reps[256];
    uint32_t n_reps = 0;
    for (uint32_t b = 0; b < 256; b++)
        if (b == 0 || b == 0x80 || b == 0xc0 || d->classes[b] != d->classes[b - 1])
            reps[n_reps++] = (uint8_t)b;
    enum { SIZE = 1024 };
    static uint32_t ring[SIZE], cost[SIZE], done[SIZE];
    uint32_t head = 0, size = 1, n_done = 0, found = NONE;
    ring[0] = state, cost[0] = 0;
    while (size && found == NONE) {
        uint32_t q = ring[head], c = cost[head];
        head = (head + 1) % SIZE, size--;
        bool seen = false;
        for (uint32_t i = 0; i < n_done && !seen; i++)
            seen = done[i] == q;
        if (seen)
            continue;
        if (n_done == SIZE || rudder_rx_accepting(rx, q)) {
            found = n_done == SIZE ? 0 : c;   /* (too large to search: assume it is near) */
            break;
        }
        done[n_done++] = q;
        for (uint32_t r = 0; r < n_reps && size < SIZE; r++) {
            uint32_t nx = rudder_rx_push(rx, q, reps[r]), step = reps[r] < 0x80 || reps[r] >= 0xc0;
            if (nx == RUDDER_DEAD)
                continue;
            if (step)
                ring[(head + size) % SIZE] = nx, cost[(head + size) % SIZE] = c + 1;
            else
                head = (head + SIZE - 1) % SIZE, ring[head] = nx, cost[head] = c;
            size++;
        }
    }
    g_dist[h].rx = rx, g_dist[h].state = state, g_dist[h].dist = found;
    return found;
}

/* The largest finite distance to a match over the DFA states a regex can reach (states
 * explored from the start, one byte per class); NONE when there are too many to tell. */
static uint32_t rx_far(rudder_rx *rx) {
    enum { MAX = 2048 };
    static uint32_t seen[MAX];
    const rudder_rx_dfa *d = (const rudder_rx_dfa *)rx;
    uint32_t n = 0, far = 0;
    seen[n++] = rudder_rx_start(rx, NULL);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t dist = rx_dist(rx, seen[i]);
        if (dist != NONE && dist > far)
            far = dist;
        for (uint32_t b = 0; b < 256; b++) {
            if (b && d->classes[b] == d->classes[b - 1])
                continue;
            uint32_t nx = rudder_rx_push(rx, seen[i], (uint8_t)b);
            bool known = nx == RUDDER_DEAD;
            for (uint32_t k = 0; k < n && !known; k++)
                known = seen[k] == nx;
            if (known)
                continue;
            if (n == MAX)
                return NONE;
            seen[n++] = nx;
        }
    }
    return far;
}

/* The search above is needed where no single regex's own pruning answers "can this string
 * still be completed": several regexes together, or one with a maximum length (one with only
 * a minimum is checked where it closes). */
static inline bool needs_reach(const jnode *n) { return n->n_rx > 1 || (n->n_rx == 1 && n->max != NONE); }

/* Can the string be completed from these regex states with `len` characters so far? */
static bool completable(const rudder_js *js, uint32_t node, const uint32_t *st, uint32_t len) {
    const jnode *n = N(js, node);
    if (n->n_rx == 1) {
        uint32_t d = rx_dist(n->rx[0], st[0]);
        return d != NONE && (n->max == NONE || len + d <= n->max);
    }
    return reach(js, node, st, len);
}

bool js_string_possible(const rudder_js *js, uint32_t node) {
    const jnode *n = N(js, node);
    if (n->max != NONE && n->min > n->max)
        return false;
    if (!n->n_rx)
        return true;
    uint32_t st[STRING_RX];
    for (uint32_t k = 0; k < n->n_rx; k++)
        st[k] = rudder_rx_start(n->rx[k], NULL);
    return reach(js, node, st, 0);   /* (exact, minimum included: once per node) */
}

/* A byte of a string value through its regexes: those it must match die with it; those it
 * must not match stay dead once they die (the string can then never match them). */
static bool rx_more(const rudder_js *js, uint32_t node, thread *s, uint8_t b) {
    const jnode *n = N(js, node);
    for (uint32_t k = 0; k < n->n_rx; k++)
        if ((s->rx[k] = rudder_rx_push(n->rx[k], s->rx[k], b)) == RUDDER_DEAD)
            return false;
    for (uint32_t k = n->n_rx; k < n->n_rx + n->n_neg; k++)
        if (s->rx[k] != RUDDER_DEAD)
            s->rx[k] = rudder_rx_push(n->rx[k], s->rx[k], b);
    if (needs_reach(n) && !completable(js, node, s->rx, s->len))   /* (mid-character too: the search steps through continuation bytes) */
        return false;
    return true;
}

/* A character's first byte inside a string value: room, regexes, reachability. */
static int count_char(const rudder_js *js, uint32_t node, thread *s, uint8_t b) {
    const jnode *n = N(js, node);
    if (n->max != NONE && s->len >= n->max)
        return DEAD;
    if (s->len < n->cap)
        s->len++;
    return rx_more(js, node, s, b) ? OK : DEAD;
}

/* May the string end here: length, the regexes it must match accept, those it must not don't. */
static bool str_complete(const jnode *n, const thread *s) {
    if (s->len < n->min || !rx_all_accept(n, s->rx))
        return false;
    for (uint32_t k = n->n_rx; k < n->n_rx + n->n_neg; k++)
        if (s->rx[k] != RUDDER_DEAD && rudder_rx_accepting(n->rx[k], s->rx[k]))
            return false;
    return true;
}

static inline int hexval(uint8_t b) {
    return b >= '0' && b <= '9' ? b - '0' : b >= 'a' && b <= 'f' ? b - 'a' + 10 : b >= 'A' && b <= 'F' ? b - 'A' + 10 : -1;
}

static const char ESC_FROM[] = "\"\\/bfnrt", ESC_TO[] = "\"\\/\b\f\n\r\t";

static bool escape_possible(const rudder_js *js, uint32_t node, const thread *s) {
    if (!N(js, node)->n_rx && !N(js, node)->n_neg)
        return true;
    thread t;
    for (uint32_t i = 0; ESC_TO[i]; i++) {
        tcopy(&t, s);
        if (count_char(js, node, &t, (uint8_t)ESC_TO[i]) == OK)
            return true;
    }
    return false;
}

/* UTF-8 structure of the next byte at a character boundary: sets the lexer to expect the
 * continuation bytes; false for a byte that cannot start a character. */
static bool utf8_lead(thread *s, uint8_t b) {
    if (b >= 0xc2 && b <= 0xdf) {
        s->u8need = 1, s->u8lo = 0x80, s->u8hi = 0xbf;
    } else if (b >= 0xe0 && b <= 0xef) {
        s->u8need = 2, s->u8lo = b == 0xe0 ? 0xa0 : 0x80, s->u8hi = b == 0xed ? 0x9f : 0xbf;
    } else if (b >= 0xf0 && b <= 0xf4) {
        s->u8need = 3, s->u8lo = b == 0xf0 ? 0x90 : 0x80, s->u8hi = b == 0xf4 ? 0x8f : 0xbf;
    } else {
        return false;
    }
    s->lphase = SL_UTF8;
    return true;
}

static bool utf8_more(thread *s, uint8_t b) {
    if (b < s->u8lo || b > s->u8hi)
        return false;
    if (--s->u8need == 0)
        s->lphase = SL_CHAR, s->u8lo = s->u8hi = 0;
    else
        s->u8lo = 0x80, s->u8hi = 0xbf;
    return true;
}

/* One byte inside a string value of `node`. */
static int str_byte(const rudder_js *js, thread *s, uint32_t node, uint8_t b) {
    const jnode *n = N(js, node);
    switch (s->lphase) {
    case SL_CHAR:
        if (b == '"')
            return str_complete(n, s) ? CLOSED : DEAD;
        if (b == '\\') {   /* an escape must have room and, under a regex, a character it may write */
            if ((n->max != NONE && s->len >= n->max) || !escape_possible(js, node, s))
                return DEAD;
            s->lphase = SL_ESC;
            return OK;
        }
        if (b < 0x20)
            return DEAD;
        if (b < 0x80)
            return count_char(js, node, s, b);
        if (!utf8_lead(s, b))
            return DEAD;
        return count_char(js, node, s, b);
    case SL_UTF8:
        if (!utf8_more(s, b))
            return DEAD;
        return rx_more(js, node, s, b) ? OK : DEAD;
    case SL_ESC: {
        if (b == 'u' && !n->n_rx && !n->n_neg) {   /* (under a regex only short escapes: decided at once) */
            s->lphase = SL_U0;
            s->hex = 0;
            return OK;
        }
        for (uint32_t i = 0; ESC_FROM[i]; i++)
            if (b == (uint8_t)ESC_FROM[i]) {
                s->lphase = SL_CHAR;
                return count_char(js, node, s, (uint8_t)ESC_TO[i]);
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
        s->hex = 0;
        s->lphase = SL_CHAR;
        return count_char(js, node, s, 'x');   /* (no regex here: only the count matters) */
    }
    }
}

/* ------------------------------------------------------------------ objects */

/* Property sets: bits from `from` on. */
static uint32_t ps_count_from(const pset *p, uint32_t from) {
    uint32_t n = 0;
    for (uint32_t w = from >> 6; w < MAX_PROPS / 64; w++) {
        uint64_t x = p->w[w];
        if (w == from >> 6)
            x &= ~0ull << (from & 63);
        n += (uint32_t)__builtin_popcountll(x);
    }
    return n;
}

static uint32_t ps_first_from(const pset *p, uint32_t from) {
    for (uint32_t w = from >> 6; w < MAX_PROPS / 64; w++) {
        uint64_t x = p->w[w];
        if (w == from >> 6)
            x &= ~0ull << (from & 63);
        if (x)
            return w * 64 + (uint32_t)__builtin_ctzll(x);
    }
    return NONE;
}

static bool ps_meets(const pset *a, const pset *b) {
    uint64_t x = 0;
    for (uint32_t w = 0; w < MAX_PROPS / 64; w++)
        x |= a->w[w] & b->w[w];
    return x != 0;
}

/* Required now: the node's required properties and those the written ones depend on (objects
 * with dependentRequired have at most 32 properties: the first word). */
static pset required_now(const rudder_js *js, const jnode *n, const frame *f) {
    pset r = js->psets[n->sets];
    if (n->has_deps)
        for (uint32_t seen = f->aux3; seen; seen &= seen - 1)
            r.w[0] |= js->props[n->a + (uint32_t)__builtin_ctz(seen)].deps;
    return r;
}

#define EXTRA_KEY 0x1ffu   /* the "current property" of an extra key (properties are < 256) */
static inline uint32_t next_prop(const frame *f) { return f->aux2 & 0x1ff; }
static inline uint32_t written(const frame *f) { return (f->aux2 >> 18) & 0xff; }

/* ------------------------------------------------------------------ extra keys written */

/* No key twice in one object (RFC 8259: names SHOULD be unique; parsers keep one). Declared
 * keys come once each by construction (in schema order); extra keys are remembered by hash in
 * the thread (`keys`, `kh`) and one equal to a key written is refused at its closing quote. */

static inline bool has_extras(const jnode *n) { return n->extra != NONE || n->n_rx; }

/* Extra keys limited to a few names (propertyNames, a maximum length, patternProperties and
 * nothing else): a key being written may have no way left to end but as one already written
 * (key_ahead looks). Elsewhere one more character always leads on. */
static inline bool restricted(const jnode *n) { return n->rx[1] || n->kmax != NONE || (n->extra == NONE && n->n_rx); }

/* The shape of a regex limiting key names, from its start: for each state it reaches (at most
 * SHAPE_STATES), whether infinitely many strings lead from it to a match, i.e. whether it
 * reaches a cycle of states that can reach a match; `all`: true of every state that can reach
 * a match. Computed once per (object, regex), when first needed: the states that can reach a
 * match (backwards from the matching ones), then those left once the states with no way on
 * among them are peeled off, repeatedly. */
#define SHAPE_STATES 1024u
struct rx_shape {
    uint32_t n, mask, *state, *slot;   /* slot: open addressing, state -> index + 1 */
    uint8_t *inf;
    bool complete, all;
};

static uint32_t shape_find(const rx_shape *sh, uint32_t state) {
    for (uint32_t h = state * 2654435761u & sh->mask; sh->slot[h]; h = (h + 1) & sh->mask)
        if (sh->state[sh->slot[h] - 1] == state)
            return sh->slot[h] - 1;
    return NONE;
}

static void *zalloc_or_panic(uint32_t bytes) {
    void *p = rudder_zalloc(bytes ? bytes : 1);
    if (!p)
        rudder_panic("jsonschema: out of memory");
    return p;
}

static rx_shape *shape_of(rudder_rx *rx) {
    const rudder_rx_dfa *d = (const rudder_rx_dfa *)rx;
    uint32_t cap = SHAPE_STATES, nc = 0;
    uint8_t reps[256];
    for (uint32_t b = 0; b < 256; b++)
        if (!b || d->classes[b] != d->classes[b - 1])
            reps[nc++] = (uint8_t)b;
    rx_shape *sh = zalloc_or_panic(sizeof *sh);
    sh->mask = 2 * cap - 1;
    sh->state = zalloc_or_panic(4 * cap);
    sh->slot = zalloc_or_panic(4 * 2 * cap);
    sh->inf = zalloc_or_panic(cap);
    uint32_t *next = zalloc_or_panic(4 * cap * nc), *at = zalloc_or_panic(4 * (cap + 1)), *from = NULL;
    uint32_t *deg = zalloc_or_panic(4 * cap), *queue = zalloc_or_panic(4 * cap);
    uint8_t *good = zalloc_or_panic(cap);
    sh->complete = true;
    sh->state[sh->n++] = rudder_rx_start(rx, NULL);
    sh->slot[sh->state[0] * 2654435761u & sh->mask] = 1;
    for (uint32_t i = 0; i < sh->n && sh->complete; i++)   /* the states, and their next state per byte class */
        for (uint32_t c = 0; c < nc && sh->complete; c++) {
            uint32_t nx = rudder_rx_push(rx, sh->state[i], reps[c]), j = nx == RUDDER_DEAD ? NONE : shape_find(sh, nx);
            if (nx != RUDDER_DEAD && j == NONE && sh->n == cap)
                sh->complete = false;
            else if (nx != RUDDER_DEAD && j == NONE) {
                j = sh->n;
                sh->state[sh->n++] = nx;
                uint32_t h = nx * 2654435761u & sh->mask;
                while (sh->slot[h])
                    h = (h + 1) & sh->mask;
                sh->slot[h] = j + 1;
            }
            next[i * nc + c] = j;
        }
    if (sh->complete) {
        uint32_t n = sh->n, head = 0, tail = 0;
        for (uint32_t e = 0; e < n * nc; e++)   /* the edges backwards: from[at[j]..at[j + 1]) lead to j */
            if (next[e] != NONE)
                at[next[e] + 1]++;
        for (uint32_t j = 0; j < n; j++)
            at[j + 1] += at[j];
        from = zalloc_or_panic(4 * (at[n] + 1));
        for (uint32_t e = 0; e < n * nc; e++)
            if (next[e] != NONE)
                from[at[next[e]] + deg[next[e]]++] = e / nc;
        for (uint32_t i = 0; i < n; i++)   /* good: a match is reachable (backwards from the matches) */
            if (rudder_rx_accepting(rx, sh->state[i]))
                good[i] = 1, queue[tail++] = i;
        while (head < tail)
            for (uint32_t k = queue[head++], e = at[k]; e < at[k + 1]; e++)
                if (!good[from[e]])
                    good[from[e]] = 1, queue[tail++] = from[e];
        head = tail = 0;   /* peel the good states whose good next states are all peeled */
        for (uint32_t i = 0; i < n; i++) {
            deg[i] = 0;
            for (uint32_t c = 0; c < nc && good[i]; c++)
                deg[i] += next[i * nc + c] != NONE && good[next[i * nc + c]];
            sh->inf[i] = good[i];
            if (good[i] && !deg[i])
                queue[tail++] = i;
        }
        while (head < tail) {
            uint32_t k = queue[head++];
            sh->inf[k] = 0;
            for (uint32_t e = at[k]; e < at[k + 1]; e++)
                if (good[from[e]] && --deg[from[e]] == 0)
                    queue[tail++] = from[e];
        }
        sh->all = true;
        for (uint32_t i = 0; i < n; i++)
            sh->all &= !good[i] || sh->inf[i];
    }
    rudder_free(next);
    rudder_free(at);
    rudder_free(from);
    rudder_free(deg);
    rudder_free(queue);
    rudder_free(good);
    return sh;
}

/* In a restricted object: does the key being written (top frame) have infinitely many ways to
 * end from here (`every`: from wherever it goes), so that one not written is always within
 * reach with no search? With no maximum length, when each regex limiting the names takes
 * whatever follows a match (no `$`), or is so shaped (shape_of). */
static bool key_open_ended(const rudder_js *js, const thread *s, bool every) {
    uint32_t node = s->f[s->sp - 1].node;
    const jnode *n = N(js, node);
    if (n->kmax != NONE || s->lphase == SL_ESC)
        return false;
    for (uint32_t k = 0; k < 2; k++) {
        if (!(k ? n->rx[1] != NULL : n->extra == NONE && n->n_rx) || (n->rx_free >> k & 1))
            continue;   /* (it does not limit the names, or a match stays one) */
        if (s->rx[k] == RUDDER_DEAD)
            return false;
        rx_shape **sh = &js->m->shapes[2 * node + k];
        if (!*sh)
            *sh = shape_of(n->rx[k]);
        uint32_t i = (*sh)->complete ? shape_find(*sh, s->rx[k]) : NONE;
        if (i == NONE || !(every ? (*sh)->all : (*sh)->inf[i]))
            return false;
    }
    return true;
}

static inline uint32_t key_slot(uint64_t kh, uint32_t tag, uint32_t up) {
    return (uint32_t)((kh ^ (up * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)tag << 40)) >> 32);
}

/* The node for key `kh` of the object of frame `tag`, written after the keys of node `up`
 * (made when new). */
static uint32_t key_node(js_matcher *m, uint64_t kh, uint32_t tag, uint32_t up) {
    if (2 * (m->n_knodes + 1) > m->kmask + 1) {
        uint32_t size = 2 * (m->kmask + 1);
        rudder_free(m->kindex);
        m->kindex = rudder_zalloc(size * 4);
        if (!m->kindex)
            rudder_panic("jsonschema: out of memory");
        m->kmask = size - 1;
        for (uint32_t i = 1; i < m->n_knodes; i++) {
            uint32_t h = key_slot(m->knodes[i].kh, m->knodes[i].tag, m->knodes[i].up) & m->kmask;
            while (m->kindex[h])
                h = (h + 1) & m->kmask;
            m->kindex[h] = i;
        }
    }
    uint32_t h = key_slot(kh, tag, up) & m->kmask;
    for (; m->kindex[h]; h = (h + 1) & m->kmask) {
        const knode *k = &m->knodes[m->kindex[h]];
        if (k->kh == kh && k->tag == tag && k->up == up)
            return m->kindex[h];
    }
    if (m->n_knodes >= RUDDER_JS_MAX_KEY_NODES)
        rudder_panic("json: too many distinct extra keys in one request (the engine's key table is full)");
    m->knodes = rudder_grow(m->knodes, &m->cap_knodes, m->n_knodes + 1, sizeof(knode));
    uint64_t bloom = kbit(kh) | (up && m->knodes[up].tag == tag ? m->knodes[up].bloom : 0);
    m->knodes[m->n_knodes] = (knode){kh, bloom, up, tag};
    m->kindex[h] = m->n_knodes;
    return m->n_knodes++;
}

/* Has the object of the top frame written the extra key `kh` (pending: or is it kh, outside a
 * key)? */
static bool key_written(const rudder_js *js, const thread *s, uint64_t kh, bool pending) {
    const knode *k = js->m->knodes;
    uint32_t tag = s->sp - 1u;
    if (pending && s->ktag == tag && s->kh == kh)
        return true;
    if (!s->keys || k[s->keys].tag != tag || !(k[s->keys].bloom & kbit(kh)))
        return false;
    for (uint32_t at = s->keys; at && k[at].tag == tag; at = k[at].up)
        if (k[at].kh == kh)
            return true;
    return false;
}

/* Has the object of the top frame written an extra key? (`pending`: outside a key, where the
 * last one is still in kh.) */
static bool wrote_extra(const rudder_js *js, const thread *s, bool pending) {
    uint32_t tag = s->sp - 1u;
    return (s->keys && js->m->knodes[s->keys].tag == tag) || (pending && s->ktag == tag);
}

/* The object of the top frame closes: its keys leave the set. */
static void keys_close(const rudder_js *js, thread *s, const jnode *n) {
    if (!has_extras(n))
        return;
    uint32_t tag = s->sp - 1u;
    const knode *k = js->m->knodes;
    while (s->keys && k[s->keys].tag == tag)
        s->keys = k[s->keys].up;
    if (s->ktag == tag)
        s->ktag = 0, s->kh = 0;
}

/* A key opens (after its quote): declared keys follow the trie; with `extras` it may be an
 * extra key, and the last extra key written joins the set here rather than at its own end, so
 * that the walks of a mask, which end many keys, make few nodes. */
static void key_start(const rudder_js *js, thread *s, frame *f, const jnode *n, bool extras) {
    f->phase = O_IN_KEY;
    f->aux = n->n ? n->trie : NONE;   /* followed even past `next`: no duplicate keys */
    f->flags = (uint8_t)((f->flags & F_COUNTS) | (extras ? F_EXTRAS : 0));
    lex_reset(s);
    s->lphase = SL_CHAR;
    if (!extras)
        return;
    if (n->n_rx)
        s->rx[0] = rudder_rx_start(n->rx[0], NULL);
    if (n->rx[1])
        s->rx[1] = rudder_rx_start(n->rx[1], NULL);
    if (s->ktag)
        s->keys = key_node(js->m, s->kh, s->ktag, s->keys);
    s->ktag = 0;
    s->kh = KH_SEED;
}

static int key_byte(const rudder_js *js, thread *s, frame *f, const jnode *n, uint8_t b);

#define KEY_DFS_DEPTH 64u
#define KEY_DFS_BUDGET 4096u

static bool key_dfs(const rudder_js *js, const thread *s, uint32_t depth, uint32_t *budget) {
    thread *t = &js->m->dfs[depth];
    for (uint32_t i = 0; i <= 0xe0; i++) {   /* the closing quote first, then 0x20..0xff */
        uint8_t b = (uint8_t)(i ? 0x1f + i : '"');
        if (i && b == '"')
            continue;
        if (!*budget)
            return true;   /* (too large to search: assume it can) */
        --*budget;
        tcopy(t, s);
        frame *f = &t->f[t->sp - 1];
        if (key_byte(js, t, f, N(js, f->node), b) != OK)
            continue;
        if (f->phase == O_COLON || depth + 1 == KEY_DFS_DEPTH || key_dfs(js, t, depth + 1, budget))
            return true;
    }
    return false;
}

/* In a restricted object that wrote extra keys: can the key of the top frame still end as a
 * key the object may take (a declared key in range, an extra key not written)? A depth-first
 * search of its next bytes, bounded. */
static bool key_ahead(const rudder_js *js, const thread *s) {
    js_matcher *m = js->m;
    if (!m->dfs)
        m->dfs = rudder_xalloc(KEY_DFS_DEPTH * sizeof(thread));
    uint32_t budget = KEY_DFS_BUDGET;
    m->in_dfs = true;
    bool ok = key_dfs(js, s, 0, &budget);
    m->in_dfs = false;
    return ok;
}

/* Extra keys may come here: the object has them and one more key leaves room for the
 * required ones (maxProperties). */
static bool extras_ok(const rudder_js *js, const thread *s, const jnode *n, const frame *f) {
    if (n->extra == NONE && !n->n_rx)
        return false;
    if (n->max != NONE) {
        uint32_t left = 0;
        if (n->n) {
            pset req = required_now(js, n, f);
            left = ps_count_from(&req, next_prop(f));
        }
        if (written(f) + 1 + left > n->max)
            return false;
    }
    return s->sp + 1 <= RUDDER_JS_MAX_DEPTH;
}

/* Declared properties that may come next: from `next` up to the first required one (none is
 * ever skipped), less those with no possible value, or whose value would not fit (nesting),
 * whose dependencies were skipped, or that would leave no room for the required ones or no
 * way to reach minProperties. */
static pset key_range(const rudder_js *js, const thread *s, const jnode *n, const frame *f) {
    pset fit = {{0}};
    uint32_t next = next_prop(f);
    if (next >= n->n)
        return fit;
    pset req = required_now(js, n, f);
    uint32_t hi = ps_first_from(&req, next);
    if (hi == NONE)
        hi = n->n - 1;
    for (uint32_t w = next >> 6; w <= hi >> 6; w++) {   /* [next, hi], less the never-fitting */
        uint64_t x = ~0ull;
        if (w == next >> 6)
            x &= ~0ull << (next & 63);
        if (w == hi >> 6 && (hi & 63) != 63)
            x &= (2ull << (hi & 63)) - 1;
        fit.w[w] = x & ~js->psets[n->sets + 1].w[w];
    }
    bool extras = n->extra != NONE || n->n_rx;
    if (!n->has_deps && n->max == NONE && (!n->min || extras) && s->sp + n->deepest <= RUDDER_JS_MAX_DEPTH)
        return fit;   /* (nothing else can exclude one) */
    for (uint32_t k = next; k <= hi; k++) {
        if (!ps_has(&fit, k))
            continue;
        const jprop *p = &js->props[n->a + k];
        bool ok = fits(js, s, p->value);
        if (ok && n->has_deps && (p->deps & ((1u << k) - 1) & ~f->aux3))
            ok = false;   /* a property it depends on came earlier and was not written */
        if (ok && n->max != NONE) {
            pset later = req;
            later.w[0] |= p->deps;
            ok = written(f) + 1 + ps_count_from(&later, k + 1) <= n->max;
        }
        if (ok && n->min && !extras)
            ok = written(f) + 1 + (n->n - k - 1) >= n->min;
        if (!ok)
            fit.w[k >> 6] &= ~(1ull << (k & 63));
    }
    return fit;
}

static bool any_in(const pset *p) {
    uint64_t x = 0;
    for (uint32_t w = 0; w < MAX_PROPS / 64; w++)
        x |= p->w[w];
    return x != 0;
}

static bool can_close(const rudder_js *js, const jnode *n, const frame *f) {
    if (n->n) {
        pset req = required_now(js, n, f);
        if (ps_first_from(&req, next_prop(f)) != NONE)
            return false;
    }
    return written(f) >= n->min;
}

/* The key is complete: property `cur` (EXTRA_KEY: an extra key, whose value node is `value`). */
static void key_done(const rudder_js *js, thread *s, frame *f, const jnode *n, uint32_t cur, uint32_t value) {
    (void)js;
    uint32_t next = next_prop(f), count = written(f);
    if (cur != EXTRA_KEY) {
        next = cur + 1;
        if (n->has_deps)
            f->aux3 |= 1u << cur;
    }
    /* counted only up to where it matters (min/maxProperties): states then repeat */
    uint32_t cap = n->max != NONE ? n->max + 1 : n->min;
    if (count < (cap < 255 ? cap : 255))
        count++;
    f->phase = O_COLON;
    f->flags &= F_COUNTS;
    f->aux = value;
    f->aux2 = next | cur << 9 | count << 18;
    lex_reset(s);
}

/* The value node of an extra key at its closing quote (NONE: no such key may be there). */
static uint32_t extra_value(const rudder_js *js, const jnode *n, const thread *s) {
    if (s->len < n->kmin || (n->rx[1] && !rudder_rx_accepting(n->rx[1], s->rx[1])))
        return NONE;
    if (!n->n_rx)
        return n->extra;
    const uint32_t *acc = s->rx[0] == RUDDER_DEAD ? NULL : rudder_rx_accept_set(n->rx[0], s->rx[0]);
    uint32_t set = acc ? acc[0] : 0;
    return set ? js->idx[n->pvals + set] : n->extra;
}

/* A byte of an extra key's name: its characters, its length and propertyNames pattern, and
 * the patternProperties it matches (both see the unescaped character). Escapes are those the
 * SDK's own writer uses for declared keys, \" and \\ only, so that a key has one spelling and
 * a declared key is told from an extra one by its bytes (a key with a control character, or
 * written with \/ or \u, is refused: docs/json-schema.md). */
static int extra_key_byte(const jnode *n, thread *s, uint8_t b) {
    bool lead = false;
    if (s->lphase == SL_CHAR) {
        if (b == '\\') {   /* it must have room, and a character to write that the patterns take */
            bool some = false;
            for (const char *e = "\"\\"; *e && !some; e++)
                some = (!n->rx[1] || rudder_rx_push(n->rx[1], s->rx[1], (uint8_t)*e) != RUDDER_DEAD) &&
                       (n->extra != NONE || (s->rx[0] != RUDDER_DEAD && rudder_rx_push(n->rx[0], s->rx[0], (uint8_t)*e) != RUDDER_DEAD));
            if ((n->kmax != NONE && s->len >= n->kmax) || !some)
                return DEAD;
            s->lphase = SL_ESC;
            return OK;
        }
        if (b < 0x20 || b == '"')
            return DEAD;
        if (b >= 0x80 && !utf8_lead(s, b))
            return DEAD;
        lead = true;
    } else if (s->lphase == SL_ESC) {
        if (b != '"' && b != '\\')
            return DEAD;
        s->lphase = SL_CHAR;
        lead = true;
    } else if (!utf8_more(s, b)) {
        return DEAD;
    }
    if (lead) {
        if (n->kmax != NONE && s->len >= n->kmax)
            return DEAD;
        if (s->len < (n->kmax != NONE ? n->kmax : n->kmin))   /* (saturated: states repeat, answers are cached) */
            s->len++;
    }
    if (n->rx[1] && (s->rx[1] = rudder_rx_push(n->rx[1], s->rx[1], b)) == RUDDER_DEAD)
        return DEAD;
    if (n->n_rx && s->rx[0] != RUDDER_DEAD) {
        s->rx[0] = rudder_rx_push(n->rx[0], s->rx[0], b);
        if (s->rx[0] == RUDDER_DEAD && n->extra == NONE)
            return DEAD;   /* it must match some pattern */
    }
    s->kh = KH_STEP(s->kh, b);   /* (the decoded byte: an escape's second byte is its character) */
    return OK;
}

static int key_byte(const rudder_js *js, thread *s, frame *f, const jnode *n, uint8_t b) {
    pset range = key_range(js, s, n, f);
    bool extras = f->flags & F_EXTRAS;
    uint32_t c = f->aux != NONE ? js_tchild(js, f->aux, b) : NONE;
    if (extras && b == '"' && s->lphase == SL_CHAR) {   /* the key ends */
        if (c != NONE && js->trie[c].term != NONE) {    /* it is a declared key */
            if (!ps_has(&range, js->trie[c].term))
                return DEAD;   /* written already, or a required one comes first */
            s->kh = 0;
            key_done(js, s, f, n, js->trie[c].term, js->props[n->a + js->trie[c].term].value);
            return OK;
        }
        uint32_t v = extra_value(js, n, s);
        uint64_t kh = s->kh;
        if (!fits(js, s, v) || key_written(js, s, kh, false))
            return DEAD;
        key_done(js, s, f, n, EXTRA_KEY, v);
        s->kh = kh, s->ktag = (uint8_t)(s->sp - 1u);
        return OK;
    }
    if (!(f->flags & F_EXTRAS)) {
        if (c == NONE || !ps_meets(&js->trie[c].below, &range))
            return DEAD;
        if (js->trie[c].term != NONE)
            key_done(js, s, f, n, js->trie[c].term, js->props[n->a + js->trie[c].term].value);
        else
            f->aux = c;
        return OK;
    }
    if (extra_key_byte(n, s, b) != OK) {   /* only a declared key can go on */
        if (c == NONE || !ps_meets(&js->trie[c].below, &range))
            return DEAD;
        f->flags &= F_COUNTS;
        lex_reset(s);
        s->kh = 0;
        if (js->trie[c].term != NONE)
            key_done(js, s, f, n, js->trie[c].term, js->props[n->a + js->trie[c].term].value);
        else
            f->aux = c;
        return OK;
    }
    f->aux = c;   /* NONE once it left every declared key */
    if (restricted(n) && !js->m->in_dfs && wrote_extra(js, s, false) && !key_open_ended(js, s, false) && !key_ahead(js, s))
        return DEAD;   /* it could only end as a key already written */
    return OK;
}

/* One more key may come (after `,`, or a `"` opening it): a declared one in range, or an extra
 * one (in a restricted object that wrote some, only if one not written can be spelled). */
static bool key_may_come(const rudder_js *js, const thread *s, const jnode *n, const frame *f, bool extras) {
    pset range = key_range(js, s, n, f);
    if (any_in(&range))
        return true;
    if (!extras)
        return false;
    if (!restricted(n) || js->m->in_dfs || !wrote_extra(js, s, true))
        return true;
    thread t;
    tcopy(&t, s);
    key_start(js, &t, &t.f[t.sp - 1], n, true);
    return key_open_ended(js, &t, false) || key_ahead(js, &t);
}

static int obj_byte(const rudder_js *js, thread *s, frame *f, const jnode *n, uint8_t b, bool ws) {
    if (f->phase == O_IN_KEY)
        return key_byte(js, s, f, n, b);
    if (ws)
        return OK;
    switch (f->phase) {
    case O_KEY_OR_END:
        if (b == '}') {
            if (!can_close(js, n, f))
                return DEAD;
            keys_close(js, s, n);
            child_done(js, s);
            return OK;
        }
        /* fall through */
    case O_KEY: {
        bool extras = extras_ok(js, s, n, f);
        if (b != '"' || !key_may_come(js, s, n, f, extras))
            return DEAD;
        key_start(js, s, f, n, extras);
        return OK;
    }
    case O_COLON:
        if (b != ':')
            return DEAD;
        f->phase = O_VALUE;
        return push_frame(js, s, f->aux, 0) ? OK : DEAD;
    case O_AFTER:
        if (b == ',' && key_may_come(js, s, n, f, extras_ok(js, s, n, f))) {
            f->phase = O_KEY;
            return OK;
        }
        if (b == '}' && can_close(js, n, f)) {
            keys_close(js, s, n);
            child_done(js, s);
            return OK;
        }
        return DEAD;
    }
    return DEAD;
}

/* ------------------------------------------------------------------ arrays */

static int arr_byte(const rudder_js *js, thread *s, frame *f, const jnode *n, uint8_t b, bool ws) {
    if (ws)
        return OK;
    uint32_t count = f->aux;
    uint32_t item = count < n->n ? js->idx[n->a + count] : n->extra;
    bool can_end = count >= n->min && f->aux3 >= n->contains;
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
        return push_frame(js, s, item, 0) ? RETRY : DEAD;
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

/* ------------------------------------------------------------------ one byte */

static bool push_byte(const rudder_js *js, thread *s, uint8_t b, tlist *split);

/* A value of a union starts: the thread goes on with the first alternative that can take the
 * byte; each other one goes on in a copy (in `split`, having taken the byte too). */
static int union_start(const rudder_js *js, thread *s, frame *f, const jnode *n, uint8_t b, tlist *split) {
    uint32_t taken = NONE, base = f->flags;
    for (uint32_t k = 0; k < n->n; k++) {
        uint32_t alt = js->idx[n->a + k];
        if (!js_bit(N(js, alt)->first, b) || s->sp - 1 + N(js, alt)->need > RUDDER_JS_MAX_DEPTH)
            continue;
        uint8_t flags = (uint8_t)(k < n->counting ? base | F_COUNTS : base);
        if (taken == NONE) {
            taken = alt;
            f->node = (uint16_t)alt;
            f->flags = flags;
            continue;
        }
        if (!split)
            continue;   /* (a caller that wants only one thread: the first alternative) */
        thread copy;
        tcopy(&copy, s);
        copy.f[copy.sp - 1].node = (uint16_t)alt;
        copy.f[copy.sp - 1].flags = flags;
        if (push_byte(js, &copy, b, split))
            tlist_add(split, &copy);
    }
    return taken == NONE ? DEAD : RETRY;
}

/* The tag of a tagged union is written (the top frame reads it; see tagged_union in
 * rudder_jsonschema_compile.c): the thread goes on in the alternative whose tag pattern accepts, as
 * if it had been that object from its start; each other one that accepts goes on in a copy. */
static void tag_switch(const rudder_js *js, thread *s, uint32_t alt) {
    frame *f = &s->f[s->sp - 1];
    f->node = (uint16_t)alt;
    uint32_t one = N(js, alt)->min ? 1 : 0;   /* written keys, counted as key_done would (max is NONE) */
    f->aux2 = (f->aux2 & 0x3ffff) | one << 18;
}

static int tag_done(const rudder_js *js, thread *s, rudder_rx *rx, uint32_t state, tlist *split) {
    const jnode *t = N(js, s->f[s->sp - 1].node);
    const uint32_t *acc = rudder_rx_accept_set(rx, state);
    uint32_t first = NONE, n = rudder_rx_n_patterns(rx);
    for (uint32_t k = 0; k < n; k++) {
        uint32_t alt = js->idx[t->tags + k];
        if (!(acc[k >> 5] >> (k & 31) & 1u) || s->sp - 1 + N(js, alt)->need > RUDDER_JS_MAX_DEPTH)
            continue;
        if (first == NONE) {
            first = alt;
        } else if (split) {
            thread copy;
            tcopy(&copy, s);
            tag_switch(js, &copy, alt);
            tlist_add(split, &copy);
        }
    }
    if (first == NONE)
        return DEAD;
    tag_switch(js, s, first);
    return OK;
}

static int step(const rudder_js *js, thread *s, uint8_t b, tlist *split) {
    frame *f = &s->f[s->sp - 1];
    bool ws = js->flexible && (b == ' ' || b == '\n' || b == '\t' || b == '\r');
    if (s->sp == 1) {
        if (f->phase == D_START) {
            if (ws)
                return OK;
            f->phase = D_VALUE;
            return push_frame(js, s, js->root, 0) ? RETRY : DEAD;
        }
        return ws && f->phase == D_DONE ? OK : DEAD;
    }
    const jnode *n = N(js, f->node);
    if (f->phase == V_START) {
        if (ws)
            return OK;
        switch (n->kind) {
        case K_UNION:
            return union_start(js, s, f, n, b, split);
        case K_OBJECT:
            if (b != '{')
                return DEAD;
            f->phase = O_KEY_OR_END;
            f->aux = f->aux2 = f->aux3 = 0;
            return OK;
        case K_ARRAY:
            if (b != '[')
                return DEAD;
            f->phase = A_ITEM_OR_END;
            f->aux = f->aux3 = 0;
            return OK;
        case K_STRING:
            if (b != '"')
                return DEAD;
            f->phase = S_IN;
            lex_reset(s);
            s->lphase = SL_CHAR;
            for (uint32_t k = 0; k < n->n_rx + n->n_neg; k++)
                s->rx[k] = rudder_rx_start(n->rx[k], NULL);
            if (needs_reach(n) && !completable(js, f->node, s->rx, 0))
                return DEAD;
            return OK;
        case K_NUMBER:
            f->phase = N_IN;
            lex_reset(s);
            s->lphase = NL_START;
            return num_byte(js, s, n, b);
        case K_LITS: {
            uint32_t c = js_tchild(js, n->trie, b);
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
        int r = str_byte(js, s, f->node, b);
        if (r == CLOSED) {
            uint32_t state = s->rx[0];   /* (child_done resets the lexer) */
            child_done(js, s);
            return N(js, s->f[s->sp - 1].node)->tags != NONE ? tag_done(js, s, n->rx[0], state, split) : OK;
        }
        return r;
    }
    case K_NUMBER:
        return num_byte(js, s, n, b);
    case K_LITS: {
        uint32_t c = js_tchild(js, f->aux, b);
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

/* Push one byte into thread s (in place); threads split off at unions go to `split` (NULL:
 * keep the first alternative only). Returns whether s itself survived. */
static bool push_byte(const rudder_js *js, thread *s, uint8_t b, tlist *split) {
    int r;
    while ((r = step(js, s, b, split)) == RETRY) {
    }
    return r == OK;
}

static bool accepting(const rudder_js *js, const thread *s0) {
    thread s;
    tcopy(&s, s0);
    for (;;) {
        frame *f = &s.f[s.sp - 1];
        if (s.sp == 1)
            return f->phase == D_DONE;
        const jnode *n = N(js, f->node);
        if (n->kind == K_NUMBER && f->phase == N_IN && number_complete(n, &s))
            child_done(js, &s);
        else if (n->kind == K_LITS && f->phase == L_IN && js->trie[f->aux].term != NONE)
            child_done(js, &s);
        else
            return false;
    }
}

/* A superset of the bytes that can come next, from the top frame alone; false when it could
 * be almost anything (inside strings, numbers, extra keys, after a complete literal). */
static bool candidates(const rudder_js *js, const thread *s, uint32_t set[8]) {
    const frame *f = &s->f[s->sp - 1];
    memset(set, 0, 32);
    bool between = true;   /* between tokens of JSON: whitespace may come (flexible) */
    if (s->sp == 1) {
        if (f->phase == D_START)
            memcpy(set, N(js, js->root)->first, 32);
    } else if (f->phase == V_START) {
        memcpy(set, N(js, f->node)->first, 32);
    } else {
        const jnode *n = N(js, f->node);
        switch (n->kind) {
        case K_OBJECT:
            switch (f->phase) {
            case O_KEY_OR_END: js_set_bit(set, '}'); /* fall through */
            case O_KEY: js_set_bit(set, '"'); break;
            case O_COLON: js_set_bit(set, ':'); break;
            case O_AFTER: js_set_bit(set, ','), js_set_bit(set, '}'); break;
            default:   /* O_IN_KEY */
                if ((f->flags & F_EXTRAS) || f->aux == NONE)
                    return false;
                for (uint32_t c = js->trie[f->aux].child; c != NONE; c = js->trie[c].sibling)
                    js_set_bit(set, js->trie[c].byte);
                between = false;
            }
            break;
        case K_ARRAY: {
            uint32_t item = f->aux < n->n ? js->idx[n->a + f->aux] : n->extra;
            if (f->phase == A_AFTER) {
                js_set_bit(set, ','), js_set_bit(set, ']');
                break;
            }
            if (f->phase == A_ITEM_OR_END)
                js_set_bit(set, ']');
            if (item != NONE)
                for (uint32_t w = 0; w < 8; w++)
                    set[w] |= N(js, item)->first[w];
            break;
        }
        case K_STRING:   /* under regexes: the bytes they all keep alive (and the closing quote) */
            if (f->phase != S_IN || !n->n_rx || (s->lphase != SL_CHAR && s->lphase != SL_UTF8))
                return false;
            memset(set, 0xff, 32);
            for (uint32_t k = 0; k < n->n_rx; k++) {
                if (n->rx_free >> k & 1)
                    continue;
                const uint32_t *live = rudder_rx_live_bytes(n->rx[k], s->rx[k]);
                for (uint32_t w = 0; w < 8; w++)
                    set[w] &= live[w];
            }
            if (s->lphase == SL_UTF8) {
                for (uint32_t b = 0; b < 256; b++)
                    if (b < s->u8lo || b > s->u8hi)
                        set[b >> 5] &= ~(1u << (b & 31));
            } else {
                set[0] = 0;   /* no control byte */
                set['"' >> 5] &= ~(1u << ('"' & 31));
                if (str_complete(n, s))
                    js_set_bit(set, '"');
                js_set_bit(set, '\\');
            }
            return true;
        case K_LITS:
        case K_NUMBER: {   /* its own next bytes, and when it may end here, the parent's */
            bool may_end;
            if (n->kind == K_LITS) {
                for (uint32_t c = js->trie[f->aux].child; c != NONE; c = js->trie[c].sibling)
                    js_set_bit(set, js->trie[c].byte);
                may_end = js->trie[f->aux].term != NONE;
            } else if (f->phase == N_IN) {
                for (const char *c = "0123456789.eE+-"; *c; c++)
                    js_set_bit(set, (uint8_t)*c);
                may_end = number_complete(n, s);
            } else {
                return false;
            }
            if (may_end) {
                thread up;
                uint32_t more[8];
                tcopy(&up, s);
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
        js_set_bit(set, ' '), js_set_bit(set, '\n'), js_set_bit(set, '\t'), js_set_bit(set, '\r');
    }
    return true;
}

/* ------------------------------------------------------------------ sets of threads */

static int tcmp(const thread *a, const thread *b) {
    uint32_t la = tsize(a), lb = tsize(b);
    int c = memcmp(a, b, la < lb ? la : lb);
    return c ? c : (int)la - (int)lb;
}

static uint32_t thash(const thread *t) {
    const uint8_t *p = (const uint8_t *)t;
    uint32_t h = 2166136261u, n = tsize(t);
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

/* Put the threads in a canonical order (by hash, then bytes) without duplicates; past
 * MAX_THREADS the rest is dropped. The order is sorted indices, then one pass of copies.
 * Returns the new count. */
static uint32_t normalize(js_matcher *m, thread *t, uint32_t n) {
    if (n < 2)
        return n;
    m->order = rudder_grow(m->order, &m->cap_order, 2 * n, 4);
    uint32_t *idx = m->order, *h = m->order + n;
    for (uint32_t i = 0; i < n; i++)
        idx[i] = i, h[i] = thash(&t[i]);
    for (uint32_t gap = n / 2; gap; gap = gap == 2 ? 1 : gap * 5 / 11)   /* shell sort of indices */
        for (uint32_t i = gap; i < n; i++) {
            uint32_t v = idx[i], j = i;
            while (j >= gap && (h[idx[j - gap]] > h[v] || (h[idx[j - gap]] == h[v] && tcmp(&t[idx[j - gap]], &t[v]) > 0))) {
                idx[j] = idx[j - gap];
                j -= gap;
            }
            idx[j] = v;
        }
    m->sorted = rudder_grow(m->sorted, &m->cap_sorted, n, sizeof(thread));
    uint32_t k = 0;
    for (uint32_t i = 0; i < n && k < MAX_THREADS; i++) {
        const thread *x = &t[idx[i]];
        if (k && h[idx[i]] == h[idx[i - 1]] && tcmp(&m->sorted[k - 1], x) == 0)
            continue;
        tcopy(&m->sorted[k++], x);
    }
    if (k == MAX_THREADS && n > MAX_THREADS)
        m->dropped += n - MAX_THREADS;
    for (uint32_t i = 0; i < k; i++)
        tcopy(&t[i], &m->sorted[i]);
    return k;
}

/* Push bytes into the current set; false (and the set unchanged) when every thread dies. The
 * bytes go through two scratch buffers in turn; the current set is written at the end. */
static bool set_push(rudder_js *js, const uint8_t *bytes, uint32_t len) {
    js_matcher *m = js->m;
    const thread *from = m->cur;
    uint32_t n = m->n_cur;
    for (uint32_t i = 0; i < len; i++) {
        uint32_t k = 0, which = i & 1;
        for (uint32_t t = 0; t < n; t++) {
            m->split.n = 0;
            m->buf[which] = rudder_grow(m->buf[which], &m->cap_buf[which], k + 1, sizeof(thread));
            thread *to = m->buf[which];
            tcopy(&to[k], &from[t]);
            if (push_byte(js, &to[k], bytes[i], &m->split))
                k++;
            if (m->split.n) {
                m->buf[which] = rudder_grow(m->buf[which], &m->cap_buf[which], k + m->split.n, sizeof(thread));
                for (uint32_t j = 0; j < m->split.n; j++)
                    tcopy(&m->buf[which][k++], &m->split.t[j]);
            }
        }
        if (k == 0)
            return false;
        n = normalize(m, m->buf[which], k);
        from = m->buf[which];
    }
    if (from != m->cur) {
        m->cur = rudder_grow(m->cur, &m->cap_cur, n, sizeof(thread));
        for (uint32_t t = 0; t < n; t++)
            tcopy(&m->cur[t], &from[t]);
    }
    m->n_cur = n;
    return true;
}

static bool set_accepting(const rudder_js *js) {
    for (uint32_t t = 0; t < js->m->n_cur; t++)
        if (accepting(js, &js->m->cur[t]))
            return true;
    return false;
}

/* ------------------------------------------------------------------ token classes */

/* Request-independent. "Plain" tokens are UTF-8 (the last character may be cut short) with no
 * quote, backslash or control byte: inside a string, at a character boundary, every one of
 * them is allowed as long as its characters fit (maxLength) and, under regexes, their cached
 * masks allow it; only the other ("special") tokens need checking one by one, and tokens that
 * are not UTF-8 at all are never allowed there. g_plain_upto[k]: the plain tokens of at most k
 * characters (k <= SHORT); longer plain tokens are few and listed apart. */
#define SHORT 24u
static uint32_t *g_plain_upto[SHORT + 1], *g_special, g_n_special, *g_long, g_n_long, g_max_token;
static uint32_t *g_special_lcp;   /* bytes shared with the previous special token (sorted) */
static uint8_t *g_chars;   /* characters of each plain token (capped at 255) */
static uint8_t *g_tail;    /* bytes its last character lacks (a token cut inside a character) */
static uint32_t g_first[256], g_n_first;   /* the trie's first-level nodes, and their bytes */
static bool g_keys_in_token;   /* some token holds `,""` (it could open and end a key in an open object) */
/* The tokens that can end an extra key (keys_view): those holding a quote; the distinct texts
 * they add to a key before its closing quote, from a character boundary (g_ext: bytes
 * g_ext_at[k]..g_ext_at[k + 1]); the hashes of the keys they write whole after `"` opens one. */
static uint32_t *g_quoted, g_n_quoted, *g_ext_at, g_n_ext, g_n_whole;
static uint8_t *g_ext_bytes;
static uint64_t *g_ext_mul, *g_ext_add;   /* g_ext k from a key's hash h: h * mul + add */
static uint64_t *g_whole;
static uint8_t g_first_byte[256];

/* Key bytes from a lexer state (phase, UTF-8 expectations) to the first unescaped quote: the
 * index past it, the hash `kh` carried on (and the decoded bytes to `out` when given); NONE
 * when the bytes are not key characters or hold no such quote. */
static uint32_t key_scan(const uint8_t *b, uint32_t n, uint8_t phase, uint8_t need, uint8_t lo, uint8_t hi, uint64_t *kh,
                         uint8_t *out, uint32_t *n_out) {
    for (uint32_t i = 0; i < n; i++) {
        uint8_t c = b[i];
        if (phase == SL_CHAR) {
            if (c == '"')
                return i + 1;
            if (c == '\\') {
                phase = SL_ESC;
                continue;
            }
            if (c < 0x20 || (c >= 0x80 && c < 0xc2) || c > 0xf4)
                return NONE;
            if (c >= 0x80) {
                phase = SL_UTF8, need = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : 1;
                lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80, hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
            }
        } else if (phase == SL_ESC) {
            if (c != '"' && c != '\\')
                return NONE;
            phase = SL_CHAR;
        } else {
            if (c < lo || c > hi)
                return NONE;
            lo = 0x80, hi = 0xbf;
            if (--need == 0)
                phase = SL_CHAR;
        }
        *kh = KH_STEP(*kh, c);
        if (out)
            out[(*n_out)++] = c;
    }
    return NONE;
}

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
        uint32_t seen = 0;   /* how much of `,""` the token holds, in order */
        for (uint32_t i = 0; i < len && seen < 3; i++)
            seen += b[i] == (uint8_t)",\"\""[seen];
        g_keys_in_token |= seen == 3;
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
    /* the tokens that can end an extra key, and how (keys_view) */
    g_quoted = rudder_xalloc(4 * (vocab + 1));
    g_ext_at = rudder_xalloc(4 * (vocab + 2));
    g_whole = rudder_xalloc(8 * (vocab + 1));
    g_ext_mul = rudder_xalloc(8 * (vocab + 1));
    g_ext_add = rudder_xalloc(8 * (vocab + 1));
    uint8_t *out = rudder_xalloc(g_max_token + 1);
    uint32_t cap_ext = 0;
    g_ext_at[0] = 0;
    for (uint32_t t = 0; t < vocab; t++) {
        uint32_t len, n_out = 0, i = 0;
        const uint8_t *b = rudder_token_bytes(t, &len);
        bool quote = false;
        for (uint32_t k = 0; b && k < len && !quote; k++)
            quote = b[k] == '"';
        if (!quote)
            continue;
        g_quoted[g_n_quoted++] = t;
        uint64_t h = 0;
        if (key_scan(b, len, SL_CHAR, 0, 0, 0, &h, out, &n_out) != NONE) {
            bool known = false;
            for (uint32_t k = 0; k < g_n_ext && !known; k++)
                known = g_ext_at[k + 1] - g_ext_at[k] == n_out && !memcmp(g_ext_bytes + g_ext_at[k], out, n_out);
            if (!known) {
                g_ext_bytes = rudder_grow(g_ext_bytes, &cap_ext, g_ext_at[g_n_ext] + n_out + 1, 1);
                memcpy(g_ext_bytes + g_ext_at[g_n_ext], out, n_out);
                g_ext_at[g_n_ext + 1] = g_ext_at[g_n_ext] + n_out;
                g_ext_mul[g_n_ext] = 1, g_ext_add[g_n_ext] = 0;
                for (uint32_t k = 0; k < n_out; k++)
                    g_ext_mul[g_n_ext] *= KH_MUL, g_ext_add[g_n_ext] = KH_STEP(g_ext_add[g_n_ext], out[k]);
                g_n_ext++;
            }
        }
        while (i < len && (b[i] == ' ' || b[i] == '\n' || b[i] == '\t' || b[i] == '\r'))
            i++;
        h = KH_SEED;
        if (i < len && b[i] == '"' && key_scan(b + i + 1, len - i - 1, SL_CHAR, 0, 0, 0, &h, NULL, NULL) != NONE) {
            bool known = false;
            for (uint32_t k = 0; k < g_n_whole && !known; k++)
                known = g_whole[k] == h;
            if (!known)
                g_whole[g_n_whole++] = h;
        }
    }
    rudder_free(out);
    if (g_n_quoted > 0xfffe)
        g_keys_in_token = true;   /* (their indices are 16 bits: keys then show every key written) */
}

/* ------------------------------------------------------------------ masks of one thread */

static uint32_t walk_range(rudder_js *js, const thread *t0, uint32_t *mask, uint32_t first, uint32_t end, uint32_t base);

/* Inside a string value or an extra key, at a character boundary, the plain tokens go as a
 * class: returns the room left in characters (NONE: unbounded), or 0 when the fast path does
 * not apply; rx/st receive the regexes every character must keep alive (and their states). */
static uint32_t plain_room(const rudder_js *js, const thread *s, rudder_rx **rx, uint32_t *st, uint32_t *n_rx, bool *reach_check) {
    const frame *f = &s->f[s->sp - 1];
    *n_rx = 0;
    *reach_check = false;
    if (s->sp < 2 || s->lphase != SL_CHAR)
        return 0;
    const jnode *n = N(js, f->node);
    if (n->kind == K_STRING && f->phase == S_IN) {
        for (uint32_t k = 0; k < n->n_rx; k++)
            if (!(n->rx_free >> k & 1))   /* (one that never dies allows every plain token) */
                rx[*n_rx] = n->rx[k], st[(*n_rx)++] = s->rx[k];
        *reach_check = needs_reach(n);
        return n->max == NONE ? NONE : n->max - s->len;
    }
    if (n->kind == K_OBJECT && f->phase == O_IN_KEY && (f->flags & F_EXTRAS)) {
        if (restricted(n) && wrote_extra(js, s, false) && !key_open_ended(js, s, true))
            return 0;   /* (each byte is checked by key_ahead) */
        if (n->rx[1])
            rx[*n_rx] = n->rx[1], st[(*n_rx)++] = s->rx[1];
        if (n->n_rx && n->extra == NONE) {   /* the key must match some pattern */
            if (s->rx[0] == RUDDER_DEAD)
                return 0;
            rx[*n_rx] = n->rx[0], st[(*n_rx)++] = s->rx[0];
        }
        return n->kmax == NONE ? NONE : n->kmax - s->len;
    }
    return 0;
}

/* Do the bytes continue from thread t (in any of the threads it splits into)? */
static bool bytes_ok(const rudder_js *js, const thread *t, const uint8_t *b, uint32_t n) {
    thread c;
    tcopy(&c, t);
    for (uint32_t k = 0; k < n; k++) {
        tlist split = {0};
        bool alive = push_byte(js, &c, b[k], &split);
        bool ok = false;
        for (uint32_t j = 0; j < split.n && !ok; j++)
            ok = bytes_ok(js, &split.t[j], b + k + 1, n - k - 1);
        rudder_free(split.t);
        if (ok)
            return true;
        if (!alive)
            return false;
    }
    return true;
}

/* A plain token inside a string value with a maximum and regexes: can the string still be
 * completed after it? (Its bytes through the regexes only: plain tokens need no lexing.) */
static bool plain_token_ok(const rudder_js *js, const thread *s, uint32_t t) {
    uint32_t node = s->f[s->sp - 1].node, len, st[STRING_RX];
    const jnode *n = N(js, node);
    const uint8_t *b = rudder_token_bytes(t, &len);
    for (uint32_t k = 0; k < n->n_rx; k++) {
        st[k] = s->rx[k];
        for (uint32_t i = 0; i < len && st[k] != RUDDER_DEAD; i++)
            st[k] = rudder_rx_push(n->rx[k], st[k], b[i]);
        if (st[k] == RUDDER_DEAD)
            return false;
    }
    return completable(js, node, st, s->len + g_chars[t]);
}

static uint32_t fill_plain(rudder_js *js, const thread *s0, uint32_t *mask, uint32_t room, rudder_rx **rx, const uint32_t *st,
                           uint32_t n_rx, bool reach_check) {
    uint32_t words = rudder_mask_words();
    const uint32_t *base = g_plain_upto[room < SHORT ? room : SHORT];
    bool narrowed = n_rx > 0 || reach_check;
    if (!narrowed) {
        for (uint32_t w = 0; w < words; w++)
            mask[w] |= base[w];
        for (uint32_t i = 0; room > SHORT && i < g_n_long; i++)
            if (g_chars[g_long[i]] <= room)
                rudder_mask_set(mask, g_long[i]);
    } else {
        /* the plain tokens that every regex's cached mask allows, each checked if needed */
        const uint32_t *allowed[STRING_RX + 1], *safe = g_plain_upto[0];
        const jnode *sn = N(js, s0->f[s0->sp - 1].node);
        if (reach_check && sn->n_rx == 1) {
            uint32_t node = s0->f[s0->sp - 1].node, far = js->m->far[node];
            if (far == NONE - 1)
                far = js->m->far[node] = rx_far(sn->rx[0]);
            if (far != NONE && room != NONE && room > far)
                safe = g_plain_upto[room - far < SHORT ? room - far : SHORT];
        }
        for (uint32_t k = 0; k < n_rx; k++)
            allowed[k] = rudder_rx_mask(rx[k], st[k]);
        for (uint32_t w = 0; w < words; w++) {
            uint32_t bits = base[w];
            for (uint32_t k = 0; k < n_rx && bits; k++)
                bits &= allowed[k][w];
            if (reach_check)   /* (tokens short enough that any state after them stays in reach pass) */
                for (uint32_t x = bits & ~safe[w]; x; x &= x - 1) {
                    uint32_t t = w * 32 + (uint32_t)__builtin_ctz(x);
                    if (!plain_token_ok(js, s0, t))
                        bits &= ~(1u << (t & 31));
                }
            mask[w] |= bits;
        }
        for (uint32_t i = 0; room > SHORT && i < g_n_long; i++) {
            uint32_t t = g_long[i], len;
            if (g_chars[t] > room)
                continue;
            const uint8_t *b = rudder_token_bytes(t, &len);
            if (bytes_ok(js, s0, b, len))
                rudder_mask_set(mask, t);
        }
    }
    /* the special tokens in byte order: a shared prefix is pushed once (J[k]: the thread after
     * k bytes, exact up to `exact`), and a dead one kills every token that starts with it; where
     * a byte splits the thread (a union begins), the token's rest is checked on every branch */
    thread *J = js->m->walk;
    tlist *spill = &js->m->split;
    tcopy(&J[0], s0);
    uint32_t dead = NONE, exact = 0;
    for (uint32_t i = 0; i < g_n_special; i++) {
        uint32_t tok = g_special[i], len, k = g_special_lcp[i];
        if (dead != NONE && k > dead)
            continue;
        const uint8_t *b = rudder_token_bytes(tok, &len);
        if (k > exact)
            k = exact;
        dead = NONE;
        bool ok = true;
        for (; k < len; k++) {
            tcopy(&J[k + 1], &J[k]);
            spill->n = 0;
            bool alive = push_byte(js, &J[k + 1], b[k], spill);
            if (spill->n) {
                ok = alive && bytes_ok(js, &J[k + 1], b + k + 1, len - k - 1);
                for (uint32_t j = 0; j < spill->n && !ok; j++) {
                    thread c;
                    tcopy(&c, &spill->t[j]);
                    ok = bytes_ok(js, &c, b + k + 1, len - k - 1);
                }
                exact = k;
                break;
            }
            if (!alive) {
                dead = exact = k;
                ok = false;
                break;
            }
            exact = k + 1;
        }
        if (ok)
            rudder_mask_set(mask, tok);
    }
    return 1;   /* (counted by the caller) */
}

static tlist *spill_at(js_matcher *m, uint32_t depth) {
    if (depth >= m->walk_cap)
        rudder_panic("jsonschema: walk deeper than the longest token");
    return &m->spill[depth];
}

/* The tokens of trie nodes [first, end) that continue from the thread in m->walk[base] (its
 * candidate bytes in m->sets[8 * base]), OR-ed into mask; the walk's stacks are used from
 * depth `base` on (a split walks the subtree deeper). Returns how many tokens were set (a token
 * set twice counts twice: only zero matters). */
static uint32_t walk_from(rudder_js *js, uint32_t *mask, uint32_t first, uint32_t end, uint32_t base) {
    js_matcher *m = js->m;
    const uint32_t *nodes = rudder_trie_get()->nodes;
    uint32_t *ends = m->ends + base, *sets = m->sets + 8 * base, count = 0;
    thread *J = m->walk + base;
    uint32_t depth = 0, i = first;
    ends[0] = end;
    while (i < end) {
        while (i >= ends[depth])
            depth--;
        uint32_t w = nodes[2 * i], size = nodes[2 * i + 1];
        if (!js_bit(sets + 8 * depth, (uint8_t)w)) {   /* the thread cannot take this byte */
            i += size;
            continue;
        }
        thread *child = &J[depth + 1];
        tcopy(child, &J[depth]);
        tlist *spill = spill_at(m, base + depth + 1);
        spill->n = 0;
        bool alive = push_byte(js, child, (uint8_t)w, spill);
        uint32_t tok1 = w >> 8;
        if (spill->n) {   /* split: the token, then its subtree from each thread */
            if (tok1) {
                mask[(tok1 - 1) >> 5] |= 1u << ((tok1 - 1) & 31);
                count++;
            }
            if (size > 1) {
                if (alive)
                    tlist_add(spill, child);
                for (uint32_t j = 0; j < spill->n; j++)
                    count += walk_range(js, &spill->t[j], mask, i + 1, i + size, base + depth + 1);
            }
            i += size;
            continue;
        }
        if (!alive) {
            i += size;
            continue;
        }
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
    return count;
}

static uint32_t walk_range(rudder_js *js, const thread *t0, uint32_t *mask, uint32_t first, uint32_t end, uint32_t base) {
    js_matcher *m = js->m;
    thread *J = m->walk + base;
    if (J != t0)
        tcopy(J, t0);
    if (!candidates(js, J, m->sets + 8 * base))
        memset(m->sets + 8 * base, 0xff, 32);
    return walk_from(js, mask, first, end, base);
}

/* The whole mask of one thread. */
static uint32_t thread_mask(rudder_js *js, const thread *t, uint32_t *mask) {
    rudder_rx *rx[STRING_RX + 1];
    uint32_t st[STRING_RX + 1], n_rx;
    bool reach_check;
    uint32_t room = plain_room(js, t, rx, st, &n_rx, &reach_check);
    js_matcher *m = js->m;
    const frame *top = &t->f[t->sp - 1];
    if (room && N(js, top->node)->kind == K_STRING && N(js, top->node)->n_rx) {
        uint32_t live = 0;   /* a narrow regex (a literal, a date...): the walk is cheaper */
        if (candidates(js, t, m->sets))
            for (uint32_t w = 0; w < 8; w++)
                live += (uint32_t)__builtin_popcount(m->sets[w]);
        if (live < 48)
            room = 0;
    }
    if (room) {
        const frame *f = &t->f[t->sp - 1];
        uint32_t count = fill_plain(js, t, mask, room, rx, st, n_rx, reach_check);
        if (N(js, f->node)->kind == K_OBJECT && f->aux != NONE && (n_rx || room != NONE)) {
            thread declared;   /* plain tokens the extra-key rules refuse may still spell a declared key */
            tcopy(&declared, t);
            declared.f[declared.sp - 1].flags &= (uint8_t)~F_EXTRAS;
            count += thread_mask(js, &declared, mask);
        }
        return count;
    }
    /* the first level from a compact list: most positions kill most first bytes, and the
     * first-level nodes are spread over the whole trie */
    const uint32_t *nodes = rudder_trie_get()->nodes;
    uint32_t count = 0;
    tcopy(&m->walk[0], t);
    if (!candidates(js, t, m->sets))
        memset(m->sets, 0xff, 32);
    uint32_t set[8];
    memcpy(set, m->sets, 32);
    for (uint32_t r = 0; r < g_n_first; r++)
        if (js_bit(set, g_first_byte[r])) {
            uint32_t at = g_first[r];
            count += walk_from(js, mask, at, at + nodes[2 * at + 1], 0);
        }
    return count;
}

/* ------------------------------------------------------------------ the engine */

static bool e_push(void *self, const uint8_t *bytes, uint32_t n) { return set_push(self, bytes, n); }

static uint32_t e_save(void *self) {
    rudder_js *js = self;
    js_matcher *m = js->m;
    uint32_t need = 4;
    for (uint32_t t = 0; t < m->n_cur; t++)
        need += tsize(&m->cur[t]);
    m->hist = rudder_grow(m->hist, &m->cap_hist, m->n_hist + need, 1);
    m->hist_at = rudder_grow(m->hist_at, &m->cap_cps, m->n_cps + 1, 4);
    uint8_t *p = m->hist + m->n_hist;
    memcpy(p, &m->n_cur, 4);
    p += 4;
    for (uint32_t t = 0; t < m->n_cur; t++) {
        memcpy(p, &m->cur[t], tsize(&m->cur[t]));
        p += tsize(&m->cur[t]);
    }
    m->hist_at[m->n_cps] = m->n_hist;
    m->n_hist += need;
    return m->n_cps++;
}

static void e_restore(void *self, uint32_t cp) {
    rudder_js *js = self;
    js_matcher *m = js->m;
    const uint8_t *p = m->hist + m->hist_at[cp];
    memcpy(&m->n_cur, p, 4);
    p += 4;
    m->cur = rudder_grow(m->cur, &m->cap_cur, m->n_cur, sizeof(thread));
    for (uint32_t t = 0; t < m->n_cur; t++) {
        uint8_t sp = p[0];
        uint32_t size = HEAD + sp * (uint32_t)sizeof(frame);
        memcpy(&m->cur[t], p, size);
        p += size;
    }
    m->n_hist = (uint32_t)(p - m->hist);
    m->n_cps = cp + 1;
}

static bool e_accepting(void *self) { return set_accepting(self); }

static uint32_t e_walk(void *self, uint32_t *mask, uint32_t first, uint32_t end) {
    rudder_js *js = self;
    js_matcher *m = js->m;
    uint32_t count = 0;
    bool whole = first == 1 && end == rudder_trie_get()->n_nodes;
    for (uint32_t t = 0; t < m->n_cur; t++) {
        thread copy;
        tcopy(&copy, &m->cur[t]);
        count += whole ? thread_mask(js, &copy, mask) : walk_range(js, &copy, mask, first, end, 0);
    }
    return whole && count ? rudder_mask_count(mask) : count;
}

/* The one byte every thread allows next, or -1 (several, none, or the document may end). */
static int forced_byte(rudder_js *js, const thread *set, uint32_t n) {
    int only = -1;
    for (uint32_t t = 0; t < n; t++) {
        if (accepting(js, &set[t]))
            return -1;
        uint32_t cand[8];
        bool narrow = candidates(js, &set[t], cand);
        thread c;
        for (uint32_t b = 0; b < 256; b++) {
            if (narrow && !js_bit(cand, (uint8_t)b))
                continue;
            tcopy(&c, &set[t]);
            tlist *spill = &js->m->split;
            spill->n = 0;
            if (push_byte(js, &c, (uint8_t)b, spill) || spill->n) {
                if (only >= 0 && only != (int)b)
                    return -1;
                only = (int)b;
            }
        }
    }
    return only;
}

static uint32_t e_forced(void *self, uint8_t *dst, uint32_t cap) {
    rudder_js *js = self;
    js_matcher *m = js->m;
    uint32_t cp = e_save(js), n = 0;   /* a checkpoint of its own, dropped at the end */
    int b;
    while (n < cap && n < MAX_FORCED && (b = forced_byte(js, m->cur, m->n_cur)) >= 0) {
        dst[n++] = (uint8_t)b;
        if (!set_push(js, &dst[n - 1], 1))
            break;
    }
    e_restore(js, cp);
    m->n_cps = cp;
    m->n_hist = m->hist_at[cp];
    return n;
}

/* How a position's key shows the extra keys written (e_key). The answer at a position (mask,
 * forced bytes, ff lists) depends on them only where a token can end an extra key: the key being
 * written (K_CLOSE), or one that a token opens and ends whole (K_WHOLE, at O_KEY); a token that
 * could reach a later one holds `,""` (with none such, g_keys_in_token is false); and in
 * restricted objects, whose key bytes can be forced (K_ALL). There the key holds which of the
 * ways a token can end the key are keys written ("dups"); elsewhere it leaves the keys out, so
 * that positions in values, and in keys of objects with none written, are shared as if no
 * keys were tracked. */
enum { K_NONE, K_CLOSE, K_WHOLE, K_ALL };

static int keys_view(const rudder_js *js, const thread *s) {
    if (g_keys_in_token)
        return K_ALL;
    for (uint32_t d = 1; d < s->sp; d++) {
        const jnode *n = N(js, s->f[d].node);
        if (n->kind == K_OBJECT && s->f[d].phase != V_START && has_extras(n) && restricted(n))
            return K_ALL;
    }
    const frame *f = &s->f[s->sp - 1];
    const jnode *n = N(js, f->node);
    if (s->sp < 2 || n->kind != K_OBJECT || !has_extras(n))
        return K_NONE;
    if (f->phase == O_KEY)
        return K_WHOLE;
    return f->phase == O_IN_KEY && (f->flags & F_EXTRAS) ? K_CLOSE : K_NONE;
}

/* The dups of a K_CLOSE or K_WHOLE thread (see keys_view), as indices into the lists of
 * rudder_js_init_tables: g_ext from a character boundary, all tokens holding a quote
 * otherwise, g_whole for keys written whole. */
static uint32_t key_dups(const rudder_js *js, const thread *s, int view, uint16_t *dups) {
    uint32_t n = 0;
    if (view == K_WHOLE) {
        if (wrote_extra(js, s, true))
            for (uint32_t k = 0; k < g_n_whole; k++)
                if (key_written(js, s, g_whole[k], true))
                    dups[n++] = (uint16_t)k;
        return n;
    }
    if (!wrote_extra(js, s, false))
        return 0;
    if (s->lphase == SL_CHAR) {
        /* the key each ending would write (its hash from the key's own), those that pass the
         * object's bloom kept, then one pass over the keys written, each against those kept */
        js_matcher *m = js->m;
        const knode *kn = m->knodes;
        uint64_t bloom = kn[s->keys].bloom, kept_bloom[4] = {0};   /* (wrote_extra: the top node is this object's) */
        uint32_t kept = 0;
        for (uint32_t k = 0; k < g_n_ext; k++) {
            uint64_t h = s->kh * g_ext_mul[k] + g_ext_add[k];
            if (bloom & kbit(h)) {
                m->ext_h[kept] = h, m->ext_k[kept++] = (uint16_t)k, m->ext_dup[k] = 0;
                kept_bloom[h >> 62] |= 1ull << (h >> 52 & 63);
            }
        }
        for (uint32_t at = s->keys; kept && at && kn[at].tag == s->sp - 1u; at = kn[at].up)
            if (kept_bloom[kn[at].kh >> 62] >> (kn[at].kh >> 52 & 63) & 1)
                for (uint32_t i = 0; i < kept; i++)
                    m->ext_dup[m->ext_k[i]] |= m->ext_h[i] == kn[at].kh;
        for (uint32_t i = 0; i < kept; i++)   /* (kept in order of k) */
            if (m->ext_dup[m->ext_k[i]])
                dups[n++] = m->ext_k[i];
        return n;
    }
    for (uint32_t k = 0; k < g_n_quoted; k++) {
        uint32_t len;
        const uint8_t *b = rudder_token_bytes(g_quoted[k], &len);
        uint64_t h = s->kh;
        if (key_scan(b, len, s->lphase, s->u8need, s->u8lo, s->u8hi, &h, NULL, NULL) != NONE && key_written(js, s, h, false))
            dups[n++] = (uint16_t)k;
    }
    return n;
}

static uint32_t e_key(void *self, uint8_t *dst, uint32_t cap) {
    rudder_js *js = self;
    js_matcher *m = js->m;
    uint32_t need = 0;
    m->dups = rudder_grow(m->dups, &m->cap_dups, m->n_cur * (g_n_quoted + 1) + 1, sizeof(uint16_t));
    m->views = rudder_grow(m->views, &m->cap_views, m->n_cur, 1);
    uint16_t *d = m->dups;
    for (uint32_t t = 0; t < m->n_cur; t++) {
        int view = m->views[t] = (uint8_t)keys_view(js, &m->cur[t]);
        need += tsize(&m->cur[t]);
        if (view == K_CLOSE || view == K_WHOLE) {
            d[0] = (uint16_t)key_dups(js, &m->cur[t], view, d + 1);
            need += 2u * (d[0] + 1u);
            d += d[0] + 1;
        }
    }
    if (need > cap)
        return need;
    uint8_t *p = dst;
    d = m->dups;
    for (uint32_t t = 0; t < m->n_cur; t++) {
        const thread *s = &m->cur[t];
        int view = m->views[t];
        memcpy(p, s, tsize(s));
        if (view != K_ALL) {
            memset(p + __builtin_offsetof(thread, keys), 0, sizeof(uint32_t));
            memset(p + __builtin_offsetof(thread, kh), 0, sizeof(uint64_t));
            p[__builtin_offsetof(thread, ktag)] = 0;
        }
        p += tsize(s);
        if (view == K_CLOSE || view == K_WHOLE) {
            memcpy(p, d, 2u * (d[0] + 1u));
            p += 2u * (d[0] + 1u);
            d += d[0] + 1;
        }
    }
    return need;
}

void js_matcher_init(rudder_js *js) {
    js_matcher *m = rudder_zalloc(sizeof *m);
    if (!m)
        rudder_panic("jsonschema: out of memory");
    js->m = m;
    m->cur = rudder_grow(NULL, &m->cap_cur, 4, sizeof(thread));
    memset(&m->cur[0], 0, sizeof(thread));
    m->cur[0].sp = 1;
    m->n_cur = 1;
    m->far = rudder_xalloc(js->n_nodes * 4 + 4);
    memset(m->far, 0xff, js->n_nodes * 4 + 4);
    for (uint32_t i = 0; i < js->n_nodes; i++)
        m->far[i] = NONE - 1;
    m->walk_cap = g_max_token + 4;
    m->walk = rudder_xalloc(m->walk_cap * sizeof(thread));
    m->ends = rudder_xalloc(m->walk_cap * 4);
    m->sets = rudder_xalloc(m->walk_cap * 32);
    m->spill = rudder_zalloc(m->walk_cap * sizeof(tlist));
    m->kmask = 63;
    m->kindex = rudder_zalloc(64 * 4);
    if (!m->spill || !m->kindex)
        rudder_panic("jsonschema: out of memory");
    m->knodes = rudder_grow(NULL, &m->cap_knodes, 64, sizeof(knode));
    m->knodes[0] = (knode){0, 0, 0, 0};
    m->shapes = rudder_zalloc(2 * sizeof(rx_shape *) * (js->n_nodes + 1));
    if (!m->shapes)
        rudder_panic("jsonschema: out of memory");
    m->ext_h = rudder_xalloc(8 * (g_n_ext + 1));
    m->ext_k = rudder_xalloc(2 * (g_n_ext + 1));
    m->ext_dup = rudder_xalloc(g_n_ext + 1);
    m->n_knodes = 1;
}

rudder_engine rudder_js_engine(rudder_js *js) {
    return (rudder_engine){.name = "json", .what = "valid JSON", .self = js, .push = e_push, .save = e_save,
                           .restore = e_restore, .accepting = e_accepting, .walk = e_walk, .forced = e_forced,
                           .key = e_key};
}
