/* rudder.h - the C guest SDK for rudder controllers (ABI version 1).
 *
 * This header is the C twin of docs/abi.md: the records the host reads, the imports of module
 * "rudder", and a small author API on top. A change to one is a change to the other.
 *
 * A controller is one .c file that implements
 *
 *     void controller_step(const rudder_step *step, rudder_out *out);   (required)
 *     int  controller_start(const char *arg, uint32_t len);              (optional, per request)
 *     int  controller_init(void);                                        (optional, once)
 *
 * and is compiled together with the SDK's .c files for wasm32-freestanding (no libc); see
 * guest-sdk/README.md. The SDK defines the module's exports and calls these callbacks.
 *
 * Memory model: one controller instance serves one sequence; it is copied at a fork, so plain
 * C globals are the controller's state (each fork keeps its own copy).
 */
#ifndef RUDDER_H
#define RUDDER_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RUDDER_ABI_VERSION 1

_Static_assert(sizeof(void *) == 4, "rudder controllers are wasm32 modules");

/* ------------------------------------------------------------------------------------------
 * ABI records (docs/abi.md, "The step"). Pointers are u32 offsets into linear memory.
 * ------------------------------------------------------------------------------------------ */

typedef struct rudder_tokens {
    uint32_t n;               /* number of token ids */
    const uint32_t *tokens;   /* the ids */
} rudder_tokens;

typedef struct rudder_branch {
    uint32_t backtrack;       /* tokens to remove from the end first */
    const uint32_t *mask;     /* NULL: unconstrained; else ceil(vocab/32) words of allowed bits */
    uint32_t n_ff;            /* number of ff lists (set by the SDK) */
    const rudder_tokens *ff;  /* the ff lists (set by the SDK) */
} rudder_branch;

typedef struct rudder_result {
    uint32_t n_branches;      /* 0: stop; 1: continue; k > 1: fork into k sequences */
    const rudder_branch *branches;
} rudder_result;

_Static_assert(sizeof(rudder_tokens) == 8, "rudder_tokens is 8 bytes");
_Static_assert(sizeof(rudder_branch) == 16, "rudder_branch is 16 bytes");
_Static_assert(sizeof(rudder_result) == 8, "rudder_result is 8 bytes");

/* ------------------------------------------------------------------------------------------
 * Raw imports (module "rudder"). Prefer the wrappers below; these are here for completeness.
 * ------------------------------------------------------------------------------------------ */

#define RUDDER_IMPORT(name) __attribute__((import_module("rudder"), import_name(#name)))

RUDDER_IMPORT(vocab_size) int32_t rudder_sys_vocab_size(void);
RUDDER_IMPORT(eos_token) int32_t rudder_sys_eos_token(void);
RUDDER_IMPORT(config) int32_t rudder_sys_config(int32_t key);
RUDDER_IMPORT(arg_len) int32_t rudder_sys_arg_len(void);
RUDDER_IMPORT(arg_read) int32_t rudder_sys_arg_read(void *dst, uint32_t cap);
RUDDER_IMPORT(tokenize) int32_t rudder_sys_tokenize(const void *text, uint32_t len, uint32_t *dst, uint32_t cap);
RUDDER_IMPORT(token_table_len) int32_t rudder_sys_token_table_len(void);
RUDDER_IMPORT(token_table_read) int32_t rudder_sys_token_table_read(void *dst, uint32_t cap);
RUDDER_IMPORT(log) void rudder_sys_log(const void *ptr, uint32_t len);
RUDDER_IMPORT(var_get) int32_t rudder_sys_var_get(const void *key, uint32_t key_len, void *dst, uint32_t cap);
RUDDER_IMPORT(var_set) int32_t rudder_sys_var_set(const void *key, uint32_t key_len, const void *val, uint32_t val_len);

