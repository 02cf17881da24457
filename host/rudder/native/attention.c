/* Attention of a few new tokens per sequence over the paged KV cache, in one call per layer.
 *
 * What the torch path of model.py does in ~20 ops per layer (RoPE on q and k, two index_copy_
 * into the cache, gathering every sequence's whole context through its block table, a padded
 * SDPA, regrouping the rows) is done here in two passes that read the cache in place:
 *   1. every new token's k (rotated) and v go into its KV slot, converted to the cache's type;
 *   2. every (group, KV head) pair: a group is a run of consecutive tokens of one sequence (a
 *      decoding token alone, a verified draft, a prefill chunk of up to 16); the rotated, scaled
 *      queries of the heads that share that KV head attend over positions 0..position of their
 *      sequence, read through the block table in tiles of 16 keys with an online softmax
 *      (running max and sum, rescaled per tile). A group reads (fp32: widens) each tile once
 *      and all its rows use it (a 9-row verification at 600 tokens of context: attention 0.75x
 *      the time of one item per row). A tile's 16 scores come out as one vector, so exp runs 16
 *      lanes wide: fp32 sums each key's products lane-wise and reduces the 16 sums together (a
 *      transpose tree); bf16 reads a cache in pairs (engine/kv_cache.py), where one load holds a
 *      pair of dimensions of all 16 keys, and needs no reduction (TILE_BF, ROW_TILE_BF).
 *      Decoding tokens of sequences whose block tables begin with the same blocks (a prompt
 *      from the prefix cache) form a cascade: the tiles of that shared prefix are read once for
 *      all of them, then each goes on over its own tiles.
 * Each query's arithmetic depends only on its own sequence's cache and position - never on the
 * batch, the group or how the items are split over threads - so a token decoded alone and the
 * same token verified among drafted ones get the same result (tests/test_native_attention.py). RoPE uses the same operations in the
 * same order as model.apply_rope (no fused multiply-add), so keys written here and keys written
 * by a prefill through torch are bit for bit the same.
 *
 * Shapes: head_dim 16, 64 or 128 and up to 8 query heads per KV head have code with their sizes
 * fixed at compile time (accumulators in registers); other head_dims that are multiples of 16
 * take a generic loop with the same arithmetic. Element types: activations (qkv, out) and cache
 * each fp32 or bf16; keys and values are stored at the activations' precision (a bf16 model's
 * fp32 cache holds bf16 values, as a bf16 cache would). Arithmetic: fp32 for an fp32 model; a
 * bf16 model (head_dim a multiple of 32) multiplies bf16 pairs into fp32 sums (vdpbf16ps), its
 * queries and softmax weights rounded to bf16 as its torch path holds them: half the
 * multiply-adds, and no widening of the cache's keys and values. Its cache is in pairs where the
 * block size is a multiple of 16 (s->kv_paired; always, from KVCache), else in the standard
 * layout, whose tiles are gathered into the same form first: the same results either way.
 */
#include "kernels.h"

#include <stdlib.h>

#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef struct {
    const rudder_attn_step *s;
    const void *qkv;
    void *k_cache, *v_cache, *out;
    int64_t cascades;                        /* the first `cascades` units are cascades, then the groups */
    const int64_t *group_first, *group_rows; /* per group: its first token, its number of rows */
    /* per cascade: where its rows' tokens start in cascade_tokens, its number of rows, and the
       end of the prefix (a multiple of TILE; of the AMX path's runs there) whose blocks every row's table shares */
    const int64_t *cascade_first, *cascade_rows, *cascade_shared, *cascade_tokens;
    int *failed; /* set by an item that found no memory (the AMX path's state) */
} attn_call;

#define TILE 16
#define MAX_D 256
#define MAX_REP 16
#define MAX_GROUP 16 /* rows per group; fewer where a group's queries would pass STATE_VECS */
#define STATE_VECS 512 /* 16-float vectors of queries (and as many of accumulators) per item */
#define STATE_ROWS (MAX_GROUP * MAX_REP) /* query rows (a running max and total each) per item */

/* x (rotate-half RoPE at one position) into dst, fp32: dst[i] = x[i]*c[i] + rot[i]*s[i]. */
static void rope(float *dst, const void *x, int bf16, int64_t at, const float *c, const float *s, int64_t d) {
#pragma clang fp contract(off)
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = load1(x, bf16, at + i), b = load1(x, bf16, at + half + i);
        dst[i] = a * c[i] + (-b) * s[i];
        dst[half + i] = b * c[half + i] + a * s[half + i];
    }
}

/* Element i of a cache as bf16 bits (an fp32 cache of a bf16 model holds bf16 values: exact), and
 * elements i, i+1 as a pair. */
static inline uint32_t half_at(const void *base, int bf16, int64_t i) {
    return bf16 ? ((const uint16_t *)base)[i] : f32_to_bf16(((const float *)base)[i]);
}
static inline uint32_t pair_at(const void *base, int bf16, int64_t i) {
    return half_at(base, bf16, i) | half_at(base, bf16, i + 1) << 16;
}

static void write_kv(void *p, int64_t t) {
    const attn_call *call = (const attn_call *)p;
    const rudder_attn_step *s = call->s;
    int64_t d = s->head_dim, h = s->heads, kvh = s->kv_heads, row = (h + 2 * kvh) * d;
    int64_t pos = s->positions[t], slot = s->slots[t], bs = s->block_size;
    float k[MAX_D];
    for (int64_t g = 0; g < kvh; g++) {
        rope(k, call->qkv, s->x_bf16, t * row + (h + g) * d, s->cos + pos * d, s->sin + pos * d, d);
        int64_t src = t * row + (h + kvh + g) * d;
        if (s->kv_paired) { /* (bf16 throughout: see TILE_BF for where each element goes) */
            uint16_t *kc = (uint16_t *)call->k_cache, *vc = (uint16_t *)call->v_cache;
            int64_t head = (slot / bs * kvh + g) * bs * d, o = slot % bs;
            for (int64_t i = 0; i < d; i++) {
                kc[head + (i / 2 * bs + o) * 2 + i % 2] = f32_to_bf16(k[i]);
                vc[head + (o / 2 * d + i) * 2 + o % 2] = (uint16_t)half_at(call->qkv, 1, src + i);
            }
            continue;
        }
        int64_t dst = (slot * kvh + g) * d;
        for (int64_t i = 0; i < d; i += 16) {
            /* keys are kept at the activations' precision whatever the cache's type */
            v16f kv = s->x_bf16 ? round16_bf16(load16_f32(k + i)) : load16_f32(k + i);
            store16(call->k_cache, s->cache_bf16, dst + i, kv);
            store16(call->v_cache, s->cache_bf16, dst + i, load16(call->qkv, s->x_bf16, src + i));
        }
    }
}

/* ---- bf16 models: products of bf16 pairs ------------------------------------------------------
 * A bf16 model's queries and weights are rounded to bf16 (as its torch path holds them) and meet
 * the bf16 keys and values as pairs summed into fp32 lanes: vdpbf16ps where the CPU has it, else
 * the same operations in plain code (the odd element of a pair first, fp32 rounding after each).
 * Half the multiply-adds of widening both sides to fp32. */
typedef uint16_t v32h __attribute__((vector_size(64), aligned(2)));

/* store16_bf16 in one instruction where the CPU has one (vcvtneps2bf16, which also takes
 * denormal inputs as zero: a machine only ever uses one of the two). */
