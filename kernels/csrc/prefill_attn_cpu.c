/* Prefill attention for the CPU: every prompt chunk of a step in one call (varlen), K/V read from
 * the block-paged cache in place, causal (and sliding-window) masking by position, softmax online
 * in float32 (flash attention's recurrence, one tile of keys at a time).
 *
 * Why a C kernel: torch's CPU flash SDPA ran the bench Llama's prefill attention at 29-35 GFLOP/s
 * on one core of an AVX512-BF16 EPYC (13.9 ms a layer at 512 tokens, 36.7 at 1,024) where its bf16
 * GEMMs run ~200: attention was a quarter of a 512-token prefill and a third of a 1,024-token one.
 *
 * Work item: (sequence, KV head, block of query tokens). Its ROWS rows are the block's tokens x
 * the group's query heads, so one pass over the keys serves every query head of a KV head. The
 * scores are computed transposed, S^T (keys x rows), with the vector lanes across rows:
 *   - Q is packed once per item (lanes across rows); each key's values are broadcast straight
 *     from its cache slot, so K is never copied or transposed;
 *   - the softmax is vertical: a row's running max and sum are lanes, and a tile's max over keys
 *     is an element-wise max of the keys' vectors (no horizontal reductions);
 * then O (rows x D, lanes across D) += P V, with V read in place (float32) or packed into
 * bfloat16 pairs (bfloat16), one broadcast of P per row and key (pair).
 *
 * Per tile of up to BK keys, from the first key any row may see to the last row's position:
 *   S^T = K Q^T         float32 sums; bfloat16 products by vdpbf16ps, float32 ones by FMA
 *   mask by position    only in tiles that reach a row's causal edge or window edge
 *   m, l, O             O *= e^(m_old - m_new), P = e^(S - m_new), l = l e^(m_old - m_new) + sum P
 *   O += P V            P rounded to bfloat16 for the bf16 products (torch's flash kernel does too)
 * and out = O / l at the end, rounded once to q's dtype.
 *
 * Layouts (row-major):
 *   q            (T, Hq, D), q's rows `q_stride` elements apart (a view into the fused QKV output)
 *   out          (T, Hq, D) contiguous, q's dtype; rows no chunk names are not written
 *   k, v caches  (num_blocks, block_size, Hk, D) contiguous, the same dtype as q
 *   tables       (nseq, table_stride) int32: each sequence's blocks in position order
 *   q_start, q_len, ctx_len (nseq,) int64: sequence s's tokens are q rows q_start .. + q_len, at
 *                positions ctx_len .. ctx_len + q_len - 1 (its K/V already written to the cache)
 * dtype 0: float32, 1: bfloat16 (needs AVX512-BF16: pd_prefill_has_bf16() says if this build has it).
 * window > 0: the token at position p sees positions > p - window.
 * Returns 0, or a negative code (unsupported shape or dtype, out of memory) the caller turns into
 * its torch path: never a wrong answer.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define BK 64    /* keys per tile */
#define ROWS 64  /* rows (tokens x heads of a group) per work item */
#define MAX_D 256

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

/* float32 lanes of one vector of this build: the float32 path is written in GCC's vector
 * extension, which the compiler maps to AVX-512 (16 lanes), AVX2 (8) or narrower. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
#define RV (ROWS / VW) /* vectors across an item's rows */
#define RB 4           /* row vectors per pass of the score kernels */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vsplat(float x) { return (vf){0} + x; }

/* Lane by lane: m ? a : b (m from a comparison: all ones or all zeros); C has no vector ?:. */
static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

#if VW == 16
/* One vmaxps (the generic select costs a compare, a mask move and three logic operations). */
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
#endif

/* Rows (positions vpos) that see key position kp: kp <= pos, and kp > pos - window with one. */
static inline vi seen(int64_t kp, vi vpos, int64_t window) {
    const vi k = (vi){0} + (int32_t)kp;
    vi m = k <= vpos;
    if (window > 0) m &= k > vpos - (int32_t)window;
    return m;
}

/* e^x for x <= 0 lane by lane (cpu_math.h's exp_nonpositive, which the compiler vectorizes);
 * a lane at -inf gives e^-87, so callers zero the masked lanes themselves. */
