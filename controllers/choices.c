/* choices: the output is exactly one of the strings in the argument, a JSON array like ["yes", "no"].
 * The engine is a byte trie of the choices; following tokens, masks, fast-forward and token
 * healing are the token layer's (guest-sdk/rudder_constraint.h, docs/constraints.md). */
#include "rudder.h"
#include "rudder_constraint.h"

/* A byte trie of the choices; `end`: a choice ends here. Node 0 is the root. */
typedef struct {
    uint32_t child, sibling;
    uint8_t byte, end;
} node;

static node *nodes;
static uint32_t n_nodes;
static uint32_t at;   /* the engine's position: a node */
static rudder_cx *cx;

static uint32_t child(uint32_t from, uint8_t byte) {
    for (uint32_t c = nodes[from].child; c; c = nodes[c].sibling)
        if (nodes[c].byte == byte)
            return c;
    return RUDDER_DEAD;
}

static uint32_t step_byte(void *self, uint32_t state, uint8_t byte) {
    (void)self;
    return child(state, byte);
}

static const rudder_recognizer prefix_of_a_choice = {.push = step_byte};

static bool push(void *self, const uint8_t *bytes, uint32_t n) {
    (void)self;
    uint32_t p = at;
    for (uint32_t i = 0; i < n; i++)
        if ((p = child(p, bytes[i])) == RUDDER_DEAD)
            return false;
    at = p;
    return true;
}

static uint32_t save(void *self) {
    (void)self;
    return at;
}

static void restore(void *self, uint32_t checkpoint) {
    (void)self;
    at = checkpoint;
}

static bool accepting(void *self) {
    (void)self;
    return nodes[at].end;
}

static uint32_t walk(void *self, uint32_t *mask, uint32_t first, uint32_t end) {
    (void)self;
    return rudder_trie_fill_range(mask, &prefix_of_a_choice, at, first, end);
}

/* The bytes of a chain of only children, up to where a choice ends. */
static uint32_t forced(void *self, uint8_t *dst, uint32_t cap) {
    (void)self;
    uint32_t n = 0;
    for (uint32_t p = at; n < cap && !nodes[p].end && nodes[p].child && !nodes[nodes[p].child].sibling;
         p = nodes[p].child)
        dst[n++] = nodes[nodes[p].child].byte;
    return n;
}

static uint32_t key(void *self, uint8_t *dst, uint32_t cap) {
    (void)self;
    if (cap >= 4)
        memcpy(dst, &at, 4);
    return 4;
}

int controller_start(const char *arg, uint32_t len) {
    uint32_t n, total = 1;
    const char *err;
    rudder_str *choices = rudder_json_strings(arg, len, &n, &err);
    if (!choices || n == 0) {
        rudder_logf("choices: the argument must be a non-empty JSON array of strings (%s)\n", err ? err : "empty");
        return 1;
    }
    for (uint32_t i = 0; i < n; i++)
        total += choices[i].len;
    nodes = rudder_xalloc(total * sizeof(node));
    nodes[0] = (node){0};
    n_nodes = 1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = 0;
        for (uint32_t j = 0; j < choices[i].len; j++) {
            uint32_t c = child(p, choices[i].ptr[j]);
            if (c == RUDDER_DEAD) {
                c = n_nodes++;
                nodes[c] = (node){.sibling = nodes[p].child, .byte = choices[i].ptr[j]};
                nodes[p].child = c;
            }
            p = c;
        }
        nodes[p].end = 1;
    }
    rudder_free(choices);
    at = 0;
    rudder_engine engine = {.name = "choices", .what = "any choice", .push = push, .save = save, .restore = restore,
                            .accepting = accepting, .walk = walk, .forced = forced, .key = key};
    cx = rudder_cx_new(&engine);
    return 0;
}

void controller_step(const rudder_step *step, rudder_out *out) { rudder_cx_step(cx, step, out); }
