/* Sampling's passes over a vocabulary row (engine/sampler.py): a tempered row's weights, and the
 * token a uniform draws from weights. One row a call; no allocation.
 *
 * torch's way (x / T, softmax, cumsum, searchsorted) allocates a scaled copy and a softmax per
 * step, and its cumulative sum over 49152 tokens is one dependent chain of additions: 16 rows took
 * ~1.7 ms a step, 10-15 % of a SmolLM2 decode step (benchmarks/RESULTS.md, "Numbers the code's
 * design rests on"). Here the draw sums blocks of the row in 16 lanes, walks the blocks' totals,
 * and only then adds single weights, inside the one block the draw falls in.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

#define MAX_BLOCKS 4096 /* block totals on the stack: blocks of 256 weights up to a 1M vocabulary */

static inline v16f load_tail(const float *p, int64_t left, float fill) {
    v16f v = (v16f){0} + fill;
    for (int64_t i = 0; i < left && i < 16; i++) v[i] = p[i];
    return v;
}

/* out = softmax(x * inv_t): exp((x[i] - max x) * inv_t), summed in 16 lanes (then pairwise), over
 * the sum; a token at -inf weighs 0. A row with no finite logit weighs 0 everywhere. */
void rudder_softmax_row(const float *x, int64_t n, float inv_t, float *out) {
    v16f top = (v16f){0} - INFINITY;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) top = __builtin_elementwise_max(top, load16_f32(x + i));
    if (i < n) top = __builtin_elementwise_max(top, load_tail(x + i, n - i, -INFINITY));
    FOLD16(top, FOLD_MAX);
    float m = top[0];
    if (!(m > -INFINITY) || m == INFINITY) { /* nothing allowed (or no number): no weight anywhere */
        memset(out, 0, (size_t)n * sizeof *out);
        return;
    }
    v16f sum = {0};
    for (i = 0; i < n; i += 16) {
        v16f v = i + 16 <= n ? load16_f32(x + i) : load_tail(x + i, n - i, -INFINITY);
        v16f e = exp16_neg((v - m) * inv_t);
        v16i cut = v == (v16f){0} - INFINITY; /* exp16_neg clamps: -inf would weigh e^-87 */
        v16i bits;
        memcpy(&bits, &e, sizeof bits);
        bits &= ~cut;
        memcpy(&e, &bits, sizeof e);
        sum += e;
        if (i + 16 <= n)
            store16_f32(out + i, e);
        else
            memcpy(out + i, &e, (size_t)(n - i) * sizeof *out);
    }
    float inv = 1.0f / hsum16(sum); /* >= 1: the most likely token weighed 1 */
    for (i = 0; i + 16 <= n; i += 16) store16_f32(out + i, load16_f32(out + i) * inv);
    for (; i < n; i++) out[i] *= inv;
}

/* The token uniform u in [0, 1) draws from weights w (>= 0): the first whose cumulative weight
 * passes u times the row's total, kept below the total, so a token of no weight is never drawn.
 * The cumulative weight is the blocks' totals (each block's 16 lanes, then the lanes pairwise,
 * then its tail) before the token's block, then the block's weights one by one. n - 1 for a row
 * with no weight (or a NaN). */
int64_t rudder_draw_row(const float *w, int64_t n, float u) {
    if (n <= 0)
        return -1;
    int64_t block = 256;
    while ((n + block - 1) / block > MAX_BLOCKS) block *= 2;
    int64_t blocks = (n + block - 1) / block;
    float sums[MAX_BLOCKS], total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * block, end = start + block < n ? start + block : n, i = start;
        v16f acc = {0};
        for (; i + 16 <= end; i += 16) acc += load16_f32(w + i);
        float s = hsum16(acc);
        for (; i < end; i++) s += w[i];
        sums[b] = s;
        total += s;
    }
    if (!(total > 0.0f) || total == INFINITY)
        return n - 1;
    float target = u * total, below = nextafterf(total, 0.0f);
    if (!(target <= below)) /* (u just under 1 rounds up; a NaN u draws the last allowed token) */
        target = below;
    float before = 0.0f;
    int64_t b = 0;
    while (b < blocks - 1 && !(before + sums[b] > target)) before += sums[b++];
    int64_t start = b * block, end = start + block < n ? start + block : n, last = -1;
    float run = before;
    for (int64_t i = start; i < end; i++) {
        if (w[i] > 0.0f)
            last = i;
        run += w[i];
        if (run > target && w[i] > 0.0f)
            return i;
    }
    if (last >= 0) /* the one-by-one sum fell short of the block's total by rounding */
        return last;
    for (int64_t i = n - 1; i >= 0; i--) /* (only reachable by rounding in an all-but-empty row) */
        if (w[i] > 0.0f)
            return i;
    return n - 1;
}

