/* rudder.c - the SDK's core: the module's exports, the step answer builder, the token
 * table and trie walk, and wrappers over the host imports. See rudder.h and docs/abi.md. */
#include "rudder.h"

#define RUDDER_EXPORT(name) __attribute__((export_name(#name)))
#define MAX_BRANCHES 256u   /* more than any server's max_forks; a larger result fails clearly */
#define MIN_INPUT 256u      /* tokens; the host asks for more room only when a step brings more */

/* ------------------------------------------------------------------ state (all in memory) */

static uint32_t g_vocab, g_eos, g_mask_words;

static struct {
    uint32_t n_nodes, max_depth;
    const uint32_t *offsets;   /* vocab + 1 entries */
    const uint32_t *nodes;     /* n_nodes x 2 words */
    const uint8_t *bytes;
    uint32_t *ends, *states;   /* walk stacks, max_depth + 2 entries */
    rudder_trie view;          /* what rudder_trie_get() hands out, once the table is loaded */
} T;

static char *g_arg;
static uint32_t g_arg_len;

static uint32_t *g_input, g_input_cap;
static uint32_t *g_seq, g_n_seq, g_seq_cap, g_n_prompt, g_step_index;

typedef struct ff_entry {
    uint32_t branch, off, n;
    uint32_t is_list;   /* 1: rudder_out_ff_list; 0: the list of rudder_out_ff / _backtrack */
} ff_entry;

struct rudder_out {
    uint32_t n_branches;
    bool failed;
    ff_entry *ents;
    uint32_t n_ents, cap_ents;
    uint32_t *data;     /* copied token ids of all staged lists */
    uint32_t n_data, cap_data;
    uint32_t **masks;   /* pool handed out by rudder_out_mask, reused every step */
    uint32_t n_masks_used, n_masks;
};

static rudder_out g_out;
static rudder_branch g_branches[MAX_BRANCHES];
static rudder_tokens *g_lists;
static uint32_t g_lists_cap;
static rudder_result g_result;

/* ------------------------------------------------------------------ default callbacks */

__attribute__((weak)) int controller_init(void) { return 0; }

__attribute__((weak)) int controller_start(const char *arg, uint32_t len) {
    (void)arg;
    (void)len;
    return 0;
}

/* ------------------------------------------------------------------ logging */

void rudder_log_bytes(const void *data, uint32_t len) {
    if (len)
        rudder_sys_log(data, len);
}

void rudder_log(const char *text) { rudder_log_bytes(text, (uint32_t)strlen(text)); }

void rudder_panic(const char *why) {
    rudder_log("rudder panic: ");
    rudder_log(why);
    rudder_log("\n");
    __builtin_trap();
}

typedef struct {
    char buf[256];
    uint32_t n;
} logbuf;

static void lb_put(logbuf *b, const char *s, uint32_t n) {
    while (n) {
        if (b->n == sizeof b->buf) {
            rudder_sys_log(b->buf, b->n);
            b->n = 0;
        }
        uint32_t k = sizeof b->buf - b->n;
        if (k > n)
            k = n;
        __builtin_memcpy(b->buf + b->n, s, k);
        b->n += k, s += k, n -= k;
    }
}

static void lb_num(logbuf *b, uint64_t v, bool neg, uint32_t base) {
    char tmp[24];
    uint32_t i = sizeof tmp;
    do {
        tmp[--i] = "0123456789abcdef"[v % base];
        v /= base;
    } while (v);
    if (neg)
        tmp[--i] = '-';
    lb_put(b, tmp + i, sizeof tmp - i);
}

