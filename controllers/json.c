/* json: the output is JSON valid against the JSON Schema in the argument ({} = any JSON). */
/* The schema engine is guest-sdk/rudder_jsonschema.c (docs/json-schema.md). This file keeps a
 * checkpoint of the automaton per generated token (so a backtrack rewinds exactly) and turns
 * the engine's answer for the current state into the step's branch. */
#include "rudder.h"
#include "rudder_jsonschema.h"

static rudder_js *js;
static rudder_js_state *states;   /* states[k]: after k generated tokens */
static uint32_t n_states, cap_states, eos;

int controller_init(void) {
    rudder_js_init_tables();   /* token classes: before the snapshot, shared by every request */
    return 0;
}

int controller_start(const char *arg, uint32_t len) {
    static char err[300];
    js = rudder_js_compile(len ? arg : "{}", len ? len : 2, err, sizeof err);
    if (!js) {
        rudder_logf("json: %s\n", err);
        return 1;
    }
    eos = rudder_eos_token();
    cap_states = 64;
    states = rudder_xalloc(cap_states * sizeof *states);
    rudder_js_start(js, &states[0]);
    n_states = 1;
    return 0;
}

static void fail_token(rudder_out *out, uint32_t tok) {
    uint32_t len;
    const uint8_t *b = rudder_token_bytes(tok, &len);
    rudder_logf("json: token %u (%.*s) does not continue valid JSON here\n", tok, (int)len, b ? (const char *)b : "");
    rudder_out_fail(out, "json: a token broke the schema");
}

void controller_step(const rudder_step *step, rudder_out *out) {
    if (step->index > 0) {   /* (the first step's tokens are the prompt) */
        uint32_t had = n_states - 1, generated = step->n_seq - step->n_prompt;
        uint32_t kept = had >= step->backtrack ? had - step->backtrack : 0;
        if (step->n_prompt > step->n_seq || kept > generated) {
            rudder_out_fail(out, "json: the sequence lost part of the prompt");
            return;
        }
        n_states = kept + 1;   /* rewind to the checkpoint, then read what was appended */
        for (uint32_t i = step->n_prompt + kept; i < step->n_seq; i++) {
            uint32_t tok = step->seq[i], len;
            if (tok == eos)
                return;   /* the document was complete (EOS is only allowed then): stop */
            const uint8_t *b = rudder_token_bytes(tok, &len);
            if (n_states == cap_states) {
                cap_states *= 2;
                states = rudder_realloc(states, cap_states * sizeof *states);
                if (!states)
                    rudder_panic("json: out of memory");
            }
            rudder_js_state *s = &states[n_states];
            memcpy(s, &states[n_states - 1], sizeof *s);
            if (!b || !len || !rudder_js_push(js, s, b, len)) {
                fail_token(out, tok);
                return;
            }
            n_states++;
        }
    }
    const rudder_js_info *in = rudder_js_info_of(js, &states[n_states - 1]);
    if (in->n_ff) {
        rudder_out_ff(out, in->ff, in->n_ff);
        return;
    }
    if (in->n_allowed == 0) {
        if (!in->accepting)
            rudder_out_fail(out, "json: no token continues the document (the schema cannot be satisfied here)");
        return;   /* complete: stop */
    }
    rudder_branch *b = rudder_out_sample(out, in->mask);
    for (uint32_t i = 0; i < in->n_lists; i++)
        rudder_out_ff_list(out, b, in->list_tokens + in->lists[2 * i], in->lists[2 * i + 1]);
}