/* Keys of rudder_config(). */
enum {
    RUDDER_CONFIG_ABI_VERSION = 0,
    RUDDER_CONFIG_MAX_FORKS = 1,   /* live sequences per request (and branches per result) */
    RUDDER_CONFIG_MAX_FF = 2,      /* fast-forward tokens per step, all lists of a result */
    RUDDER_CONFIG_FLAGS = 3,
    RUDDER_CONFIG_HEAL = 4,        /* prompt tokens the first answer takes back (token healing); 0: none */
};
#define RUDDER_FLAG_FORKS 1u       /* bit 0 of RUDDER_CONFIG_FLAGS: forks allowed */
#define RUDDER_FLAG_BACKTRACK 2u   /* bit 1: backtrack allowed */

/* ------------------------------------------------------------------------------------------
 * The author's callbacks.
 * ------------------------------------------------------------------------------------------ */

/* What one call of the step hook sees. The SDK keeps the whole sequence for you. */
typedef struct rudder_step {
    uint32_t index;            /* 0 on the first step of this sequence's history (forks continue the count) */
    uint32_t branch_idx;       /* which branch of the previous result this sequence took */
    uint32_t backtrack;        /* tokens removed from the end since the previous step */
    const uint32_t *tokens;    /* tokens appended since then (the prompt on the first step) */
    uint32_t n_tokens;
    const uint32_t *seq;       /* the whole sequence now: prompt, then generated tokens */
    uint32_t n_seq;
    uint32_t n_prompt;         /* seq[0 .. n_prompt) is the prompt (less if a backtrack cut into it) */
} rudder_step;

typedef struct rudder_out rudder_out;   /* the step's answer, built with rudder_out_* below */

/* Required: decide this step. Add branches to `out`; adding none stops the sequence. */
void controller_step(const rudder_step *step, rudder_out *out);

/* Optional (the SDK has weak defaults returning 0). Non-zero fails the request; log why.
 * `arg` is the request argument, NUL-terminated (it may also contain NUL bytes: use `len`). */
int controller_start(const char *arg, uint32_t len);
int controller_init(void);  /* runs once per (module, tokenizer), after the SDK loaded the token table */

/* ------------------------------------------------------------------------------------------
 * Building the answer. All memory is owned by the SDK and reused across steps; token lists
 * are copied, masks are not (a mask must live until the next step: use rudder_out_mask(), or
 * a mask of your own that you do not change before then).
 * ------------------------------------------------------------------------------------------ */

/* New branch: sample one token; `mask` NULL = any token. */
rudder_branch *rudder_out_sample(rudder_out *out, const uint32_t *mask);
/* New branch: append `tokens` without sampling. */
rudder_branch *rudder_out_ff(rudder_out *out, const uint32_t *tokens, uint32_t n);
/* New branch: only remove the last `n` tokens (n > 0); the next step gets fresh logits. */
rudder_branch *rudder_out_backtrack(rudder_out *out, uint32_t n);
/* On a masked branch: if the sampled token is tokens[0], append the whole list (n > 0). */
void rudder_out_ff_list(rudder_out *out, rudder_branch *b, const uint32_t *tokens, uint32_t n);
/* Any branch can also remove tokens first:  rudder_out_sample(out, m)->backtrack = 2;  */

/* Remove all branches added so far: the sequence stops. */
void rudder_out_stop(rudder_out *out);
/* Fail the request with this message (logged). */
void rudder_out_fail(rudder_out *out, const char *why);
/* A zeroed mask owned by the SDK, valid until the next step (each call gives a new one). */
uint32_t *rudder_out_mask(rudder_out *out);
uint32_t rudder_out_n_branches(const rudder_out *out);

/* ------------------------------------------------------------------------------------------
 * Vocabulary, masks, token bytes.
 * ------------------------------------------------------------------------------------------ */

#define RUDDER_NO_TOKEN 0xffffffffu

uint32_t rudder_vocab_size(void);
uint32_t rudder_eos_token(void);                  /* RUDDER_NO_TOKEN if the tokenizer has none */
uint32_t rudder_mask_words(void);                 /* (vocab_size + 31) / 32 */
uint32_t *rudder_mask_new(void);                  /* zeroed, from the heap (rudder_free it) */
void rudder_mask_clear_all(uint32_t *mask);
void rudder_mask_set_all(uint32_t *mask);         /* every token id (bits past the vocab stay 0) */
uint32_t rudder_mask_count(const uint32_t *mask); /* number of allowed tokens */

