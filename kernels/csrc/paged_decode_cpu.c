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

#include "cpu_math.h"

#define MAX_ROW 4096     /* Hk * D of one cached slot, in floats */
#define MAX_Q_HEADS 256

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

/* A walk over a request's positions in order: its block and the offset inside it, advanced by
 * one without dividing (the slot of position p was table[p / bs] * bs + p % bs: a 64-bit
 * division per position and pass, dearer than the position's arithmetic at D = 64). */
typedef struct {
    const int32_t *table;
    int64_t bs, blk, off;
} pos_walk;

static inline pos_walk walk_from(const int32_t *table, int64_t bs, int64_t p) {
    pos_walk w = {table, bs, p / bs, p % bs};
    return w;
}

/* The walk's current slot; then one position on. */
static inline int64_t walk_next(pos_walk *w) {
    const int64_t slot = (int64_t)w->table[w->blk] * w->bs + w->off;
    if (++w->off == w->bs) {
        w->off = 0;
        w->blk++;
    }
    return slot;
}

/* Heads [h0, h0 + nh) of cache slot `slot` as float32: in place for a float32 cache, converted
 * into `row` for bfloat16. */
static inline const float *slot_row(const void *cache, int dtype, int64_t slot, int64_t hk, int64_t h0, int64_t d,
                                    int64_t nh, float *row) {
    const int64_t off = (slot * hk + h0) * d;
    if (dtype == 0) return (const float *)cache + off;
    load_row(cache, dtype, off, nh * d, row);
    return row;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SCORE_BLOCK 8 /* positions scored at once by dot8 */

/* Eight dot products of length d (a multiple of 8) at once, q against the rows kr[0..7], as one
 * vector of 8 sums. Why: a single dot product is one chain of dependent FMAs ending in a
 * horizontal sum (~40 cycles at d = 64); eight independent chains keep both FMA ports busy and
 * share one transposing reduction (hadd tree). With the walk above: 1.2-1.3x per call at batch
 * 1-32 on a 2-core Zen 3 (benchmarks/paged_decode_ab.py, RESULTS.md session 18). */
static inline __m256 dot8(const float *q, const float *const kr[SCORE_BLOCK], int64_t d) {
    __m256 a[SCORE_BLOCK];
    for (int r = 0; r < SCORE_BLOCK; r++) a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < SCORE_BLOCK; r++) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[r] + i), a[r]);
    }
    /* hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]: two levels leave
     * row r's low-half sum in lane r % 4 of the low 128 bits and its high-half sum in the high. */
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

/* The score pass of ATTEND below, SCORE_BLOCK positions at a time from p while a whole block
 * remains, when D is a multiple of 8 on an AVX2 build; the positions left over (and all of them
 * elsewhere) take the one-at-a-time loop. A bfloat16 cache's block of rows is widened into the
 * SCORE_ROWS * nh * D floats ATTEND allocates after the scores. */
#if defined(__AVX2__) && defined(__FMA__)
#define SCORE_ROWS SCORE_BLOCK
#define SCORE_BLOCKS(DIM)                                                                           \
    if (DIM(d) % 8 == 0) {                                                                          \
        float *wide_rows = scores + len * nq;                                                       \
        for (; p + SCORE_BLOCK <= n; p += SCORE_BLOCK) {                                            \
            const float *kr[SCORE_BLOCK], *kj[SCORE_BLOCK];                                         \
            for (int r = 0; r < SCORE_BLOCK; r++)                                                   \
                kr[r] = slot_row(k, dtype, walk_next(&kw), hk, h0, dd, nh, wide_rows + r * nh * dd); \
            for (int64_t j = 0; j < nq; j++) {                                                      \
                for (int r = 0; r < SCORE_BLOCK; r++) kj[r] = kr[r] + (j / g) * dd;                 \
                _mm256_storeu_ps(scores + j * len + (p - lo),                                       \
                                 _mm256_mul_ps(dot8(qh + j * dd, kj, dd), _mm256_set1_ps(scale)));  \
            }                                                                                       \
        }                                                                                           \
    }
#else
#define SCORE_ROWS 0
#define SCORE_BLOCKS(DIM)
#endif

/* One request, KV heads [h0, h1), each with its GQA group of `g` query heads, against positions
 * [lo, n). A task covers several heads so it walks each cached slot's Hk * D row contiguously
 * (every cache line and page it touches is used whole, where one head per task read 1/Hk of
 * each line's neighbourhood and left the rest to another task). Written once as a macro and
 * instantiated for the common head sizes so the products over D fully unroll; DIM(d) is that
 * constant, or the runtime d in the generic instance. q/out point at the request's first query
 * head; scores are [query head - h0 * g][position]. */
