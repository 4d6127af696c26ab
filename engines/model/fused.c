/* Fused CPU kernels for our model's prefill and decode step (built with fused_gemm.c and loaded by fused.py).
 *
 * Each kernel replaces a chain of small torch ops of engines/model/{layers,attention}.py: mHC weights (with the
 * block's input RMSNorm) and merge, norms with RoPE, the compressors' window step, the lightning indexer's
 * scores and top-k, sink attention over the sliding window plus compressed entries, and (fused_gemm.c) every
 * matmul, routing and the routed + shared experts, plus the rollout engine's inverse-CDF sampler. They compute
 * the same formulas in float32, but sums run in another order (8-lane partial sums, fused multiply-adds) and
 * exp/cos come from libm, so results differ from the torch ops by float32 rounding only:
 * engines/model/fused_model.py checks them against those ops within a stated bound before first use.
 *
 * Layout conventions: every matrix is row-major float32; `ld*` is the distance between two rows (inputs may be
 * column slices of one wider matmul output); positions are int64. A kernel that takes `threads` splits
 * independent tasks (experts, rows, panels) over that many threads, each output computed by one task in a
 * fixed order, so results do not depend on the thread count.
 */
#include "fused.h"
#include "sinkhorn.h"

/* ------------------------------------------------------------------------------------------ mHC */
typedef struct {
    const float *streams, *mixes, *base, *scale, *norm_w;
    i64 hc, D, iters, nmix;
    float rms_eps, hc_eps, norm_eps;
    int head;
    float *post, *comb, *x;
    i64 rows;
} hc_pre_t;

static void hc_pre_rows(void *ctx, i64 task, int worker) {
    (void)worker;
    const hc_pre_t *a = (const hc_pre_t *)ctx;
    i64 hc = a->hc, D = a->D, width = hc * D, nmix = a->nmix;
    float pre[16];
    for (i64 b = task * ROWS_PER_TASK; b < (task + 1) * ROWS_PER_TASK && b < a->rows; b++) {
        const float *st = a->streams + b * width;
        float mb[(2 + 16) * 16], inv = 1.0f / sqrtf(dot(st, st, width) / (float)width + a->rms_eps);
        /* linear(norm(x)) = linear(x) * rsqrt(mean(x^2) + eps) */
        for (i64 j = 0; j < nmix; j++) mb[j] = a->mixes[b * nmix + j] * inv;
        for (i64 s = 0; s < hc; s++) pre[s] = sigmoidf(mb[s] * a->scale[0] + a->base[s]) + a->hc_eps;
        if (!a->head) {
            for (i64 s = 0; s < hc; s++)
                a->post[b * hc + s] = 2.0f * sigmoidf(mb[hc + s] * a->scale[1] + a->base[hc + s]);
            float *cm = a->comb + b * hc * hc;
            for (i64 i = 0; i < hc; i++) {
                float *row = cm + i * hc, mx = -INFINITY, sum = 0.0f;
                for (i64 j = 0; j < hc; j++) {
                    row[j] = mb[2 * hc + i * hc + j] * a->scale[2] + a->base[2 * hc + i * hc + j];
                    if (row[j] > mx) mx = row[j];
                }
                for (i64 j = 0; j < hc; j++) {
                    row[j] = expf(row[j] - mx);
                    sum += row[j];
                }
                for (i64 j = 0; j < hc; j++) row[j] = row[j] / sum + a->hc_eps;
            }
            sinkhorn_matrix(cm, hc, a->iters, a->hc_eps);
        }
        float *xb = a->x + b * D;
        for (i64 d = 0; d < D; d++) xb[d] = pre[0] * st[d];
        for (i64 t = 1; t < hc; t++)
            for (i64 d = 0; d < D; d++) xb[d] += pre[t] * st[t * D + d];
        rms_norm_row(xb, D, a->norm_w, a->norm_eps, xb);
    }
}