static inline vf vexp(vf x) {
    float a[VW];
    memcpy(a, &x, sizeof a);
#pragma omp simd
    for (int i = 0; i < VW; i++) a[i] = exp_nonpositive(a[i]);
    memcpy(&x, a, sizeof a);
    return x;
}

typedef struct {
    int64_t hq, hk, d, bs, window, q_stride;
    float scale;
    int dtype;
} shape;

typedef struct {
    float *st;      /* BK x ROWS: scores, then probabilities (float32) */
    uint32_t *pp;   /* BK/2 x ROWS: probabilities as bfloat16 pairs (keys 2t, 2t + 1) */
    float *o;       /* ROWS x D running sums */
    void *qt;       /* Q packed: D x ROWS float32, or D/2 x ROWS bfloat16 pairs */
    uint32_t *vp;   /* BK/2 x D: one tile of V as bfloat16 pairs (rows 2t, 2t + 1) */
    float *m, *l, *alpha; /* ROWS each */
    const void **krow, **vrow; /* BK: each key's K and V in the cache */
} scratch;

/* ---- S^T = K Q^T: keys x rows, lanes across rows ---- */

/* JB keys x RB row vectors a pass: each key's value (pair) broadcast from its cache slot meets
 * RB vectors of packed Q. */
#define QK_F32(JB)                                                                                 \
    static void qk_f32_##JB(const float *const *k, const float *qt, int64_t d, float *st) {         \
        vf acc[JB][RB];                                                                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++)                                       \
            _Pragma("GCC unroll 8") for (int c = 0; c < RB; c++) acc[j][c] = vsplat(0.0f);         \
        for (int64_t e = 0; e < d; e++) {                                                          \
            vf qv[RB];                                                                             \
            _Pragma("GCC unroll 8") for (int c = 0; c < RB; c++) qv[c] = vload(qt + e * ROWS + c * VW); \
            _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++) {                                 \
                const vf b = vsplat(k[j][e]);                                                      \
                _Pragma("GCC unroll 8") for (int c = 0; c < RB; c++) acc[j][c] += b * qv[c];       \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++)                                       \
            _Pragma("GCC unroll 8") for (int c = 0; c < RB; c++) vstore(st + j * ROWS + c * VW, acc[j][c]); \
    }
#if VW == 16
#define QK_F32_JB 6 /* 24 accumulators of 32 registers */
QK_F32(6)
#else
#define QK_F32_JB 2 /* 8 of 16 */
QK_F32(2)
#endif
QK_F32(1)

static void qk_f32(const float *const *k, const float *qt, int64_t d, int64_t nk, float *st) {
    for (int c = 0; c < RV; c += RB) {
        int64_t j = 0;
        for (; j + QK_F32_JB <= nk; j += QK_F32_JB)
#if VW == 16
            qk_f32_6(k + j, qt + c * VW, d, st + j * ROWS + c * VW);
#else
            qk_f32_2(k + j, qt + c * VW, d, st + j * ROWS + c * VW);
#endif
        for (; j < nk; j++) qk_f32_1(k + j, qt + c * VW, d, st + j * ROWS + c * VW);
    }
}

#if HAVE_BF16_DOT
/* bfloat16: vdpbf16ps adds two bf16 products to each float32 lane. Q packed as D/2 x ROWS pairs
 * (q[r][2i], q[r][2i + 1]); key j's pair i, broadcast, meets 16 rows per instruction. */
#define QK_BF16(JB)                                                                                \
    static void qk_bf16_##JB(const uint32_t *const *k, const uint32_t *qt, int64_t d, float *st) { \
        __m512 acc[JB][4];                                                                         \
        _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++)                                       \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[j][c] = _mm512_setzero_ps();   \
        for (int64_t i = 0; i < d / 2; i++) {                                                      \
            __m512bh qv[4];                                                                        \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)                                    \
                qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qt + i * ROWS + c * 16));      \
            _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++) {                                 \
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int)k[j][i]);                      \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], qv[c], b); \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < JB; j++)                                       \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) _mm512_storeu_ps(st + j * ROWS + c * 16, acc[j][c]); \
    }
QK_BF16(6)
QK_BF16(1)

