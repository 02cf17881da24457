/* rudder_json.c - just enough JSON for arguments: an array of strings. */
#include "rudder.h"

typedef struct {
    const uint8_t *p, *end;
    const char *err;
} parser;

static char errbuf[80];

static bool fail(parser *ps, const char *what, const uint8_t *start) {
    /* "<what> at byte <n>" into a static buffer (no snprintf here) */
    uint32_t i = 0, pos = (uint32_t)(ps->p - start);
    while (*what && i < sizeof errbuf - 24)
        errbuf[i++] = *what++;
    const char *at = " at byte ";
    while (*at)
        errbuf[i++] = *at++;
    char digits[12];
    uint32_t k = 0;
    do {
        digits[k++] = (char)('0' + pos % 10);
        pos /= 10;
    } while (pos);
    while (k)
        errbuf[i++] = digits[--k];
    errbuf[i] = 0;
    ps->err = errbuf;
    return false;
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static int hex4(const uint8_t *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Decode the string at ps->p (just after its opening quote) into out; returns its length. */
static bool string(parser *ps, const uint8_t *start, uint8_t *out, uint32_t *len) {
    uint32_t n = 0;
    while (ps->p < ps->end) {
        uint8_t c = *ps->p++;
        if (c == '"') {
            out[n] = 0;
            *len = n;
            return true;
        }
        if (c < 0x20)
            return ps->p--, fail(ps, "control character in a string", start);
        if (c != '\\') {
            out[n++] = c;
            continue;
        }
        if (ps->p >= ps->end)
            break;
        c = *ps->p++;
        const char *simple = "\"\"\\\\//b\bf\fn\nr\rt\t";
        bool done = false;
        for (const char *s = simple; *s; s += 2)
            if (c == (uint8_t)s[0]) {
                out[n++] = (uint8_t)s[1];
                done = true;
                break;
            }
        if (done)
            continue;
        if (c != 'u')
            return ps->p--, fail(ps, "unknown escape", start);
        int cp = ps->end - ps->p >= 4 ? hex4(ps->p) : -1;
        if (cp < 0)
            return fail(ps, "bad \\u escape", start);
        ps->p += 4;
        if (cp >= 0xdc00 && cp <= 0xdfff)
            return fail(ps, "lone low surrogate", start);
        if (cp >= 0xd800 && cp <= 0xdbff) {
            int lo = ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u' ? hex4(ps->p + 2) : -1;
            if (lo < 0xdc00 || lo > 0xdfff)
                return fail(ps, "lone high surrogate", start);
            ps->p += 6;
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        n += rudder_utf8_encode(cp, out + n);
    }
    return fail(ps, "unterminated string", start);
}

rudder_str *rudder_json_strings(const char *json, uint32_t len, uint32_t *n, const char **err) {
    const uint8_t *start = (const uint8_t *)json;
    parser ps = {start, start + len, NULL};
    /* Decoded text is never longer than its JSON; one block holds the array and the bytes
     * (a string of k bytes takes k + 3 JSON bytes and k + 1 bytes here, NUL included). */
    uint32_t max_strings = len / 2 + 1;
    rudder_str *arr = rudder_alloc((size_t)max_strings * sizeof(rudder_str) + len + 1);
    if (!arr) {
        *err = "out of memory";
        return NULL;
    }
    uint8_t *bytes = (uint8_t *)(arr + max_strings);
    uint32_t count = 0;
    skip_ws(&ps);
    if (ps.p >= ps.end || *ps.p != '[') {
        fail(&ps, "expected '['", start);
        goto bad;
    }
    ps.p++;
    skip_ws(&ps);
    if (ps.p < ps.end && *ps.p == ']') {
        ps.p++;
    } else {
        for (;;) {
            if (ps.p >= ps.end || *ps.p != '"') {
                fail(&ps, "expected a string", start);
                goto bad;
            }
            ps.p++;
            uint32_t l;
            if (!string(&ps, start, bytes, &l))
                goto bad;
            arr[count].ptr = bytes;
            arr[count++].len = l;
            bytes += l + 1;
            skip_ws(&ps);
            if (ps.p < ps.end && *ps.p == ',') {
                ps.p++;
                skip_ws(&ps);
                continue;
            }
            if (ps.p < ps.end && *ps.p == ']') {
                ps.p++;
                break;
            }
            fail(&ps, "expected ',' or ']'", start);
            goto bad;
        }
    }
    skip_ws(&ps);
    if (ps.p != ps.end) {
        fail(&ps, "unexpected text after the array", start);
        goto bad;
    }
    *n = count;
    *err = NULL;
    return arr;
bad:
    rudder_free(arr);
    *err = ps.err;
    return NULL;
}

/* ------------------------------------------------------------------ a document model */

#include "rudder_json.h"

/* One block holds everything: the root, then each container's items (copied there when the
 * container closes, from a scratch stack), object keys and decoded strings. Every value takes
 * at least one byte of text, so sizes follow from the text's length. */
typedef struct {
    parser ps;
    const uint8_t *start;
    uint8_t *block;
    rudder_jv *vals;      /* next free value slot */
    rudder_str *keys;     /* next free key slot */
    uint8_t *bytes;       /* next free string byte */
    rudder_jv *stack;     /* values of the containers being parsed */
    rudder_str *kstack;
    uint32_t n_stack, cap_stack, depth;
} dom;

#define JV_MAX_DEPTH 512u

static bool dom_push(dom *d, const rudder_jv *v, const rudder_str *key) {
    if (d->n_stack == d->cap_stack) {
        uint32_t cap = d->cap_stack ? 2 * d->cap_stack : 64;
        rudder_jv *s = rudder_realloc(d->stack, (size_t)cap * sizeof *s);
        rudder_str *k = s ? rudder_realloc(d->kstack, (size_t)cap * sizeof *k) : NULL;
        if (s)
            d->stack = s;
        if (!k)
            return fail(&d->ps, "out of memory", d->start);
        d->kstack = k;
        d->cap_stack = cap;
    }
    d->stack[d->n_stack] = *v;
    d->kstack[d->n_stack++] = key ? *key : (rudder_str){0};
    return true;
}

static bool number(dom *d, rudder_jv *v) {
    parser *ps = &d->ps;
    const uint8_t *p = ps->p, *e = ps->end, *begin = p;
    bool neg = p < e && *p == '-';
    p += neg;
    if (p >= e || *p < '0' || *p > '9')
        return fail(ps, "expected a value", d->start);
    uint64_t mant = 0;
    int32_t exp10 = 0, digits = 0;
    if (*p == '0') {
        p++;
    } else {
        for (; p < e && *p >= '0' && *p <= '9'; p++)
            if (digits < 19)
                mant = mant * 10 + (uint64_t)(*p - '0'), digits += mant > 0;
            else
                exp10++;
    }
    if (p < e && *p == '.') {
        p++;
        if (p >= e || *p < '0' || *p > '9')
            return ps->p = p, fail(ps, "expected a digit after '.'", d->start);
        for (; p < e && *p >= '0' && *p <= '9'; p++) {
            if (digits < 19)
                mant = mant * 10 + (uint64_t)(*p - '0'), digits += mant > 0, exp10--;
        }
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        bool eneg = p < e && *p == '-';
        p += p < e && (*p == '-' || *p == '+');
        if (p >= e || *p < '0' || *p > '9')
            return ps->p = p, fail(ps, "expected a digit in the exponent", d->start);
        int32_t x = 0;
        for (; p < e && *p >= '0' && *p <= '9'; p++)
            if (x < 100000)
                x = x * 10 + (*p - '0');
        exp10 += eneg ? -x : x;
    }
    double val = (double)mant;
    static const double p10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
    int32_t x = exp10 < 0 ? -exp10 : exp10;
    while (x > 0 && val != 0) {   /* exact for |exp10| <= 22, close enough past that */
        int32_t k = x > 22 ? 22 : x;
        val = exp10 < 0 ? val / p10[k] : val * p10[k];
        x -= k;
    }
    v->type = RUDDER_JV_NUMBER;
    v->num = neg ? -val : val;
    v->integral = val < 9007199254740992.0 && (val == (double)(uint64_t)val);
    v->str = begin;
    v->n = (uint32_t)(p - begin);
    ps->p = p;
    return true;
}

static bool literal(dom *d, const char *word, rudder_jv_type type, rudder_jv *v) {
    uint32_t n = (uint32_t)strlen(word);
    if ((uint32_t)(d->ps.end - d->ps.p) < n || memcmp(d->ps.p, word, n) != 0)
        return fail(&d->ps, "expected a value", d->start);
    d->ps.p += n;
    v->type = type;
    return true;
}

static bool value(dom *d, rudder_jv *v);

/* Move the last n stacked values (and keys) into the block as a container's items. */
static void dom_close(dom *d, rudder_jv *v, uint32_t n, bool object) {
    d->n_stack -= n;
    v->n = n;
    v->items = d->vals;
    memcpy(d->vals, d->stack + d->n_stack, (size_t)n * sizeof(rudder_jv));
    d->vals += n;
    if (object) {
        v->keys = d->keys;
        memcpy(d->keys, d->kstack + d->n_stack, (size_t)n * sizeof(rudder_str));
        d->keys += n;
    }
}

static bool container(dom *d, rudder_jv *v, bool object) {
    parser *ps = &d->ps;
    if (++d->depth > JV_MAX_DEPTH)
        return fail(ps, "nested too deeply", d->start);
    uint8_t close = object ? '}' : ']';
    uint32_t n = 0;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
    } else {
        for (;;) {
            rudder_str key = {0};
            if (object) {
                if (ps->p >= ps->end || *ps->p != '"')
                    return fail(ps, "expected a string key", d->start);
                ps->p++;
                if (!string(ps, d->start, d->bytes, &key.len))
                    return false;
                key.ptr = d->bytes;
                d->bytes += key.len + 1;
                skip_ws(ps);
                if (ps->p >= ps->end || *ps->p != ':')
                    return fail(ps, "expected ':'", d->start);
                ps->p++;
                skip_ws(ps);
            }
            rudder_jv item = {0};
            if (!value(d, &item) || !dom_push(d, &item, object ? &key : NULL))
                return false;
            n++;
            skip_ws(ps);
            if (ps->p < ps->end && *ps->p == ',') {
                ps->p++;
                skip_ws(ps);
                continue;
            }
            if (ps->p < ps->end && *ps->p == close) {
                ps->p++;
                break;
            }
            return fail(ps, object ? "expected ',' or '}'" : "expected ',' or ']'", d->start);
        }
    }
    v->type = object ? RUDDER_JV_OBJECT : RUDDER_JV_ARRAY;
    dom_close(d, v, n, object);
    d->depth--;
    return true;
}

static bool value(dom *d, rudder_jv *v) {
    parser *ps = &d->ps;
    if (ps->p >= ps->end)
        return fail(ps, "expected a value", d->start);
    switch (*ps->p) {
    case '{':
        return container(d, v, true);
    case '[':
        return container(d, v, false);
    case '"':
        ps->p++;
        if (!string(ps, d->start, d->bytes, &v->n))
            return false;
        v->type = RUDDER_JV_STRING;
        v->str = d->bytes;
        d->bytes += v->n + 1;
        return true;
    case 't':
        return literal(d, "true", RUDDER_JV_TRUE, v);
    case 'f':
        return literal(d, "false", RUDDER_JV_FALSE, v);
    case 'n':
        return literal(d, "null", RUDDER_JV_NULL, v);
    default:
        return number(d, v);
    }
}

/* Room for the values and keys of a text, from one scan outside strings: a value is the root
 * or follows '[', ',' or ':'; a key follows ':'. (A bad text may need less: it fails anyway.) */
static void count_room(const uint8_t *s, uint32_t len, size_t *vals, size_t *keys) {
    size_t v = 2, k = 1;
    bool in_string = false;
    for (uint32_t i = 0; i < len; i++) {
        uint8_t c = s[i];
        if (in_string) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == ',' || c == ':') {
            v++;
            k += c == ':';
        }
    }
    *vals = v;
    *keys = k;
}

rudder_jv *rudder_jv_parse(const char *text, uint32_t len, char *err, uint32_t cap) {
    const uint8_t *start = (const uint8_t *)text;
    size_t n_vals, n_keys;
    count_room(start, len, &n_vals, &n_keys);
    size_t size = n_vals * sizeof(rudder_jv) + n_keys * sizeof(rudder_str) + 2 * (size_t)len + 8;
    dom d = {.ps = {start, start + len, NULL}, .start = start};
    d.block = rudder_zalloc(size);
    bool ok = d.block != NULL;
    if (!ok)
        fail(&d.ps, "out of memory", start);
    rudder_jv *root = (rudder_jv *)d.block;
    if (ok) {
        d.vals = root + 1;
        d.keys = (rudder_str *)(root + n_vals);
        d.bytes = (uint8_t *)(d.keys + n_keys);
        skip_ws(&d.ps);
        ok = value(&d, root);
        skip_ws(&d.ps);
        if (ok && d.ps.p != d.ps.end)
            ok = fail(&d.ps, "unexpected text after the value", start);
    }
    rudder_free(d.stack);
    rudder_free(d.kstack);
    if (ok)
        return root;
    rudder_free(d.block);
    uint32_t i = 0;
    for (const char *m = d.ps.err; cap && m && *m && i + 1 < cap; m++)
        err[i++] = *m;
    if (cap)
        err[i] = 0;
    return NULL;
}

void rudder_jv_free(rudder_jv *root) { rudder_free(root); }

const rudder_jv *rudder_jv_get(const rudder_jv *obj, const char *key) {
    if (!obj || obj->type != RUDDER_JV_OBJECT)
        return NULL;
    uint32_t n = (uint32_t)strlen(key);
    for (uint32_t i = 0; i < obj->n; i++)
        if (obj->keys[i].len == n && memcmp(obj->keys[i].ptr, key, n) == 0)
            return &obj->items[i];
    return NULL;
}

bool rudder_jv_equal_str(const rudder_jv *v, const char *s) {
    uint32_t n = (uint32_t)strlen(s);
    return v && v->type == RUDDER_JV_STRING && v->n == n && memcmp(v->str, s, n) == 0;
}

typedef struct {
    uint8_t *dst;
    uint32_t cap, n;
} writer;

static void w_bytes(writer *w, const void *p, uint32_t n) {
    for (uint32_t i = 0; i < n; i++, w->n++)
        if (w->n < w->cap)
            w->dst[w->n] = ((const uint8_t *)p)[i];
}

static void w_string(writer *w, const uint8_t *s, uint32_t n) {
    w_bytes(w, "\"", 1);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t c = s[i];
        if (c == '"' || c == '\\') {
            uint8_t e[2] = {'\\', c};
            w_bytes(w, e, 2);
        } else if (c < 0x20) {
            uint8_t e[6] = {'\\', 'u', '0', '0', "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]};
            w_bytes(w, e, 6);
        } else {
            w_bytes(w, &c, 1);
        }
    }
    w_bytes(w, "\"", 1);
}

static void w_value(writer *w, const rudder_jv *v) {
    switch (v->type) {
    case RUDDER_JV_NULL:
        return w_bytes(w, "null", 4);
    case RUDDER_JV_FALSE:
        return w_bytes(w, "false", 5);
    case RUDDER_JV_TRUE:
        return w_bytes(w, "true", 4);
    case RUDDER_JV_NUMBER:
        return w_bytes(w, v->str, v->n);
    case RUDDER_JV_STRING:
        return w_string(w, v->str, v->n);
    case RUDDER_JV_ARRAY:
    case RUDDER_JV_OBJECT: {
        bool obj = v->type == RUDDER_JV_OBJECT;
        w_bytes(w, obj ? "{" : "[", 1);
        for (uint32_t i = 0; i < v->n; i++) {
            if (i)
                w_bytes(w, ",", 1);
            if (obj) {
                w_string(w, v->keys[i].ptr, v->keys[i].len);
                w_bytes(w, ":", 1);
            }
            w_value(w, &v->items[i]);
        }
        w_bytes(w, obj ? "}" : "]", 1);
    }
    }
}

uint32_t rudder_jv_write(const rudder_jv *v, uint8_t *dst, uint32_t cap) {
    writer w = {dst, cap, 0};
    w_value(&w, v);
    return w.n;
}