void v4rl_hc_pre(const float *streams, i64 B, i64 hc, i64 D, const float *fn_packed, const float *base,
                 const float *scale, float rms_eps, float hc_eps, i64 iters, const float *norm_w, float norm_eps,
                 int head, float *post, float *comb, float *x, int threads) {
    i64 width = hc * D, nmix = head ? hc : (2 + hc) * hc;
    if (hc > 16) return;
    float *mixes = arena_take(sizeof(float) * (size_t)(B * nmix));
    if (mixes == NULL) return;
    linear_parallel(streams, width, B, fn_packed, 1, nmix, width, mixes, nmix, threads);
    hc_pre_t a = {streams, mixes, base, scale, norm_w, hc, D, iters, nmix, rms_eps, hc_eps, norm_eps, head, post,
                  comb, x, B};
    parallel_for(threads, (B + ROWS_PER_TASK - 1) / ROWS_PER_TASK, hc_pre_rows, &a);
    arena_give(mixes);
}

/* New streams after a block (layers.hc_merge): out[b,s,:] = post[b,s] * y[b,:] + sum_t comb[b,t,s] * streams[b,t,:]. */
typedef struct {
    const float *streams, *y, *post, *comb;
    i64 rows, hc, D;
    float *out;
} hc_post_t;

static void hc_post_rows(void *ctx, i64 task, int worker) {
    (void)worker;
    const hc_post_t *a = (const hc_post_t *)ctx;
    i64 hc = a->hc, D = a->D;
    for (i64 b = task * ROWS_PER_TASK; b < (task + 1) * ROWS_PER_TASK && b < a->rows; b++) {
        const float *restrict st = a->streams + b * hc * D, *restrict yb = a->y + b * D, *cm = a->comb + b * hc * hc;
        for (i64 s = 0; s < hc; s++) {
            float *restrict o = a->out + (b * hc + s) * D, p = a->post[b * hc + s];
            for (i64 d = 0; d < D; d++) o[d] = cm[s] * st[d];
            for (i64 t = 1; t < hc; t++)
                for (i64 d = 0; d < D; d++) o[d] += cm[t * hc + s] * st[t * D + d];
            for (i64 d = 0; d < D; d++) o[d] = p * yb[d] + o[d];
        }
    }
}

void v4rl_hc_post(const float *streams, i64 B, i64 hc, i64 D, const float *y, const float *post, const float *comb,
                  float *out, int threads) {
    hc_post_t a = {streams, y, post, comb, B, hc, D, out};
    parallel_for(threads, (B + ROWS_PER_TASK - 1) / ROWS_PER_TASK, hc_post_rows, &a);
}

/* ------------------------------------------------------------------------------------------ norms + RoPE */
/* Weighted RMSNorm of B rows (input row stride ldx) into out [B, n] (contiguous). */
void v4rl_rms_norm(const float *x, i64 ldx, i64 B, i64 n, const float *w, float eps, float *out) {
    for (i64 b = 0; b < B; b++) rms_norm_row(x + b * ldx, n, w, eps, out + b * n);
}

/* Queries: per head an unweighted RMSNorm, then RoPE at the row's position; x [B, heads*dim] (row stride ldx)
 * -> out [B, heads, dim]. cos/sin: [B, half]. norm = 0 skips the norm (the indexer's queries). */
void v4rl_heads_norm_rope(const float *x, i64 ldx, i64 B, i64 heads, i64 dim, float eps, int norm,
                          const float *cos, const float *sin, i64 half, float *out) {
    for (i64 b = 0; b < B; b++)
        for (i64 h = 0; h < heads; h++) {
            const float *src = x + b * ldx + h * dim;
            float *dst = out + (b * heads + h) * dim;
            if (norm)
                rms_norm_row(src, dim, NULL, eps, dst);
            else
                memcpy(dst, src, sizeof(float) * (size_t)dim);
            rope_row(dst, dim, half, cos + b * half, sin + b * half, 1.0f);
        }
}

/* The new K=V row of each sequence: weighted RMSNorm, RoPE, then stored into the sliding-window ring
 * window [B, W, dim] at slot pos % W. */