void rudder_vlogf(const char *fmt, va_list ap) {
    logbuf b;
    b.n = 0;
    for (const char *p = fmt; *p; p++) {
        if (*p != '%') {
            const char *q = p;
            while (q[1] && q[1] != '%')
                q++;
            lb_put(&b, p, (uint32_t)(q - p + 1));
            p = q;
            continue;
        }
        p++;
        int prec = -1, longs = 0;
        if (p[0] == '.' && p[1] == '*') {
            prec = va_arg(ap, int);
            p += 2;
        }
        while (*p == 'l' || *p == 'z') {
            longs += *p == 'l';
            p++;
        }
        switch (*p) {
        case 'd':
        case 'i': {
            int64_t v = longs >= 2 ? va_arg(ap, long long) : longs ? va_arg(ap, long) : va_arg(ap, int);
            lb_num(&b, v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v, v < 0, 10);
            break;
        }
        case 'u':
        case 'x': {
            uint64_t v = longs >= 2 ? va_arg(ap, unsigned long long)
                         : longs ? va_arg(ap, unsigned long) : va_arg(ap, unsigned);
            lb_num(&b, v, false, *p == 'u' ? 10 : 16);
            break;
        }
        case 'c': {
            char c = (char)va_arg(ap, int);
            lb_put(&b, &c, 1);
            break;
        }
        case 's': {
            const char *s = va_arg(ap, const char *);
            if (!s)
                s = "(null)";
            /* %.*s: exactly prec bytes (token bytes are not NUL-terminated) */
            lb_put(&b, s, prec >= 0 ? (uint32_t)prec : (uint32_t)strlen(s));
            break;
        }
        case '%':
            lb_put(&b, "%", 1);
            break;
        case 0:
            p--;
            break;
        default:
            lb_put(&b, p - 1, 2);
        }
    }
    if (b.n)
        rudder_sys_log(b.buf, b.n);
}

void rudder_logf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    rudder_vlogf(fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------ host services */

int32_t rudder_config(int32_t key) { return rudder_sys_config(key); }

bool rudder_parse_uint(const char *s, uint32_t len, uint32_t *value) {
    uint32_t i = 0, end = len;
    while (i < end && s[i] == ' ')
        i++;
    while (end > i && s[end - 1] == ' ')
        end--;
    if (i == end)
        return false;
    uint64_t v = 0;
    for (; i < end; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        v = v * 10 + (uint64_t)(s[i] - '0');
        if (v > 0xffffffffull)
            return false;
    }
    *value = (uint32_t)v;
    return true;
}

const char *rudder_arg(uint32_t *len) {
    if (len)
        *len = g_arg_len;
    return g_arg ? g_arg : "";
}

int32_t rudder_var_get(const char *key, void *dst, uint32_t cap) {
    return rudder_sys_var_get(key, (uint32_t)strlen(key), dst, cap);
}

int32_t rudder_var_set(const char *key, const void *val, uint32_t len) {
    return rudder_sys_var_set(key, (uint32_t)strlen(key), val, len);
}

uint32_t rudder_utf8_encode(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xc0 | cp >> 6);
        out[1] = (uint8_t)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xe0 | cp >> 12);
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (uint8_t)(0xf0 | cp >> 18);
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

bool rudder_utf8_valid(const void *text, uint32_t len) {
    const uint8_t *s = text;
    uint32_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        uint32_t more;
        uint8_t lo = 0x80, hi = 0xbf;   /* range of the second byte */
        if (c >= 0xc2 && c <= 0xdf) {
            more = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            more = 2;
            lo = c == 0xe0 ? 0xa0 : 0x80;   /* no overlong forms */
            hi = c == 0xed ? 0x9f : 0xbf;   /* no surrogates */
        } else if (c >= 0xf0 && c <= 0xf4) {
            more = 3;
            lo = c == 0xf0 ? 0x90 : 0x80;
            hi = c == 0xf4 ? 0x8f : 0xbf;   /* nothing past U+10FFFF */
        } else {
            return false;
        }
        if (len - i - 1 < more || s[i + 1] < lo || s[i + 1] > hi)
            return false;
        for (uint32_t k = 2; k <= more; k++)
            if ((s[i + k] & 0xc0) != 0x80)
                return false;
        i += more + 1;
    }
    return true;
}

