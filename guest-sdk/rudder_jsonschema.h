/* rudder_jsonschema.h - JSON Schema (draft 2020-12 subset) as a byte-level constraint.
 *
 * rudder_js_compile turns a schema into a graph of nodes; a rudder_js_state is the position of
 * a byte-level pushdown automaton over that graph (a bounded stack of frames: node, phase,
 * container progress; plus the lexer of the current string or number). The state is a plain
 * struct: copy it to keep a checkpoint. rudder_js_info answers, for a state, everything a
 * controller needs for one step (mask, EOS, forced bytes as fast-forward tokens, per-token ff
 * lists) and caches the answer per state. See docs/json-schema.md for the supported keywords
 * and the design.
 */
#ifndef RUDDER_JSONSCHEMA_H
#define RUDDER_JSONSCHEMA_H

#include "rudder.h"

#define RUDDER_JS_MAX_DEPTH 32   /* nesting of objects and arrays (incl. the document) */

typedef struct rudder_js_frame {
    uint16_t node;
    uint8_t phase, flags;
    uint32_t aux, aux2;
} rudder_js_frame;

typedef struct rudder_js_state {
    uint8_t sp, lphase, u8need, u8lo, u8hi, neg, pad[2];
    uint32_t len;          /* string: code points (saturated); number: digit counts */
    uint32_t hex;          /* \uXXXX accumulator */
    uint32_t rx;           /* regex state of a pattern/format string */
    uint32_t pad2;
    double num;            /* number magnitude so far (bounded numbers only) */
    rudder_js_frame f[RUDDER_JS_MAX_DEPTH];
} rudder_js_state;

typedef struct rudder_js rudder_js;

/* Compile a schema (JSON text). NULL on error, with a message naming the keyword and its JSON
 * pointer path in err. Root keywords "x-rudder-whitespace" ("compact" | "flexible") and
 * "x-rudder-ff" (true | false) set the options. */
rudder_js *rudder_js_compile(const char *text, uint32_t len, char *err, uint32_t cap);

/* Request-independent tables (token classes); call once from controller_init (optional: done
 * lazily otherwise). */
void rudder_js_init_tables(void);

void rudder_js_start(rudder_js *js, rudder_js_state *s);
/* Advance by bytes; false (state unchanged in meaning: do not use it) when rejected. */
bool rudder_js_push(rudder_js *js, rudder_js_state *s, const uint8_t *bytes, uint32_t n);
/* Is the document complete here? */
bool rudder_js_accepting(rudder_js *js, const rudder_js_state *s);

/* What to do at a state. Either ff (n_ff > 0: append these tokens, forced by the schema), or
 * sample under mask (EOS included when the document is complete) with the ff lists; when
 * n_allowed == 0 the document is complete and nothing may follow (stop), or (!accepting) the
 * schema is unsatisfiable here. Valid until the next call. */
typedef struct rudder_js_info {
    bool accepting;
    const uint32_t *ff;
    uint32_t n_ff;
    const uint32_t *mask;
    uint32_t n_allowed;          /* tokens in mask, EOS included */
    uint32_t n_lists;            /* ff lists: lists[i] = {start, len} into list_tokens */
    const uint32_t *lists;
    const uint32_t *list_tokens;
} rudder_js_info;

const rudder_js_info *rudder_js_info_of(rudder_js *js, const rudder_js_state *s);

/* Counters for benchmarks/logs: mask cache hits and misses. */
void rudder_js_stats(const rudder_js *js, uint32_t *hits, uint32_t *misses);

#endif /* RUDDER_JSONSCHEMA_H */
