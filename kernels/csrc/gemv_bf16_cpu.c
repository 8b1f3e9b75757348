/* Small-batch products over bfloat16 weights in float32 arithmetic: y (M, N) = x (M, K) @ W^T (+ b)
 * with W (N, K) stored as bfloat16, x, b and y float32, for the few rows of a decode step.
 *
 * Why: at M = 1-8 a linear layer is a read of its weight, nothing more. On a CPU that computes in
 * float32 (no BF16 instructions) the engine holds a bf16 checkpoint's weights as float32 for
 * oneDNN, so every decode step reads twice the checkpoint's bytes. A bfloat16 value is the top
 * half of a float32, so widening it is a shift: this kernel reads the checkpoint's own bytes and
 * forms exactly the float32 products oneDNN forms from the widened weight. Only the summation
 * order differs (eight partial sums per output, reduced at the end), which float32 never promised.
 *
 * Work split: output features in blocks of 64 rows of W, blocks divided over the threads; inside a
 * block each weight vector is loaded and widened once per MT rows of x (the block of W, 64 * K * 2
 * bytes, stays in L2 while the rows of x pass over it).
 *
 * Built at first use by kernels/native.py (-O3 -march=native -fopenmp); the AVX2/FMA path needs
 * those instructions at build time, otherwise the portable loop below runs (the compiler
 * vectorizes it as far as the target allows). Returns 0, or a negative code on bad arguments.
 */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The four sums of a0..a3 (each a vector of 8 partial sums) in one 128-bit vector. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline float hsum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Rows m0..m0+MT-1 of y, features n..n+NT-1: NT weight rows against MT rows of x, each weight
 * vector loaded and widened once. The shapes used (MT x NT): 1 x 8, 2 x 4, 3 x 2 and 4 x 2, so
 * MT * NT accumulators + MT x vectors + 1 weight vector fit in 16 registers. K % 8 == 0 here; the
 * caller adds the tail. out: MT x NT sums, row-major. */
#define TILE(MT, NT)                                                                               \
    static void tile_##MT##x##NT(const float *x, int64_t ldx, const uint16_t *w, int64_t K,          \
                                 int64_t k8, float *out) {                                          \
        __m256 acc[MT][NT];                                                                        \
        for (int m = 0; m < MT; m++)                                                               \
            for (int j = 0; j < NT; j++) acc[m][j] = _mm256_setzero_ps();                          \
        for (int64_t k = 0; k < k8; k += 8) {                                                      \
            __m256 xv[MT];                                                                         \
            for (int m = 0; m < MT; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);                \
            for (int j = 0; j < NT; j++) {                                                         \
                /* the next tile's rows, one tile ahead: ~9% on a 2-core EPYC (prefetches past   \
                 * the end of W are harmless: they never fault) */                                \
                _mm_prefetch((const char *)(w + (j + NT) * K + k), _MM_HINT_T0);                   \
                __m256 wv = load_bf16x8(w + j * K + k);                                            \
                for (int m = 0; m < MT; m++) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);    \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < MT; m++) {                                                             \
            int j = 0;                                                                             \
            for (; j + 4 <= NT; j += 4)                                                            \
                _mm_storeu_ps(out + m * NT + j, hsum4(acc[m][j], acc[m][j + 1], acc[m][j + 2],       \
                                                      acc[m][j + 3]));                             \
            for (; j < NT; j++) out[m * NT + j] = hsum1(acc[m][j]);                                \
        }                                                                                          \
    }
TILE(1, 8)
TILE(2, 4)
TILE(3, 2)
TILE(4, 2)
#endif

/* y[m, n] for one weight row n and rows m0..m0+mt-1 over k in [k0, K): the tail of the vector
 * loop, or the whole dot product on a build without AVX2. */
static inline float dot_tail(const float *xr, const uint16_t *wr, int64_t k0, int64_t K) {
    float s = 0.0f;
    for (int64_t k = k0; k < K; k++) s += xr[k] * bf16_to_f32(wr[k]);
    return s;
}

/* Features [n0, n0 + nt) for every row of x. */
static void rows_block(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t ldy,
                       int64_t M, int64_t n0, int64_t nt, int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t k8 = K & ~(int64_t)7;
    float part[8]; /* MT x NT sums of one tile: at most 8 */
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        const int mt = left >= 4 ? 4 : (int)left;
        const int ntile = mt == 1 ? 8 : mt == 2 ? 4 : 2; /* the TILE shapes above */
        int64_t n = n0;
        for (; n + ntile <= n0 + nt; n += ntile) {
            const float *xm = x + m0 * ldx;
            const uint16_t *wn = w + n * K;
            switch (mt) {
                case 1: tile_1x8(xm, ldx, wn, K, k8, part); break;
                case 2: tile_2x4(xm, ldx, wn, K, k8, part); break;
                case 3: tile_3x2(xm, ldx, wn, K, k8, part); break;
                default: tile_4x2(xm, ldx, wn, K, k8, part); break;
            }
            for (int m = 0; m < mt; m++)
                for (int j = 0; j < ntile; j++) {
                    const int64_t row = m0 + m, col = n + j;
                    float v = part[m * ntile + j] + dot_tail(x + row * ldx, w + col * K, k8, K);
                    y[row * ldy + col] = bias ? v + bias[col] : v;
                }
        }
        for (; n < n0 + nt; n++) /* features left over after the last whole tile */
            for (int m = 0; m < mt; m++) {
                const int64_t row = m0 + m;
                __m256 a = _mm256_setzero_ps();
                for (int64_t k = 0; k < k8; k += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(x + row * ldx + k), load_bf16x8(w + n * K + k), a);
                float v = hsum1(a) + dot_tail(x + row * ldx, w + n * K, k8, K);
                y[row * ldy + n] = bias ? v + bias[n] : v;
            }
        m0 += mt;
    }
#else
    for (int64_t n = n0; n < n0 + nt; n++)
        for (int64_t m = 0; m < M; m++) {
            float v = dot_tail(x + m * ldx, w + n * K, 0, K);
            y[m * ldy + n] = bias ? v + bias[n] : v;
        }
#endif
}

/* x (M, K) with row stride ldx, w (N, K) contiguous bfloat16, bias (N,) or NULL, y (M, N)
 * contiguous. Features are split over `threads` in blocks of a multiple of 4 rows of W. */
int pd_gemv_bf16(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || threads < 1) return -1;
    if (M == 0 || N == 0) return 0;
    /* Blocks of 64 features: small enough to balance 768-wide layers over the threads, large
     * enough that each thread streams long runs of W. */
    const int64_t block = 64, nblocks = (N + block - 1) / block;
    if (threads > nblocks) threads = (int)nblocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * block, nt = N - n0 < block ? N - n0 : block;
        rows_block(x, ldx, w, bias, y, N, M, n0, nt, K);
    }
    return 0;
}