static void qk_bf16(const uint32_t *const *k, const uint32_t *qt, int64_t d, int64_t nk, float *st) {
    int64_t j = 0;
    for (; j + 6 <= nk; j += 6) qk_bf16_6(k + j, qt, d, st + j * ROWS);
    for (; j < nk; j++) qk_bf16_1(k + j, qt, d, st + j * ROWS);
}
#endif

/* ---- O += P V: rows x D, lanes across D ---- */

/* float32: 4 rows x NV vectors of D, V rows read in place from the cache. */
static inline __attribute__((always_inline)) void pv_f32_rows(const float *st, int64_t r, const float *const *v,
                                                              int64_t nk, int64_t e, float *o, int64_t d,
                                                              const int rb, const int nv) {
    vf acc[4][4];
    for (int i = 0; i < rb; i++)
        for (int c = 0; c < nv; c++) acc[i][c] = vload(o + (r + i) * d + e + c * VW);
    for (int64_t j = 0; j < nk; j++) {
        vf vv[4];
        for (int c = 0; c < nv; c++) vv[c] = vload(v[j] + e + c * VW);
        for (int i = 0; i < rb; i++) {
            const vf b = vsplat(st[j * ROWS + r + i]);
            for (int c = 0; c < nv; c++) acc[i][c] += b * vv[c];
        }
    }
    for (int i = 0; i < rb; i++)
        for (int c = 0; c < nv; c++) vstore(o + (r + i) * d + e + c * VW, acc[i][c]);
}

#define PV_F32(R, NV)                                                                              \
    static void pv_f32_##R##_##NV(const float *st, int64_t r, const float *const *v, int64_t nk, int64_t e, \
                                  float *o, int64_t d) {                                           \
        pv_f32_rows(st, r, v, nk, e, o, d, R, NV);                                                 \
    }
#if VW == 16
#define PV_F32_NV 4
#else
#define PV_F32_NV 2 /* 4 rows x 2 vectors: 8 accumulators of 16 registers */
#endif
PV_F32(4, 4)
PV_F32(4, 2)
PV_F32(4, 1)
PV_F32(1, 4)
PV_F32(1, 2)
PV_F32(1, 1)

static void pv_f32(const float *st, int64_t rows, const float *const *v, int64_t nk, float *o, int64_t d) {
    for (int64_t r = 0; r < rows;) {
        const int four = rows - r >= 4;
        for (int64_t e = 0; e < d;) {
            const int64_t left = (d - e) / VW;
            if (PV_F32_NV == 4 && left >= 4) { /* AVX-512 only: AVX2 has registers for 4 rows x 2 */
                four ? pv_f32_4_4(st, r, v, nk, e, o, d) : pv_f32_1_4(st, r, v, nk, e, o, d);
                e += 4 * VW;
            } else if (left >= 2) {
                four ? pv_f32_4_2(st, r, v, nk, e, o, d) : pv_f32_1_2(st, r, v, nk, e, o, d);
                e += 2 * VW;
            } else {
                four ? pv_f32_4_1(st, r, v, nk, e, o, d) : pv_f32_1_1(st, r, v, nk, e, o, d);
                e += VW;
            }
        }
        r += four ? 4 : 1;
    }
}

#if HAVE_BF16_DOT
/* bfloat16: V packed as BK/2 x D pairs (v[2t][e], v[2t + 1][e]); row r's probability pair t,
 * broadcast, meets 16 columns of D per instruction. 4 rows x NV vectors of D. */
static inline __attribute__((always_inline)) void pv_bf16_rows(const uint32_t *pp, int64_t r, const uint32_t *vp,
                                                               int64_t np, int64_t e, float *o, int64_t d,
                                                               const int rb, const int nv) {
    __m512 acc[4][4];
    for (int i = 0; i < rb; i++)
        for (int c = 0; c < nv; c++) acc[i][c] = _mm512_loadu_ps(o + (r + i) * d + e + c * 16);
    for (int64_t t = 0; t < np; t++) {
        __m512bh vv[4];
        for (int c = 0; c < nv; c++) vv[c] = (__m512bh)_mm512_loadu_si512((const void *)(vp + t * d + e + c * 16));
        for (int i = 0; i < rb; i++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pp[t * ROWS + r + i]);
            for (int c = 0; c < nv; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv[c], b);
        }
    }
    for (int i = 0; i < rb; i++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + (r + i) * d + e + c * 16, acc[i][c]);
}