uint32_t *rudder_tokenize(const void *text, uint32_t len, uint32_t *n) {
    *n = 0;
    if (!rudder_utf8_valid(text, len))
        return NULL;
    uint32_t cap = len + 4;
    uint32_t *buf = rudder_xalloc(cap * 4);
    int32_t r = rudder_sys_tokenize(text, len, buf, cap);
    if (r > 0 && (uint32_t)r > cap) {
        cap = (uint32_t)r;
        buf = rudder_realloc(buf, cap * 4);
        if (!buf)
            rudder_panic("out of memory");
        r = rudder_sys_tokenize(text, len, buf, cap);
    }
    if (r < 0 || (uint32_t)r > cap)
        rudder_panic("tokenize: the host returned an invalid count");
    *n = (uint32_t)r;
    return buf;
}

uint32_t *rudder_tokenize_str(const char *text, uint32_t *n) {
    return rudder_tokenize(text, (uint32_t)strlen(text), n);
}

/* ------------------------------------------------------------------ vocabulary and masks */

uint32_t rudder_vocab_size(void) { return g_vocab; }
uint32_t rudder_eos_token(void) { return g_eos; }
uint32_t rudder_mask_words(void) { return g_mask_words; }

uint32_t *rudder_mask_new(void) { return rudder_zalloc((size_t)g_mask_words * 4); }

void rudder_mask_clear_all(uint32_t *mask) { __builtin_memset(mask, 0, (size_t)g_mask_words * 4); }

void rudder_mask_set_all(uint32_t *mask) {
    __builtin_memset(mask, 0xff, (size_t)g_mask_words * 4);
    if (g_vocab & 31)
        mask[g_mask_words - 1] = (1u << (g_vocab & 31)) - 1;
}

uint32_t rudder_mask_count(const uint32_t *mask) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < g_mask_words; i++)
        n += (uint32_t)__builtin_popcount(mask[i]);
    return n;
}

const uint8_t *rudder_token_bytes(uint32_t token, uint32_t *len) {
    if (token >= g_vocab || !T.offsets) {
        *len = 0;
        return NULL;
    }
    *len = T.offsets[token + 1] - T.offsets[token];
    return T.bytes + T.offsets[token];
}

uint32_t rudder_detokenize(const uint32_t *tokens, uint32_t n, uint8_t *dst, uint32_t cap) {
    uint32_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t len;
        const uint8_t *b = rudder_token_bytes(tokens[i], &len);
        if (total < cap)
            __builtin_memcpy(dst + total, b, len < cap - total ? len : cap - total);
        total += len;
    }
    return total;
}

/* ------------------------------------------------------------------ token table */

#define RTT1_MAGIC 0x31545452u

static int table_fail(const char *why) {
    rudder_logf("rudder: bad token table: %s\n", why);
    return -1;
}

