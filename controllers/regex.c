/* regex: the output matches the regular expression in the argument (whole match). The engine
 * is guest-sdk/rudder_regex.h; following tokens, masks and fast-forward are the token layer's
 * (guest-sdk/rudder_constraint.h, docs/constraints.md). */
#include "rudder.h"
#include "rudder_constraint.h"
#include "rudder_regex.h"

static rudder_cx *cx;

int controller_start(const char *arg, uint32_t len) {
    static char err[256];
    rudder_rx *rx = rudder_rx_compile(arg, len, err, sizeof err);
    if (!rx) {
        rudder_logf("regex: %s\n", err);
        return 1;
    }
    rudder_engine engine = rudder_rx_engine(rx);
    cx = rudder_cx_new(&engine);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) { rudder_cx_step(cx, step, out); }
