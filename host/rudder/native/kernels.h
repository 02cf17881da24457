/* Shared by the model's kernels (parallel.c, attention.c, linear.c): element types, bf16
 * conversions, 16-lane float vectors, and the parallel loop over torch's own OpenMP team. */
#ifndef RUDDER_KERNELS_H
#define RUDDER_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Run fn(ctx, i) for every i in [0, n) on up to `threads` threads of the OpenMP team torch uses
 * (parallel.c); chunks are taken dynamically, so which thread runs which i varies, but each
 * i's arithmetic is the same whatever the split. */
typedef void (*rudder_chunk_fn)(void *ctx, int64_t i);
void rudder_parallel_for(rudder_chunk_fn fn, void *ctx, int64_t n, int threads);

/* What every layer's attention call of one step shares (attention.c). */
typedef struct rudder_attn_step {
    int64_t tokens;           /* T new tokens */
    const int64_t *positions; /* [T] position of each token in its sequence */
    const int64_t *slots;     /* [T] its flat KV slot (block * block_size + offset) */
    const int64_t *seq_of;    /* [T] row of `tables` of its sequence */
    const int64_t *tables;    /* [B, width] block tables */
    int64_t width, block_size;
    const float *cos, *sin;   /* [max_position, head_dim] RoPE tables (rotate-half layout) */
    int64_t heads, kv_heads, head_dim;
    int32_t x_bf16, cache_bf16;
    int32_t kv_paired;        /* the cache's blocks hold K and V in pairs (engine/kv_cache.py) */
    int32_t threads;
    float scale;
} rudder_attn_step;

int rudder_amx_on(void); /* linear.c: AMX's tile state granted (rudder_linear_init) */
int rudder_attention(const rudder_attn_step *s, const void *qkv, void *k_cache, void *v_cache, void *out);
int64_t rudder_attention_cascade_rows(void);
void rudder_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, const float *bias, int64_t n,
                        void *out, int32_t out_bf16, int32_t op, int32_t threads);
void rudder_linear_i8(const void *x, int32_t x_bf16, int64_t m, int64_t k, const int8_t *w, const float *wscale,
                      const int32_t *wsum, const float *bias, int64_t n, void *out, int32_t out_bf16, int32_t op,
                      int32_t threads);
void rudder_rms_norm(const void *x, int32_t x_bf16, const void *weight, int32_t w_bf16, void *out, int32_t out_bf16,
                     int64_t m, int64_t k, float eps);

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

static inline v16f load16_f32(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16_f32(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* bf16 is the top half of an fp32: widening is exact. */
static inline v16f load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even (torch's rounding; NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void store16_bf16(uint16_t *p, v16f v) {
    v16u u;
    memcpy(&u, &v, sizeof u);
    v16u nan = (u & 0x7fffffffu) > 0x7f800000u;
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16u out = (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
    v16h h = __builtin_convertvector(out, v16h);
    memcpy(p, &h, sizeof h);
}

/* Rounded to bf16 and widened back (the value a bf16 tensor would hold). */
static inline v16f round16_bf16(v16f v) {
    uint16_t h[16];
    store16_bf16(h, v);
    return load16_bf16(h);
}

/* A vector of element type `bf16` (else fp32) at element `i` of `base`. */
static inline v16f load16(const void *base, int bf16, int64_t i) {
    return bf16 ? load16_bf16((const uint16_t *)base + i) : load16_f32((const float *)base + i);
}

static inline void store16(void *base, int bf16, int64_t i, v16f v) {
    if (bf16)
        store16_bf16((uint16_t *)base + i, v);
    else
        store16_f32((float *)base + i, v);
}

static inline float load1(const void *base, int bf16, int64_t i) {
    if (bf16) {
        uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)base)[i];
}

static inline void store1(void *base, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

/* Lane i takes lane i + w, for w = 8, 4, 2, 1 (lane 0 ends with all 16): a fixed order of
 * operations, in registers. */
#define FOLD16(v, op)                                                                              \
    do {                                                                                           \
        v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)); \
        v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));     \
        v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));     \
        v = op(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));     \
    } while (0)
#define FOLD_ADD(a, b) ((a) + (b))
#define FOLD_MAX(a, b) __builtin_elementwise_max(a, b)

/* Lanes summed in a fixed order (pairwise), so a dot product never depends on the batch. */
static inline float hsum16(v16f v) {
    FOLD16(v, FOLD_ADD);
    return v[0];
}

/* exp(x) for x <= 0 (clamped below at -87), 16 lanes: Cody-Waite reduction and a degree-6
 * polynomial, ~2e-7 relative error. Softmaxes: attention's (attention.c) and sampling's (sample.c). */
static inline v16f exp16_neg(v16f x) {
    x = __builtin_elementwise_max(x, (v16f){0} - 87.0f);
    v16f n = __builtin_elementwise_floor(x * 1.44269504088896341f + 0.5f);
    v16f r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    v16f p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16f scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* exp(x) over the whole float range (clamped to [-87, 88]): the SwiGLU epilogue's sigmoid (linear.c). */
static inline v16f exp16(v16f x) { return exp16_neg(__builtin_elementwise_min(x, (v16f){0} + 88.0f)); }

#endif
