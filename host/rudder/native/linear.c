/* Linear layers y = x W^T for the rows of a step (any number): bf16 weights, or int8 weights with
 * a scale per output column.
 *
 * Why not oneDNN for these: its bf16 kernels change with the number of rows (AMX tiles for many,
 * vector code for few), so a row's result would depend on what else the step computes; its bf16
 * products come out in bf16, and the LM head's logits need fp32; and torch has no fast CPU kernel
 * for int8 weights with per-channel scales at a few rows (_weight_int8pack_mm ran far slower than
 * fp32: benchmarks/RESULTS.md, "Numbers the code's design rests on").
 *
 * Layout: the weight is packed once (packed_linear.py) into blocks of 16 output columns, each
 * block one contiguous run over K: bf16 [n/16][k/2][16][2] (a pair of k per column), int8
 * [n/16][k/4][16][4] (four k per column). One 64-byte row of a block is a vector of 16 columns -
 * the layout of AVX-512's dot-product instructions and of an AMX B tile alike.
 *
 * A row's result must not depend on the rest of the step, so every output element is computed
 * the same way whatever the number of rows:
 * - bf16 (x bf16, fp32 sums): on a CPU with AMX, tiles of 16 rows for any number of rows (a few
 *   rows are padded to a tile: at one row the weights' bytes, not the tile arithmetic, set the
 *   time); without AMX, each row's pair of x broadcast against 16 columns, a sequential sum over
 *   K per column (vdpbf16ps, or the same fp32 operations in plain code). The two orders differ,
 *   so one machine only ever uses one of them.
 * - int8: each input row is quantised to 16-bit integers with a scale of its own (max |x| /
 *   32767), split into a low byte (unsigned) and a high byte (signed, +128 to make it unsigned);
 *   both planes meet the int8 weights in u8 x s8 integer dot products (AVX-512 VNNI for a few
 *   rows, AMX int8 tiles for 16 and more) - exact sums, so both paths give the same integers -
 *   and y = (256 * (hi - 128 * sum(w)) + lo) * row scale * column scale. The weights stay int8
 *   (half of bf16's bytes) and the activations keep ~15 bits against the row's largest value.
 *
 * Work is split over groups of column blocks on torch's OpenMP threads (parallel.c): 4 blocks,
 * or 8 for 1 to WIDE_ROWS rows of bf16 without AMX. At a few rows a step takes the time of reading
 * the weights, and eight streams in flight read them faster than four on the development host
 * (benchmarks/RESULTS.md). From 4 rows the arithmetic per byte grows, and items of four blocks in
 * passes of MR rows were faster than passes of 3 rows x 8 blocks or 12 rows x 2 blocks.
 *
 * Epilogues (`op`): 0 none; 1 out += y (the residual stream, in place); 2 SwiGLU: the weight
 * holds the gate columns then the up columns (each padded to whole blocks) and out[:, j] =
 * silu(gate_j) * up_j. A bias (fp32, optional) is added to y first.
 */
#include <stdlib.h>

#include "kernels.h"

#include <math.h>

#if defined(__AVX512BF16__) || defined(__AVX512VNNI__) || defined(__AMX_TILE__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

#define MR 6    /* input rows per block (vector path; int8 takes 3: two accumulators each) */
#define GROUP 4 /* column blocks per work item */
#define WIDE_GROUP 8 /* ... for up to WIDE_ROWS rows on the bf16 vector path */
#define WIDE_ROWS 3
/* Rows per work item from 2 * ROW_CHUNK rows (vector path): a prefill's 9 items of SmolLM2's
 * o and down projections left a thread idle for up to a ninth of the call */
#define ROW_CHUNK 48
#define AMX_MIN_ROWS_I8 8 /* int8: AMX tiles from this many rows (the same integers either way) */

enum { OP_NONE = 0, OP_ADD = 1, OP_SWIGLU = 2 };

static int amx_usable; /* set by rudder_linear_init */

/* Ask the kernel for AMX's tile state (Linux grants it per process); returns 1 if usable. */
int rudder_linear_init(void) {
#ifdef HAVE_AMX
    amx_usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#endif
    return amx_usable;
}

