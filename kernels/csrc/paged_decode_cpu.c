/* Paged decode attention for the CPU: one query token per request, K/V read in place from the
 * block-paged cache (no gather copy, no padding, no mask tensor), scores and softmax in float32.
 *
 * Why a C kernel: in torch, decode attention over a paged cache costs five passes over each
 * request's context (the block gather of K and V, two batched products on the gathered copy, the
 * mask and softmax) plus padding to the group's longest row. Reading K and V once each is the
 * memory floor; this kernel reads exactly that (two passes per (request, KV head): scores, then
 * the weighted sum of V). Built at first use by kernels/native.py with the machine's C compiler
 * (-O3 -march=native -fopenmp); OpenMP resolves to the libgomp torch already loaded, so the
 * kernel shares torch's thread pool instead of starting a second one.
 *
 * Layouts (all contiguous, row-major):
 *   q, out       (B, Hq, D) float32
 *   k, v         (num_blocks, block_size, Hk, D), float32 (dtype 0) or bfloat16 (dtype 1)
 *   tables       (B, table_stride) int32: block ids of each request, in position order
 *   seq_lens     (B,) int64: the context length including the new token
 * window > 0: the new token (position seq_len - 1) sees positions >= seq_len - window.
 * Returns 0, or a negative code the caller turns into a fallback (never a wrong answer).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 512
#define MAX_GROUP 64

static inline void load_row(const void *base, int dtype, int64_t off, int64_t d, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + off, (size_t)d * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + off;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) {
            uint32_t u = (uint32_t)src[i] << 16; /* bfloat16 is the top half of a float32 */
            float f;
            memcpy(&f, &u, sizeof f);
            dst[i] = f;
        }
    }
}

/* One (request, KV head): its GQA group of `g` query heads against positions [lo, n). */
static int attend_one(const float *q, float *out, const void *k, const void *v, int dtype,
                      const int32_t *table, int64_t lo, int64_t n, int64_t hk, int64_t h,
                      int64_t d, int64_t bs, int64_t g, float scale) {
    int64_t len = n - lo;
    float *scores = (float *)malloc((size_t)(len * g) * sizeof(float)); /* [g][len] */
    if (scores == NULL) return -3;
    float row[MAX_HEAD_DIM];
    float mx[MAX_GROUP], sum[MAX_GROUP];
    for (int64_t j = 0; j < g; j++) mx[j] = -INFINITY;
    for (int64_t p = lo; p < n; p++) {
        int64_t off = (((int64_t)table[p / bs] * bs + p % bs) * hk + h) * d;
        const float *kr;
        if (dtype == 0) {
            kr = (const float *)k + off;
        } else {
            load_row(k, dtype, off, d, row);
            kr = row;
        }
        for (int64_t j = 0; j < g; j++) {
            const float *qj = q + j * d;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; i++) s += qj[i] * kr[i];
            s *= scale;
            scores[j * len + (p - lo)] = s;
            if (s > mx[j]) mx[j] = s;
        }
    }
    for (int64_t j = 0; j < g; j++) {
        float *sj = scores + j * len;
        float t = 0.0f;
        for (int64_t i = 0; i < len; i++) {
            sj[i] = expf(sj[i] - mx[j]);
            t += sj[i];
        }
        sum[j] = t;
        float *oj = out + j * d;
        for (int64_t i = 0; i < d; i++) oj[i] = 0.0f;
    }
    for (int64_t p = lo; p < n; p++) {
        int64_t off = (((int64_t)table[p / bs] * bs + p % bs) * hk + h) * d;
        const float *vr;
        if (dtype == 0) {
            vr = (const float *)v + off;
        } else {
            load_row(v, dtype, off, d, row);
            vr = row;
        }
        for (int64_t j = 0; j < g; j++) {
            float w = scores[j * len + (p - lo)];
            float *oj = out + j * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) oj[i] += w * vr[i];
        }
    }
    for (int64_t j = 0; j < g; j++) {
        float inv = 1.0f / sum[j];
        float *oj = out + j * d;
        for (int64_t i = 0; i < d; i++) oj[i] *= inv;
    }
    free(scores);
    return 0;
}

int pd_paged_decode(const float *q, float *out, const void *k, const void *v, int dtype,
                    const int32_t *tables, int64_t table_stride, const int64_t *seq_lens,
                    int64_t batch, int64_t hq, int64_t hk, int64_t d, int64_t bs, int64_t window,
                    float scale, int nthreads) {
    if (dtype != 0 && dtype != 1) return -1;
    if (d > MAX_HEAD_DIM || hk <= 0 || hq % hk != 0 || hq / hk > MAX_GROUP) return -2;
    int64_t g = hq / hk;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t t = 0; t < batch * hk; t++) {
        int64_t b = t / hk, h = t % hk;
        int64_t n = seq_lens[b];
        int64_t lo = (window > 0 && n > window) ? n - window : 0;
        const float *qb = q + (b * hq + h * g) * d;
        float *ob = out + (b * hq + h * g) * d;
        if (n <= 0) { /* nothing to attend to: zeros, as the torch reference gives */
            memset(ob, 0, (size_t)(g * d) * sizeof(float));
            continue;
        }
        int rc = attend_one(qb, ob, k, v, dtype, tables + b * table_stride, lo, n, hk, h, d, bs, g, scale);
        if (rc != 0) {
#pragma omp atomic write
            status = rc;
        }
    }
    return status;
}
