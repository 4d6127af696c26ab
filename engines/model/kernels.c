/* Native CPU kernels for engines/model (built and loaded by kernels.py).
 *
 * Each kernel performs the same IEEE float32 operations, in the same order, as the torch ops it
 * replaces, so results are bit-identical (kernels.py checks this before first use). Build with
 * -ffp-contract=off and without -ffast-math: a fused multiply-add or a reassociated sum would round
 * differently from torch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sinkhorn.h"

/* mHC's Sinkhorn normalisation of `count` row-major n x n matrices, in place (sinkhorn.h). */
void v4rl_sinkhorn(float *m, int64_t count, int64_t n, int64_t iters, float eps) {
    for (int64_t b = 0; b < count; b++) sinkhorn_matrix(m + b * n * n, n, iters, eps);
}

/* Gradient of v4rl_sinkhorn for `count` matrices: grad_in = d(loss)/d(m) given grad_out = d(loss)/d(result).
 * The forward steps are recomputed per matrix (no saved activations); each step y = x / d, d = x.sum(axis) + eps,
 * is differentiated with autograd's own formulas and order for these torch ops, so the result equals
 * torch.autograd's for the torch version of the forward bit for bit:
 *   grad_x = grad_y / d + sum_axis(-grad_y * ((x / d) / d))      (div: self and other; sum: expand; add: pass)
 * Returns 0, or -1 if the scratch memory could not be allocated. */
int v4rl_sinkhorn_backward(const float *m, const float *grad_out, float *grad_in, int64_t count, int64_t n,
                           int64_t iters, float eps) {
    int64_t steps = 2 * iters - 1, nn = n * n;
    float *xs = malloc(sizeof(float) * (size_t)(steps * nn + steps * n + nn + n));
    if (xs == NULL) return -1;
    float *ds = xs + steps * nn, *g = ds + steps * n, *gd = g + nn;
    for (int64_t b = 0; b < count; b++) {
        memcpy(xs, m + b * nn, sizeof(float) * (size_t)nn);
        for (int64_t k = 0; k < steps; k++) {  /* even k: columns, odd k: rows */
            const float *x = xs + k * nn;
            float *d = ds + k * n, *y = xs + (k + 1) * nn;
            int row = (int)(k & 1);
            for (int64_t i = 0; i < n; i++) {
                float s = row ? x[i * n] : x[i];
                for (int64_t j = 1; j < n; j++) s += row ? x[i * n + j] : x[j * n + i];
                d[i] = s + eps;
            }
            if (k + 1 < steps)
                for (int64_t r = 0; r < n; r++)
                    for (int64_t c = 0; c < n; c++) y[r * n + c] = x[r * n + c] / d[row ? r : c];
        }
        memcpy(g, grad_out + b * nn, sizeof(float) * (size_t)nn);
        for (int64_t k = steps - 1; k >= 0; k--) {
            const float *x = xs + k * nn, *d = ds + k * n;
            int row = (int)(k & 1);
            for (int64_t i = 0; i < n; i++) {
                float s = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    int64_t at = row ? i * n + j : j * n + i;
                    float t = (-g[at]) * ((x[at] / d[i]) / d[i]);
                    s = (j == 0) ? t : s + t;
                }
                gd[i] = s;
            }
            for (int64_t r = 0; r < n; r++)
                for (int64_t c = 0; c < n; c++) {
                    int64_t i = row ? r : c;
                    g[r * n + c] = g[r * n + c] / d[i] + gd[i];
                }
        }
        memcpy(grad_in + b * nn, g, sizeof(float) * (size_t)nn);
    }
    free(xs);
    return 0;
}
