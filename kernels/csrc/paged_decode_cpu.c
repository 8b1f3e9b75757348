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

/* Positions the passes below prefetch ahead of the one they read. Why: a request's blocks lie
 * wherever the pool had them, so the hardware prefetcher restarts at every block (16 slots of
 * a few hundred bytes); without this, the loads of the rows took ~45% of the kernel's samples
 * and a batch of 32 x 512 positions read at ~5 GB/s (RESULTS.md, session 30). */
#define PREFETCH_POSITIONS 16

/* A second walk, PREFETCH_POSITIONS ahead of a pass: each step passes one slot, until n, and
 * prefetches its rows (heads [h0, h0 + nh)) when its block jumps (below). */
typedef struct {
    pos_walk w;
    int64_t p, n;
} ahead_walk;

static inline ahead_walk ahead_from(const int32_t *table, int64_t bs, int64_t lo, int64_t n) {
    const int64_t p = lo + PREFETCH_POSITIONS < n ? lo + PREFETCH_POSITIONS : n;
    ahead_walk a = {walk_from(table, bs, p), p, n};
    return a;
}

static inline void ahead_step(ahead_walk *a, const void *cache, int dtype, int64_t hk, int64_t h0, int64_t d,
                              int64_t nh, int always) {
    if (a->p >= a->n) return;
    a->p++;
    /* A block right after the one before it in memory is the hardware prefetcher's (prefetching
     * those too cost 10-25% on a pool handed out in order); a jump elsewhere is ours. */
    const int64_t blk = a->w.blk;
    const int contiguous = blk > 0 && a->w.table[blk] == a->w.table[blk - 1] + 1;
    const int64_t slot = walk_next(&a->w);
    if (contiguous && !always) return; /* `always`: the vdpbf16ps score pass (DOT_BLOCKS) */
    const int64_t elem = dtype == 0 ? 4 : 2, off = (slot * hk + h0) * d * elem;
    const char *row = (const char *)cache + off;
    for (int64_t b = 0; b < nh * d * elem; b += 64) __builtin_prefetch(row + b, 0, 3);
}

static inline void ahead_next(ahead_walk *a, const void *cache, int dtype, int64_t hk, int64_t h0, int64_t d,
                              int64_t nh) {
    ahead_step(a, cache, dtype, hk, h0, d, nh, 0);
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
            for (int r = 0; r < SCORE_BLOCK; r++) {                                                 \
                ahead_next(&kpf, k, dtype, hk, h0, dd, nh);                                         \
                kr[r] = slot_row(k, dtype, walk_next(&kw), hk, h0, dd, nh, wide_rows + r * nh * dd); \
            }                                                                                       \
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

/* The score pass on vdpbf16ps (AVX512-BF16 builds), DOT_BLOCK positions at a time, for a
 * bfloat16 cache whose query rows are bfloat16 values too (a bfloat16 model's q, widened: every
 * float's low half zero, checked per task). Each pair product is exact in float32 and summed
 * with one rounding, as an FMA would; only the order of the sum differs from the AVX2 blocks.
 * Why: those widen each K row to float32 into a buffer and run AVX2-width FMAs over it, ~40
 * instructions per position and KV head at D = 64 with 3 query heads; here the cache's bytes
 * meet the query's straight from memory, 16 positions per sweep of one query head, ending in
 * one transposing reduction (hsum16). It reads each row a head at a time across the block's 16
 * rows, a pattern the hardware prefetcher does not follow, so it prefetches every block's rows
 * ahead, in order or not. Per call, against the AVX2 blocks: 1.34-1.50x at 16-32 rows of 256-512
 * positions, 1.03-1.11x where the cache no longer holds the context (RESULTS.md, session 31). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define DOT_BLOCK 16

static inline int all_bf16(const float *x, int64_t n) {
    uint32_t low = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        low |= u;
    }
    return (low & 0xffffu) == 0;
}

/* Lane r of the result is the sum of the 16 lanes of a[r]: three levels of pairwise merges
 * (within 128-bit lanes, then across them), 45 instructions for 16 sums. */
static inline __m512 hsum16(const __m512 a[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

#define DOT_BLOCKS(DIM)                                                                             \
    if (dtype == 1 && DIM(d) % 32 == 0 && all_bf16(qh, nq * dd)) {                                  \
        uint16_t *qb = (uint16_t *)(scores + len * nq + wide);                                       \
        for (int64_t i = 0; i < nq * dd; i++) {                                                     \
            uint32_t u;                                                                             \
            memcpy(&u, qh + i, sizeof u);                                                           \
            qb[i] = (uint16_t)(u >> 16);                                                            \
        }                                                                                           \
        for (; p + DOT_BLOCK <= n; p += DOT_BLOCK) {                                                \
            const uint16_t *kr[DOT_BLOCK];                                                          \
            for (int r = 0; r < DOT_BLOCK; r++) {                                                   \
                ahead_step(&kpf, k, dtype, hk, h0, dd, nh, 1);                                      \
                kr[r] = (const uint16_t *)k + (walk_next(&kw) * hk + h0) * dd;                      \
            }                                                                                       \
            for (int64_t j = 0; j < nq; j++) {                                                      \
                const int64_t kh = (j / g) * dd;                                                    \
                __m512 acc[DOT_BLOCK];                                                              \
                for (int r = 0; r < DOT_BLOCK; r++) acc[r] = _mm512_setzero_ps();                   \
                for (int64_t i = 0; i < dd; i += 32) {                                              \
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qb + j * dd + i)); \
                    for (int r = 0; r < DOT_BLOCK; r++)                                             \
                        acc[r] = _mm512_dpbf16_ps(acc[r], qv,                                       \
                                                  (__m512bh)_mm512_loadu_si512((const void *)(kr[r] + kh + i))); \
                }                                                                                   \
                _mm512_storeu_ps(scores + j * len + (p - lo), _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale))); \
            }                                                                                       \
        }                                                                                           \
    }
