/* RMSNorm over rows: out = x / sqrt(mean(x^2) + eps) * weight, in fp32 arithmetic.
 *
 * torch's rms_norm on bf16 rows runs as several separate ops, each a pass over memory; this is one pass
 * per row. x, weight and out are each fp32 or bf16. The sum of squares runs in 16 lanes over
 * the row in order, then the lanes pairwise: a row's result never depends on the others.
 */
#include <math.h>

#include "kernels.h"

void rudder_rms_norm(const void *x, int32_t x_bf16, const void *weight, int32_t w_bf16, void *out, int32_t out_bf16,
                     int64_t m, int64_t k, float eps) {
    int64_t vk = k / 16 * 16;
    for (int64_t i = 0; i < m; i++) {
        int64_t row = i * k;
        v16f acc = {0};
        for (int64_t c = 0; c < vk; c += 16) {
            v16f v = load16(x, x_bf16, row + c);
            acc += v * v;
        }
        float ss = hsum16(acc);
        for (int64_t c = vk; c < k; c++) {
            float v = load1(x, x_bf16, row + c);
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(ss / (float)k + eps);
        for (int64_t c = 0; c < vk; c += 16)
            store16(out, out_bf16, row + c, load16(x, x_bf16, row + c) * inv * load16(weight, w_bf16, c));
        for (int64_t c = vk; c < k; c++)
            store1(out, out_bf16, row + c, load1(x, x_bf16, row + c) * inv * load1(weight, w_bf16, c));
    }
}