static inline void rudder_mask_set(uint32_t *mask, uint32_t token) { mask[token >> 5] |= 1u << (token & 31); }
static inline void rudder_mask_clear(uint32_t *mask, uint32_t token) { mask[token >> 5] &= ~(1u << (token & 31)); }
static inline bool rudder_mask_test(const uint32_t *mask, uint32_t token) { return (mask[token >> 5] >> (token & 31)) & 1u; }

/* The bytes of a token (not NUL-terminated; special tokens have none). NULL for a bad id. */
const uint8_t *rudder_token_bytes(uint32_t token, uint32_t *len);
/* Concatenated bytes of tokens into dst (up to cap); returns the full length. */
uint32_t rudder_detokenize(const uint32_t *tokens, uint32_t n, uint8_t *dst, uint32_t cap);

/* ------------------------------------------------------------------------------------------
 * The token trie: compute a mask from a byte-level recognizer.
 *
 * A recognizer is a state machine over bytes with uint32 states. rudder_trie_fill_mask walks
 * the tokenizer's trie from `state`, feeding each token's bytes through `push`; it prunes
 * whole subtrees as soon as `push` returns RUDDER_DEAD, so its cost follows the live part of
 * the vocabulary. A token is allowed when all its bytes keep the state alive and, if `allow`
 * is set, allow(self, state after the token, token) is true. Allowed bits are OR-ed into
 * `mask` (special tokens are not in the trie: set e.g. rudder_eos_token() yourself).
 * ------------------------------------------------------------------------------------------ */

#define RUDDER_DEAD 0xffffffffu

typedef struct rudder_recognizer {
    uint32_t (*push)(void *self, uint32_t state, uint8_t byte);    /* next state or RUDDER_DEAD */
    bool (*allow)(void *self, uint32_t state, uint32_t token);     /* optional */
    void *self;
} rudder_recognizer;

/* The trie as the walk sees it (SDK internals; read-only). */
typedef struct rudder_trie {
    const uint32_t *nodes;     /* n_nodes x {byte | (token + 1) << 8, subtree size} */
    uint32_t n_nodes;
    uint32_t *ends, *states;   /* walk stacks, one entry per depth */
} rudder_trie;
const rudder_trie *rudder_trie_get(void);

/* The walk over the trie nodes [first, end): a forest of whole subtrees (the root's children
 * are [1, n_nodes); node i's children are [i + 1, i + subtree size)), each node's byte pushed
 * from `state` (a node in the range is at depth 1). Returns the number of tokens allowed.
 * Inline, so that a recognizer known at compile time (e.g. a static const rudder_recognizer)
 * is inlined into the loop. */
static inline uint32_t rudder_trie_fill_range(uint32_t *mask, const rudder_recognizer *r, uint32_t state,
                                              uint32_t first, uint32_t end) {
    const rudder_trie *t = rudder_trie_get();
    const uint32_t *nodes = t->nodes;
    uint32_t *ends = t->ends, *states = t->states;
    uint32_t depth = 0, count = 0, i = first;
    ends[0] = end;
    states[0] = state;
    while (i < end) {
        while (i >= ends[depth])
            depth--;
        uint32_t w0 = nodes[2 * i], size = nodes[2 * i + 1];
        uint32_t s = r->push(r->self, states[depth], (uint8_t)w0);
        if (s == RUDDER_DEAD) {
            i += size;
            continue;
        }
        uint32_t tok1 = w0 >> 8;
        if (tok1 && (!r->allow || r->allow(r->self, s, tok1 - 1))) {
            mask[(tok1 - 1) >> 5] |= 1u << ((tok1 - 1) & 31);
            count++;
        }
        if (size > 1) {
            ends[++depth] = i + size;
            states[depth] = s;
        }
        i++;
    }
    return count;
}

/* Every token of the vocabulary: the walk over the whole trie. */
static inline uint32_t rudder_trie_fill_mask(uint32_t *mask, const rudder_recognizer *r, uint32_t state) {
    return rudder_trie_fill_range(mask, r, state, 1, rudder_trie_get()->n_nodes);
}