#define DOT_Q_SCRATCH(nq, dd) (((nq) * (dd) + 1) / 2) /* floats that hold the packed q */
#else
#define DOT_BLOCKS(DIM)
#define DOT_Q_SCRATCH(nq, dd) 0
#endif

/* The weighted sum of V for the query heads of one KV head, accumulated in registers: for each
 * run of up to JB of its g query heads, one sweep over the positions keeps their JB x D/VW
 * accumulators in vector registers and widens each V row once for all of them. Why: the sweep
 * that visits every query head of a position in turn kept its outputs in memory, a load and a
 * store per vector per head per position, the hottest loop of the kernel once the rows' reads
 * were prefetched (RESULTS.md, session 30). Each output sums its positions in the same
 * order, from zero, with one multiply-add each, as before. GCC's vector extension: 16 lanes on
 * AVX-512, 8 on AVX2, 4 elsewhere. o: this KV head's g x D outputs (unnormalised); scores:
 * [query head][position - lo], the group's first row at `scores`. */
#if defined(__AVX512F__)
#define PV_VW 16
#define PV_ACC_REGS 24
#elif defined(__AVX2__)
#define PV_VW 8
#define PV_ACC_REGS 8
#else
#define PV_VW 4
#define PV_ACC_REGS 8
#endif
typedef float pv_vf __attribute__((vector_size(PV_VW * 4)));
typedef uint16_t pv_vh __attribute__((vector_size(PV_VW * 2)));
typedef uint32_t pv_vu __attribute__((vector_size(PV_VW * 4)));

static inline pv_vf pv_load(const void *base, int dtype, int64_t off) {
    pv_vf f;
    if (dtype == 0) {
        memcpy(&f, (const float *)base + off, sizeof f);
    } else {
        pv_vh h;
        memcpy(&h, (const uint16_t *)base + off, sizeof h);
        const pv_vu u = __builtin_convertvector(h, pv_vu) << 16; /* bfloat16: the top half of a float32 */
        memcpy(&f, &u, sizeof f);
    }
    return f;
}

#define PV_RUN(NAME, DIM, JB)                                                                      \
    static void NAME(const float *scores, int64_t len, const void *v, int dtype, const int32_t *table, \
                     int64_t lo, int64_t n, int64_t hk, int64_t h, int64_t bs, float *o) {        \
        enum { NV = (DIM) / PV_VW };                                                               \
        pv_vf acc[JB][NV];                                                                         \
        _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++)                                       \
            _Pragma("GCC unroll 16") for (int t = 0; t < NV; t++) acc[j][t] = (pv_vf){0};          \
        pos_walk vw = walk_from(table, bs, lo);                                                    \
        ahead_walk vpf = ahead_from(table, bs, lo, n);                                             \
        for (int64_t p = lo; p < n; p++) {                                                         \
            ahead_next(&vpf, v, dtype, hk, h, DIM, 1);                                             \
            const int64_t off = (walk_next(&vw) * hk + h) * (DIM);                                 \
            pv_vf vr[NV];                                                                          \
            _Pragma("GCC unroll 16") for (int t = 0; t < NV; t++) vr[t] = pv_load(v, dtype, off + t * PV_VW); \
            _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++) {                                 \
                const float w = scores[j * len + (p - lo)];                                        \
                _Pragma("GCC unroll 16") for (int t = 0; t < NV; t++) acc[j][t] += w * vr[t];      \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++)                                       \
            _Pragma("GCC unroll 16") for (int t = 0; t < NV; t++)                                  \
                memcpy(o + j * (DIM) + t * PV_VW, &acc[j][t], sizeof acc[j][t]);                   \
    }
