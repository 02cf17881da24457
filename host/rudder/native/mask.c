/* The sampler's hot loop: apply an allowed-token bitmask to a row of logits, in place.
 *
 * Token i is allowed when bit (i & 31) of words[i >> 5] is set; every other logit becomes
 * -inf. One pass over the row, no intermediate buffer. Whole words that allow everything or
 * nothing (most of a real constraint's mask) take a shortcut; mixed words run a branch-free
 * select that the compiler vectorises. Built with zig cc at first use (see native/__init__.py).
 */
#include <stddef.h>
#include <stdint.h>

void rudder_apply_mask(float *logits, const uint32_t *words, size_t n_tokens) {
    const float neg_inf = -__builtin_inff();
    size_t full_words = n_tokens / 32;
    for (size_t w = 0; w < full_words; w++) {
        uint32_t bits = words[w];
        float *x = logits + 32 * w;
        if (bits == 0xffffffffu)
            continue;
        if (bits == 0) {
            for (int j = 0; j < 32; j++)
                x[j] = neg_inf;
            continue;
        }
        for (int j = 0; j < 32; j++)
            x[j] = ((bits >> j) & 1u) ? x[j] : neg_inf;
    }
    for (size_t i = full_words * 32; i < n_tokens; i++)
        if (!((words[i >> 5] >> (i & 31)) & 1u))
            logits[i] = neg_inf;
}
