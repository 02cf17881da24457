/* rudder_jsonschema.h - JSON Schema (draft 2020-12, with the older drafts' forms) as a
 * byte-level constraint engine for the token layer (rudder_constraint.h).
 *
 * rudder_js_compile turns a schema into a graph of nodes (rudder_jsonschema_compile.c): combinators,
 * $ref and sibling keywords are flattened into unions of plain alternatives first (allOf is
 * merged, anyOf/oneOf distribute over it). The engine (rudder_jsonschema_match.c) is a byte-level
 * pushdown automaton over that graph whose position is a *set* of threads: where alternatives
 * of a union can start alike, each goes on in its own thread until the bytes tell them apart,
 * so any mix of anyOf, oneOf, type arrays and $ref works. See docs/json-schema.md for the
 * keywords and the design.
 */
#ifndef RUDDER_JSONSCHEMA_H
#define RUDDER_JSONSCHEMA_H

#include "rudder.h"
#include "rudder_constraint.h"

typedef struct rudder_js rudder_js;

/* Compile a schema (JSON text). NULL on error, with a message naming the keyword and its JSON
 * pointer path in err. Root keywords set the options: "x-rudder-undeclared" ("forbid", the
 * default: objects generate the keys they name, tuples their prefix | "allow": the
 * specification's reading), "x-rudder-strict" (true: refuse what would be relaxed, with its
 * path), "x-rudder-whitespace" ("compact" | "flexible") and "x-rudder-ff" (true | false). No
 * object gets a key twice. The work is bounded: a schema whose combinators expand past the
 * limits is refused with a message saying so. */
rudder_js *rudder_js_compile(const char *text, uint32_t len, char *err, uint32_t cap);

/* Request-independent tables (token classes); call once from controller_init, so that they
 * land in the host's snapshot (optional: done lazily otherwise). */
void rudder_js_init_tables(void);

/* The schema as an engine for the token layer: one JSON document from the start. Positions
 * are sets of threads; their key is the set itself. */
rudder_engine rudder_js_engine(rudder_js *js);

/* "x-rudder-ff": false turns fast-forward off (every token sampled under a mask). */
bool rudder_js_ff(const rudder_js *js);

#endif /* RUDDER_JSONSCHEMA_H */
