/* The decoder layers of one forward pass in one call, for models whose every layer runs on the
 * native kernels (bf16 or int8 weights, bf16 activations).
 *
 * Composing a layer from Python costs 8 kernel calls through cffi plus the module calls,
 * allocations and checks around them: a large share of an int8 decode step at batch 1
 * (benchmarks/RESULTS.md, "Numbers the code's design rests on"). This
 * file runs the same kernels in the same order - RMSNorm, QKV, attention, o_proj with the
 * residual add, RMSNorm, gate/up with SwiGLU, down with the residual add - so its results are
 * bit for bit those of model.py's composed path (tests check it), with the intermediate rows in
 * buffers reused across layers.
 */
#include <stdlib.h>

#include "kernels.h"

enum { OP_NONE = 0, OP_ADD = 1, OP_SWIGLU = 2 };

typedef struct rudder_dense {
    const void *w;       /* packed blocks (packed_linear.pack_blocks) */
    const float *scale;  /* int8: [columns] */
    const int32_t *sum;  /* int8: [columns] */
    const float *bias;   /* [n] or NULL */
    int64_t n;           /* output columns (SwiGLU: of each half) */
    int32_t int8;
} rudder_dense;

typedef struct rudder_layer {
    const uint16_t *norm1, *norm2; /* bf16 RMSNorm weights [hidden] */
    rudder_dense qkv, o, gate_up, down;
} rudder_layer;

static void dense(const rudder_dense *d, const uint16_t *x, int64_t m, int64_t k, uint16_t *out, int op, int threads) {
    if (d->int8)
        rudder_linear_i8(x, 1, m, k, (const int8_t *)d->w, d->scale, d->sum, d->bias, d->n, out, 1, op, threads);
    else
        rudder_linear_bf16(x, m, k, (const uint16_t *)d->w, d->bias, d->n, out, 1, op, threads);
}

/* x: the residual stream [T, hidden] bf16, updated in place. Layer i's K and V caches are at
 * kv + (2 i) * layer_stride and kv + (2 i + 1) * layer_stride elements (the KVCache layout).
 * `threads`: for the linear layers (attention takes the step's). Returns 0, or -1 without
 * memory for the buffers (or for a shape attention does not take). */
int rudder_decoder(const rudder_layer *layers, int64_t n_layers, const rudder_attn_step *step, uint16_t *x,
                   int64_t hidden, float eps, void *kv, int64_t layer_stride, int32_t threads) {
    int64_t t = step->tokens, d = step->head_dim;
    int64_t qkv_cols = (step->heads + 2 * step->kv_heads) * d, attn_cols = step->heads * d;
    int64_t ffn = layers[0].gate_up.n;
    int64_t widest = qkv_cols > ffn ? qkv_cols : ffn;
    widest = widest > hidden ? widest : hidden;
    uint16_t *h = (uint16_t *)malloc((size_t)(t * hidden) * 2), *wide = (uint16_t *)malloc((size_t)(t * widest) * 2);
    uint16_t *attn = (uint16_t *)malloc((size_t)(t * attn_cols) * 2);
    int rc = h != 0 && wide != 0 && attn != 0 ? 0 : -1;
    size_t elem = step->cache_bf16 ? 2 : 4;
    for (int64_t i = 0; rc == 0 && i < n_layers; i++) {
        const rudder_layer *L = layers + i;
        char *k_cache = (char *)kv + (size_t)(2 * i) * (size_t)layer_stride * elem;
        char *v_cache = k_cache + (size_t)layer_stride * elem;
        rudder_rms_norm(x, 1, L->norm1, 1, h, 1, t, hidden, eps);
        dense(&L->qkv, h, t, hidden, wide, OP_NONE, threads);
        rc = rudder_attention(step, wide, k_cache, v_cache, attn);
        dense(&L->o, attn, t, attn_cols, x, OP_ADD, threads);
        rudder_rms_norm(x, 1, L->norm2, 1, h, 1, t, hidden, eps);
        dense(&L->gate_up, h, t, hidden, wide, OP_SWIGLU, threads);
        dense(&L->down, wide, t, ffn, x, OP_ADD, threads);
    }
    free(h);
    free(wide);
    free(attn);
    return rc;
}