#define PV_BF16(R, NV)                                                                             \
    static void pv_bf16_##R##_##NV(const uint32_t *pp, int64_t r, const uint32_t *vp, int64_t np, int64_t e, \
                                   float *o, int64_t d) {                                          \
        pv_bf16_rows(pp, r, vp, np, e, o, d, R, NV);                                               \
    }
PV_BF16(4, 4)
PV_BF16(4, 2)
PV_BF16(4, 1)
PV_BF16(1, 4)
PV_BF16(1, 2)
PV_BF16(1, 1)

static void pv_bf16(const uint32_t *pp, int64_t rows, const uint32_t *vp, int64_t np, float *o, int64_t d) {
    for (int64_t r = 0; r < rows;) {
        const int four = rows - r >= 4;
        for (int64_t e = 0; e < d;) {
            const int64_t left = (d - e) / 16;
            if (left >= 4) {
                four ? pv_bf16_4_4(pp, r, vp, np, e, o, d) : pv_bf16_1_4(pp, r, vp, np, e, o, d);
                e += 64;
            } else if (left >= 2) {
                four ? pv_bf16_4_2(pp, r, vp, np, e, o, d) : pv_bf16_1_2(pp, r, vp, np, e, o, d);
                e += 32;
            } else {
                four ? pv_bf16_4_1(pp, r, vp, np, e, o, d) : pv_bf16_1_1(pp, r, vp, np, e, o, d);
                e += 16;
            }
        }
        r += four ? 4 : 1;
    }
}

/* Probabilities of keys 2t and 2t + 1 for 16 rows -> 16 bf16 pairs (round to nearest even). */
static inline __m512i bf16_pairs(__m512 a, __m512 b) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}
#endif

int pd_prefill_has_bf16(void) { return HAVE_BF16_DOT; }