/* Read and check the table once; the trie walk relies on what is checked here. */
static int load_token_table(void) {
    int32_t len = rudder_sys_token_table_len();
    if (len < 16 || (len & 3))
        return table_fail("size is not a multiple of 4 words");
    uint32_t *raw = rudder_alloc((size_t)len);
    if (!raw)
        return table_fail("out of memory");
    if (rudder_sys_token_table_read(raw, (uint32_t)len) != len)
        return table_fail("short read");
    uint32_t vocab = raw[1], n_nodes = raw[2], bytes_len = raw[3];
    if (raw[0] != RTT1_MAGIC)
        return table_fail("magic is not RTT1");
    if (vocab != g_vocab)
        return table_fail("vocab_size differs from the vocab_size import");
    uint64_t want = 16 + 4 * ((uint64_t)vocab + 1) + 8 * (uint64_t)n_nodes + (((uint64_t)bytes_len + 3) & ~3ull);
    if (want != (uint64_t)len || n_nodes == 0)
        return table_fail("sizes in the header do not add up");
    T.offsets = raw + 4;
    T.nodes = T.offsets + vocab + 1;
    T.bytes = (const uint8_t *)(T.nodes + 2 * (size_t)n_nodes);
    T.n_nodes = n_nodes;
    uint32_t max_len = 0;
    if (T.offsets[0] != 0 || T.offsets[vocab] != bytes_len)
        return table_fail("offsets do not span the bytes");
    for (uint32_t i = 0; i < vocab; i++) {
        if (T.offsets[i + 1] < T.offsets[i])
            return table_fail("offsets decrease");
        uint32_t l = T.offsets[i + 1] - T.offsets[i];
        if (l > max_len)
            max_len = l;
    }
    T.max_depth = max_len;
    T.ends = rudder_alloc(4 * ((size_t)max_len + 2));
    T.states = rudder_alloc(4 * ((size_t)max_len + 2));
    if (!T.ends || !T.states)
        return table_fail("out of memory");
    /* The trie: subtree sizes nest, depth <= longest token, a node's token spells its path. */
    if (T.nodes[1] != n_nodes)
        return table_fail("root subtree size is not n_nodes");
    uint32_t depth = 0;
    T.ends[0] = n_nodes;
    for (uint32_t i = 1; i < n_nodes; i++) {
        while (i >= T.ends[depth])
            depth--;
        uint32_t w0 = T.nodes[2 * i], size = T.nodes[2 * i + 1];
        if (size == 0 || size > T.ends[depth] - i)
            return table_fail("a subtree size does not nest");
        if (depth + 1 > max_len)
            return table_fail("the trie is deeper than the longest token");
        uint32_t tok1 = w0 >> 8;
        if (tok1) {
            if (tok1 > vocab)
                return table_fail("a node's token id is out of range");
            uint32_t l = T.offsets[tok1] - T.offsets[tok1 - 1];
            if (l != depth + 1 || T.bytes[T.offsets[tok1] - 1] != (w0 & 0xff))
                return table_fail("a node's token does not spell its path");
        }
        T.ends[++depth] = i + size;
    }
    T.view = (rudder_trie){T.nodes, T.n_nodes, T.ends, T.states};
    return 0;
}

const rudder_trie *rudder_trie_get(void) {
    if (!T.view.nodes)
        rudder_panic("rudder_trie_fill_mask: no token table");
    return &T.view;
}

uint32_t rudder_trie_node(const uint8_t *bytes, uint32_t len) {
    const uint32_t *nodes = rudder_trie_get()->nodes;
    uint32_t at = 0;
    for (uint32_t k = 0; k < len; k++) {   /* the children of node i lie in (i, i + size) */
        uint32_t c = at + 1, end = at + nodes[2 * at + 1];
        while (c < end && (uint8_t)nodes[2 * c] != bytes[k])
            c += nodes[2 * c + 1];
        if (c >= end)
            return 0;
        at = c;
    }
    return at;
}

/* ------------------------------------------------------------------ building the answer */

static void out_reset(rudder_out *out) {
    out->n_branches = 0;
    out->failed = false;
    out->n_ents = 0;
    out->n_data = 0;
    out->n_masks_used = 0;
}

uint32_t rudder_out_n_branches(const rudder_out *out) { return out->n_branches; }

void rudder_out_fail(rudder_out *out, const char *why) {
    if (!out->failed)
        rudder_logf("controller failed: %s\n", why);
    out->failed = true;
}

void rudder_out_stop(rudder_out *out) {
    out->n_branches = 0;
    out->n_ents = 0;
}

static rudder_branch *new_branch(rudder_out *out, const uint32_t *mask) {
    if (out->n_branches == MAX_BRANCHES) {
        rudder_out_fail(out, "too many branches in one step");
        return &g_branches[MAX_BRANCHES - 1];   /* harmless scratch; the step fails anyway */
    }
    rudder_branch *b = &g_branches[out->n_branches++];
    b->backtrack = 0;
    b->mask = mask;
    b->n_ff = 0;
    b->ff = NULL;
    return b;
}

static void stage(rudder_out *out, uint32_t branch, const uint32_t *tokens, uint32_t n, uint32_t is_list) {
    if (out->n_ents == out->cap_ents) {
        out->cap_ents = out->cap_ents ? 2 * out->cap_ents : 16;
        out->ents = rudder_realloc(out->ents, out->cap_ents * sizeof(ff_entry));
        if (!out->ents)
            rudder_panic("out of memory");
    }
    if (!out->data || n > out->cap_data - out->n_data) {   /* even an empty list gets a real pointer */
        uint32_t cap = out->cap_data ? out->cap_data : 256;
        while (cap - out->n_data < n)
            cap *= 2;
        out->data = rudder_realloc(out->data, (size_t)cap * 4);
        if (!out->data)
            rudder_panic("out of memory");
        out->cap_data = cap;
    }
    __builtin_memcpy(out->data + out->n_data, tokens, (size_t)n * 4);
    out->ents[out->n_ents++] = (ff_entry){branch, out->n_data, n, is_list};
    out->n_data += n;
}