static inline void store16_bf16_fast(uint16_t *p, v16f v) {
#ifdef __AVX512BF16__
    __m512 f;
    memcpy(&f, &v, 64);
    __m256bh h = _mm512_cvtneps_pbh(f);
    memcpy(p, &h, 32);
#else
    store16_bf16(p, v);
#endif
}

static inline v32h at32h(const uint32_t *p) {
    v32h r;
    memcpy(&r, p, 64);
    return r;
}

/* acc + the pair at *pair (broadcast to every lane) times b's pairs. vdpbf16ps takes the broadcast
 * from memory itself ({1to16}); the compiler would broadcast into a register first, an operation
 * that competes with the products (1.34 against 1.01 cycles a product, measured). */
static inline v16f dot_pair_at(v16f acc, const uint32_t *pair, v32h b) {
#ifdef __AVX512BF16__
    __m512 a;
    __m512bh pb;
    memcpy(&a, &acc, 64);
    memcpy(&pb, &b, 64);
    __asm__("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(a) : "m"(*pair), "v"(pb));
    memcpy(&acc, &a, 64);
    return acc;
#else
#pragma clang fp contract(off)
    v16u ua = (v16u){0} + *pair, ub;
    memcpy(&ub, &b, 64);
    v16u ha = ua & 0xffff0000u, hb = ub & 0xffff0000u, la = ua << 16, lb = ub << 16;
    v16f fha, fhb, fla, flb;
    memcpy(&fha, &ha, 64);
    memcpy(&fhb, &hb, 64);
    memcpy(&fla, &la, 64);
    memcpy(&flb, &lb, 64);
    acc = acc + fha * fhb;
    return acc + fla * flb;
#endif
}

/* dst[0..16): src's first n elements, zeros after (the elements past n are not read). */
static inline void first16(uint32_t *dst, const uint32_t *src, int n) {
#ifdef __AVX512F__
    _mm512_storeu_si512(dst, _mm512_maskz_loadu_epi32((__mmask16)((1u << n) - 1), src));
#else
    for (int j = 0; j < TILE; j++)
        dst[j] = j < n ? src[j] : 0;
#endif
}

/* Lane j: `in` where j < n, else `out`. */
static inline v16f lanes_below(int n, float in, float out) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16i below = lane < n;
    v16f a = (v16f){0} + in, b = (v16f){0} + out, r;
    v16i ai, bi;
    memcpy(&ai, &a, 64);
    memcpy(&bi, &b, 64);
    ai = (below & ai) | (~below & bi);
    memcpy(&r, &ai, 64);
    return r;
}

#define MAX_OP(a, b) __builtin_elementwise_max(a, b)

static inline float hmax16(v16f v) {
    FOLD16(v, MAX_OP);
    return v[0];
}

/* 16 lane-wise partial dot products (one per key) -> one vector of their 16 sums (key j in
 * lane j), in a fixed order of additions. */