/* The trie node that spells `bytes` (0: none; a node need not carry a token). */
uint32_t rudder_trie_node(const uint8_t *bytes, uint32_t len);

/* ------------------------------------------------------------------------------------------
 * Host services.
 * ------------------------------------------------------------------------------------------ */

/* Tokenize UTF-8 text; returns a rudder_alloc'ed array (free it with rudder_free) of *n ids,
 * or NULL (*n = 0) if the text is not valid UTF-8 (the host would trap on it). */
uint32_t *rudder_tokenize(const void *text, uint32_t len, uint32_t *n);
uint32_t *rudder_tokenize_str(const char *text, uint32_t *n);
/* Strict UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF), as the host checks. */
bool rudder_utf8_valid(const void *text, uint32_t len);
/* Write code point cp (at most U+10FFFF) as UTF-8 into out[0..4); returns its length (1-4). */
uint32_t rudder_utf8_encode(uint32_t cp, uint8_t out[4]);

/* The request argument (NUL-terminated; *len may be NULL). */
const char *rudder_arg(uint32_t *len);
/* Parse a decimal number (surrounding spaces allowed) from s[0..len); false if it is not one
 * or exceeds UINT32_MAX. E.g. `if (len && !rudder_parse_uint(arg, len, &n)) return 1;` */
bool rudder_parse_uint(const char *s, uint32_t len, uint32_t *value);
/* A host setting (RUDDER_CONFIG_*); -1 for an unknown key. */
int32_t rudder_config(int32_t key);

/* The request's log. rudder_logf knows %d %i %u %x %c %s %.*s %% (and an 'l' size prefix). */
void rudder_log(const char *text);
void rudder_log_bytes(const void *data, uint32_t len);
void rudder_logf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void rudder_vlogf(const char *fmt, va_list ap);

/* Shared variables of the request (all forks see them). get: -1 if unset, else the full
 * length (min(len, cap) bytes copied). set: 0 ok, -1 over the host's limit. */
int32_t rudder_var_get(const char *key, void *dst, uint32_t cap);
int32_t rudder_var_set(const char *key, const void *val, uint32_t len);

/* ------------------------------------------------------------------------------------------
 * Memory: a size-class allocator over memory.grow. rudder_alloc returns NULL when the host's
 * memory limit is reached; rudder_xalloc logs and traps instead (the request fails).
 * ------------------------------------------------------------------------------------------ */

void *rudder_alloc(size_t n);
void *rudder_zalloc(size_t n);
void *rudder_xalloc(size_t n);
void *rudder_realloc(void *p, size_t n);
void rudder_free(void *p);
/* A growable array: `p` (NULL at first) with room for *cap items of `elem` bytes, grown by
 * doubling to at least `need` items (new room is not zeroed); traps when out of memory. */
void *rudder_grow(void *p, uint32_t *cap, uint32_t need, uint32_t elem);
__attribute__((noreturn)) void rudder_panic(const char *why);   /* log and trap */

/* No libc here; these are provided by the SDK (memcpy and memset compile to bulk-memory ops). */
void *memcpy(void *dst, const void *src, size_t n);
void *memmove(void *dst, const void *src, size_t n);
void *memset(void *dst, int c, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);

/* ------------------------------------------------------------------------------------------
 * Minimal JSON, for arguments: an array of strings, e.g. ["yes", "no", "caf\u00e9"]. Escapes:
 * \" \\ \/ \b \f \n \r \t \uXXXX (surrogate pairs too). Returns one rudder_alloc'ed block
 * (free it with rudder_free) holding *n strings, or NULL with a message in *err.
 * ------------------------------------------------------------------------------------------ */

typedef struct rudder_str {
    const uint8_t *ptr;   /* decoded UTF-8 bytes (NUL-terminated as a convenience) */
    uint32_t len;
} rudder_str;

rudder_str *rudder_json_strings(const char *json, uint32_t len, uint32_t *n, const char **err);

#ifdef __cplusplus
}
#endif
#endif /* RUDDER_H */