void v4rl_kv_store(const float *x, i64 ldx, i64 B, i64 dim, const float *w, float eps, const float *cos,
                   const float *sin, i64 half, const i64 *pos, float *window, i64 W) {
    for (i64 b = 0; b < B; b++) {
        float *dst = window + (b * W + pos[b] % W) * dim;
        rms_norm_row(x + b * ldx, dim, w, eps, dst);
        rope_row(dst, dim, half, cos + b * half, sin + b * half, 1.0f);
    }
}

/* ------------------------------------------------------------------------------------------ compressor */
/* One token per row into a compressor's open window (attention.Compressor.step): kv/gate [B, width] raw
 * projections (row stride ld) go to slot pos % rate of buf_kv/buf_gate [B, rate, width]; a row whose window
 * closes pools it (softmax over the window of gate + ape per channel; with `overlap`, CSA's two series: the
 * previous window's Ca half from ov_kv/ov_gate [B, rate, d], gate -inf before the first, then this window's
 * Cb half), normalises (weight norm_w), applies RoPE at the window's first position with inv_freq (half
 * frequencies) and writes entry pos / rate of entries [B, cap, d]; with `overlap` this window's Ca half
 * (gate + ape) becomes the next prior. cap > pos / rate for every closing row (the caller grows it). */
void v4rl_compress_step(const float *kv, const float *gate, i64 ld, i64 B, i64 rate, i64 width, i64 d,
                        int overlap, const i64 *pos, float *buf_kv, float *buf_gate, float *entries, i64 cap,
                        float *ov_kv, float *ov_gate, const float *ape, const float *norm_w, float eps,
                        const float *inv_freq, i64 half) {
    float *pooled = malloc(sizeof(float) * (size_t)(d + 2 * half));
    if (pooled == NULL) return;
    float *c = pooled + d, *s = c + half;
    for (i64 b = 0; b < B; b++) {
        i64 slot = pos[b] % rate;
        float *bk = buf_kv + b * rate * width, *bg = buf_gate + b * rate * width;
        memcpy(bk + slot * width, kv + b * ld, sizeof(float) * (size_t)width);
        memcpy(bg + slot * width, gate + b * ld, sizeof(float) * (size_t)width);
        if (slot != rate - 1) continue;
        i64 index = pos[b] / rate;
        for (i64 ch = 0; ch < d; ch++) {
            float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
            i64 off = overlap ? d + ch : ch;
            float *okv = overlap ? ov_kv + b * rate * d : NULL, *og = overlap ? ov_gate + b * rate * d : NULL;
            if (overlap)
                for (i64 j = 0; j < rate; j++) mx = og[j * d + ch] > mx ? og[j * d + ch] : mx;
            for (i64 j = 0; j < rate; j++) {
                float g = bg[j * width + off] + ape[j * width + off];
                mx = g > mx ? g : mx;
            }
            if (overlap)
                for (i64 j = 0; j < rate; j++) sum += expf(og[j * d + ch] - mx);
            for (i64 j = 0; j < rate; j++) sum += expf(bg[j * width + off] + ape[j * width + off] - mx);
            if (overlap)
                for (i64 j = 0; j < rate; j++) acc += okv[j * d + ch] * (expf(og[j * d + ch] - mx) / sum);
            for (i64 j = 0; j < rate; j++)
                acc += bk[j * width + off] * (expf(bg[j * width + off] + ape[j * width + off] - mx) / sum);
            pooled[ch] = acc;
        }
        if (overlap)
            for (i64 j = 0; j < rate; j++)
                for (i64 ch = 0; ch < d; ch++) {
                    ov_kv[(b * rate + j) * d + ch] = bk[j * width + ch];
                    ov_gate[(b * rate + j) * d + ch] = bg[j * width + ch] + ape[j * width + ch];
                }
        float *e = entries + (b * cap + index) * d;
        rms_norm_row(pooled, d, norm_w, eps, e);
        float at = (float)(index * rate);
        for (i64 i = 0; i < half; i++) {
            c[i] = cosf(at * inv_freq[i]);
            s[i] = sinf(at * inv_freq[i]);
        }
        rope_row(e, d, half, c, s, 1.0f);
    }
    free(pooled);
}