static int descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static inline v16f keep_at_least(v16f v, float t) { /* lanes below t to 0 */
    v16i keep = v >= t, bits;
    memcpy(&bits, &v, sizeof bits);
    bits &= keep;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The positive weights in [eps, most] of w, sorted from the largest, into vals (room for `room`);
 * their count, or -1 if more than `room`. `mass` gets their sum. Most of a row is below eps: 16
 * lanes are compared at once and only a run with one in range looked at weight by weight. */
static int64_t gather(const float *w, int64_t n, float eps, float most, float *vals, int64_t room, float *mass) {
    int64_t count = 0, i = 0;
    float sum = 0.0f;
    for (; i < n; i += 16) {
        if (i + 16 <= n) {
            v16i hit = load16_f32(w + i) >= eps;
            if (!__builtin_reduce_or(hit))
                continue;
        }
        for (int64_t j = i; j < i + 16 && j < n; j++)
            if (w[j] >= eps && w[j] <= most && w[j] > 0.0f) {
                if (count == room)
                    return -1;
                vals[count++] = w[j];
                sum += w[j];
            }
    }
    qsort(vals, (size_t)count, sizeof *vals, descending);
    *mass = sum;
    return count;
}

#define BUCKET_SHIFT 19 /* a positive float's top 12 bits (exponent, 4 of mantissa): ordered like the value */
#define BUCKETS 4096

/* The k-th largest weight (top-k, k >= 1) or, for k = 0, the nucleus threshold of top_p: the
 * smallest weight kept when tokens are kept from the most likely while the mass before them is
 * below top_p of the row's total (the first always stays); 0 when nothing is cut. From the
 * weights >= 1e-3 of the total (at most a thousand, sorted) when they suffice - LM distributions
 * are peaked. Else a histogram of the weights by their top bits (ordered like their values)
 * finds the one bucket the threshold lies in, and that bucket's weights are sorted. */
static float threshold(const float *w, int64_t n, int64_t k, float top_p, float total) {
    float vals[1024], mass = 0.0f, limit = top_p * total;
    int64_t count = gather(w, n, 1e-3f * total, 1e30f, vals, 1024, &mass), kept = 0;
    if (count >= 0 && (k > 0 ? count >= k : mass >= limit)) {
        if (k > 0)
            return vals[k - 1];
        float before = 0.0f;
        while (kept < count && before < limit) before += vals[kept++];
        return vals[kept - 1];
    }
    static _Thread_local float bucket_mass[BUCKETS];
    static _Thread_local int64_t bucket_count[BUCKETS];
    memset(bucket_mass, 0, sizeof bucket_mass);
    memset(bucket_count, 0, sizeof bucket_count);
    for (int64_t i = 0; i < n; i++)
        if (w[i] > 0.0f) {
            uint32_t bits;
            memcpy(&bits, &w[i], sizeof bits);
            bucket_mass[bits >> BUCKET_SHIFT] += w[i];
            bucket_count[bits >> BUCKET_SHIFT]++;
        }
    float before = 0.0f;
    int64_t above = 0, b = BUCKETS - 1;
    for (; b >= 0; b--) { /* the bucket where the count reaches k, or the mass reaches the limit */
        if (k > 0 ? above + bucket_count[b] >= k : before + bucket_mass[b] >= limit)
            break;
        above += bucket_count[b];
        before += bucket_mass[b];
    }
    if (b < 0)
        return 0.0f; /* fewer than k weighted tokens, or (rounding) the mass never reached top_p */
    uint32_t lo_bits = (uint32_t)b << BUCKET_SHIFT, hi_bits = lo_bits | ((1u << BUCKET_SHIFT) - 1);
    float lo, hi;
    memcpy(&lo, &lo_bits, sizeof lo);
    memcpy(&hi, &hi_bits, sizeof hi);
    float *in = (float *)malloc((size_t)bucket_count[b] * sizeof *in), t = 0.0f;
    if (in == 0)
        return 0.0f; /* (no memory: nothing is cut) */
    count = gather(w, n, lo, hi, in, bucket_count[b], &mass);
    if (k > 0) {
        t = in[k - above - 1];
    } else {
        while (kept < count && before < limit) before += in[kept++];
        t = in[kept - 1];
    }
    free(in);
    return t;
}

/* Weights below t to 0; the row's new total (16 lanes, then pairwise, then the tail). */
static float cut_below(float *w, int64_t n, float t) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16f v = keep_at_least(load16_f32(w + i), t);
        store16_f32(w + i, v);
        acc += v;
    }
    float total = hsum16(acc);
    for (; i < n; i++) {
        if (w[i] < t)
            w[i] = 0.0f;
        total += w[i];
    }
    return total;
}

/* top-k (0 < k < n), then top-p (< 1) of the distribution top-k left, then min_p (> 0), on
 * softmax weights w in place: cut tokens weigh 0, and the row sums to 1 again after top-k and
 * top-p (not after min_p). Ties at a threshold stay. */
void rudder_cut_row(float *w, int64_t n, int64_t top_k, float top_p, float min_p) {
    float total = 1.0f;
    if (top_k > 0 && top_k < n)
        total = cut_below(w, n, threshold(w, n, top_k, 1.0f, total));
    if (top_p < 1.0f)
        total = cut_below(w, n, threshold(w, n, 0, top_p, total));
    int64_t i;
    if (total > 0.0f && total != 1.0f) {
        float inv = 1.0f / total;
        for (i = 0; i + 16 <= n; i += 16) store16_f32(w + i, load16_f32(w + i) * inv);
        for (; i < n; i++) w[i] *= inv;
    }
    if (min_p > 0.0f) {
        v16f top16 = {0};
        for (i = 0; i + 16 <= n; i += 16) top16 = __builtin_elementwise_max(top16, load16_f32(w + i));
        FOLD16(top16, FOLD_MAX);
        float top = top16[0];
        for (; i < n; i++) top = w[i] > top ? w[i] : top;
        cut_below(w, n, top * min_p);
    }
}