/* One work item: tokens [t0, t0 + nt) of sequence s, KV head h. */
static void item(const shape *sh, const void *q, void *out, const void *kc, const void *vc, const int32_t *table,
                 int64_t q_start, int64_t ctx, int64_t t0, int64_t nt, int64_t h, scratch *w) {
    const int64_t g = sh->hq / sh->hk, d = sh->d, rows = nt * g;
    const int bf16 = sh->dtype == 1;
    const int64_t esz = bf16 ? 2 : 4;
    /* Q packed with lanes across rows; rows past `rows` are zero (computed, never stored). */
    if (bf16) {
        uint32_t *qt = (uint32_t *)w->qt;
        memset(qt, 0, (size_t)(d / 2) * ROWS * sizeof(uint32_t));
        for (int64_t r = 0; r < rows; r++) {
            const uint32_t *src = (const uint32_t *)((const char *)q +
                                                     ((q_start + t0 + r / g) * sh->q_stride + (h * g + r % g) * d) * esz);
            for (int64_t i = 0; i < d / 2; i++) qt[i * ROWS + r] = src[i];
        }
    } else {
        float *qt = (float *)w->qt;
        memset(qt, 0, (size_t)d * ROWS * sizeof(float));
        for (int64_t r = 0; r < rows; r++) {
            const float *src = (const float *)q + (q_start + t0 + r / g) * sh->q_stride + (h * g + r % g) * d;
            for (int64_t e = 0; e < d; e++) qt[e * ROWS + r] = src[e];
        }
    }
    /* Each row's position; padded rows take the last token's (their values are never stored). */
    int32_t pos[ROWS];
    for (int64_t r = 0; r < ROWS; r++) pos[r] = (int32_t)(ctx + t0 + (r < rows ? r / g : nt - 1));
    for (int64_t r = 0; r < ROWS; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, (size_t)(ROWS * d) * sizeof(float));
    const int64_t p_first = ctx + t0, p_last = ctx + t0 + nt - 1;
    const int64_t win = sh->window;
    const int64_t lo = win > 0 ? (p_first - win + 1 > 0 ? p_first - win + 1 : 0) : 0;
    for (int64_t k0 = lo; k0 <= p_last; k0 += BK) {
        const int64_t nk = p_last + 1 - k0 < BK ? p_last + 1 - k0 : BK;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t p = k0 + j;
            const int64_t off = ((int64_t)table[p / sh->bs] * sh->bs + p % sh->bs) * sh->hk + h;
            w->krow[j] = (const char *)kc + off * d * esz;
            w->vrow[j] = (const char *)vc + off * d * esz;
        }
#if HAVE_BF16_DOT
        if (bf16)
            qk_bf16((const uint32_t *const *)w->krow, (const uint32_t *)w->qt, d, nk, w->st);
        else
#endif
            qk_f32((const float *const *)w->krow, (const float *)w->qt, d, nk, w->st);
        /* Every row sees every key of this tile unless the tile reaches the first row's causal
         * edge or the last row's window edge: only then is there a mask to apply. */
        const int masked = k0 + nk - 1 > p_first || (win > 0 && k0 <= p_last - win);
        const vf scale = vsplat(sh->scale), ninf = vsplat(-INFINITY), zero = vsplat(0.0f);
        for (int c = 0; c < RV; c++) {
            const int64_t r0 = c * VW;
            vi vpos;
            memcpy(&vpos, pos + r0, sizeof vpos);
            /* Two passes over the tile's scores: the row maxima, then the probabilities (written
             * as the products want them). The maximum is taken before scaling: the scale is
             * positive (checked at entry), so the scaled maximum is the maximum of the scaled
             * scores exactly. */
            vf mx = ninf;
            for (int64_t j = 0; j < nk; j++) {
                vf s = vload(w->st + j * ROWS + r0);
                if (masked) s = vsel(seen(k0 + j, vpos, win), s, ninf);
                mx = vmax(mx, s);
            }
            const vf m_old = vload(w->m + r0);
            const vf m_new = vmax(m_old, mx * scale);
            /* A row with no key seen yet keeps m = -inf; it subtracts 0 instead (its lanes are all
             * masked to 0 below, and its O and l are 0, which any alpha keeps). */
            const vf m_use = vsel(m_new == ninf, zero, m_new);
            const vf alpha = vexp(m_old - m_use);
            vf sum = zero;
#define PROB(j) (masked ? vsel(seen(k0 + (j), vpos, win), vexp(vload(w->st + (j) * ROWS + r0) * scale - m_use), zero) \
                        : vexp(vload(w->st + (j) * ROWS + r0) * scale - m_use))
#if HAVE_BF16_DOT
            if (bf16) {
                for (int64_t t = 0; t < (nk + 1) / 2; t++) {
                    const vf p0 = PROB(2 * t), p1 = 2 * t + 1 < nk ? PROB(2 * t + 1) : zero;
                    sum += p0;
                    sum += p1;
                    _mm512_storeu_si512((void *)(w->pp + t * ROWS + r0), bf16_pairs((__m512)p0, (__m512)p1));
                }
            } else
#endif
            {
                for (int64_t j = 0; j < nk; j++) {
                    const vf p = PROB(j);
                    vstore(w->st + j * ROWS + r0, p);
                    sum += p;
                }
            }
#undef PROB
            vstore(w->l + r0, vload(w->l + r0) * alpha + sum);
            vstore(w->m + r0, m_new);
            vstore(w->alpha + r0, alpha);
        }
        for (int64_t r = 0; r < rows; r++) {
            const float a = w->alpha[r];
            if (a != 1.0f) {
                float *o = w->o + r * d;
#pragma omp simd
                for (int64_t e = 0; e < d; e++) o[e] *= a;
            }
        }
#if HAVE_BF16_DOT
        if (bf16) {
            /* V pairs: rows 2t and 2t + 1 of the tile (a zero row past nk) interleaved by column. */
            static const uint16_t zero_row[MAX_D];
            for (int64_t t = 0; t < (nk + 1) / 2; t++) {
                const uint16_t *a = (const uint16_t *)w->vrow[2 * t];
                const uint16_t *b = 2 * t + 1 < nk ? (const uint16_t *)w->vrow[2 * t + 1] : zero_row;
                uint32_t *dst = w->vp + t * d;
#pragma omp simd
                for (int64_t e = 0; e < d; e++) dst[e] = (uint32_t)a[e] | ((uint32_t)b[e] << 16);
            }
            pv_bf16(w->pp, rows, w->vp, (nk + 1) / 2, w->o, d);
        } else
