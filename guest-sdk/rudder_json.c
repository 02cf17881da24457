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
        if (cp < 0x80) {
            out[n++] = (uint8_t)cp;
        } else if (cp < 0x800) {
            out[n++] = (uint8_t)(0xc0 | cp >> 6);
            out[n++] = (uint8_t)(0x80 | (cp & 0x3f));
        } else if (cp < 0x10000) {
            out[n++] = (uint8_t)(0xe0 | cp >> 12);
            out[n++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
            out[n++] = (uint8_t)(0x80 | (cp & 0x3f));
        } else {
            out[n++] = (uint8_t)(0xf0 | cp >> 18);
            out[n++] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
            out[n++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
            out[n++] = (uint8_t)(0x80 | (cp & 0x3f));
        }
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