/* Whether rudder_linear_init got AMX's tile state (attention.c takes its tiles path then). */
int rudder_amx_on(void) { return amx_usable; }

typedef struct {
    const uint16_t *x;   /* bf16: [m, k] (AMX: padded to whole 16-row tiles) */
    const uint8_t *lo, *hi; /* int8: x's planes [m, k] (padded likewise) */
    const float *xscale; /* int8: [m] */
    int64_t m, k, n;     /* n output columns (SwiGLU: the weight has two halves of n) */
    const void *w;       /* packed blocks, bf16 or int8 */
    const float *wscale; /* int8: [columns] in packed order (halves padded apart) */
    const int32_t *wsum; /* int8: [columns] each column's sum of codes */
    const float *bias;   /* [n] fp32, added before the epilogue, or NULL (not with SwiGLU) */
    void *out;           /* [m, n] */
    int out_bf16, op, int8, amx;
    int64_t mpad;        /* AMX: rows padded to whole tiles */
    int group;           /* column blocks per work item: GROUP or WIDE_GROUP (run) */
    int64_t row_chunks;  /* ... and the rows split in chunks of ROW_CHUNK (many rows, vector path) */
} lin;

static inline float hmax16_f(v16f v) {
    float s[16];
    memcpy(s, &v, sizeof s);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++)
            s[i] = s[i] > s[i + w] ? s[i] : s[i + w];
    return s[0];
}

/* ---- epilogue ------------------------------------------------------------------------------ */

/* One (row, block) result: fp32 sums (bf16), or the int8 planes' two integer sums. */
typedef struct {
    v16f f;
    v16i lo, hi;
} acc16;

static inline v16f values(const lin *L, int64_t i, int64_t blk, const acc16 *a) {
    if (!L->int8)
        return a->f;
    v16i sum;
    v16f ws;
    memcpy(&sum, L->wsum + blk * 16, 64);
    memcpy(&ws, L->wscale + blk * 16, 64);
    v16f q = 256.0f * __builtin_convertvector(a->hi - 128 * sum, v16f) + __builtin_convertvector(a->lo, v16f);
    return q * (L->xscale[i] * ws);
}

/* Row i, the 16 columns of block `blk` (and `up` from block `up_blk`, its SwiGLU partner). */
static void finish(const lin *L, int64_t i, int64_t blk, const acc16 *a, int64_t up_blk, const acc16 *up) {
    v16f y = values(L, i, blk, a);
    if (up != 0) {
        v16f u = values(L, i, up_blk, up);
        y = y / (1.0f + exp16(-y)) * u;
    }
    int64_t col0 = blk * 16, cols = L->n - col0 < 16 ? L->n - col0 : 16, at = i * L->n + col0;
    if (L->bias != 0) {
        float b[16] = {0};
        memcpy(b, L->bias + col0, (size_t)cols * sizeof(float));
        y += load16_f32(b);
    }
    if (cols == 16) {
        if (L->op == OP_ADD)
            y += load16(L->out, L->out_bf16, at);
        store16(L->out, L->out_bf16, at, y);
        return;
    }
    float v[16];
    memcpy(v, &y, 64);
    for (int64_t c = 0; c < cols; c++)
        store1(L->out, L->out_bf16, at + c, v[c] + (L->op == OP_ADD ? load1(L->out, L->out_bf16, at + c) : 0.0f));
}

/* ---- vector path: rows broadcast against 16-column vectors ------------------------------------ */

