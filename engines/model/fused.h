/* Shared pieces of the fused decode/prefill kernels (fused.c, fused_gemm.c; built into one library by fused.py):
 * the integer type, small inline helpers (dot products, norms, RoPE) and the few functions one file provides to
 * the other (a thread pool, per-thread scratch memory, the packed GEMM). Hidden: only v4rl_* entry points whose
 * declarations are not here are exported. */
#ifndef V4RL_FUSED_H
#define V4RL_FUSED_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
#define MAX_THREADS 64
#define INTERNAL __attribute__((visibility("hidden")))

/* fused_gemm.c */
INTERNAL void parallel_for(int threads, i64 n_tasks, void (*fn)(void *, i64, int), void *ctx);
INTERNAL void *arena_take(size_t bytes);
INTERNAL void arena_give(void *p);
INTERNAL void gemm_packed(const float *x, i64 ldx, i64 M, const float *wp, i64 N, i64 K, float *out, i64 ldo);
INTERNAL void linear_parallel(const float *x, i64 ldx, i64 M, const float *wp, i64 groups, i64 N, i64 K, float *out,
                              i64 ldo, int threads);

#define ROWS_PER_TASK 64
/* Rows per task of the row-wise kernels (mHC, indexer) when they run on several threads. */

static inline size_t round16(i64 n) { return (size_t)((n + 15) / 16 * 16); }

/* Partial sums per accumulator: 8 lanes (one 256-bit register). On Zen 4 a 512-bit FMA costs two 256-bit
 * ones, so wider lanes only make the final reductions dearer (measured: 4x4 blocks at K=128 reach ~75
 * GFLOP/s with 8 lanes, ~38 with 16). */
#define LANES 8

static inline float reduce_lanes(const float *acc) {
    float s4[4];
    for (int l = 0; l < 4; l++) s4[l] = acc[l] + acc[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float dot(const float *restrict a, const float *restrict b, i64 n) {
    float acc[2 * LANES] = {0};  /* two vector accumulators: one alone would wait on each FMA's latency */
    i64 k = 0;
    for (; k + 2 * LANES <= n; k += 2 * LANES)
        for (int l = 0; l < 2 * LANES; l++) acc[l] += a[k + l] * b[k + l];
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[k + l] * b[k + l];
    for (int l = 0; l < LANES; l++) acc[l] += acc[l + LANES];
    float s = reduce_lanes(acc);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Weighted RMSNorm of n values into out (out may equal x): w * (x * rsqrt(mean(x^2) + eps)). */
static inline void rms_norm_row(const float *x, i64 n, const float *w, float eps, float *out) {
    float ss = dot(x, x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i64 i = 0; i < n; i++) out[i] = w ? w[i] * (x[i] * inv) : x[i] * inv;
}

/* Interleaved RoPE on the trailing 2*half channels of v[0..dim): pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s).
 * sign -1 applies the conjugate rotation (undoing V's RoPE on the attention output). */
static inline void rope_row(float *v, i64 dim, i64 half, const float *c, const float *s, float sign) {
    float *r = v + dim - 2 * half;
    for (i64 i = 0; i < half; i++) {
        float x0 = r[2 * i], x1 = r[2 * i + 1], sn = sign * s[i];
        r[2 * i] = x0 * c[i] - x1 * sn;
        r[2 * i + 1] = x1 * c[i] + x0 * sn;
    }
}

#endif