/* ------------------------------------------------------------------------------------------ indexer */
typedef struct { float score; i64 index; } scored_t;

/* a ranks before b: higher score, or the same score and the earlier entry (attention.Indexer.select). */
static inline int ranks_before(scored_t a, scored_t b) {
    return a.score > b.score || (a.score == b.score && a.index < b.index);
}

static void sift_down(scored_t *h, i64 n, i64 i) {  /* min-heap by rank: the worst kept entry on top */
    for (;;) {
        i64 l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && ranks_before(h[w], h[l])) w = l;
        if (r < n && ranks_before(h[w], h[r])) w = r;
        if (w == i) return;
        scored_t t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

typedef struct {
    const float *q, *wraw, *keys;
    const i64 *pos;
    i64 rows, heads, dim, ldw, cap, rate, rows_per_seq, topk;
    i64 *sel;
} indexer_t;

static void indexer_rows(void *ctx, i64 task, int worker) {
    (void)worker;
    const indexer_t *a = (const indexer_t *)ctx;
    i64 topk = a->topk, heads = a->heads, dim = a->dim;
    scored_t *heap = malloc(sizeof(scored_t) * (size_t)(topk > 0 ? topk : 1));
    unsigned char *keep = malloc((size_t)(a->cap > 0 ? a->cap : 1));
    float scale = 1.0f / sqrtf((float)dim), wscale = 1.0f / sqrtf((float)heads);
    for (i64 b = task * ROWS_PER_TASK; b < (task + 1) * ROWS_PER_TASK && b < a->rows; b++) {
        i64 n = (a->pos[b] + 1) / a->rate, kept = 0;
        if (n > a->cap) n = a->cap;
        i64 *out = a->sel + b * topk;
        if (n <= topk || heap == NULL || keep == NULL) {  /* (out of memory: every entry, never silently none) */
            for (i64 t = 0; t < topk; t++) out[t] = t < n ? t : -1;
            continue;
        }
        const float *qb = a->q + b * heads * dim, *wb = a->wraw + b * a->ldw;
        const float *kb = a->keys + (b / a->rows_per_seq) * a->cap * dim;
        for (i64 t = 0; t < n; t++) {
            const float *k = kb + t * dim;
            float score = 0.0f;
            for (i64 h = 0; h < heads; h++) {
                float v = dot(qb + h * dim, k, dim);
                score += (v > 0.0f ? v : 0.0f) * scale * (wb[h] * wscale);
            }
            scored_t e = {score, t};
            if (kept < topk) {
                heap[kept++] = e;
                if (kept == topk)
                    for (i64 i = topk / 2 - 1; i >= 0; i--) sift_down(heap, topk, i);
            } else if (ranks_before(e, heap[0])) {
                heap[0] = e;
                sift_down(heap, topk, 0);
            }
        }
        if (n > 0) memset(keep, 0, (size_t)n);
        for (i64 i = 0; i < topk; i++) keep[heap[i].index] = 1;
        i64 j = 0;
        for (i64 t = 0; t < n; t++)
            if (keep[t]) out[j++] = t;
    }
    free(heap);
    free(keep);
}

/* Lightning indexer: score_t = sum_h w_h * ReLU(q_h . k_t) * dim^-0.5 with w = wraw * heads^-0.5, over the
 * (pos+1)/rate entries whose window closed; keeps the top `topk` (ties: the earlier entry) and writes their
 * indices ascending into sel [rows, topk], -1 after. q: [rows, heads, dim] (RoPE applied); wraw: [rows, heads]
 * with row stride ldw; row r is a query of sequence r / rows_per_seq, whose entries are keys[seq] [cap, dim]
 * (decode: one query per sequence; prefill: every position). */
void v4rl_indexer_select(const float *q, i64 rows, i64 heads, i64 dim, const float *wraw, i64 ldw, const float *keys,
                         i64 cap, i64 rate, const i64 *pos, i64 rows_per_seq, i64 topk, i64 *sel, int threads) {
    indexer_t a = {q, wraw, keys, pos, rows, heads, dim, ldw, cap, rate, rows_per_seq, topk, sel};
    parallel_for(threads, (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, indexer_rows, &a);
}

/* ------------------------------------------------------------------------------------------ attention */
/* Sink attention of one query row (all heads) over nkeys K=V rows, then V's RoPE undone (conjugate rotation):
 * per head softmax over [q.k_j * scale ..., sink], the sink's probability dropped (attention._attend). */
static void attend_keys(const float *q, i64 heads, i64 dim, const float *const *keys, i64 nkeys, const float *sinks,
                        float scale, const float *c, const float *s, i64 half, float *out, float *logits) {
    for (i64 h = 0; h < heads; h++) {
        const float *qh = q + h * dim;
        float *o = out + h * dim, mx = sinks[h], sum;
        for (i64 j = 0; j < nkeys; j++) {
            logits[j] = dot(qh, keys[j], dim) * scale;
            mx = logits[j] > mx ? logits[j] : mx;
        }
        sum = expf(sinks[h] - mx);
        for (i64 j = 0; j < nkeys; j++) {
            logits[j] = expf(logits[j] - mx);
            sum += logits[j];
        }
        memset(o, 0, sizeof(float) * (size_t)dim);
        for (i64 j = 0; j < nkeys; j++) {
            float pj = logits[j] / sum;
            const float *k = keys[j];
            for (i64 ch = 0; ch < dim; ch++) o[ch] += pj * k[ch];
        }
        rope_row(o, dim, half, c, s, -1.0f);
    }
}

typedef struct {
    const float *q, *window, *entries, *sinks, *cos, *sin;
    const i64 *pos, *sel;
    i64 heads, dim, W, cap, rate, ksel, half, seq_len;
    float scale;
    float *out;
} attend_t;

/* The compressed entries row r attends after its window keys: those in sel (CSA) or the complete ones (HCA). */
static i64 add_entries(const attend_t *a, i64 r, const float *entries, const float **keys, i64 nkeys) {
    if (entries == NULL) return nkeys;
    if (a->sel != NULL) {
        for (i64 i = 0; i < a->ksel; i++) {
            i64 t = a->sel[r * a->ksel + i];
            if (t >= 0) keys[nkeys++] = entries + t * a->dim;
        }
        return nkeys;
    }
    i64 n = (a->pos[r] + 1) / a->rate;
    if (n > a->cap) n = a->cap;
    for (i64 t = 0; t < n; t++) keys[nkeys++] = entries + t * a->dim;
    return nkeys;
}

static void attend_row(void *ctx, i64 r, int worker) {
    (void)worker;
    const attend_t *a = (const attend_t *)ctx;
    i64 p = a->pos[r], nkeys = 0, max_keys = a->W + (a->sel ? a->ksel : a->cap);
    const float **keys = malloc(sizeof(float *) * (size_t)max_keys);
    float *logits = malloc(sizeof(float) * (size_t)max_keys);
    if (keys == NULL || logits == NULL) {
        free(keys);
        free(logits);
        return;
    }
    const float *entries = a->entries;
    if (a->seq_len == 0) {  /* decode: ring slot j holds position p - ((p - j) mod W), a token once that is >= 0 */
        for (i64 j = 0; j < a->W; j++)
            if (((p - j) % a->W + a->W) % a->W <= p) keys[nkeys++] = a->window + (r * a->W + j) * a->dim;
        entries = entries ? entries + r * a->cap * a->dim : NULL;
    } else {  /* prefill: row r is position p of sequence r / seq_len; its window is the sequence's last W rows */
        i64 seq = r / a->seq_len, first = p - a->W + 1 > 0 ? p - a->W + 1 : 0;
        for (i64 t = first; t <= p; t++) keys[nkeys++] = a->window + (seq * a->seq_len + t) * a->dim;
        entries = entries ? entries + seq * a->cap * a->dim : NULL;
    }
    nkeys = add_entries(a, r, entries, keys, nkeys);
    attend_keys(a->q + r * a->heads * a->dim, a->heads, a->dim, keys, nkeys, a->sinks, a->scale,
                a->cos + r * a->half, a->sin + r * a->half, a->half, a->out + r * a->heads * a->dim, logits);
    free(keys);
    free(logits);
}

/* Sink attention with K=V (attention.Attention._attend + the conjugate RoPE of _output) for `rows` queries
 * q [rows, heads, dim] at positions pos [rows]. Keys: the query's sliding window, then compressed entries
 * ([.., cap, dim] per sequence, NULL for sliding layers): those listed in sel [rows, ksel] (-1 = none; CSA)
 * or, with sel NULL, the (pos+1)/rate complete ones (HCA). sinks [heads]: one extra logit per head whose
 * probability is dropped. seq_len == 0 (decode): one query per sequence, `window` is the ring [rows, W, dim];
 * seq_len > 0 (prefill): rows are seq_len consecutive positions 0.. of each sequence and `window` its K=V rows
 * [rows, dim]. out [rows, heads, dim] with V's RoPE undone at the query position (cos/sin [rows, half]). */
void v4rl_attend(const float *q, i64 rows, i64 heads, i64 dim, const float *window, i64 W, i64 seq_len,
                 const i64 *pos, const float *entries, i64 cap, i64 rate, const i64 *sel, i64 ksel,
                 const float *sinks, float scale, const float *cos, const float *sin, i64 half, float *out,
                 int threads) {
    attend_t a = {q, window, entries, sinks, cos, sin, pos, sel, heads, dim, W, cap, rate, ksel, half, seq_len,
                  scale, out};
    parallel_for(threads, rows, attend_row, &a);
}

/* ------------------------------------------------------------------------------------------ sampling */
/* One token per row of logits [B, V] (the rollout engine's plain-temperature rows): with temperature t > 0 the
 * first token whose cumulative weight exp((logit - max) / t) (float32 exp, summed in float64 in index order)
 * exceeds u times the row's total, for the row's uniform draw u in [0, 1) (inverse-CDF sampling); t == 0 takes
 * the first maximum. logprob: the RAW log-softmax
 * of the unprocessed logits at the chosen token (what a trainer recomputes). */
void v4rl_sample(const float *logits, i64 B, i64 V, const float *temperature, const double *uniform, i64 *token,
                 float *logprob) {
    for (i64 b = 0; b < B; b++) {
        const float *l = logits + b * V;
        float mx = l[0];
        i64 best = 0;
        for (i64 v = 1; v < V; v++)
            if (l[v] > mx) {
                mx = l[v];
                best = v;
            }
        double raw = 0.0;
        for (i64 v = 0; v < V; v++) raw += (double)expf(l[v] - mx);
        i64 chosen = best;
        float t = temperature[b];
        if (t > 0.0f) {  /* at temperature 1 the weights are the raw ones: no second pass of exp */
            float inv_t = 1.0f / t;
            double total = raw, acc = 0.0;
            if (t != 1.0f) {
                total = 0.0;
                for (i64 v = 0; v < V; v++) total += (double)expf((l[v] - mx) * inv_t);
            }
            double target = uniform[b] * total;
            chosen = V - 1;  /* rounding can leave the running sum a hair below the target at the end */
            for (i64 v = 0; v < V; v++) {
                acc += (double)expf(t != 1.0f ? (l[v] - mx) * inv_t : l[v] - mx);
                if (acc > target) {
                    chosen = v;
                    break;
                }
            }
        }
        token[b] = chosen;
        logprob[b] = (float)((double)(l[chosen] - mx) - log(raw));
    }
}