rudder_branch *rudder_out_sample(rudder_out *out, const uint32_t *mask) { return new_branch(out, mask); }

rudder_branch *rudder_out_ff(rudder_out *out, const uint32_t *tokens, uint32_t n) {
    rudder_branch *b = new_branch(out, NULL);
    stage(out, out->n_branches - 1, tokens, n, 0);
    return b;
}

rudder_branch *rudder_out_backtrack(rudder_out *out, uint32_t n) {
    rudder_branch *b = rudder_out_ff(out, NULL, 0);
    b->backtrack = n;
    return b;
}

void rudder_out_ff_list(rudder_out *out, rudder_branch *b, const uint32_t *tokens, uint32_t n) {
    uint32_t idx = (uint32_t)(b - g_branches);
    if (b < g_branches || idx >= out->n_branches)
        rudder_out_fail(out, "rudder_out_ff_list: not a branch of this step");
    else if (n == 0)
        rudder_out_fail(out, "rudder_out_ff_list: an ff list under a mask must not be empty");
    else
        stage(out, idx, tokens, n, 1);
}

uint32_t *rudder_out_mask(rudder_out *out) {
    if (out->n_masks_used == out->n_masks) {
        uint32_t cap = out->n_masks ? 2 * out->n_masks : 4;
        uint32_t **m = rudder_realloc(out->masks, cap * sizeof(uint32_t *));
        if (!m)
            rudder_panic("out of memory");
        for (uint32_t i = out->n_masks; i < cap; i++)
            m[i] = NULL;
        out->masks = m;
        out->n_masks = cap;
    }
    uint32_t **slot = &out->masks[out->n_masks_used++];
    if (!*slot)
        *slot = rudder_xalloc((size_t)g_mask_words * 4);
    rudder_mask_clear_all(*slot);
    return *slot;
}

/* Lay the staged lists out as the ABI records, checking the rules the host would reject. */
static const rudder_result *out_finish(rudder_out *out) {
    if (out->failed)
        return NULL;
    uint32_t nb = out->n_branches;
    if (out->n_ents > g_lists_cap) {
        rudder_free(g_lists);
        g_lists_cap = out->n_ents + 16;
        g_lists = rudder_xalloc(g_lists_cap * sizeof(rudder_tokens));
    }
    for (uint32_t i = 0; i < nb; i++)
        g_branches[i].n_ff = 0;
    for (uint32_t e = 0; e < out->n_ents; e++)
        g_branches[out->ents[e].branch].n_ff++;
    uint32_t start = 0;
    for (uint32_t i = 0; i < nb; i++) {
        g_branches[i].ff = g_branches[i].n_ff ? g_lists + start : NULL;
        start += g_branches[i].n_ff;
        g_branches[i].n_ff = 0;   /* refilled below, as a cursor */
    }
    for (uint32_t e = 0; e < out->n_ents; e++) {
        const ff_entry *fe = &out->ents[e];
        rudder_branch *b = &g_branches[fe->branch];
        rudder_tokens *slot = (rudder_tokens *)&b->ff[b->n_ff++];
        slot->n = fe->n;
        slot->tokens = out->data + fe->off;
        if (fe->is_list && !b->mask) {
            rudder_out_fail(out, "rudder_out_ff_list needs a masked branch");
            return NULL;
        }
        if (!fe->is_list && b->mask) {
            rudder_out_fail(out, "a rudder_out_ff branch cannot have a mask (use rudder_out_ff_list)");
            return NULL;
        }
    }
    for (uint32_t i = 0; i < nb; i++) {
        const rudder_branch *b = &g_branches[i];
        if (!b->mask && b->n_ff == 1 && b->ff[0].n == 0 && b->backtrack == 0) {
            rudder_out_fail(out, "an empty fast-forward needs a backtrack");
            return NULL;
        }
    }
    g_result.n_branches = nb;
    g_result.branches = g_branches;
    return &g_result;
}

