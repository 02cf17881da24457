/* grammar: the output is a sentence of the context-free grammar in the argument (docs/grammar.md).
 * The engine is guest-sdk/rudder_grammar.h; following tokens, masks and fast-forward are the
 * token layer's (guest-sdk/rudder_constraint.h). */
#include "rudder.h"
#include "rudder_constraint.h"
#include "rudder_grammar.h"

static rudder_cx *cx;

int controller_init(void) {
    rudder_gm_init_tables();   /* before the snapshot, shared by every request */
    return 0;
}

int controller_start(const char *arg, uint32_t len) {
    static char err[256];
    rudder_grammar *g = rudder_gm_new(arg, len, err, sizeof err);
    if (!g) {
        rudder_logf("grammar: %s\n", err);
        return 1;
    }
    rudder_engine engine = rudder_gm_engine(g);
    cx = rudder_cx_new(&engine);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) { rudder_cx_step(cx, step, out); }
