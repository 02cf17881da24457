/* rudder_regex.h - byte-level regular expressions for controllers, determinized lazily.
 *
 * One `rudder_rx` holds one or more patterns (a grammar's lexemes, or one regex). Patterns are
 * compiled to one NFA over bytes (UTF-8 aware: a class like [é-ü] or `.` becomes the byte
 * sequences of its code points); DFA states (sets of NFA states) are built on first use and
 * cached, so a state is a small uint32 id that stays valid until rudder_rx_free. Patterns are
 * anchored at both ends: a state *accepts* pattern i when the bytes pushed since the start
 * state match pattern i entirely.
 *
 * Syntax (Python `re`-like): literals, escapes \n \t \r \f \v \0 \xHH \uHHHH \\ \. and
 * friends, \d \w \s \D \W \S (ASCII), classes [a-z0-9_] [^"\\] (ranges of code points),
 * `.` (any code point but \n), groups ( ) (?: ), alternation |, quantifiers * + ? {n} {n,}
 * {n,m} (lazy forms like *? are accepted and mean the same: a set of strings has no laziness),
 * and ^ / $ at the very start / end (accepted, no-ops: every pattern is anchored).
 * Not supported (a clear compile error): backreferences, lookaround, possessive quantifiers.
 */
#ifndef RUDDER_REGEX_H
#define RUDDER_REGEX_H

#include "rudder.h"
#include "rudder_constraint.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rudder_rx rudder_rx;

/* One pattern to compile: a regex, or (literal) the exact bytes. */
typedef struct rudder_rx_pattern {
    const char *text;
    uint32_t len;
    bool literal;
} rudder_rx_pattern;

/* Compile n >= 1 patterns into one lazy DFA. On error returns NULL and writes a NUL-terminated
 * message (naming the pattern index and byte offset) into err[0..err_cap). */
rudder_rx *rudder_rx_new(const rudder_rx_pattern *patterns, uint32_t n, char *err, uint32_t err_cap);
/* One regex. */
rudder_rx *rudder_rx_compile(const char *pattern, uint32_t len, char *err, uint32_t err_cap);
void rudder_rx_free(rudder_rx *rx);
uint32_t rudder_rx_n_patterns(const rudder_rx *rx);

/* The start state for the patterns whose bits are set in `subset` (ceil(n/32) words; NULL: all
 * patterns). RUDDER_DEAD if the subset is empty. */
uint32_t rudder_rx_start(rudder_rx *rx, const uint32_t *subset);

/* Internals the inline fast path reads (do not write). next[state * n_classes + class[byte]]
 * is the next state, RUDDER_DEAD, or RUDDER_RX_UNKNOWN (not built yet). `next` may move when
 * states are added: always read it through the struct. */
#define RUDDER_RX_UNKNOWN 0xfffffffeu
typedef struct rudder_rx_dfa {
    uint32_t *next;
    uint32_t n_classes;
    uint8_t classes[256];
} rudder_rx_dfa;
uint32_t rudder_rx_push_slow(rudder_rx *rx, uint32_t state, uint8_t byte);

/* The state after `byte`, or RUDDER_DEAD when no pattern can match any longer. */
static inline uint32_t rudder_rx_push(rudder_rx *rx, uint32_t state, uint8_t byte) {
    const rudder_rx_dfa *d = (const rudder_rx_dfa *)rx;   /* the struct's first member */
    uint32_t s = d->next[state * d->n_classes + d->classes[byte]];
    return s != RUDDER_RX_UNKNOWN ? s : rudder_rx_push_slow(rx, state, byte);
}
/* Push `len` bytes; RUDDER_DEAD as soon as one kills the state. */
uint32_t rudder_rx_push_bytes(rudder_rx *rx, uint32_t state, const uint8_t *bytes, uint32_t len);

/* Does `state` accept some pattern? Which is the lowest-numbered one (-1: none)? The full set
 * (a bitset of n_patterns bits, valid until rudder_rx_free)? */
bool rudder_rx_accepting(rudder_rx *rx, uint32_t state);
int32_t rudder_rx_accepted(rudder_rx *rx, uint32_t state);
const uint32_t *rudder_rx_accept_set(rudder_rx *rx, uint32_t state);
/* The patterns that can still match after more bytes (or now): a bitset as above. */
const uint32_t *rudder_rx_alive_set(rudder_rx *rx, uint32_t state);
/* Can some non-empty continuation still lead to acceptance? (false: the match is complete) */
bool rudder_rx_can_extend(rudder_rx *rx, uint32_t state);
/* The only byte that keeps `state` alive, when there is exactly one and the state does not
 * accept (the constraint forces it); else -1. For fast-forward. */
int32_t rudder_rx_forced_byte(rudder_rx *rx, uint32_t state);

/* OR into `mask` every token whose bytes keep `state` alive (walking the token trie, pruned at
 * dead states); returns the number of tokens. Special tokens (EOS) are not included. */
uint32_t rudder_rx_fill_mask(rudder_rx *rx, uint32_t state, uint32_t *mask);
/* The same mask, computed once per state and cached (valid until rudder_rx_free). */
const uint32_t *rudder_rx_mask(rudder_rx *rx, uint32_t state);
/* The bytes that keep `state` alive, a 256-bit set (8 words), cached per state. */
const uint32_t *rudder_rx_live_bytes(rudder_rx *rx, uint32_t state);

/* The regex as an engine for the token layer (rudder_constraint.h): a whole match of its
 * patterns from the start state; positions are DFA states (their own checkpoints and keys). */
rudder_engine rudder_rx_engine(rudder_rx *rx);

/* Escape `len` bytes so that they match literally inside a pattern; writes up to cap bytes to
 * dst and returns the full length needed. */
uint32_t rudder_rx_escape(const char *text, uint32_t len, char *dst, uint32_t cap);

#ifdef __cplusplus
}
#endif
#endif /* RUDDER_REGEX_H */