/* ------------------------------------------------------------------ exports */

RUDDER_EXPORT(rudder_abi_version) int32_t rudder__abi_version(void) { return RUDDER_ABI_VERSION; }

RUDDER_EXPORT(rudder_init) int32_t rudder__init(void) {
    int32_t v = rudder_sys_vocab_size();
    if (v <= 0) {
        rudder_log("rudder: vocab_size() is not positive\n");
        return -1;
    }
    g_vocab = (uint32_t)v;
    g_mask_words = (g_vocab + 31) / 32;
    int32_t eos = rudder_sys_eos_token();
    g_eos = eos >= 0 && (uint32_t)eos < g_vocab ? (uint32_t)eos : RUDDER_NO_TOKEN;
    if (load_token_table() != 0)
        return -1;
    return controller_init();
}

RUDDER_EXPORT(rudder_start) int32_t rudder__start(void) {
    int32_t len = rudder_sys_arg_len();
    if (len < 0)
        len = 0;
    g_arg = rudder_xalloc((size_t)len + 1);
    g_arg_len = (uint32_t)rudder_sys_arg_read(g_arg, (uint32_t)len);
    if (g_arg_len > (uint32_t)len)
        g_arg_len = (uint32_t)len;
    g_arg[g_arg_len] = 0;
    g_n_seq = 0;
    g_n_prompt = 0;
    g_step_index = 0;
    return controller_start(g_arg, g_arg_len);
}

RUDDER_EXPORT(rudder_input) uint32_t *rudder__input(int32_t n) {
    uint32_t want = n > 0 ? (uint32_t)n : 0;
    if (want > g_input_cap || !g_input) {
        uint32_t cap = want > MIN_INPUT ? want : MIN_INPUT;
        rudder_free(g_input);
        g_input = rudder_alloc((size_t)cap * 4);
        g_input_cap = g_input ? cap : 0;
        if (!g_input)
            rudder_log("rudder: out of memory for the input buffer\n");
    }
    return g_input;
}

RUDDER_EXPORT(rudder_mid_process)
const rudder_result *rudder__mid_process(int32_t branch_idx, int32_t backtrack, int32_t n_append) {
    uint32_t bt = (uint32_t)backtrack, na = (uint32_t)n_append;
    if (backtrack < 0 || bt > g_n_seq || n_append < 0 || (na && (!g_input || na > g_input_cap))) {
        rudder_logf("rudder: invalid step (backtrack %d of %u tokens, %d appended, input room %u)\n",
                    (int)backtrack, g_n_seq, (int)n_append, g_input_cap);
        return NULL;
    }
    g_n_seq -= bt;
    if (g_n_prompt > g_n_seq)
        g_n_prompt = g_n_seq;
    if (na > g_seq_cap - g_n_seq) {
        uint32_t cap = g_seq_cap ? g_seq_cap : 1024;
        while (cap - g_n_seq < na)
            cap *= 2;
        g_seq = rudder_realloc(g_seq, (size_t)cap * 4);
        if (!g_seq)
            rudder_panic("out of memory");
        g_seq_cap = cap;
    }
    if (na)
        __builtin_memcpy(g_seq + g_n_seq, g_input, (size_t)na * 4);
    g_n_seq += na;
    if (g_step_index == 0)
        g_n_prompt = g_n_seq;

    rudder_step step = {
        .index = g_step_index,
        .branch_idx = (uint32_t)branch_idx,
        .backtrack = bt,
        .tokens = g_seq + g_n_seq - na,
        .n_tokens = na,
        .seq = g_seq,
        .n_seq = g_n_seq,
        .n_prompt = g_n_prompt,
    };
    out_reset(&g_out);
    controller_step(&step, &g_out);
    g_step_index++;
    return out_finish(&g_out);
}