static inline v16f reduce16(const v16f p[16]) {
    v16f a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Row i (token t at position pos) before its first tile: for each head r of KV head g, its
 * query rotated and scaled, its sums at zero, its running max and total. */
#define START_ROW(D, REP, BF, i, t, pos)                                                           \
    for (int r = 0; r < (REP); r++) {                                                              \
        int64_t at_ = (i) * (REP) + r;                                                             \
        float qf[MAX_D];                                                                           \
        uint16_t qh_[MAX_D];                                                                       \
        rope(qf, call->qkv, s->x_bf16, (t) * row + (g * (REP) + r) * (D), s->cos + (pos) * (D),    \
             s->sin + (pos) * (D), (D));                                                           \
        for (int c = 0; c < (D) / 16; c++) {                                                       \
            if (BF)                                                                                \
                store16_bf16(qh_ + 16 * c, load16_f32(qf + 16 * c) * s->scale);                    \
            else                                                                                   \
                q[at_ * ((D) / 16) + c] = load16_f32(qf + 16 * c) * s->scale;                      \
            acc[at_ * ((D) / 16) + c] = (v16f){0};                                                 \
        }                                                                                          \
        if (BF)                                                                                    \
            memcpy(&qb[at_ * ((D) / 2)], qh_, (D) * sizeof(uint16_t));                              \
        m[at_] = -1e30f;                                                                           \
        l[at_] = 0.0f;                                                                             \
        if (BF)                                                                                    \
            lv_all[at_] = (v16f){0};                                                               \
    }

/* Row i (token t) after its last tile: its sums over its total, into the output. */
#define END_ROW(D, REP, BF, i, t)                                                                  \
    for (int r = 0; r < (REP); r++) {                                                              \
        float total_ = (BF) ? hsum16(lv_all[(i) * (REP) + r]) : l[(i) * (REP) + r];                \
        for (int c = 0; c < (D) / 16; c++)                                                         \
            store16(call->out, s->x_bf16, (t) * h * (D) + (g * (REP) + r) * (D) + 16 * c,            \
                    acc[((i) * (REP) + r) * ((D) / 16) + c] * (1.0f / total_));                    \
    }

/* at[]: the cache offsets of the tile of keys from p0 of `table`'s sequence, for KV head g; past
 * its first `count` keys, the last key again. A tile lies in one block when blocks hold whole
 * tiles: one lookup per tile. */
#define TILE_AT(D, table, p0, count)                                                               \
    int64_t at[TILE];                                                                              \
    {                                                                                              \
        int64_t run_ = bs % TILE == 0 ? ((table)[(p0) / bs] * bs + (p0) % bs) * kvh : -1;          \
        for (int j = 0; j < TILE; j++) {                                                           \
            int64_t kp = (p0) + (j < (count) ? j : (count) - 1);                                   \
            at[j] = ((run_ >= 0 ? run_ + (kp - (p0)) * kvh : ((table)[kp / bs] * bs + kp % bs) * kvh) + g) * (D); \
        }                                                                                          \
    }

/* Head r of a row takes `top` as its running max: its sums and `total` scaled to it. */
#define RESCALE_ROW(D, r, top, total)                                                              \
    do {                                                                                           \
        float corr_ = exp16_neg((v16f){0} + (mi[r] - (top)))[0];                                   \
        (total) *= corr_;                                                                          \
        for (int c_ = 0; c_ < (D) / 16; c_++)                                                      \
            ai[(r) * ((D) / 16) + c_] *= corr_;                                                    \
        mi[r] = (top);                                                                             \
    } while (0)

/* The tile at at[] into kt/vt, widened to fp32 once for every row that uses it. */
#define LOAD_TILE(D)                                                                               \
    for (int j = 0; j < TILE; j++)                                                                 \
        for (int c = 0; c < (D) / 16; c++) {                                                       \
            kt[j][c] = load16(call->k_cache, cb, at[j] + 16 * c);                                  \
            vt[j][c] = load16(call->v_cache, cb, at[j] + 16 * c);                                  \
        }

/* The tile of keys from p0 of `table`'s sequence (its first `count` inside the context) for a bf16
 * model, as ROW_TILE_BF reads it: kq + p * ks holds pair p (dimensions 2p, 2p+1) of the 16 keys,
 * vq + j * D the values of keys 2j and 2j+1 paired (lane i: dimension i). A paired cache holds
 * its whole tiles so (kv_cache.py): they are read in place. A tile cut by the end of the context
 * is copied with zeros past its end (the cache there may hold anything: never read), and a
 * standard cache's tiles are gathered into that form. The same numbers reach the arithmetic
 * either way, so a row's result does not depend on which. In scope: kq, vq, ks, kbuf, vbuf, and
 * at[] (TILE_AT) for a standard cache. */
#define TILE_BF(D, table, p0, count)                                                               \
    if (s->kv_paired) {                                                                            \
        int64_t head_ = ((table)[(p0) / bs] * kvh + g) * bs * ((D) / 2), o_ = (p0) % bs;           \
        kq = (const uint32_t *)call->k_cache + head_ + o_;                                         \
        vq = (const uint32_t *)call->v_cache + head_ + o_ / 2 * (D);                               \
        ks = bs;                                                                                   \
        if ((count) < TILE) {                                                                      \
            for (int p_ = 0; p_ < (D) / 2; p_++)                                                   \
                first16(kbuf + p_ * TILE, kq + p_ * bs, (count));                                  \
            for (int j_ = 0; j_ < ((count) + 1) / 2; j_++)                                         \
                for (int i_ = 0; i_ < (D); i_++) /* (the odd key of the last pair may be past it) */ \
                    vbuf[j_ * (D) + i_] = vq[j_ * (D) + i_] & (2 * j_ + 1 < (count) ? ~0u : 0xffffu); \
            kq = kbuf, vq = vbuf, ks = TILE;                                                       \
        }                                                                                          \
    } else { /* (at[]: TILE_AT's offsets) */                                                       \
        for (int j_ = 0; j_ < TILE; j_++)                                                          \
            for (int p_ = 0; p_ < (D) / 2; p_++)                                                   \
                kbuf[p_ * TILE + j_] = j_ < (count) ? pair_at(call->k_cache, cb, at[j_] + 2 * p_) : 0; \
        for (int j_ = 0; j_ < ((count) + 1) / 2; j_++)                                             \
            for (int i_ = 0; i_ < (D); i_++)                                                       \
                vbuf[j_ * (D) + i_] = half_at(call->v_cache, cb, at[2 * j_] + i_) |                \
                    (2 * j_ + 1 < (count) ? half_at(call->v_cache, cb, at[2 * j_ + 1] + i_) << 16 : 0); \
        kq = kbuf, vq = vbuf, ks = TILE;                                                           \
    }

/* ROW_TILE of a bf16 model (its queries as bf16 pairs at qbi) over the tile at kq/vq (TILE_BF): the
 * 16 keys' scores come out lane-wise, each query pair broadcast against a pair of every key, in
 * four chains of sums (pairs p = c mod 4) added at the end: products, no reduction across lanes.
 * The online softmax keeps its reference max until a score passes it by LAZY_MAX (weights up to
 * e^8, far from fp32's range), so a tile's exps do not wait for its max, and the total is summed
 * lane-wise (lv), reduced once at the end: the chain of dependent operations per tile is what
 * bounded a row's time. The weights are rounded to bf16 (masked keys' to exactly 0) and the total
 * sums them as rounded, so a row's output is a weighted mean of its values. */
#define LAZY_MAX 8.0f
#define ROW_TILE_BF(D, REP)                                                                        \
    do {                                                                                           \
        v16f valid = lanes_below(n, 0.0f, -1e30f), keep = lanes_below(n, 1.0f, 0.0f);              \
        v16f sc[REP];                                                                              \
        {                                                                                          \
            v16f ch[(REP)][4];                                                                     \
            for (int r = 0; r < (REP); r++)                                                        \
                for (int c = 0; c < 4; c++)                                                        \
                    ch[r][c] = (v16f){0};                                                          \
            for (int p = 0; p < (D) / 2; p += 4)                                                   \
                _Pragma("clang loop unroll(full)")                                                 \
                for (int c = 0; c < 4; c++) {                                                      \
                    v32h kp = at32h(kq + (p + c) * ks);                                            \
                    _Pragma("clang loop unroll(full)")                                             \
                    for (int r = 0; r < (REP); r++)                                                \
                        ch[r][c] = dot_pair_at(ch[r][c], qbi + r * ((D) / 2) + p + c, kp);         \
                }                                                                                  \
            for (int r = 0; r < (REP); r++)                                                        \
                sc[r] = (ch[r][0] + ch[r][1]) + (ch[r][2] + ch[r][3]);                             \
        }                                                                                          \
        uint32_t wp[(REP)][TILE / 2];                                                              \
        for (int r = 0; r < (REP); r++) {                                                          \
            v16f x = n < TILE ? sc[r] + valid : sc[r]; /* (a whole tile masks nothing) */          \
            if (__builtin_reduce_or(x > mi[r] + LAZY_MAX)) /* (rarely: the exps need not wait) */  \
                RESCALE_ROW(D, r, hmax16(x), lv[r]);                                               \
            uint16_t wh[TILE];                                                                     \
            v16f e = exp16_neg(x - mi[r]);                                                         \
            store16_bf16_fast(wh, n < TILE ? e * keep : e);                                        \
            lv[r] += load16_bf16(wh);                                                              \
            memcpy(wp[r], wh, sizeof wh);                                                          \
        }                                                                                          \
        v16f ar[(REP) * ((D) / 16)];                                                               \
        for (int e = 0; e < (REP) * ((D) / 16); e++)                                               \
            ar[e] = ai[e];                                                                         \
        for (int j = 0; j < (n + 1) / 2; j++)                                                      \
            _Pragma("clang loop unroll(full)") /* (the row's sums then stay in registers) */       \
            for (int c = 0; c < (D) / 16; c++) {                                                   \
                v32h vv = at32h(vq + j * (D) + 16 * c);                                            \
                for (int r = 0; r < (REP); r++)                                                    \
                    ar[r * ((D) / 16) + c] = dot_pair_at(ar[r * ((D) / 16) + c], &wp[r][j], vv);   \
            }                                                                                      \
        for (int e = 0; e < (REP) * ((D) / 16); e++)                                               \
            ai[e] = ar[e];                                                                         \
    } while (0)

/* One row's update by one tile of keys: its scores, the online softmax, the weighted values.
 * In scope: n (keys of the tile this row attends; the rest masked), qi/ai/mi/li (its queries,
 * sums, running max and total), the tile as kt/vt (SH) or as the cache offsets at[] (not SH). Every
 * path runs this same code, so a row's arithmetic never depends on the path. */
#define ROW_TILE(D, REP, SH)                                                                       \
    do {                                                                                           \
        v16f valid = lanes_below(n, 0.0f, -1e30f);                                                 \
        v16f sc[REP];                                                                              \
        for (int r = 0; r < (REP); r++) {                                                          \
            v16f part[TILE];                                                                       \
            _Pragma("clang loop unroll(full)") /* (the 16 sums then stay in registers) */          \
            for (int j = 0; j < TILE; j++) {                                                       \
                v16f a = (v16f){0};                                                                \
                for (int c = 0; c < (D) / 16; c++)                                                 \
                    a += qi[r * ((D) / 16) + c] * KEY(j, c, SH);                                   \
                part[j] = a;                                                                       \
            }                                                                                      \
            sc[r] = reduce16(part);                                                                \
        }                                                                                          \
        for (int r = 0; r < (REP); r++) {                                                          \
            v16f x = sc[r] + valid;                                                                \
            float top = hmax16(x);                                                                 \
            top = top > mi[r] ? top : mi[r];                                                       \
            if (top > mi[r]) /* (else the factor would be exp(0) = 1 exactly) */                  \
                RESCALE_ROW(D, r, top, li[r]);                                                     \
            sc[r] = exp16_neg(x - top);                                                            \
            li[r] += hsum16(sc[r]);                                                                \
        }                                                                                          \
        /* the weights as floats (each broadcast from memory) and the row's sums in locals         \
           (registers): the same operations as sums in place, in the same order */                 \
        float wj[(REP)][TILE];                                                                     \
        v16f ar[(REP) * ((D) / 16)];                                                               \
        for (int r = 0; r < (REP); r++) {                                                          \
            memcpy(wj[r], &sc[r], sizeof wj[r]);                                                   \
            for (int c = 0; c < (D) / 16; c++)                                                     \
                ar[r * ((D) / 16) + c] = ai[r * ((D) / 16) + c];                                   \
        }                                                                                          \
        for (int j = 0; j < n; j++)                                                                \
            for (int c = 0; c < (D) / 16; c++) {                                                   \
                v16f vv = VALUE(j, c, SH);                                                         \
                for (int r = 0; r < (REP); r++)                                                    \
                    ar[r * ((D) / 16) + c] += wj[r][j] * vv;                                       \
            }                                                                                      \
        for (int e = 0; e < (REP) * ((D) / 16); e++)                                               \
            ai[e] = ar[e];                                                                         \
    } while (0)

/* One (group, KV head) item: the rows of a group are consecutive tokens of one sequence (a
 * drafted continuation, or a chunk of a prefill), so they attend over the same keys: each tile
 * of keys and values is read from the cache once (fp32: widened) and used by every row of the
 * group. A row's arithmetic is exactly what it would be alone (a group of one): the same tiles,
 * the same sums in the same order. A row whose context ends inside a tile masks the keys past its
 * end; keys past the end of a row's context add exactly 0 (their score is -1e30 whatever the
 * key, their weight 0). D and REP are compile-time constants in the
 * specialised copies below (a row's accumulators then live in registers), runtime values in the
 * generic one. */
#define ATTEND_BODY(D, REP, SHARED, BF)                                                            \
    const attn_call *call = (const attn_call *)p;                                                  \
    const rudder_attn_step *s = call->s;                                                           \
    int64_t h = s->heads, kvh = s->kv_heads, row = (h + 2 * kvh) * (D);                            \
    int64_t g = item % kvh, t0 = call->group_first[item / kvh];                                    \
    int64_t rows = (SHARED) ? call->group_rows[item / kvh] : 1;                                    \
    int64_t bs = s->block_size, pos0 = s->positions[t0], ctx_all = pos0 + rows;                    \
    const int64_t *table = s->tables + s->seq_of[t0] * s->width;                                   \
    int cb = s->cache_bf16;                                                                        \
    /* (sized for one row when not SHARED: its state then lives in registers) */                \
    v16f q[(BF) ? 1 : (SHARED) ? STATE_VECS : (REP) * ((D) / 16)];                                \
    v16f acc[(SHARED) ? STATE_VECS : (REP) * ((D) / 16)];                                          \
    v16f kt[(SHARED) && !(BF) ? TILE : 1][(D) / 16], vt[(SHARED) && !(BF) ? TILE : 1][(D) / 16];   \
    uint32_t qb[(BF) ? (SHARED) ? STATE_VECS * 8 : (REP) * ((D) / 2) : 1];                         \
    uint32_t kbuf[(BF) ? (D) / 2 * TILE : 1], vbuf[(BF) ? TILE / 2 * (D) : 1];                      \
    float m[(SHARED) ? STATE_ROWS : (REP)], l[(SHARED) ? STATE_ROWS : (REP)];                      \
    v16f lv_all[(BF) ? (SHARED) ? STATE_ROWS : (REP) : 1];                                         \
    for (int64_t i = 0; i < rows; i++)                                                             \
        START_ROW(D, REP, BF, i, t0 + i, pos0 + i);                                                \
    for (int64_t p0 = 0; p0 < ctx_all; p0 += TILE) {                                               \
        int n_all = ctx_all - p0 < TILE ? (int)(ctx_all - p0) : TILE;                              \
        TILE_AT(D, table, p0, n_all);                                                              \
        const uint32_t *kq = kbuf, *vq = vbuf;                                                     \
        int64_t ks = TILE;                                                                         \
        if (BF) {                                                                                  \
            TILE_BF(D, table, p0, n_all);                                                          \
        } else if (SHARED) {                                                                       \
            LOAD_TILE(D);                                                                          \
        }                                                                                          \
        /* rows whose context ends before this tile are done: the first row to attend is the   \
           first whose context reaches p0 (row i's context is pos0 + i + 1) */                     \
        for (int64_t i = (SHARED) && p0 > pos0 ? p0 - pos0 : 0; i < rows; i++) {                   \
            int64_t left = pos0 + i + 1 - p0;                                                      \
            int n = left < TILE ? (int)left : TILE;                                                \
            v16f *qi = q + ((BF) ? 0 : i * (REP) * ((D) / 16)), *ai = acc + i * (REP) * ((D) / 16); \
            uint32_t *qbi = qb + ((BF) ? i * (REP) * ((D) / 2) : 0);                               \
            float *mi = m + i * (REP), *li = l + i * (REP);                                        \
            v16f *lv = lv_all + ((BF) ? i * (REP) : 0);                                            \
            if (BF)                                                                                \
                ROW_TILE_BF(D, REP);                                                               \
            else                                                                                   \
                ROW_TILE(D, REP, SHARED);                                                          \
        }                                                                                          \
    }                                                                                              \
    for (int64_t i = 0; i < rows; i++)                                                             \
        END_ROW(D, REP, BF, i, t0 + i);

/* A group of one row (a decoding token) reads the cache directly: copying its tiles would cost
 * more than it saves. */
#define KEY(j, c, SHARED) (SHARED ? kt[j][c] : load16(call->k_cache, cb, at[j] + 16 * (c)))
#define VALUE(j, c, SHARED) (SHARED ? vt[j][c] : load16(call->v_cache, cb, at[j] + 16 * (c)))

/* One (cascade, KV head) item: decoding rows of different sequences whose block tables begin
 * with the same blocks (a prompt they share, from the prefix cache). The tiles of that shared
 * prefix are read from the cache once and used by every row, as a group's are; each row then goes
 * on over its own tiles. Each row sees the same tiles in the same order through ROW_TILE as it
 * would alone, so its result is bit for bit the same (one expansion of ROW_TILE serves both
 * phases: it is most of the kernel's compile time). */
#define CASCADE_BODY(D, REP, BF)                                                                   \
    const attn_call *call = (const attn_call *)p;                                                  \
    const rudder_attn_step *s = call->s;                                                           \
    int64_t h = s->heads, kvh = s->kv_heads, row = (h + 2 * kvh) * (D), g = item % kvh;            \
    int64_t unit = item / kvh, rows = call->cascade_rows[unit], shared = call->cascade_shared[unit]; \
    const int64_t *tok = call->cascade_tokens + call->cascade_first[unit];                         \
    int64_t bs = s->block_size;                                                                    \
    int cb = s->cache_bf16;                                                                        \
    v16f q[(BF) ? 1 : STATE_VECS], acc[STATE_VECS];                                                \
    v16f kt[(BF) ? 1 : TILE][(D) / 16], vt[(BF) ? 1 : TILE][(D) / 16];                             \
    uint32_t qb[(BF) ? STATE_VECS * 8 : 1];                                                        \
    uint32_t kbuf[(BF) ? (D) / 2 * TILE : 1], vbuf[(BF) ? TILE / 2 * (D) : 1];                      \
    float m[STATE_ROWS], l[STATE_ROWS];                                                            \
    v16f lv_all[(BF) ? STATE_ROWS : 1];                                                            \
    for (int64_t i = 0; i < rows; i++)                                                             \
        START_ROW(D, REP, BF, i, tok[i], s->positions[tok[i]]);                                    \
    /* the shared tiles (whole, inside every row's context, read through the first row's table)   \
       for every row, then each row's own tiles for that row: one tile at a time */              \
    for (int64_t own = -1; own < rows; own++) {                                                    \
        int64_t lead = tok[own < 0 ? 0 : own];                                                     \
        const int64_t *table = s->tables + s->seq_of[lead] * s->width;                             \
        int64_t from = own < 0 ? 0 : shared, to = own < 0 ? shared : s->positions[lead] + 1;       \
        for (int64_t p0 = from; p0 < to; p0 += TILE) {                                             \
            int n = to - p0 < TILE ? (int)(to - p0) : TILE;                                        \
            TILE_AT(D, table, p0, n);                                                              \
            const uint32_t *kq = kbuf, *vq = vbuf;                                                 \
            int64_t ks = TILE;                                                                     \
            if (BF) {                                                                              \
                TILE_BF(D, table, p0, n);                                                          \
            } else {                                                                               \
                LOAD_TILE(D);                                                                      \
            }                                                                                      \
            for (int64_t i = own < 0 ? 0 : own; i < (own < 0 ? rows : own + 1); i++) {             \
                v16f *qi = q + ((BF) ? 0 : i * (REP) * ((D) / 16)), *ai = acc + i * (REP) * ((D) / 16); \
                uint32_t *qbi = qb + ((BF) ? i * (REP) * ((D) / 2) : 0);                           \
                float *mi = m + i * (REP), *li = l + i * (REP);                                    \
                v16f *lv = lv_all + ((BF) ? i * (REP) : 0);                                        \
                if (BF)                                                                            \
                    ROW_TILE_BF(D, REP);                                                           \
                else                                                                               \
                    ROW_TILE(D, REP, 1);                                                           \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int64_t i = 0; i < rows; i++)                                                             \
        END_ROW(D, REP, BF, i, tok[i]);

/* Units: the cascades first (the largest items, claimed first), then the groups. BF: the bf16
 * arithmetic (pairs of 32 bits: head_dims that are multiples of 32). */
#define ATTEND_AS(D, REP, BF, NAME)                                                                \
    static void attend_one_##NAME(void *p, int64_t item) { ATTEND_BODY(D, REP, 0, BF) }            \
    static void attend_group_##NAME(void *p, int64_t item) { ATTEND_BODY(D, REP, 1, BF) }          \
    static void attend_cascade_##NAME(void *p, int64_t item) { CASCADE_BODY(D, REP, BF) }          \
    static void attend_##NAME(void *p, int64_t item) {                                             \
        const attn_call *call = (const attn_call *)p;                                              \
        int64_t kvh = call->s->kv_heads;                                                           \
        if (item < call->cascades * kvh)                                                           \
            attend_cascade_##NAME(p, item);                                                        \
        else if (call->group_rows[item / kvh - call->cascades] > 1)                                \
            attend_group_##NAME(p, item - call->cascades * kvh);                                   \
        else                                                                                       \
            attend_one_##NAME(p, item - call->cascades * kvh);                                     \
    }
#define ATTEND_F32(D, REP) ATTEND_AS(D, REP, 0, D##_##REP)
#define ATTEND(D, REP) ATTEND_AS(D, REP, 0, D##_##REP) ATTEND_AS(D, REP, 1, D##_##REP##_bf)
ATTEND_F32(16, 1) ATTEND_F32(16, 2) ATTEND_F32(16, 3) ATTEND_F32(16, 4)
ATTEND(64, 1) ATTEND(64, 2) ATTEND(64, 3) ATTEND(64, 4) ATTEND(64, 5) ATTEND(64, 6) ATTEND(64, 7) ATTEND(64, 8)
ATTEND(128, 1) ATTEND(128, 2) ATTEND(128, 3) ATTEND(128, 4) ATTEND(128, 5) ATTEND(128, 6) ATTEND(128, 7) ATTEND(128, 8)

/* Any head_dim that is a multiple of 16 (up to MAX_D) and up to MAX_REP heads per KV head. (Its
 * head_dim is not known when compiled, so the loops meant to be unrolled stay loops.) */
#pragma clang diagnostic ignored "-Wpass-failed"
static void attend_any(void *p, int64_t item) {
    const rudder_attn_step *shape = ((const attn_call *)p)->s;
    int64_t d = shape->head_dim, rep = shape->heads / shape->kv_heads;
    if (shape->x_bf16 && d % 32 == 0) {
        ATTEND_BODY(d, rep, 1, 1)
    } else {
        ATTEND_BODY(d, rep, 1, 0)
    }
}

/* The item function for this shape; *specialised: whether it is a compiled-in shape (only those
 * take cascades). */
static rudder_chunk_fn pick(int64_t d, int64_t rep, int bf16, int *specialised) {
    *specialised = 1;
#define CASE_F32(D, REP) if (d == D && rep == REP) return attend_##D##_##REP;
#define CASE(D, REP) if (d == D && rep == REP) return bf16 ? attend_##D##_##REP##_bf : attend_##D##_##REP;
    CASE_F32(16, 1) CASE_F32(16, 2) CASE_F32(16, 3) CASE_F32(16, 4)
    CASE(64, 1) CASE(64, 2) CASE(64, 3) CASE(64, 4) CASE(64, 5) CASE(64, 6) CASE(64, 7) CASE(64, 8)
    CASE(128, 1) CASE(128, 2) CASE(128, 3) CASE(128, 4) CASE(128, 5) CASE(128, 6) CASE(128, 7) CASE(128, 8)
#undef CASE
#undef CASE_F32
    *specialised = 0;
    return attend_any;
}

/* Splits the tokens into groups: runs of consecutive positions of one sequence, each at most
 * `most` rows; returns how many. */
static int64_t make_groups(const rudder_attn_step *s, int64_t most, int64_t *first, int64_t *rows) {
    int64_t n = 0;
    for (int64_t t = 0; t < s->tokens; t++) {
        if (n > 0 && rows[n - 1] < most && s->seq_of[t] == s->seq_of[t - 1] &&
            s->positions[t] == s->positions[t - 1] + 1) {
            rows[n - 1]++;
            continue;
        }
        first[n] = t;
        rows[n++] = 1;
    }
    return n;
}

/* The cascades: decoding rows (groups of one) of different sequences whose tables begin with the
 * same blocks, for at least MIN_SHARED_TILES whole tiles inside every row's context. Fills the
 * cascade arrays (`order`: their rows' tokens), removes their rows from the groups, and returns
 * how many cascades; each is cut into pieces of at least 2 rows when the items would not give
 * every thread two. `order` has room for every token; first/rows/shared for as many cascades. */
#define MIN_SHARED_TILES 4
static int64_t cascade_rows_seen; /* rows attended in cascades (rudder_attention_cascade_rows) */
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t make_cascades(const rudder_attn_step *s, int64_t most, int64_t quantum, int64_t *n_groups,
                             int64_t *group_first, int64_t *group_rows, int64_t *order, int64_t *first, int64_t *rows,
                             int64_t *shared) {
#define TABLE(grp) (s->tables + s->seq_of[group_first[grp]] * s->width)
#define CTX(grp) (s->positions[group_first[grp]] + 1)
    int64_t n = 0, ones = 0;
    for (int64_t i = 0; i < *n_groups; i++) /* the decoding rows' groups, by first block (insertion sort) */
        if (group_rows[i] == 1 && CTX(i) >= MIN_SHARED_TILES * TILE) {
            int64_t j = ones++;
            for (; j > 0 && TABLE(order[j - 1])[0] > TABLE(i)[0]; j--)
                order[j] = order[j - 1];
            order[j] = i;
        }
    int64_t kept = 0, at = 0; /* order[0, kept): groups in cascades; order[at, ones): still to look at */
    while (at < ones) {
        const int64_t *lead = TABLE(order[at]);
        int64_t end = at + 1, blocks = s->width, ctx = CTX(order[at]);
        while (end < ones && end - at < most) { /* the run with this first block, sharing enough */
            const int64_t *other = TABLE(order[end]);
            int64_t same = 0, c = min64(ctx, CTX(order[end]));
            while (same < blocks && other[same] == lead[same])
                same++;
            if (min64(same * s->block_size, c) / TILE < MIN_SHARED_TILES)
                break;
            blocks = same;
            ctx = c;
            end++;
        }
        if (end - at >= 2) {
            for (int64_t j = at; j < end; j++)
                order[kept + j - at] = order[j];
            first[n] = kept;
            rows[n] = end - at;
            shared[n++] = min64(blocks * s->block_size, ctx) / quantum * quantum;
            kept += end - at;
        }
        at = end;
    }
#undef TABLE
#undef CTX
    if (n == 0)
        return 0;
    __atomic_add_fetch(&cascade_rows_seen, kept, __ATOMIC_RELAXED);
    /* their groups become tokens in `order` and leave the groups */
    for (int64_t j = 0; j < kept; j++) {
        group_rows[order[j]] = 0;
        order[j] = group_first[order[j]];
    }
    int64_t g = 0;
    for (int64_t i = 0; i < *n_groups; i++)
        if (group_rows[i] > 0) {
            group_first[g] = group_first[i];
            group_rows[g++] = group_rows[i];
        }
    *n_groups = g;
    /* pieces, so that the threads have two items each where the rows allow it */
    int64_t kvh = s->kv_heads, pieces = (2 * s->threads + (n + g) * kvh - 1) / ((n + g) * kvh);
    for (int64_t c = pieces > 1 ? n - 1 : -1; c >= 0; c--) { /* from the last: split ones stay after c */
        int64_t k = min64(pieces, rows[c] / 2);
        if (k < 2)
            continue;
        for (int64_t e = n - 1; e > c; e--) { /* room for k - 1 more after c */
            first[e + k - 1] = first[e];
            rows[e + k - 1] = rows[e];
            shared[e + k - 1] = shared[e];
        }
        int64_t f = first[c], r = rows[c], sh = shared[c];
        for (int64_t q = 0; q < k; q++) {
            first[c + q] = f + r * q / k;
            rows[c + q] = r * (q + 1) / k - r * q / k;
            shared[c + q] = sh;
        }
        n += k - 1;
    }
    return n;
}

/* ---- AMX: a bf16 model's products on tiles ---------------------------------------------------
 * Where the CPU has AMX and the OS grants its tiles (linear.c asks), a bf16 model's attention
 * computes on them: up to 16 query vectors (rows of a unit times the heads of one KV head) meet a
 * tile of 16 keys in one tdpbf16ps per 32 dimensions, and their weights meet the tile's values in
 * one per 16 dimensions. Keys come in runs of up to RUN tiles, aligned to multiples of RUN * TILE
 * positions: the run's scores first, then each query's softmax over them (its reference max
 * checked once per run, weights rounded to bf16 and summed lane-wise, as ROW_TILE_BF's), then the
 * weighted values: one dependent chain of tile operations per run instead of per tile. On such a
 * host the vector path's vdpbf16ps were the slow part of a step (benchmarks/RESULTS.md,
 * attention.py). A tile's rows never mix, and every row - alone, in a group or in a cascade (whose
 * shared prefix then ends on a run) - meets the same runs with the same operations, so a row's
 * result still never depends on its unit. The tiles round their sums otherwise than vdpbf16ps: a
 * host takes one path or the other, never both. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ATTN_AMX 1
#define RUN 4

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

/* The tiles: scores S0..S3 = Q K (16 queries x 16 keys each; S0 then holds sums O, 16 queries x
 * 16 dimensions), queries Q (32 dimensions), keys K (16 pairs of dimensions x 16 keys), weights P
 * (16 queries x 8 pairs of keys), values V (8 pairs of keys x 16 dimensions). */
enum { T_S = 0, T_O = 0, T_Q = 4, T_K = 5, T_P = 6, T_V = 7 };

static void attention_tiles_on(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t == T_V ? 8 : 16;
        c.colsb[t] = t == T_P ? 32 : 64;
    }
    _tile_loadconfig(&c);
}

/* A unit's queries in chunks of 16 slots: a chunk holds `per_chunk` rows, a row its `rep` heads'
 * queries in consecutive slots (the slots past the last row's are zeros nobody reads). */
typedef struct {
    int64_t d, rep, per_chunk, rows;
    uint16_t *q;             /* [chunk][16][d]: the queries, rotated, scaled, rounded to bf16 */
    float *o;                /* [chunk][16][d]: the weighted values */
    float m[MAX_GROUP * 16]; /* each query's reference max */
    v16f lv[MAX_GROUP * 16]; /* each query's total, lane-wise */
} amx_unit;

/* A run of tiles of keys in TILE_BF's form (keys kq with pair stride ks, values vq). */
typedef struct {
    int tiles;
    const uint32_t *kq[RUN], *vq[RUN];
    int64_t ks[RUN];
    uint32_t kbuf[RUN][MAX_D / 2 * TILE], vbuf[RUN][TILE / 2 * MAX_D];
} amx_run;

static int64_t slot_of(const amx_unit *u, int64_t i, int64_t r) {
    return i / u->per_chunk * 16 + i % u->per_chunk * u->rep + r;
}

/* A unit's state in `stack` where it fits (most units: a row or a few), else on the heap. */
#define AMX_STACK_FLOATS (64 * 128)
static int amx_unit_new(amx_unit *u, const rudder_attn_step *s, int64_t rows, float *stack) {
    int64_t d = s->head_dim, rep = s->heads / s->kv_heads, per = 16 / rep, slots = (rows + per - 1) / per * 16;
    u->d = d, u->rep = rep, u->per_chunk = per, u->rows = rows, u->q = 0, u->o = 0;
    if (slots * d <= AMX_STACK_FLOATS / 2) { /* o (fp32), then q (bf16: half as many floats) */
        u->o = stack;
        u->q = (uint16_t *)(stack + slots * d);
    } else {
        u->q = (uint16_t *)aligned_alloc(64, (size_t)(slots * d * 2 + 63) / 64 * 64);
        u->o = (float *)aligned_alloc(64, (size_t)(slots * d * 4));
        if (u->q == 0 || u->o == 0)
            return -1;
    }
    memset(u->q, 0, (size_t)(slots * d * 2));
    memset(u->o, 0, (size_t)(slots * d * 4));
    for (int64_t i = 0; i < slots; i++) {
        u->m[i] = -1e30f;
        u->lv[i] = (v16f){0};
    }
    return 0;
}

static void amx_unit_free(amx_unit *u, const float *stack) {
    if (u->o != stack) {
        free(u->q);
        free(u->o);
    }
}

/* Row i of the unit is token t at `pos`: its queries for KV head g, as START_ROW's bf16 ones. */
static void amx_start(amx_unit *u, const attn_call *call, int64_t g, int64_t i, int64_t t, int64_t pos) {
    const rudder_attn_step *s = call->s;
    int64_t d = u->d, row = (s->heads + 2 * s->kv_heads) * d;
    float qf[MAX_D];
    for (int64_t r = 0; r < u->rep; r++) {
        rope(qf, call->qkv, s->x_bf16, t * row + (g * u->rep + r) * d, s->cos + pos * d, s->sin + pos * d, d);
        for (int64_t c = 0; c < d / 16; c++)
            store16_bf16(u->q + slot_of(u, i, r) * d + 16 * c, load16_f32(qf + 16 * c) * s->scale);
    }
}

/* Row i's sums over its total, into the output (END_ROW). */
static void amx_end(const amx_unit *u, const attn_call *call, int64_t g, int64_t i, int64_t t) {
    const rudder_attn_step *s = call->s;
    int64_t d = u->d;
    for (int64_t r = 0; r < u->rep; r++) {
        int64_t sl = slot_of(u, i, r);
        float total = hsum16(u->lv[sl]);
        for (int64_t c = 0; c < d / 16; c++)
            store16(call->out, s->x_bf16, t * s->heads * d + (g * u->rep + r) * d + 16 * c,
                    load16_f32(u->o + sl * d + 16 * c) * (1.0f / total));
    }
}

/* Up to RUN tiles of keys from p0 (up to position `to`) of `table`'s sequence into the run. */
static void amx_load_run(amx_run *run, const attn_call *call, int64_t g, const int64_t *table, int64_t p0,
                         int64_t to) {
    const rudder_attn_step *s = call->s;
    int64_t d = s->head_dim, kvh = s->kv_heads, bs = s->block_size;
    int cb = s->cache_bf16;
    run->tiles = 0;
    for (int64_t t0 = p0; t0 < to && run->tiles < RUN; t0 += TILE) {
        int n = to - t0 < TILE ? (int)(to - t0) : TILE, t = run->tiles++;
        uint32_t *kbuf = run->kbuf[t], *vbuf = run->vbuf[t];
        TILE_AT(d, table, t0, n);
        const uint32_t *kq = kbuf, *vq = vbuf;
        int64_t ks = TILE;
        TILE_BF(d, table, t0, n);
        if (vq == vbuf) /* TILE_BF fills the pairs of values it holds; the tiles read all 8 (weight 0
                           past the end, but 0 times a stale NaN is NaN) */
            memset(vbuf + (n + 1) / 2 * d, 0, (size_t)(TILE / 2 - (n + 1) / 2) * (size_t)d * 4);
        run->kq[t] = kq, run->vq[t] = vq, run->ks[t] = ks;
    }
}

/* The run's tiles for rows [lo, hi) of the unit, row i attending the first n[i - lo] keys of the
 * run (none where n <= 0). */
static void amx_attend_run(amx_unit *u, int64_t lo, int64_t hi, const int *n, const amx_run *run) {
    int64_t d = u->d, rep = u->rep, per = u->per_chunk;
    float sc[RUN][16][16] __attribute__((aligned(64)));
    uint16_t w[RUN][16][16] __attribute__((aligned(64)));
    for (int64_t c0 = lo / per * per; c0 < hi; c0 += per) {
        int64_t a = c0 > lo ? c0 : lo, b = c0 + per < hi ? c0 + per : hi, end = c0 + per < u->rows ? c0 + per : u->rows;
        const uint16_t *qc = u->q + c0 / per * 16 * d;
        float *oc = u->o + c0 / per * 16 * d;
        int tiles = run->tiles;
        /* the scores: S_t = Q K_t (the tile register numbers must be constants) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < d / 32; c++) {
            _tile_loadd(T_Q, qc + 32 * c, d * 2);
#define SCORES(T)                                                                                  \
    if (tiles > T) {                                                                               \
        _tile_loadd(T_K, run->kq[T] + 16 * c * run->ks[T], run->ks[T] * 4);                        \
        _tile_dpbf16ps(T, T_Q, T_K);                                                               \
    }
            SCORES(0) SCORES(1) SCORES(2) SCORES(3)
#undef SCORES
        }
        _tile_stored(0, sc[0], 64);
        if (tiles > 1)
            _tile_stored(1, sc[1], 64);
        if (tiles > 2)
            _tile_stored(2, sc[2], 64);
        if (tiles > 3)
            _tile_stored(3, sc[3], 64);
        /* each query's softmax over the run */
        memset(w, 0, (size_t)tiles * sizeof w[0]);
        int every = a == c0 && b == end; /* every row of the chunk attends the run */
        for (int64_t i = a; i < b; i++) {
            int ni = n[i - lo];
            if (ni <= 0) {
                every = 0;
                continue;
            }
            int in = (ni + TILE - 1) / TILE; /* the tiles it attends */
            for (int64_t r = 0; r < rep; r++) {
                int64_t sl = (i - c0) * rep + r, at = c0 / per * 16 + sl;
                v16f x[RUN];
                int over = 0;
                for (int t = 0; t < in; t++) {
                    int nt = ni - t * TILE < TILE ? ni - t * TILE : TILE;
                    x[t] = nt < TILE ? load16_f32(sc[t][sl]) + lanes_below(nt, 0.0f, -1e30f) : load16_f32(sc[t][sl]);
                    over |= __builtin_reduce_or(x[t] > u->m[at] + LAZY_MAX);
                }
                if (over) { /* RESCALE_ROW, to the run's max */
                    v16f top16 = x[0];
                    for (int t = 1; t < in; t++)
                        top16 = __builtin_elementwise_max(top16, x[t]);
                    float top = hmax16(top16), corr = exp16_neg((v16f){0} + (u->m[at] - top))[0];
                    u->lv[at] *= corr;
                    for (int64_t c = 0; c < d / 16; c++)
                        store16_f32(oc + sl * d + 16 * c, load16_f32(oc + sl * d + 16 * c) * corr);
                    u->m[at] = top;
                }
                for (int t = 0; t < in; t++) {
                    int nt = ni - t * TILE < TILE ? ni - t * TILE : TILE;
                    v16f e = exp16_neg(x[t] - u->m[at]);
                    store16_bf16_fast(w[t][sl], nt < TILE ? e * lanes_below(nt, 1.0f, 0.0f) : e);
                    u->lv[at] += load16_bf16(w[t][sl]);
                }
            }
        }
        /* the weighted values: O += P_t V_t, in the order of the tiles; with 64 dimensions the
           four tiles of O stay in registers over the run (each P_t is loaded once) */
        if (d == 64 && every) {
            _tile_loadd(0, oc, d * 4);
            _tile_loadd(1, oc + 16, d * 4);
            _tile_loadd(2, oc + 32, d * 4);
            _tile_loadd(3, oc + 48, d * 4);
            for (int t = 0; t < tiles; t++) {
                _tile_loadd(T_P, w[t], 32);
#define VALUES(T)                                                                                  \
    _tile_loadd(T_V, run->vq[t] + 16 * T, d * 4);                                                  \
    _tile_dpbf16ps(T, T_P, T_V);
                VALUES(0) VALUES(1) VALUES(2) VALUES(3)
#undef VALUES
            }
            _tile_stored(0, oc, d * 4);
            _tile_stored(1, oc + 16, d * 4);
            _tile_stored(2, oc + 32, d * 4);
            _tile_stored(3, oc + 48, d * 4);
            continue;
        }
        for (int64_t c = 0; c < d / 16; c++) {
            _tile_loadd(T_O, oc + 16 * c, d * 4);
            for (int t = 0; t < tiles; t++) {
                _tile_loadd(T_P, w[t], 32);
                _tile_loadd(T_V, run->vq[t] + 16 * c, d * 4);
                _tile_dpbf16ps(T_O, T_P, T_V);
            }
            if (every) {
                _tile_stored(T_O, oc + 16 * c, d * 4);
                continue;
            }
            _tile_stored(T_O, sc[0], 64); /* (the scores are used) only the rows that attended take it */
            for (int64_t i = a; i < b; i++)
                if (n[i - lo] > 0)
                    for (int64_t r = 0; r < rep; r++)
                        memcpy(oc + ((i - c0) * rep + r) * d + 16 * c, sc[0][(i - c0) * rep + r], 64);
        }
    }
}

/* A group's keys (or a row's alone): ATTEND_BODY's tiles, in runs, for its rows (consecutive
 * tokens of one sequence from t0). */
static void amx_group_keys(amx_unit *u, const attn_call *call, int64_t g, int64_t t0, amx_run *run) {
    const rudder_attn_step *s = call->s;
    int64_t rows = u->rows, pos0 = s->positions[t0], ctx_all = pos0 + rows;
    const int64_t *table = s->tables + s->seq_of[t0] * s->width;
    for (int64_t p0 = 0; p0 < ctx_all; p0 += RUN * TILE) {
        amx_load_run(run, call, g, table, p0, ctx_all);
        int64_t first = p0 > pos0 ? p0 - pos0 : 0; /* rows whose context ends before p0 are done */
        int n[MAX_GROUP];
        for (int64_t i = first; i < rows; i++) {
            int64_t left = pos0 + i + 1 - p0;
            n[i - first] = left < RUN * TILE ? (int)left : RUN * TILE;
        }
        amx_attend_run(u, first, rows, n, run);
    }
}

/* A cascade's keys: CASCADE_BODY's tiles, in runs - the shared ones for every row at once, then
 * each row's own. */
static void amx_cascade_keys(amx_unit *u, const attn_call *call, int64_t g, int64_t unit, const int64_t *tok,
                             amx_run *run) {
    const rudder_attn_step *s = call->s;
    int64_t rows = u->rows, shared = call->cascade_shared[unit];
    int whole[MAX_GROUP];
    for (int64_t i = 0; i < rows; i++)
        whole[i] = RUN * TILE;
    for (int64_t own = -1; own < rows; own++) {
        int64_t lead = tok[own < 0 ? 0 : own];
        const int64_t *table = s->tables + s->seq_of[lead] * s->width;
        int64_t from = own < 0 ? 0 : shared, to = own < 0 ? shared : s->positions[lead] + 1;
        for (int64_t p0 = from; p0 < to; p0 += RUN * TILE) {
            amx_load_run(run, call, g, table, p0, to);
            int n = to - p0 < RUN * TILE ? (int)(to - p0) : RUN * TILE;
            if (own < 0)
                amx_attend_run(u, 0, rows, whole, run);
            else
                amx_attend_run(u, own, own + 1, &n, run);
        }
    }
}

/* One (unit, KV head) item: a cascade's rows, or a group's (a row alone is a group of one). */
static void attend_amx(void *p, int64_t item) {
    const attn_call *call = (const attn_call *)p;
    const rudder_attn_step *s = call->s;
    int64_t kvh = s->kv_heads, g = item % kvh, unit = item / kvh, tok[MAX_GROUP], rows;
    int cascade = unit < call->cascades;
    if (cascade) {
        rows = call->cascade_rows[unit];
        memcpy(tok, call->cascade_tokens + call->cascade_first[unit], (size_t)rows * sizeof(int64_t));
    } else {
        rows = call->group_rows[unit - call->cascades];
        for (int64_t i = 0; i < rows; i++)
            tok[i] = call->group_first[unit - call->cascades] + i;
    }
    amx_unit u;
    amx_run run __attribute__((aligned(64))); /* (with the state below ~115 KiB: the pool's threads have 1 MiB stacks) */
    float stack[AMX_STACK_FLOATS] __attribute__((aligned(64)));
    if (amx_unit_new(&u, s, rows, stack)) { /* (no memory for its state: rudder_attention returns -2) */
        amx_unit_free(&u, stack);
        __atomic_store_n(call->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t i = 0; i < rows; i++)
        amx_start(&u, call, g, i, tok[i], s->positions[tok[i]]);
    attention_tiles_on();
    if (cascade)
        amx_cascade_keys(&u, call, g, unit, tok, &run);
    else
        amx_group_keys(&u, call, g, tok[0], &run);
    _tile_release();
    for (int64_t i = 0; i < rows; i++)
        amx_end(&u, call, g, i, tok[i]);
    amx_unit_free(&u, stack);
}
#endif

/* 0 on success; -1 for a shape the kernel does not take (the caller checks first). */
int rudder_attention(const rudder_attn_step *s, const void *qkv, void *k_cache, void *v_cache, void *out) {
    int64_t d = s->head_dim, rep = s->kv_heads > 0 ? s->heads / s->kv_heads : 0;
    if (d % 16 != 0 || d > MAX_D || rep < 1 || rep > MAX_REP || rep * s->kv_heads != s->heads)
        return -1;
    if (s->kv_paired && !(s->x_bf16 && s->cache_bf16 && d % 32 == 0 && s->block_size % TILE == 0))
        return -1; /* a paired cache is only made for the bf16 arithmetic (kv_cache.py) */
    int64_t most = STATE_VECS / (rep * (d / 16));
    most = most < MAX_GROUP ? most : MAX_GROUP;
    int64_t *groups = (int64_t *)malloc(6 * (size_t)s->tokens * sizeof(int64_t));
    if (groups == NULL)
        return -2;
    int64_t n = make_groups(s, most, groups, groups + s->tokens);
    if (n * s->kv_heads < 2 * s->threads && s->tokens > 1) {
        /* Too few items for the threads (a verified draft is one group per KV head: 3 items on 2
           threads), so groups of half the rows: each thread gets a share; a row's arithmetic does
           not depend on its group, only the tiles are read once more. */
        int64_t longest = 1;
        for (int64_t i = 0; i < n; i++)
            longest = groups[s->tokens + i] > longest ? groups[s->tokens + i] : longest;
        n = make_groups(s, (longest + 1) / 2, groups, groups + s->tokens);
    }
    int specialised;
    int64_t quantum = TILE; /* a cascade's shared prefix ends on a multiple of it */
    rudder_chunk_fn fn = pick(d, rep, s->x_bf16, &specialised);
#ifdef ATTN_AMX
    if (s->x_bf16 && d % 32 == 0 && rudder_amx_on()) {
        fn = attend_amx;
        specialised = 1;
        quantum = RUN * TILE;
    }
#endif
    int64_t *cascades = groups + 2 * s->tokens, nc = 0; /* tokens, then per cascade first/rows/shared */
    if (specialised && n > 1)
        nc = make_cascades(s, most, quantum, &n, groups, groups + s->tokens, cascades, cascades + s->tokens,
                           cascades + 2 * s->tokens, cascades + 3 * s->tokens);
    int failed = 0;
    attn_call call = {s, qkv, k_cache, v_cache, out, nc, groups, groups + s->tokens, cascades + s->tokens,
                      cascades + 2 * s->tokens, cascades + 3 * s->tokens, cascades, &failed};
    rudder_parallel_for(write_kv, &call, s->tokens, s->tokens >= 16 ? s->threads : 1);
    rudder_parallel_for(fn, &call, (nc + n) * s->kv_heads, s->threads);
    free(groups);
    return failed ? -2 : 0;
}

/* Rows attended in cascades so far, over all calls (tests and benchmarks read it). */
int64_t rudder_attention_cascade_rows(void) {
    return __atomic_load_n(&cascade_rows_seen, __ATOMIC_RELAXED);
}
