/* rudder_constraint.h - the token layer of constraint controllers (regex, grammar, json,
 * triggers): from a byte-level engine to the answer of each decoding step.
 *
 * An engine (rudder_engine) knows bytes: it holds a current position that `push` advances, it
 * checkpoints and restores positions, tells whether the output may end, which bytes are forced,
 * and which tokens of a part of the token trie continue. This layer knows tokens, with one set
 * of rules for every engine:
 * - it follows the generated tokens with one checkpoint per token, so a backtrack is a restore;
 * - forced bytes become a fast-forward: whole UTF-8 characters, tokenized canonically, the last
 *   token held back when a longer token starting with it could follow (it could merge with what
 *   the model writes next: `": "` before a string could become `": "A`);
 * - otherwise a mask of the tokens that continue, with EOS when the output may end; when few
 *   tokens are allowed, each one after which bytes are forced carries an ff list (the token,
 *   then the forced tokens), within the host's fast-forward budget;
 * - a position's answer is cached when the engine gives positions a key;
 * - token healing: when the host asks for it (RUDDER_CONFIG_HEAL = k > 0), the first step takes
 *   back the prompt's last k tokens and the output writes their bytes again first, in tokens of
 *   the model's choice (a mask of the tokens that spell a prefix of them, or all of them and then
 *   bytes that continue the constraint); only the bytes after them reach the engine.
 * See docs/constraints.md.
 */
#ifndef RUDDER_CONSTRAINT_H
#define RUDDER_CONSTRAINT_H

#include "rudder.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A byte-level engine. Checkpoints follow a stack discipline: restoring one forgets those
 * taken after it. */
typedef struct rudder_engine {
    const char *name;   /* in messages: "regex", "json", "grammar" */
    const char *what;   /* what a rejected token does not continue: "the match", "valid JSON" */
    void *self;
    /* Advance by bytes; false when some byte is rejected (the position is then unchanged). */
    bool (*push)(void *self, const uint8_t *bytes, uint32_t n);
    uint32_t (*save)(void *self);
    void (*restore)(void *self, uint32_t checkpoint);
    /* May the output end here? */
    bool (*accepting)(void *self);
    /* OR into mask the tokens of the trie nodes [first, end) (a forest of whole subtrees, see
     * rudder_trie_fill_range) whose bytes continue from here; returns how many. */
    uint32_t (*walk)(void *self, uint32_t *mask, uint32_t first, uint32_t end);
    /* The bytes every continuation starts with (up to where the output could end): writes up
     * to cap of them; returns how many. The position does not move. */
    uint32_t (*forced)(void *self, uint8_t *dst, uint32_t cap);
    /* A key for the current position (equal keys, equal answers): its full length (it may
     * exceed cap: then nothing is cached), 0 when positions have no key. */
    uint32_t (*key)(void *self, uint8_t *dst, uint32_t cap);
} rudder_engine;

typedef struct rudder_cx rudder_cx;

/* A layer over `engine` (copied), starting at the engine's current position. NULL: no
 * constraint (every byte continues, the output may end anywhere, steps sample freely), for a
 * controller that only heals; such a layer takes rudder_cx_step and the follow calls only. */
rudder_cx *rudder_cx_new(const rudder_engine *engine);
const rudder_engine *rudder_cx_engine(const rudder_cx *cx);
/* No fast-forward at all (every token is sampled under a mask); also when the host's budget
 * RUDDER_CONFIG_MAX_FF is 0. */
void rudder_cx_disable_ff(rudder_cx *cx);

/* Start over from the position the layer was created at, then push `prefix` (a token can hold
 * the end of a trigger and the first bytes of the constrained text). false: rejected. */
bool rudder_cx_begin(rudder_cx *cx, const uint8_t *prefix, uint32_t n);

/* Follow tokens[0..n), the tokens since the start; the first `kept` of them are unchanged since
 * the previous call (fewer after a backtrack). Rewinds to the checkpoint after them, then
 * pushes the rest. A token the engine rejects is logged ("<name>: token <id> (<text>) after <k>
 * generated tokens does not continue <what>") and its index written to *bad; returns false.
 * EOS ends the output: the tokens after it are ignored, and *ended is set. */
bool rudder_cx_follow(rudder_cx *cx, const uint32_t *tokens, uint32_t n, uint32_t kept, uint32_t *bad, bool *ended);
/* Tokens followed so far. */
uint32_t rudder_cx_count(const rudder_cx *cx);
/* The same one token at a time: back to after the first `kept` tokens (since the start), then
 * one more token (false, nothing changed, when the engine rejects it: no log). */
void rudder_cx_rewind(rudder_cx *cx, uint32_t kept);
bool rudder_cx_push(rudder_cx *cx, uint32_t token);
/* May the constrained text end here? */
bool rudder_cx_accepting(rudder_cx *cx);

/* The answer at the current position. Either ff (n_ff > 0: append these tokens, forced), or
 * sample under mask (n_tokens > 0: the tokens that continue, plus EOS when accepting) with ff
 * lists, or neither: n_tokens == 0 means the output is complete and nothing can follow
 * (accepting) or that no token of the vocabulary continues (not accepting). Valid until the
 * next call into the layer. */
typedef struct rudder_cx_info {
    bool accepting;
    const uint32_t *ff;
    uint32_t n_ff;
    const uint32_t *mask;
    uint32_t n_tokens;           /* tokens in mask, EOS not counted */
    uint32_t n_lists;            /* list i is list_tokens[lists[2i] .. lists[2i] + lists[2i+1]) */
    const uint32_t *lists;
    const uint32_t *list_tokens;
} rudder_cx_info;
const rudder_cx_info *rudder_cx_info_now(rudder_cx *cx);

/* The branch for an answer: ff, or a masked sample with its lists; no branch when complete; a
 * failure when nothing continues. Returns the masked branch (NULL otherwise). */
rudder_branch *rudder_cx_answer(rudder_cx *cx, const rudder_cx_info *in, rudder_out *out);

/* A whole step of a controller whose output is constrained from its first token: follow the
 * generated tokens, then answer; with token healing, the first step takes back the prompt's last
 * RUDDER_CONFIG_HEAL tokens, and steps answer under the healing mask until their bytes are
 * written again. */
void rudder_cx_step(rudder_cx *cx, const rudder_step *step, rudder_out *out);
/* Are taken-back prompt bytes still to be written again (token healing)? */
bool rudder_cx_healing(const rudder_cx *cx);

/* Counters for benchmarks and logs: answers served from the cache, and computed. */
void rudder_cx_stats(const rudder_cx *cx, uint32_t *hits, uint32_t *misses);

#ifdef __cplusplus
}
#endif
#endif /* RUDDER_CONSTRAINT_H */