#endif
            pv_f32(w->st, rows, (const float *const *)w->vrow, nk, w->o, d);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t tok = q_start + t0 + r / g, head = h * g + r % g;
        const float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        const float *o = w->o + r * d;
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + (tok * sh->hq + head) * d;
            for (int64_t e = 0; e < d; e++) dst[e] = (uint16_t)bf16_bits(o[e] * inv);
        } else {
            float *dst = (float *)out + (tok * sh->hq + head) * d;
#pragma omp simd
            for (int64_t e = 0; e < d; e++) dst[e] = o[e] * inv;
        }
    }
}

static void *aligned(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 64, (n + 63) / 64 * 64) == 0 ? p : NULL;
}

int pd_prefill_attn(const void *q, void *out, const void *kc, const void *vc, int dtype, const int32_t *tables,
                    int64_t table_stride, const int64_t *q_start, const int64_t *q_len, const int64_t *ctx_len,
                    int64_t nseq, int64_t hq, int64_t hk, int64_t d, int64_t bs, int64_t q_stride, int64_t window,
                    float scale, int nthreads) {
    if (dtype != 0 && !(dtype == 1 && HAVE_BF16_DOT)) return -2;
    if (hk <= 0 || hq % hk || hq / hk > ROWS || d <= 0 || d > MAX_D || d % 16 || bs <= 0 || nseq < 0 || !(scale > 0.0f))
        return -2;
    const shape sh = {hq, hk, d, bs, window, q_stride, scale, dtype};
    const int64_t tb = ROWS / (hq / hk); /* tokens per item */
    /* Items: (sequence, KV head, token block), numbered in sequence order. */
    int64_t *first_item = (int64_t *)malloc((size_t)(nseq + 1) * sizeof(int64_t));
    if (!first_item) return -3;
    first_item[0] = 0;
    for (int64_t s = 0; s < nseq; s++) first_item[s + 1] = first_item[s] + hk * ((q_len[s] + tb - 1) / tb);
    const int64_t n_items = first_item[nseq];
    int failed = 0;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(| : failed)
    {
        scratch w;
        const size_t esz = dtype == 0 ? 4 : 2;
        w.st = (float *)aligned((size_t)BK * ROWS * sizeof(float));
        w.pp = (uint32_t *)aligned((size_t)(BK / 2) * ROWS * sizeof(uint32_t));
        w.o = (float *)aligned((size_t)ROWS * d * sizeof(float));
        w.qt = aligned((size_t)d * ROWS * esz);
        w.vp = (uint32_t *)aligned((size_t)(BK / 2) * d * sizeof(uint32_t));
        w.m = (float *)aligned(ROWS * sizeof(float));
        w.l = (float *)aligned(ROWS * sizeof(float));
        w.alpha = (float *)aligned(ROWS * sizeof(float));
        w.krow = (const void **)aligned(BK * sizeof(void *));
        w.vrow = (const void **)aligned(BK * sizeof(void *));
        const int ok = w.st && w.pp && w.o && w.qt && w.vp && w.m && w.l && w.alpha && w.krow && w.vrow;
        int64_t s = 0;
        /* Every thread enters the loop (a worksharing construct some threads skipped would hang);
         * one without scratch marks the call failed and the caller's torch path redoes it. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; it++) {
            if (!ok) {
                failed = 1;
                continue;
            }
            while (first_item[s + 1] <= it) s++;
            while (first_item[s] > it) s--;
            const int64_t local = it - first_item[s];
            const int64_t blocks = (q_len[s] + tb - 1) / tb;
            const int64_t h = local / blocks, t0 = (local % blocks) * tb;
            const int64_t nt = q_len[s] - t0 < tb ? q_len[s] - t0 : tb;
            item(&sh, q, out, kc, vc, tables + s * table_stride, q_start[s], ctx_len[s], t0, nt, h, &w);
        }
        free(w.st);
        free(w.pp);
        free(w.o);
        free(w.qt);
        free(w.vp);
        free(w.m);
        free(w.l);
        free(w.alpha);
        free((void *)w.krow);
        free((void *)w.vrow);
    }
    free(first_item);
    return failed ? -3 : 0;
}
