/* Native CPU kernels for engines/model (built and loaded by kernels.py).
 *
 * Each kernel performs the same IEEE float32 operations, in the same order, as the torch ops it
 * replaces, so results are bit-identical (kernels.py checks this before first use). Build with
 * -ffp-contract=off and without -ffast-math: a fused multiply-add or a reassociated sum would round
 * differently from torch.
 */
#include <stdint.h>

/* mHC's Sinkhorn normalisation of `count` row-major n x n matrices, in place:
 *   m = m / (m.sum(-2) + eps)                                   (columns first)
 *   iters - 1 times: m = m / (m.sum(-1) + eps); m = m / (m.sum(-2) + eps)
 * torch sums a dimension of 4 sequentially, ((a0 + a1) + a2) + a3, and so does this. */
void v4rl_sinkhorn(float *m, int64_t count, int64_t n, int64_t iters, float eps) {
    for (int64_t b = 0; b < count; b++) {
        float *a = m + b * n * n;
        for (int64_t it = 0; it < iters; it++) {
            if (it > 0) {
                for (int64_t r = 0; r < n; r++) {
                    float s = a[r * n];
                    for (int64_t c = 1; c < n; c++) s += a[r * n + c];
                    s += eps;
                    for (int64_t c = 0; c < n; c++) a[r * n + c] /= s;
                }
            }
            for (int64_t c = 0; c < n; c++) {
                float s = a[c];
                for (int64_t r = 1; r < n; r++) s += a[r * n + c];
                s += eps;
                for (int64_t r = 0; r < n; r++) a[r * n + c] /= s;
            }
        }
    }
}
