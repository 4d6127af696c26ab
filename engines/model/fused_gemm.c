/* Fused CPU kernels, part 2 (built with fused.c by fused.py): a thread pool, per-thread scratch memory, the
 * packed GEMM every kernel multiplies with, and the routed + shared experts. Same numerics contract as fused.c. */
#include <pthread.h>

#include "fused.h"

/* ------------------------------------------------------------------------------------------ threads */
typedef struct {
    void (*fn)(void *ctx, i64 task, int worker);
    void *ctx;
    i64 n_tasks;
    i64 next;
} pool_t;

static void run_tasks(pool_t *p, int worker) {
    for (;;) {
        i64 t = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t, worker);
    }
}

/* Workers live for the process and sleep on a condition variable between jobs (starting threads per call cost
 * ~20 us each, more than many kernels). One job at a time: a caller that finds the pool busy (another engine
 * in the process) runs its tasks alone. After fork() the child starts with no workers. */
static pthread_mutex_t pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int pool_busy, pool_started, pool_wanted, pool_finished;
static i64 pool_generation;
static pool_t *pool_job;

static void *pool_worker(void *arg) {
    int worker = (int)(intptr_t)arg;
    i64 seen = 0;
    pthread_mutex_lock(&pool_mutex);
    for (;;) {
        while (pool_generation == seen) pthread_cond_wait(&pool_work, &pool_mutex);
        seen = pool_generation;
        if (worker >= pool_wanted) continue;
        pool_t *job = pool_job;
        pthread_mutex_unlock(&pool_mutex);
        run_tasks(job, worker);
        pthread_mutex_lock(&pool_mutex);
        if (++pool_finished == pool_wanted - 1) pthread_cond_signal(&pool_done);
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool_mutex, NULL);
    pthread_cond_init(&pool_work, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_busy = pool_started = pool_wanted = pool_finished = 0;
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Runs fn(ctx, t, worker) for t in [0, n_tasks) on up to `threads` threads (the caller is worker 0, the others
 * 1, 2, ...); tasks are handed out dynamically, so each must write outputs of its own. */
void parallel_for(int threads, i64 n_tasks, void (*fn)(void *, i64, int), void *ctx) {
    pool_t p = {fn, ctx, n_tasks, 0};
    int wanted = threads < n_tasks ? threads : (int)n_tasks;
    if (wanted > MAX_THREADS) wanted = MAX_THREADS;
    pthread_once(&pool_once, pool_init);
    pthread_mutex_lock(&pool_mutex);
    if (wanted <= 1 || pool_busy) {
        pthread_mutex_unlock(&pool_mutex);
        run_tasks(&p, 0);
        return;
    }
    while (pool_started < wanted - 1) {  /* grow the pool; a thread that cannot start just leaves fewer workers */
        pthread_t th;
        if (pthread_create(&th, NULL, pool_worker, (void *)(intptr_t)(pool_started + 1)) != 0) break;
        pthread_detach(th);
        pool_started++;
    }
    if (wanted > pool_started + 1) wanted = pool_started + 1;
    pool_busy = 1;
    pool_job = &p;
    pool_wanted = wanted;
    pool_finished = 0;
    pool_generation++;
    pthread_cond_broadcast(&pool_work);
    pthread_mutex_unlock(&pool_mutex);
    run_tasks(&p, 0);
    pthread_mutex_lock(&pool_mutex);
    while (pool_finished < pool_wanted - 1) pthread_cond_wait(&pool_done, &pool_mutex);
    pool_busy = 0;
    pthread_mutex_unlock(&pool_mutex);
}

/* Scratch memory that stays mapped between calls of one thread (a fresh malloc of a few MB is a fresh mmap, and
 * its first-touch page faults cost more than a small kernel); above ARENA_KEEP bytes it is freed after the call. */
#define ARENA_KEEP ((size_t)32 << 20)
static __thread char *arena_base;
static __thread size_t arena_size;

static void *aligned(size_t bytes) {  /* 64-byte aligned: vector loads never straddle a cache line */
    void *p = NULL;
    return posix_memalign(&p, 64, bytes) == 0 ? p : NULL;
}

void *arena_take(size_t bytes) {
    if (bytes > ARENA_KEEP) return aligned(bytes);
    if (bytes > arena_size) {
        free(arena_base);
        arena_base = aligned(bytes);
        arena_size = arena_base ? bytes : 0;
    }
    return arena_base;
}

void arena_give(void *p) {
    if (p != arena_base) free(p);
}


/* ------------------------------------------------------------------------------------------ packed GEMM */
/* out = x @ W^T for a weight W [N, K] packed in panels of PANEL output columns: panel p holds
 * wp[(p*K + k)*PANEL + j] = W[p*PANEL + j, k] (zero past N; fused.py `pack` builds it once per weight version).
 * The kernel keeps MR rows x PANEL columns of sums in registers and, per k, broadcasts one x value per row
 * against two vectors of the panel: no horizontal reductions, one load of the panel per MR rows. Each output
 * is one sequential float32 sum over k (with fused multiply-adds), on every instruction set. Measured on Zen 4:
 * ~100 GFLOP/s per core with AVX-512, against ~40 for dot products of 8-lane partial sums and ~50-80 for
 * torch's matmul at these sizes; on Zen 3 (AVX2 path below) 47 per core, 88 on two, torch 77. */
#define PANEL 32
#define ROW_BLOCK 48
/* Rows per block: the block's x rows stay in L2 while the panels stream past; a multiple of MR. */

#if defined(__AVX512F__)
#include <immintrin.h>
#define MR 6
typedef __m512 v16f;
#define V16_LOAD(p) _mm512_loadu_ps(p)
#define V16_ZERO() _mm512_setzero_ps()
#define V16_SET1(v) _mm512_set1_ps(v)
#define V16_FMA(a, b, acc) _mm512_fmadd_ps(a, b, acc)
#define V16_STORE(p, v) _mm512_storeu_ps(p, v)
#elif defined(__AVX2__) && defined(__FMA__)
/* 16 lanes as two 256-bit registers with explicit FMAs: GCC's generic 64-byte vectors compile to memory
 * round trips on AVX2 (measured on Zen 3: 1.9 GFLOP/s per core against torch's ~75). 3 rows x 4 registers of
 * sums + a broadcast + one panel vector at a time fit the 16 YMM registers. */
#include <immintrin.h>
#define MR 3
typedef struct {
    __m256 lo, hi;
} v16f;
static inline v16f v16_load(const float *p) {
    v16f v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return v;
}
static inline v16f v16_set1(float x) {
    __m256 s = _mm256_set1_ps(x);
    v16f v = {s, s};
    return v;
}
static inline v16f v16_fma(v16f a, v16f b, v16f acc) {
    v16f v = {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
    return v;
}
static inline void v16_store(float *p, v16f v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
#define V16_LOAD(p) v16_load(p)
#define V16_ZERO() v16_set1(0.0f)
#define V16_SET1(v) v16_set1(v)
#define V16_FMA(a, b, acc) v16_fma(a, b, acc)
#define V16_STORE(p, v) v16_store(p, v)
#else
#define MR 2  /* 16-lane vectors are two or four registers here: fewer rows keep the sums in registers */
typedef float v16f __attribute__((vector_size(64)));
static inline v16f v16_load(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof(v));
    return v;
}
#define V16_LOAD(p) v16_load(p)
#define V16_ZERO() ((v16f){0})
#define V16_SET1(v) ((v16f){0} + (v))
#define V16_FMA(a, b, acc) ((acc) + (a) * (b))
#define V16_STORE(p, v) memcpy(p, &(v), sizeof(v16f))
#endif

static inline void store_panel_row(float *out, v16f lo, v16f hi, i64 cols) {
    if (cols == PANEL) {
        V16_STORE(out, lo);
        V16_STORE(out + 16, hi);
        return;
    }
    float t[PANEL];
    V16_STORE(t, lo);
    V16_STORE(t + 16, hi);
    memcpy(out, t, sizeof(float) * (size_t)cols);
}

#define PANEL_KERNEL(R)                                                                                      \
    static inline void panel_##R(const float *restrict x, i64 ldx, const float *restrict wp, i64 K,          \
                                 float *out, i64 ldo, i64 cols) {                                            \
        v16f lo[R], hi[R];                                                                                    \
        for (int r = 0; r < R; r++) lo[r] = hi[r] = V16_ZERO();                                               \
        for (i64 k = 0; k < K; k++) {                                                                         \
            v16f w0 = V16_LOAD(wp + k * PANEL), w1 = V16_LOAD(wp + k * PANEL + 16);                           \
            for (int r = 0; r < R; r++) {                                                                     \
                v16f xb = V16_SET1(x[r * ldx + k]);                                                           \
                lo[r] = V16_FMA(xb, w0, lo[r]);                                                               \
                hi[r] = V16_FMA(xb, w1, hi[r]);                                                               \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++) store_panel_row(out + r * ldo, lo[r], hi[r], cols);                       \
    }
PANEL_KERNEL(1)
PANEL_KERNEL(2)
#if MR >= 3
PANEL_KERNEL(3)
#endif
#if MR == 6
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)
#endif

/* Rows [r0, r0 + rows) (rows <= ROW_BLOCK) against panels [p0, p1). */
static void gemm_block(const float *x, i64 ldx, i64 r0, i64 rows, const float *wp, i64 N, i64 K, i64 p0, i64 p1,
                       float *out, i64 ldo) {
    for (i64 p = p0; p < p1; p++) {
        const float *panel = wp + p * K * PANEL;
        i64 cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (i64 r = r0; r < r0 + rows; r += MR) {
            i64 n = r0 + rows - r < MR ? r0 + rows - r : MR;
            const float *xr = x + r * ldx;
            float *o = out + r * ldo + p * PANEL;
            switch (n) {
#if MR == 6
                case 6: panel_6(xr, ldx, panel, K, o, ldo, cols); break;
                case 5: panel_5(xr, ldx, panel, K, o, ldo, cols); break;
                case 4: panel_4(xr, ldx, panel, K, o, ldo, cols); break;
#endif
#if MR >= 3
                case 3: panel_3(xr, ldx, panel, K, o, ldo, cols); break;
#endif
                case 2: panel_2(xr, ldx, panel, K, o, ldo, cols); break;
                default: panel_1(xr, ldx, panel, K, o, ldo, cols); break;
            }
        }
    }
}

void gemm_packed(const float *x, i64 ldx, i64 M, const float *wp, i64 N, i64 K, float *out, i64 ldo) {
    i64 panels = (N + PANEL - 1) / PANEL;
    for (i64 r0 = 0; r0 < M; r0 += ROW_BLOCK)
        gemm_block(x, ldx, r0, M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK, wp, N, K, 0, panels, out, ldo);
}

typedef struct {
    const float *x, *wp;
    i64 ldx, M, N, K, ldo, panels, panel_group, groups, in_per_group;
    float *out;
} linear_t;

#define PANELS_PER_TASK 4

/* task = (group, row block, run of PANELS_PER_TASK panels) */
static void linear_task(void *ctx, i64 task, int worker) {
    (void)worker;
    const linear_t *l = (const linear_t *)ctx;
    i64 runs = (l->panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK, blocks = (l->M + ROW_BLOCK - 1) / ROW_BLOCK;
    i64 g = task / (blocks * runs), rest = task % (blocks * runs), r0 = (rest / runs) * ROW_BLOCK;
    i64 p0 = (rest % runs) * PANELS_PER_TASK, p1 = p0 + PANELS_PER_TASK < l->panels ? p0 + PANELS_PER_TASK : l->panels;
    gemm_block(l->x + g * l->in_per_group, l->ldx, r0, l->M - r0 < ROW_BLOCK ? l->M - r0 : ROW_BLOCK,
               l->wp + g * l->panels * l->K * PANEL, l->N, l->K, p0, p1, l->out + g * l->N, l->ldo);
}

/* out [M, groups*N] (row stride ldo) = for each group g: x[:, g*K:(g+1)*K] (row stride ldx) @ W_g^T, with the
 * groups' packed weights wp [groups, ceil(N/PANEL), K, PANEL] (groups = 1: a plain linear layer). */
void linear_parallel(const float *x, i64 ldx, i64 M, const float *wp, i64 groups, i64 N, i64 K, float *out, i64 ldo,
                     int threads) {
    i64 panels = (N + PANEL - 1) / PANEL;
    linear_t l = {x, wp, ldx, M, N, K, ldo, panels, 0, groups, K, out};
    i64 tasks = groups * ((M + ROW_BLOCK - 1) / ROW_BLOCK) * ((panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
    parallel_for(threads, tasks, linear_task, &l);
}

/* ------------------------------------------------------------------------------------------ MoE */
#define MOE_BLOCK 32
/* Rows per expert task: a block's gathered inputs and activations stay in L1/L2 while the expert's weights
 * stream past, and big prefills split into many tasks for the threads. */

typedef struct {
    const float *x;
    i64 B, D, I, k;
    const float *w13, *w2, *s13, *s2;  /* packed: w1 and w3 stacked [2I, D], w2 [D, I]; per expert, then shared */
    i64 w13_size, w2_size;             /* floats per expert in w13 / w2 */
    float limit;
    const i64 *task_expert, *task_first, *pairs;  /* pairs sorted by expert: pair p = row * k + slot */
    const float *pair_w;
    i64 routed_tasks;
    float *pair_out, *shared_out, *scratch;
} moe_t;

static i64 moe_scratch_floats(i64 D, i64 I) { return (i64)round16(MOE_BLOCK * (2 * D + 3 * I)); }

/* y[r] = w2(silu(min(w1 x_r, limit)) * clamp(w3 x_r, -limit, limit)) for up to MOE_BLOCK rows (h: scratch). */
static void expert_rows(const moe_t *m, const float *w13, const float *w2, const float *x, i64 rows, float *h,
                        float *y) {
    i64 I = m->I;
    float *act = h + MOE_BLOCK * 2 * I;
    gemm_packed(x, m->D, rows, w13, 2 * I, m->D, h, 2 * I);
    for (i64 r = 0; r < rows; r++)
        for (i64 i = 0; i < I; i++) {
            float g = h[r * 2 * I + i], u = h[r * 2 * I + I + i];
            g = g < m->limit ? g : m->limit;
            u = u < -m->limit ? -m->limit : (u > m->limit ? m->limit : u);
            act[r * I + i] = g / (1.0f + expf(-g)) * u;
        }
    gemm_packed(act, I, rows, w2, m->D, I, y, m->D);
}

static void moe_task(void *ctx, i64 task, int worker) {
    moe_t *m = (moe_t *)ctx;
    float *xg = m->scratch + (i64)worker * moe_scratch_floats(m->D, m->I), *y = xg + MOE_BLOCK * m->D;
    float *h = y + MOE_BLOCK * m->D;
    if (task < m->routed_tasks) {  /* a block of one routed expert's pairs: gather, run, scale by the weight */
        i64 e = m->task_expert[task], first = m->task_first[task], rows = m->task_first[task + 1] - first;
        for (i64 i = 0; i < rows; i++)
            memcpy(xg + i * m->D, m->x + (m->pairs[first + i] / m->k) * m->D, sizeof(float) * (size_t)m->D);
        expert_rows(m, m->w13 + e * m->w13_size, m->w2 + e * m->w2_size, xg, rows, h, y);
        for (i64 i = 0; i < rows; i++) {
            i64 p = m->pairs[first + i];
            float wgt = m->pair_w[p];
            for (i64 c = 0; c < m->D; c++) m->pair_out[p * m->D + c] = y[i * m->D + c] * wgt;
        }
    } else {  /* a block of rows through the shared expert */
        i64 r0 = (task - m->routed_tasks) * MOE_BLOCK, rows = m->B - r0 < MOE_BLOCK ? m->B - r0 : MOE_BLOCK;
        expert_rows(m, m->s13, m->s2, m->x + r0 * m->D, rows, h, m->shared_out + r0 * m->D);
    }
}

/* Router of B rows: scores sqrt(softplus(x @ gate^T)) [B, E] (gate packed); experts by tid2eid[tokens] (hash
 * layers, [V, k] int64) or the top-k of scores + bias; weights = chosen scores / (sum + 1e-20) * scaling. */
static void route(const float *x, i64 B, i64 D, i64 E, i64 k, const float *gate, const float *bias,
                  const i64 *tid2eid, const i64 *tokens, float scaling, float *scores, i64 *chosen_all, float *pair_w) {
    gemm_packed(x, D, B, gate, E, D, scores, E);
    for (i64 i = 0; i < B * E; i++) {
        float v = scores[i];
        scores[i] = sqrtf(v > 20.0f ? v : log1pf(expf(v)));  /* torch's softplus: linear above 20 */
    }
    for (i64 b = 0; b < B; b++) {
        const float *sc = scores + b * E;
        i64 *chosen = chosen_all + b * k;
        if (tid2eid != NULL) {
            for (i64 j = 0; j < k; j++) chosen[j] = tid2eid[tokens[b] * k + j];
        } else {  /* top-k of score + bias by repeated selection (k is small) */
            for (i64 j = 0; j < k; j++) {
                i64 best = -1;
                float bv = -INFINITY;
                for (i64 e = 0; e < E; e++) {
                    int taken = 0;
                    for (i64 t = 0; t < j; t++) taken |= chosen[t] == e;
                    float v = sc[e] + bias[e];
                    if (!taken && (best < 0 || v > bv)) {
                        best = e;
                        bv = v;
                    }
                }
                chosen[j] = best;
            }
        }
        float sum = 0.0f;
        for (i64 j = 0; j < k; j++) sum += sc[chosen[j]];
        for (i64 j = 0; j < k; j++) pair_w[b * k + j] = sc[chosen[j]] / (sum + 1e-20f) * scaling;
    }
}

/* Routed + shared experts of B rows (layers.MoE): route as above, then out [B, D] = sum over slots (in slot
 * order) of weight * expert(x) + shared(x); chosen_out [B, k] (NULL: not wanted) receives the experts chosen. Packed weights (see packed GEMM): gate [E, D]; w13 [E][2I, D] (w1
 * rows then w3 rows), w2 [E][D, I]; s13, s2 the shared expert's. Returns 0, or -1 if scratch memory could not
 * be allocated. */
int v4rl_moe(const float *x, i64 B, i64 D, i64 I, i64 E, i64 k, const float *gate, const float *bias,
             const i64 *tid2eid, const i64 *tokens, float scaling, const float *w13, const float *w2,
             const float *s13, const float *s2, float limit, float *out, i64 *chosen_out, int threads) {
    i64 n_pairs = B * k, max_tasks = n_pairs / MOE_BLOCK + E + 1;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* float blocks first, each a multiple of 16 floats so every block (the workers' scratch above all) starts
     * 64-byte aligned; the integer tables after them */
    size_t scratch_floats = (size_t)threads * (size_t)moe_scratch_floats(D, I);
    size_t floats = round16(B * E) + round16(n_pairs) + round16(n_pairs * D) + round16(B * D) + scratch_floats;
    size_t ints = (size_t)(n_pairs + n_pairs + (E + 1) + 2 * (max_tasks + 1));
    char *mem = arena_take(sizeof(float) * floats + sizeof(i64) * ints);
    if (mem == NULL) return -1;
    float *scratch = (float *)mem, *scores = scratch + scratch_floats, *pair_w = scores + round16(B * E);
    float *pair_out = pair_w + round16(n_pairs), *shared_out = pair_out + round16(n_pairs * D);
    i64 *chosen = (i64 *)(shared_out + round16(B * D)), *pairs = chosen + n_pairs, *start = pairs + n_pairs;
    i64 *task_expert = start + E + 1, *task_first = task_expert + max_tasks + 1;
    route(x, B, D, E, k, gate, bias, tid2eid, tokens, scaling, scores, chosen, pair_w);
    if (chosen_out != NULL) memcpy(chosen_out, chosen, sizeof(i64) * (size_t)n_pairs);  /* the routes used */
    memset(start, 0, sizeof(i64) * (size_t)(E + 1));
    for (i64 p = 0; p < n_pairs; p++) start[chosen[p] + 1]++;
    for (i64 e = 0; e < E; e++) start[e + 1] += start[e];
    i64 *fill = task_expert;  /* borrowed as the counting sort's cursor before the task table is written */
    memcpy(fill, start, sizeof(i64) * (size_t)E);
    for (i64 p = 0; p < n_pairs; p++) pairs[fill[chosen[p]]++] = p;  /* ascending rows within each expert */
    i64 n_tasks = 0;
    for (i64 e = 0; e < E; e++)
        for (i64 first = start[e]; first < start[e + 1]; first += MOE_BLOCK) {
            task_expert[n_tasks] = e;
            task_first[n_tasks++] = first;
        }
    task_first[n_tasks] = n_pairs;  /* blocks tile the sorted pairs: a block ends where the next begins */
    i64 p13 = (2 * I + PANEL - 1) / PANEL, p2 = (D + PANEL - 1) / PANEL;
    moe_t m = {x, B, D, I, k, w13, w2, s13, s2, p13 * D * PANEL, p2 * I * PANEL, limit, task_expert, task_first,
               pairs, pair_w, n_tasks, pair_out, shared_out, scratch};
    parallel_for(threads, n_tasks + (B + MOE_BLOCK - 1) / MOE_BLOCK, moe_task, &m);
    for (i64 b = 0; b < B; b++) {
        float *o = out + b * D;
        const float *first = pair_out + (b * k) * D;
        for (i64 c = 0; c < D; c++) o[c] = first[c];
        for (i64 j = 1; j < k; j++)
            for (i64 c = 0; c < D; c++) o[c] += pair_out[(b * k + j) * D + c];
        for (i64 c = 0; c < D; c++) o[c] += shared_out[b * D + c];
    }
    arena_give(mem);
    return 0;
}


/* linear_parallel, exported (fused.py `linear`). */
void v4rl_linear(const float *x, i64 ldx, i64 M, const float *wp, i64 groups, i64 N, i64 K, float *out, i64 ldo,
                 int threads) {
    linear_parallel(x, ldx, M, wp, groups, N, K, out, ldo, threads);
}