#define ATTEND(NAME, DIM)                                                                           \
    static int NAME(const float *q, float *out, const void *k, const void *v, int dtype,           \
                    const int32_t *table, int64_t lo, int64_t n, int64_t hk, int64_t h0, int64_t h1, \
                    int64_t d, int64_t bs, int64_t g, float scale) {                                \
        const int64_t dd = DIM(d);                                                                  \
        const int64_t len = n - lo, nh = h1 - h0, nq = nh * g;                                      \
        /* scores, then (a bfloat16 cache) a block of SCORE_BLOCK slot rows widened to float32 */  \
        const int64_t wide = dtype == 0 ? 0 : SCORE_ROWS * nh * dd;                                  \
        float *scores = (float *)malloc((size_t)(len * nq + wide) * sizeof(float));                 \
        if (scores == NULL) return -3;                                                              \
        float row[MAX_ROW];                                                                         \
        float sum[MAX_Q_HEADS];                                                                     \
        const float *qh = q + h0 * g * dd;                                                          \
        int64_t p = lo;                                                                             \
        pos_walk kw = walk_from(table, bs, lo);                                                     \
        SCORE_BLOCKS(DIM)                                                                           \
        for (; p < n; p++) {                                                                        \
            const float *kr = slot_row(k, dtype, walk_next(&kw), hk, h0, dd, nh, row);                \
            for (int64_t j = 0; j < nq; j++) {                                                      \
                const float *qj = qh + j * dd, *kj = kr + (j / g) * dd;                             \
                float s = 0.0f;                                                                     \
                _Pragma("omp simd reduction(+ : s)") for (int64_t i = 0; i < dd; i++) s += qj[i] * kj[i]; \
                scores[j * len + (p - lo)] = s * scale;                                             \
            }                                                                                       \
        }                                                                                           \
        float *oh = out + h0 * g * dd;                                                              \
        for (int64_t j = 0; j < nq; j++) {                                                          \
            float *sj = scores + j * len;                                                           \
            float m = -INFINITY;                                                                    \
            _Pragma("omp simd reduction(max : m)") for (int64_t i = 0; i < len; i++) m = sj[i] > m ? sj[i] : m; \
            float t = 0.0f;                                                                         \
            _Pragma("omp simd reduction(+ : t)") for (int64_t i = 0; i < len; i++) {                \
                sj[i] = exp_nonpositive(sj[i] - m);                                                 \
                t += sj[i];                                                                         \
            }                                                                                       \
            sum[j] = t;                                                                             \
        }                                                                                           \
        memset(oh, 0, (size_t)(nq * dd) * sizeof(float));                                          \
        pos_walk vw = walk_from(table, bs, lo);                                                     \
        for (int64_t p = lo; p < n; p++) {                                                          \
            const float *vr = slot_row(v, dtype, walk_next(&vw), hk, h0, dd, nh, row);               \
            for (int64_t j = 0; j < nq; j++) {                                                      \
                const float w = scores[j * len + (p - lo)];                                         \
                const float *vj = vr + (j / g) * dd;                                                \
                float *oj = oh + j * dd;                                                            \
                _Pragma("omp simd") for (int64_t i = 0; i < dd; i++) oj[i] += w * vj[i];            \
            }                                                                                       \
        }                                                                                           \
        for (int64_t j = 0; j < nq; j++) {                                                          \
            const float inv = 1.0f / sum[j];                                                        \
            float *oj = oh + j * dd;                                                                \
            _Pragma("omp simd") for (int64_t i = 0; i < dd; i++) oj[i] *= inv;                      \
        }                                                                                           \
        free(scores);                                                                               \
        return 0;                                                                                   \
    }

#define DIM_RUNTIME(d) (d)
#define DIM_64(d) 64
#define DIM_128(d) 128
ATTEND(attend_generic, DIM_RUNTIME)
ATTEND(attend_64, DIM_64)
ATTEND(attend_128, DIM_128)

int pd_paged_decode(const float *q, float *out, const void *k, const void *v, int dtype,
                    const int32_t *tables, int64_t table_stride, const int64_t *seq_lens,
                    int64_t batch, int64_t hq, int64_t hk, int64_t d, int64_t bs, int64_t window,
                    float scale, int nthreads) {
    if (dtype != 0 && dtype != 1) return -1;
    if (hk <= 0 || hq % hk != 0 || hq > MAX_Q_HEADS || hk * d > MAX_ROW) return -2;
    const int64_t g = hq / hk;
    /* Tasks of whole requests when there are enough of them to keep every thread busy; else each
     * request's heads split into up to Hk chunks (batch-1 decode still uses every thread). */
    int64_t chunks = nthreads > 1 ? (4 * nthreads + batch - 1) / batch : 1;
    chunks = chunks < 1 ? 1 : (chunks > hk ? hk : chunks);
    const int64_t per = (hk + chunks - 1) / chunks;
    chunks = (hk + per - 1) / per;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t t = 0; t < batch * chunks; t++) {
        const int64_t b = t / chunks, h0 = (t % chunks) * per;
        const int64_t h1 = h0 + per < hk ? h0 + per : hk;
        const int64_t n = seq_lens[b];
        const int64_t lo = (window > 0 && n > window) ? n - window : 0;
        const float *qb = q + b * hq * d;
        float *ob = out + b * hq * d;
        if (n <= 0) { /* nothing to attend to: zeros, as the torch reference gives */
            memset(ob + h0 * g * d, 0, (size_t)((h1 - h0) * g * d) * sizeof(float));
            continue;
        }
        const int32_t *tb = tables + b * table_stride;
        int rc = d == 64    ? attend_64(qb, ob, k, v, dtype, tb, lo, n, hk, h0, h1, d, bs, g, scale)
                 : d == 128 ? attend_128(qb, ob, k, v, dtype, tb, lo, n, hk, h0, h1, d, bs, g, scale)
                            : attend_generic(qb, ob, k, v, dtype, tb, lo, n, hk, h0, h1, d, bs, g, scale);
        if (rc != 0) {
#pragma omp atomic write
            status = rc;
        }
    }
    return status;
}