static void dot_bf16(const lin *L, const int64_t *blocks, int64_t m0, int mr, int ng, acc16 acc[][WIDE_GROUP],
                     int g0) {
    const uint16_t *x = L->x, *w = (const uint16_t *)L->w;
    int64_t k = L->k, pairs = k / 2, per_block = 16 * k;
#ifdef __AVX512BF16__
#define BF16_KERNEL(R, G)                                                                          \
    if (mr == R && ng == G) {                                                                      \
        __m512 a[R][G];                                                                            \
        for (int r = 0; r < R; r++)                                                                \
            for (int g = 0; g < G; g++) a[r][g] = _mm512_setzero_ps();                             \
        for (int64_t p = 0; p < pairs; p++) {                                                      \
            __m512bh wv[G];                                                                        \
            for (int g = 0; g < G; g++)                                                            \
                wv[g] = (__m512bh)_mm512_loadu_si512(w + blocks[g] * per_block + p * 32);          \
            _Pragma("clang loop unroll(full)") /* (not by default for the wide shapes) */          \
            for (int r = 0; r < R; r++) {                                                          \
                int32_t xp;                                                                        \
                memcpy(&xp, x + (m0 + r) * k + 2 * p, 4);                                          \
                __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);                                     \
                for (int g = 0; g < G; g++) a[r][g] = _mm512_dpbf16_ps(a[r][g], xb, wv[g]);        \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int g = 0; g < G; g++) memcpy(&acc[r][g0 + g].f, &a[r][g], 64);                   \
        return;                                                                                    \
    }
    BF16_KERNEL(3, 8) BF16_KERNEL(2, 8) BF16_KERNEL(1, 8)
    BF16_KERNEL(6, 4) BF16_KERNEL(5, 4) BF16_KERNEL(4, 4) BF16_KERNEL(3, 4) BF16_KERNEL(2, 4) BF16_KERNEL(1, 4)
    BF16_KERNEL(6, 2) BF16_KERNEL(5, 2) BF16_KERNEL(4, 2) BF16_KERNEL(3, 2) BF16_KERNEL(2, 2) BF16_KERNEL(1, 2)
    BF16_KERNEL(6, 1) BF16_KERNEL(5, 1) BF16_KERNEL(4, 1) BF16_KERNEL(3, 1) BF16_KERNEL(2, 1) BF16_KERNEL(1, 1)
#undef BF16_KERNEL
#endif
    /* Other shapes, and CPUs without avx512_bf16: the same operations per column in the same
     * order as vdpbf16ps (the odd element of a pair first), with fp32 rounding after each. */
    for (int r = 0; r < mr; r++)
        for (int g = 0; g < ng; g++) {
            const uint16_t *wb = w + blocks[g] * per_block, *xr = x + (m0 + r) * k;
            float s[16] = {0};
            for (int64_t p = 0; p < pairs; p++) {
                float x0 = load1(xr, 1, 2 * p), x1 = load1(xr, 1, 2 * p + 1);
                for (int c = 0; c < 16; c++) {
#pragma clang fp contract(off)
                    s[c] = s[c] + x1 * load1(wb, 1, p * 32 + 2 * c + 1);
                    s[c] = s[c] + x0 * load1(wb, 1, p * 32 + 2 * c);
                }
            }
            memcpy(&acc[r][g0 + g].f, s, 64);
        }
}