/* Query heads per sweep: as many as PV_ACC_REGS accumulators hold, 1 to 6. */
#define PV_JB(DIM) ((PV_ACC_REGS * PV_VW / (DIM)) < 1 ? 1 : (PV_ACC_REGS * PV_VW / (DIM)) > 6 ? 6 : (PV_ACC_REGS * PV_VW / (DIM)))
#define PV_RUNS(DIM)                                                                               \
    PV_RUN(pv_##DIM##_1, DIM, 1)                                                                   \
    PV_RUN(pv_##DIM##_2, DIM, 2)                                                                   \
    PV_RUN(pv_##DIM##_3, DIM, 3)                                                                   \
    PV_RUN(pv_##DIM##_4, DIM, 4)                                                                   \
    PV_RUN(pv_##DIM##_5, DIM, 5)                                                                   \
    PV_RUN(pv_##DIM##_6, DIM, 6)                                                                   \
    static void pv_##DIM(const float *scores, int64_t len, const void *v, int dtype, const int32_t *table, \
                         int64_t lo, int64_t n, int64_t hk, int64_t h, int64_t bs, int64_t g, float *o) { \
        for (int64_t j0 = 0; j0 < g;) {                                                            \
            const int64_t jb = g - j0 < PV_JB(DIM) ? g - j0 : PV_JB(DIM);                          \
            const float *sj = scores + j0 * len;                                                   \
            float *oj = o + j0 * (DIM);                                                            \
            switch (jb) {                                                                          \
                case 1: pv_##DIM##_1(sj, len, v, dtype, table, lo, n, hk, h, bs, oj); break;       \
                case 2: pv_##DIM##_2(sj, len, v, dtype, table, lo, n, hk, h, bs, oj); break;       \
                case 3: pv_##DIM##_3(sj, len, v, dtype, table, lo, n, hk, h, bs, oj); break;       \
                case 4: pv_##DIM##_4(sj, len, v, dtype, table, lo, n, hk, h, bs, oj); break;       \
                case 5: pv_##DIM##_5(sj, len, v, dtype, table, lo, n, hk, h, bs, oj); break;       \
                default: pv_##DIM##_6(sj, len, v, dtype, table, lo, n, hk, h, bs, oj); break;      \
            }                                                                                      \
            j0 += jb;                                                                              \
        }                                                                                          \
    }
PV_RUNS(64)
PV_RUNS(128)

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
        float *scores = (float *)malloc((size_t)(len * nq + wide + DOT_Q_SCRATCH(nq, dd)) * sizeof(float)); \
        if (scores == NULL) return -3;                                                              \
        float row[MAX_ROW];                                                                         \
        float sum[MAX_Q_HEADS];                                                                     \
        const float *qh = q + h0 * g * dd;                                                          \
        int64_t p = lo;                                                                             \
        pos_walk kw = walk_from(table, bs, lo);                                                     \
        ahead_walk kpf = ahead_from(table, bs, lo, n);                                              \
        DOT_BLOCKS(DIM)                                                                             \
        SCORE_BLOCKS(DIM)                                                                           \
        for (; p < n; p++) {                                                                        \
            ahead_next(&kpf, k, dtype, hk, h0, dd, nh);                                             \
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
        if (PV(DIM, dd) == NULL) {                                                                  \
            memset(oh, 0, (size_t)(nq * dd) * sizeof(float));                                      \
            pos_walk vw = walk_from(table, bs, lo);                                                 \
            ahead_walk vpf = ahead_from(table, bs, lo, n);                                          \
            for (int64_t p = lo; p < n; p++) {                                                      \
                ahead_next(&vpf, v, dtype, hk, h0, dd, nh);                                         \
                const float *vr = slot_row(v, dtype, walk_next(&vw), hk, h0, dd, nh, row);           \
                for (int64_t j = 0; j < nq; j++) {                                                  \
                    const float w = scores[j * len + (p - lo)];                                     \
                    const float *vj = vr + (j / g) * dd;                                            \
                    float *oj = oh + j * dd;                                                        \
                    _Pragma("omp simd") for (int64_t i = 0; i < dd; i++) oj[i] += w * vj[i];        \
                }                                                                                   \
            }                                                                                       \
        } else {                                                                                    \
            for (int64_t hh = 0; hh < nh; hh++)                                                     \
                PV(DIM, dd)(scores + hh * g * len, len, v, dtype, table, lo, n, hk, h0 + hh, bs, g, \
                            oh + hh * g * dd);                                                      \
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
/* The register-accumulating V pass of a head size, or NULL (the generic sweep above). */
typedef void (*pv_fn)(const float *, int64_t, const void *, int, const int32_t *, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int64_t, float *);
#define PV(DIM, d) (DIM(d) == 64 ? (pv_fn)pv_64 : DIM(d) == 128 ? (pv_fn)pv_128 : (pv_fn)NULL)
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
