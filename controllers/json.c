/* json: the output is JSON valid against the JSON Schema in the argument ({} = any JSON). The
 * engine is guest-sdk/rudder_jsonschema.h (docs/json-schema.md); following tokens, masks and
 * fast-forward are the token layer's (guest-sdk/rudder_constraint.h). */
#include "rudder.h"
#include "rudder_constraint.h"
#include "rudder_jsonschema.h"

static rudder_cx *cx;

int controller_init(void) {
    rudder_js_init_tables();   /* token classes: before the snapshot, shared by every request */
    return 0;
}

int controller_start(const char *arg, uint32_t len) {
    static char err[400];
    rudder_js *js = rudder_js_compile(len ? arg : "{}", len ? len : 2, err, sizeof err);
    if (!js) {
        rudder_logf("json: %s\n", err);
        return 1;
    }
    rudder_engine engine = rudder_js_engine(js);
    cx = rudder_cx_new(&engine);
    if (!rudder_js_ff(js))
        rudder_cx_disable_ff(cx);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) { rudder_cx_step(cx, step, out); }
