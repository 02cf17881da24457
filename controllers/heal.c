/* heal: no constraint, for token healing alone (a request's token_healing, docs/constraints.md):
 * the first step takes back the end of the prompt, the output writes it again first in tokens of
 * the model's choice, then every step samples freely. The token layer does it
 * (guest-sdk/rudder_constraint.h) as it does for the constraint controllers. */
#include "rudder.h"
#include "rudder_constraint.h"

static rudder_cx *cx;

int controller_start(const char *arg, uint32_t len) {
    (void)arg;
    if (len) {
        rudder_log("heal: takes no argument\n");
        return 1;
    }
    cx = rudder_cx_new(NULL);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) { rudder_cx_step(cx, step, out); }