static void dot_i8(const lin *L, const int64_t *blocks, int64_t m0, int mr, int ng, acc16 acc[][WIDE_GROUP]) {
    const int8_t *w = (const int8_t *)L->w;
    int64_t k = L->k, quads = k / 4, per_block = 16 * k;
#ifdef __AVX512VNNI__
#define I8_KERNEL(R, G)                                                                            \
    if (mr == R && ng == G) {                                                                      \
        __m512i lo[R][G], hi[R][G];                                                                \
        for (int r = 0; r < R; r++)                                                                \
            for (int g = 0; g < G; g++) lo[r][g] = hi[r][g] = _mm512_setzero_si512();              \
        for (int64_t q = 0; q < quads; q++) {                                                      \
            __m512i wv[G];                                                                         \
            for (int g = 0; g < G; g++) wv[g] = _mm512_loadu_si512(w + blocks[g] * per_block + q * 64); \
            for (int r = 0; r < R; r++) {                                                          \
                int32_t xl, xh;                                                                    \
                memcpy(&xl, L->lo + (m0 + r) * k + 4 * q, 4);                                      \
                memcpy(&xh, L->hi + (m0 + r) * k + 4 * q, 4);                                      \
                __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);                    \
                for (int g = 0; g < G; g++) {                                                      \
                    lo[r][g] = _mm512_dpbusd_epi32(lo[r][g], bl, wv[g]);                           \
                    hi[r][g] = _mm512_dpbusd_epi32(hi[r][g], bh, wv[g]);                           \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            for (int g = 0; g < G; g++) {                                                          \
                memcpy(&acc[r][g].lo, &lo[r][g], 64);                                              \
                memcpy(&acc[r][g].hi, &hi[r][g], 64);                                              \
            }                                                                                      \
        return;                                                                                    \
    }
    I8_KERNEL(3, 4) I8_KERNEL(2, 4) I8_KERNEL(1, 4)
    I8_KERNEL(3, 2) I8_KERNEL(2, 2) I8_KERNEL(1, 2)
    I8_KERNEL(3, 1) I8_KERNEL(2, 1) I8_KERNEL(1, 1)
#undef I8_KERNEL
#endif
    for (int r = 0; r < mr; r++) /* exact integer sums: any order gives the same */
        for (int g = 0; g < ng; g++)
            for (int c = 0; c < 16; c++) {
                const int8_t *wb = w + blocks[g] * per_block;
                const uint8_t *xl = L->lo + (m0 + r) * k, *xh = L->hi + (m0 + r) * k;
                int32_t sl = 0, sh = 0;
                for (int64_t q = 0; q < quads; q++)
                    for (int j = 0; j < 4; j++) {
                        sl += (int32_t)xl[4 * q + j] * wb[q * 64 + 4 * c + j];
                        sh += (int32_t)xh[4 * q + j] * wb[q * 64 + 4 * c + j];
                    }
                acc[r][g].lo[c] = sl;
                acc[r][g].hi[c] = sh;
            }
}

static void vector_item(const lin *L, const int64_t *blocks, int ng, int passes, int64_t row0, int64_t row1) {
    int rows_per = L->int8 ? 3 : MR;
    for (int64_t m0 = row0; m0 < row1; m0 += rows_per) {
        int mr = row1 - m0 < rows_per ? (int)(row1 - m0) : rows_per;
        acc16 acc[2][MR][WIDE_GROUP]; /* [pass: gate or plain, up][row][block] */
        for (int h = 0; h < passes; h++) {
            if (L->int8)
                dot_i8(L, blocks + h * ng, m0, mr, ng, acc[h]);
            else if (ng <= GROUP || (mr <= WIDE_ROWS && ng == WIDE_GROUP))
                dot_bf16(L, blocks + h * ng, m0, mr, ng, acc[h], 0);
            else { /* a wide item's tail (5-7 blocks): four, then the rest */
                dot_bf16(L, blocks + h * ng, m0, mr, GROUP, acc[h], 0);
                dot_bf16(L, blocks + h * ng + GROUP, m0, mr, ng - GROUP, acc[h], GROUP);
            }
        }
        for (int r = 0; r < mr; r++)
            for (int g = 0; g < ng; g++)
                finish(L, m0 + r, blocks[g], &acc[0][r][g], passes == 2 ? blocks[ng + g] : 0,
                       passes == 2 ? &acc[1][r][g] : 0);
    }
}

/* ---- AMX path: 16-row tiles ------------------------------------------------------------------ */

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Every tile 16 rows x 64 bytes. bf16 - 0-3: C (fp32), 4: A (32 bf16 of 16 rows of x), 5-7: B.
 * int8 - 0-3: C (int32; lo and hi of two blocks), 4, 5: A (64 bytes of each plane), 6, 7: B. */
static void tiles_on(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* bf16: rows m0..m0+15 of `cnt` (<= 4) blocks, into c[g][row].f */
static void amx_bf16(const lin *L, const int64_t *blocks, int64_t m0, int cnt, acc16 c[GROUP][16]) {
    int64_t k = L->k, per_block = 16 * k;
    const uint16_t *x = L->x + m0 * k, *w = (const uint16_t *)L->w;
    float out[16][16];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < k; kc += 32) {
        int64_t off = kc * 16; /* 16 rows of 32 bf16 (a pair of k per column) per 32 k */
        _tile_loadd(4, x + kc, k * 2);
        _tile_loadd(5, w + blocks[0] * per_block + off, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (cnt > 1) {
            _tile_loadd(6, w + blocks[1] * per_block + off, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (cnt > 2) {
            _tile_loadd(7, w + blocks[2] * per_block + off, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (cnt > 3) {
            _tile_loadd(5, w + blocks[3] * per_block + off, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
#define STORE(T)                                                                                   \
    if (cnt > T) {                                                                                 \
        _tile_stored(T, out, 64);                                                                  \
        for (int r = 0; r < 16; r++) memcpy(&c[T][r].f, out[r], 64);                               \
    }
    STORE(0) STORE(1) STORE(2) STORE(3)
#undef STORE
}

/* bf16: rows m0..m0+31 (two tiles) of `cnt` (<= 2) blocks, into c[g][row] (the first tile's
 * rows) and c2[g][row]: each weight tile meets two row tiles, and no tile register is loaded
 * again before the product that reads it is done (a prefill's many rows: SmolLM2's linears at
 * 400 rows 1.2x faster than one tile with four blocks, benchmarks/RESULTS.md). Every output element takes the
 * same products in the same order as through amx_bf16, so a row's result is the same either way. */
static void amx_bf16_2x2(const lin *L, const int64_t *blocks, int64_t m0, int cnt, acc16 c[][16], acc16 c2[][16]) {
    int64_t k = L->k, per_block = 16 * k;
    const uint16_t *x = L->x + m0 * k, *w = (const uint16_t *)L->w;
    float out[16][16];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < k; kc += 32) {
        int64_t off = kc * 16;
        _tile_loadd(4, x + kc, k * 2);
        _tile_loadd(5, x + 16 * k + kc, k * 2);
        _tile_loadd(6, w + blocks[0] * per_block + off, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (cnt > 1) {
            _tile_loadd(7, w + blocks[1] * per_block + off, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
#define STORE(T, DST)                                                                              \
    {                                                                                              \
        _tile_stored(T, out, 64);                                                                  \
        for (int r = 0; r < 16; r++) memcpy(&(DST)[r].f, out[r], 64);                              \
    }
    STORE(0, c[0]) STORE(2, c2[0])
    if (cnt > 1) {
        STORE(1, c[1]) STORE(3, c2[1])
    }
#undef STORE
}

/* int8: rows m0..m0+15 of `cnt` (<= 2) blocks, into c[g][row].lo/.hi */
static void amx_i8(const lin *L, const int64_t *blocks, int64_t m0, int cnt, acc16 c[GROUP][16]) {
    int64_t k = L->k, per_block = 16 * k;
    const int8_t *w = (const int8_t *)L->w;
    int32_t out[16][16];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < k; kc += 64) {
        int64_t off = kc * 16; /* 16 rows of 64 bytes (four k per column) per 64 k */
        _tile_loadd(4, L->lo + m0 * k + kc, k);
        _tile_loadd(5, L->hi + m0 * k + kc, k);
        _tile_loadd(6, w + blocks[0] * per_block + off, 64);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 5, 6);
        if (cnt > 1) {
            _tile_loadd(7, w + blocks[1] * per_block + off, 64);
            _tile_dpbusd(2, 4, 7);
            _tile_dpbusd(3, 5, 7);
        }
    }
#define STORE(T, G, PART)                                                                          \
    {                                                                                              \
        _tile_stored(T, out, 64);                                                                  \
        for (int r = 0; r < 16; r++) memcpy(&c[G][r].PART, out[r], 64);                            \
    }
    STORE(0, 0, lo) STORE(1, 0, hi)
    if (cnt > 1) {
        STORE(2, 1, lo) STORE(3, 1, hi)
    }
#undef STORE
}

/* The rows of tiles m0 and m0 + 16 (bf16, two tiles a pass) through their epilogues. */
static void amx_pair_item(const lin *L, const int64_t *blocks, int ng, int passes, int64_t m0) {
    acc16 c[2][2][GROUP][16]; /* [row tile][pass][block][row] */
    for (int h = 0; h < passes; h++)
        for (int g = 0; g < ng; g += 2)
            amx_bf16_2x2(L, blocks + h * ng + g, m0, ng - g < 2 ? ng - g : 2, c[0][h] + g, c[1][h] + g);
    for (int t = 0; t < 2; t++) {
        int64_t at = m0 + 16 * t, rows = L->m - at < 16 ? L->m - at : 16;
        for (int64_t r = 0; r < rows; r++)
            for (int g = 0; g < ng; g++)
                finish(L, at + r, blocks[g], &c[t][0][g][r], passes == 2 ? blocks[ng + g] : 0,
                       passes == 2 ? &c[t][1][g][r] : 0);
    }
}

static void amx_item(const lin *L, const int64_t *blocks, int ng, int passes) {
    tiles_on();
    int64_t m0 = 0;
    if (!L->int8)
        for (; m0 + 32 <= L->mpad; m0 += 32)
            amx_pair_item(L, blocks, ng, passes, m0);
    for (; m0 < L->mpad; m0 += 16) {
        acc16 c[2][GROUP][16]; /* [pass: gate or plain, up][block][row] */
        for (int h = 0; h < passes; h++) {
            const int64_t *b = blocks + h * ng;
            if (!L->int8) {
                amx_bf16(L, b, m0, ng, c[h]);
                continue;
            }
            for (int g = 0; g < ng; g += 2) /* two blocks at a time: each takes two C tiles */
                amx_i8(L, b + g, m0, ng - g < 2 ? ng - g : 2, c[h] + g);
        }
        int64_t rows = L->m - m0 < 16 ? L->m - m0 : 16;
        for (int64_t r = 0; r < rows; r++)
            for (int g = 0; g < ng; g++)
                finish(L, m0 + r, blocks[g], &c[0][g][r], passes == 2 ? blocks[ng + g] : 0,
                       passes == 2 ? &c[1][g][r] : 0);
    }
    _tile_release();
}
#endif

/* ---- driver ----------------------------------------------------------------------------------- */

static void run_item(void *p, int64_t item) {
    const lin *L = (const lin *)p;
    int64_t chunk = item % L->row_chunks, row0 = chunk * ROW_CHUNK;
    int64_t row1 = chunk == L->row_chunks - 1 ? L->m : row0 + ROW_CHUNK;
    item /= L->row_chunks;
    int64_t nblocks = (L->n + 15) / 16, first = item * L->group;
    int ng = nblocks - first < L->group ? (int)(nblocks - first) : L->group;
    int passes = L->op == OP_SWIGLU ? 2 : 1;
    int64_t blocks[2 * WIDE_GROUP]; /* the item's blocks; with SwiGLU, then their up partners */
    for (int g = 0; g < ng; g++) {
        blocks[g] = first + g;
        blocks[ng + g] = nblocks + first + g;
    }
#ifdef HAVE_AMX
    if (L->amx) {
        amx_item(L, blocks, ng, passes);
        return;
    }
#endif
    vector_item(L, blocks, ng, passes, row0, row1);
}

static void run(lin *L, int threads) {
    L->group = !L->int8 && !L->amx && L->m <= WIDE_ROWS ? WIDE_GROUP : GROUP;
    L->row_chunks = L->amx || L->m < 2 * ROW_CHUNK ? 1 : (L->m + ROW_CHUNK - 1) / ROW_CHUNK;
    int64_t items = ((L->n + 15) / 16 + L->group - 1) / L->group;
    rudder_parallel_for(run_item, L, items * L->row_chunks, threads);
}

/* Rows padded to whole 16-row tiles (zeros), in a buffer of 64-byte alignment; NULL if no memory. */
static void *padded(const void *x, int64_t m, int64_t mpad, int64_t row_bytes) {
    char *buf = (char *)aligned_alloc(64, (size_t)(mpad * row_bytes + 63) / 64 * 64);
    if (buf != 0) {
        memcpy(buf, x, (size_t)(m * row_bytes));
        memset(buf + m * row_bytes, 0, (size_t)((mpad - m) * row_bytes));
    }
    return buf;
}

void rudder_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, const float *bias, int64_t n,
                        void *out, int32_t out_bf16, int32_t op, int32_t threads) {
    lin L = {x, 0, 0, 0, m, k, n, w, 0, 0, bias, out, out_bf16, op, 0, 0, m};
    void *pad = 0;
#ifdef HAVE_AMX
    if (amx_usable && k % 32 == 0) { /* every row through the tiles, so every row alike */
        L.mpad = (m + 15) / 16 * 16;
        pad = L.mpad == m ? 0 : padded(x, m, L.mpad, 2 * k);
        L.amx = L.mpad == m || pad != 0;
        if (pad != 0)
            L.x = (const uint16_t *)pad;
    }
#endif
    run(&L, threads);
    free(pad);
}

/* x (fp32 or bf16 rows) as 16-bit integers with a scale per row, split into two byte planes. */
static void planes(const void *x, int x_bf16, int64_t m, int64_t k, uint8_t *lo, uint8_t *hi, float *scales) {
    int64_t vk = k / 16 * 16;
    for (int64_t i = 0; i < m; i++) {
        int64_t row = i * k;
        v16f top16 = {0};
        for (int64_t c = 0; c < vk; c += 16)
            top16 = __builtin_elementwise_max(top16, __builtin_elementwise_abs(load16(x, x_bf16, row + c)));
        float top = hmax16_f(top16);
        for (int64_t c = vk; c < k; c++) {
            float v = fabsf(load1(x, x_bf16, row + c));
            top = v > top ? v : top;
        }
        float scale = top > 0.0f ? top / 32767.0f : 1.0f, inv = 1.0f / scale;
        for (int64_t c = 0; c < vk; c += 16) {
            /* round half to even, as lrintf: the values are within +-32767, so the float sum
             * with 1.5 * 2^23 rounds them in the FPU's default mode */
            v16f r = load16(x, x_bf16, row + c) * inv + 12582912.0f;
            v16i q = __builtin_convertvector(r - 12582912.0f, v16i);
            for (int j = 0; j < 16; j++) {
                lo[row + c + j] = (uint8_t)(q[j] & 0xff);
                hi[row + c + j] = (uint8_t)((q[j] >> 8) + 128); /* signed high byte, made unsigned */
            }
        }
        for (int64_t c = vk; c < k; c++) {
            int32_t q = (int32_t)lrintf(load1(x, x_bf16, row + c) * inv);
            lo[row + c] = (uint8_t)(q & 0xff);
            hi[row + c] = (uint8_t)((q >> 8) + 128);
        }
        scales[i] = scale;
    }
}

void rudder_linear_i8(const void *x, int32_t x_bf16, int64_t m, int64_t k, const int8_t *w, const float *wscale,
                      const int32_t *wsum, const float *bias, int64_t n, void *out, int32_t out_bf16, int32_t op,
                      int32_t threads) {
    int64_t mpad = (m + 15) / 16 * 16;
    uint8_t *buf = (uint8_t *)aligned_alloc(64, (size_t)(2 * mpad * k + 63) / 64 * 64);
    float *scales = (float *)malloc((size_t)mpad * sizeof(float));
    if (buf == 0 || scales == 0)
        abort(); /* out of memory for a step's activations: nothing sensible left to do */
    memset(buf, 0, (size_t)(2 * mpad * k));
    uint8_t *lo = buf, *hi = buf + mpad * k;
    planes(x, x_bf16, m, k, lo, hi, scales);
    lin L = {0, lo, hi, scales, m, k, n, w, wscale, wsum, bias, out, out_bf16, op, 1, 0, mpad};
#ifdef HAVE_AMX
    L.amx = amx_usable && m >= AMX_MIN_ROWS_I8 && k % 64 == 0;
#endif
    run(&L, threads);
    free(scales);
    free(buf);
}
