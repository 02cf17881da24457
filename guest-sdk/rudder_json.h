/* rudder_json.h - a JSON document model for controllers that read structured arguments
 * (e.g. a JSON Schema). rudder.h has the smaller rudder_json_strings for arrays of strings.
 *
 * rudder_jv_parse reads one JSON text (RFC 8259: surrounding whitespace allowed, nothing
 * after it) into a tree of rudder_jv; strings are decoded to UTF-8 (escapes resolved, lone
 * surrogates rejected), numbers keep their source text next to a double. Duplicate object
 * keys are kept in source order (rudder_jv_get finds the first). */
#ifndef RUDDER_JSON_H
#define RUDDER_JSON_H

#include "rudder.h"

typedef enum rudder_jv_type {
    RUDDER_JV_NULL, RUDDER_JV_FALSE, RUDDER_JV_TRUE, RUDDER_JV_NUMBER, RUDDER_JV_STRING,
    RUDDER_JV_ARRAY, RUDDER_JV_OBJECT,
} rudder_jv_type;

typedef struct rudder_jv rudder_jv;
struct rudder_jv {
    rudder_jv_type type;
    uint32_t n;             /* string: byte length; array, object: number of items */
    const uint8_t *str;     /* string: decoded bytes (NUL-terminated); number: its source text */
    double num;             /* number: the value (not correctly rounded past 2^53 or 1e22) */
    bool integral;          /* number: no fraction (e.g. 3, 3.0, 3e2) and |value| < 2^53 */
    rudder_jv *items;       /* array items; object values */
    rudder_str *keys;       /* object keys (decoded) */
};

/* Parse; NULL on error with "<what> at byte <n>" in err (NUL-terminated, cut to cap). The tree
 * lives in one allocation chain: rudder_jv_free(root) frees it all. */
rudder_jv *rudder_jv_parse(const char *text, uint32_t len, char *err, uint32_t cap);
void rudder_jv_free(rudder_jv *root);
/* The value of `key` in an object (NULL if absent or not an object). */
const rudder_jv *rudder_jv_get(const rudder_jv *obj, const char *key);
/* Compact serialization (no whitespace, keys in source order, numbers as written, strings
 * escaped minimally: " \ and control characters). Returns the full length; writes up to cap. */
uint32_t rudder_jv_write(const rudder_jv *v, uint8_t *dst, uint32_t cap);
bool rudder_jv_equal_str(const rudder_jv *v, const char *s);

#endif /* RUDDER_JSON_H */
