/* rudder_grammar.h - context-free grammars for controllers: a lexer + Earley parser over bytes.
 *
 * A grammar is written in the Lark-like syntax of docs/grammar.md: lowercase rules, uppercase
 * terminals (lexemes), `%ignore` for skippable lexemes, `start` as the start rule. Terminals
 * are compiled into one rudder_rx (rudder_regex.h); the parser is an Earley parser over
 * lexemes, so any context-free grammar works (left recursion, ambiguity, empty rules).
 *
 * One rudder_grammar holds the compiled grammar *and* one parse: the bytes pushed so far. The
 * parse position is a small value (rudder_gm_pos) that can be saved and restored, so keeping one
 * per generated token makes backtracking cheap.
 *
 * Lexing is greedy (maximal munch): a lexeme goes on while the next byte can extend one of the
 * terminals the parser allows here; it ends when the next byte cannot extend it and it matches
 * a terminal; all terminals it matches are offered to the parser together. A `%json {...}`
 * element is a terminal whose lexemes are JSON values valid against the schema, matched by the
 * JSON Schema engine (rudder_jsonschema.h) embedded in the lexer.
 */
#ifndef RUDDER_GRAMMAR_H
#define RUDDER_GRAMMAR_H

#include "rudder.h"
#include "rudder_constraint.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rudder_grammar rudder_grammar;

/* Where a parse stands: the lexer state inside the current lexeme (RUDDER_GM_BOUNDARY: none
 * begun), the number of lexemes + 1 the parser has seen, the bytes pushed; inside a %json value,
 * where it began and a checkpoint of the JSON engine (replayed from the bytes when the engine
 * has begun another value since). Positions are checkpoints: they follow a stack discipline
 * (restoring one makes those saved after it invalid). */
typedef struct rudder_gm_pos {
    uint32_t lexer;
    uint32_t n_sets;
    uint32_t n_bytes;
    uint32_t json_at, json_cp, json_epoch;
} rudder_gm_pos;
#define RUDDER_GM_BOUNDARY 0xfffffffdu

/* Request-independent tables (the token trie's shape, the JSON engine's token classes, for
 * %json); call once from controller_init, so that they land in the host's snapshot (optional:
 * done on first use otherwise). */
void rudder_gm_init_tables(void);

/* Compile grammar text. On error returns NULL and writes a one-line message ("line:col: ...")
 * into err[0..err_cap). The parse starts at the beginning of a sentence. */
rudder_grammar *rudder_gm_new(const char *text, uint32_t len, char *err, uint32_t err_cap);
void rudder_gm_free(rudder_grammar *g);

rudder_gm_pos rudder_gm_save(rudder_grammar *g);
/* Go back to a position saved earlier on this parse (later positions become invalid). */
void rudder_gm_restore(rudder_grammar *g, rudder_gm_pos pos);

/* Feed bytes. false: some byte cannot continue a sentence; the parse is then unchanged. */
bool rudder_gm_push(rudder_grammar *g, const uint8_t *bytes, uint32_t len);
/* Is the input so far a complete sentence (may the output end here)? */
bool rudder_gm_accepting(rudder_grammar *g);

/* Can any byte continue the input? (false with rudder_gm_accepting: the sentence is finished) */
bool rudder_gm_can_continue(rudder_grammar *g);

/* OR into `mask` every token whose bytes can continue the input (EOS is not included: add it
 * when rudder_gm_accepting). Returns the number of tokens set in `mask` afterwards. */
uint32_t rudder_gm_fill_mask(rudder_grammar *g, uint32_t *mask);

/* The bytes that must come next whatever the continuation (a keyword with no alternative...):
 * writes up to cap of them to dst and returns how many. Stops where the input could end. */
uint32_t rudder_gm_forced(rudder_grammar *g, uint8_t *dst, uint32_t cap);

/* The grammar as an engine for the token layer (rudder_constraint.h), from the parse's current
 * position. Positions have no key: the parser caches what it can itself. */
rudder_engine rudder_gm_engine(rudder_grammar *g);

/* Sizes, for logs and tests. */
uint32_t rudder_gm_n_terminals(const rudder_grammar *g);
uint32_t rudder_gm_n_rules(const rudder_grammar *g);

#ifdef __cplusplus
}
#endif
#endif /* RUDDER_GRAMMAR_H */
