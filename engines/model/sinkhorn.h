/* mHC's Sinkhorn normalisation of one row-major n x n matrix, in place, with the float32 operations of
 * layers.sinkhorn_torch in its order (so bit-identical to the torch ops when compiled without fused
 * multiply-adds or reassociation; there are no products to fuse):
 *   m = m / (m.sum(-2) + eps)                                   (columns first)
 *   iters - 1 times: m = m / (m.sum(-1) + eps); m = m / (m.sum(-2) + eps)
 * torch sums a dimension of 4 sequentially, ((a0 + a1) + a2) + a3, and so does this.
 * Shared by kernels.c (the bit-identical Sinkhorn) and fused.c (inside the fused mHC kernel). */
#ifndef V4RL_SINKHORN_H
#define V4RL_SINKHORN_H

#include <stdint.h>

static inline void sinkhorn_matrix(float *a, int64_t n, int64_t iters, float eps) {
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

#endif
