/* Small-batch products of bfloat16 rows with bfloat16 weights on bf16 dot-product instructions
 * (AVX512-BF16): y (M, N) = x (M, K) @ W^T (+ b), with x's values bfloat16 (a bfloat16 model's
 * activations, given as float32), W (N, K) bfloat16 in the pair layout below, b and y float32,
 * for the rows of a decode step (1 to ~64).
 *
 * Layout (made once at load by kernels/gemv_bf16_cpu.py `pack`): W's rows in blocks of 64 output
 * features; inside a block, K in pairs (k, k + 1); pair p of block b holds features 64b..64b+63,
 * each as its two values: 128 bfloat16, 256 bytes, four 64-byte lines. So a 32-bit lane of a line
 * is one feature's pair, exactly what vdpbf16ps multiplies with a pair of x broadcast to every
 * lane: lane j of accumulator t gathers feature 64b + 16t + j's whole dot product, and the four
 * accumulators of a row are stored as they are, with no reduction across lanes. Both ends are zero
 * padded (N to a multiple of 64, K to an even count). A block is one sequential run of memory
 * (K / 2 * 256 bytes), the hardware prefetcher's easiest stream.
 *
 * Why this and not the 4-row tiles of gemv_bf16_cpu.c: there a lane held four partial sums of
 * one feature, so every (row, tile) ended in a reduction across lanes and a scattered store, and
 * each instruction took a 128-bit slice of x broadcast four times over; the tiles' products of a
 * bench-Llama decode step ran at 0.78-0.83x oneDNN's bf16 GEMM at 8-64 rows. This layout needs
 * one 32-bit broadcast per row and pair: 1.1-1.9x oneDNN at 4-32 rows, at par at 64, and the
 * batch-1 GEMV reads the weights as fast as the tiles did (benchmarks/gemv_bf16.py; RESULTS.md,
 * session 30).
 *
 * Passes: up to PAIR_ONE_PASS_ROWS rows go through a block in one pass, so the weights are read
 * once (at 7-8 rows the 28-32 accumulators spill a few registers, which costs less than a second
 * read of the block); more rows take passes of at most PAIR_PASS_ROWS, spread evenly, the block
 * (<= 256 KiB at K <= 2,048) served from L2 after the first.
 *
 * Exactness: products of bfloat16 pairs are exact in float32; each output lane sums its pairs in
 * order of K, one instruction per pair, from zero, then adds the bias: the same operations for a
 * row whatever rows share the call, pass or thread, so a row's result does not depend on the rows
 * beside it. The instruction treats denormal inputs as zero (as oneDNN's bf16 GEMM, which uses
 * it, does).
 *
 * Built at first use by kernels/native.py (-march=native). Without AVX512-BF16 in the target the
 * entry points below report 0 / refuse, and the tiles of gemv_bf16_cpu.c serve every product.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAIR_BLOCK 64         /* output features per block: four 16-lane accumulators per row */
#define PAIR_PASS_ROWS 6      /* rows per pass when several passes are needed: 24 accumulators */
#define PAIR_ONE_PASS_ROWS 8  /* up to this many rows: one pass over the weights */
/* Prefetch this many weight values (4 KiB, 16 pairs) ahead of the pair being read, every line of
 * it: half the lines prefetched left the batch-1 products 1.45x slower than the tiles' (session 30). */
#define PAIR_PREFETCH 2048

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_PAIRS 1

/* MT rows of xp (pairs of bfloat16, row stride ldxp pairs) against one block over kp pairs; the
 * block's features [col0, col0 + 64) clipped to n are stored (+ bias) into y (row stride ldy).
 * Kept out of line per MT, its loops unrolled, so the accumulators stay registers. */
#define PAIR_ROWS(MT)                                                                              \
    __attribute__((noinline)) static void pair_rows_##MT(const uint32_t *xp, int64_t ldxp,         \
                                                         const uint16_t *wb, int64_t kp,           \
                                                         const float *bias, float *y, int64_t ldy, \
                                                         int64_t col0, int64_t n) {                \
        __m512 acc[MT][4];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                       \
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) acc[m][t] = _mm512_setzero_ps();   \
        for (int64_t p = 0; p < kp; p++) {                                                         \
            const uint16_t *w = wb + p * PAIR_BLOCK * 2;                                           \
            _Pragma("GCC unroll 4") for (int l = 0; l < 4; l++)                                    \
                _mm_prefetch((const char *)(w + PAIR_PREFETCH + 32 * l), _MM_HINT_T0);             \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)w);                     \
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w + 32));              \
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512((const void *)(w + 64));              \
            const __m512bh w3 = (__m512bh)_mm512_loadu_si512((const void *)(w + 96));              \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                 \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xp[m * ldxp + p]);             \
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);                                   \
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);                                   \
                acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xb);                                   \
                acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xb);                                   \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                                      \
            const int64_t c = col0 + 16 * t;                                                       \
            if (c >= n) break;                                                                     \
            const __mmask16 k = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1); \
            const __m512 b = bias ? _mm512_maskz_loadu_ps(k, bias + c) : _mm512_setzero_ps();      \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++)                                   \
                _mm512_mask_storeu_ps(y + m * ldy + c, k, _mm512_add_ps(acc[m][t], b));             \
        }                                                                                          \
    }
PAIR_ROWS(1)
PAIR_ROWS(2)
PAIR_ROWS(3)
PAIR_ROWS(4)
PAIR_ROWS(5)
PAIR_ROWS(6)
PAIR_ROWS(7)
PAIR_ROWS(8)

static void pair_rows(int mt, const uint32_t *xp, int64_t ldxp, const uint16_t *wb, int64_t kp, const float *bias,
                      float *y, int64_t ldy, int64_t col0, int64_t n) {
    switch (mt) {
        case 1: pair_rows_1(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        case 2: pair_rows_2(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        case 3: pair_rows_3(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        case 4: pair_rows_4(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        case 5: pair_rows_5(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        case 6: pair_rows_6(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        case 7: pair_rows_7(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
        default: pair_rows_8(xp, ldxp, wb, kp, bias, y, ldy, col0, n); return;
    }
}
#else
#define HAVE_PAIRS 0
#endif

/* 1 when this build runs the pair products (a CPU with AVX512-BF16), else 0. */
int pd_gemv_pairs_available(void) { return HAVE_PAIRS; }

/* x (M, K) float32 holding bfloat16 values, row stride ldx; wp the pair layout of W (ceil(N / 64)
 * blocks of ceil(K / 2) pairs x 64 features x 2); bias (N,) or NULL; y (M, N) contiguous.
 * Returns 0; -1 on bad arguments; -2 without memory for x's bfloat16 copy; -3 when this build
 * has no pair products. x is narrowed by dropping each float's low half (exact for its values). */
int pd_gemv_pairs(const float *x, int64_t ldx, const uint16_t *wp, const float *bias, float *y, int64_t M,
                  int64_t N, int64_t K, int threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || threads < 1) return -1;
#if HAVE_PAIRS
    if (M == 0 || N == 0) return 0;
    if (K == 0) {
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) y[m * N + j] = bias ? bias[j] : 0.0f;
        return 0;
    }
    const int64_t kp = (K + 1) / 2, nblocks = (N + PAIR_BLOCK - 1) / PAIR_BLOCK;
    uint32_t *xp = malloc((size_t)(M * kp) * sizeof *xp);
    if (xp == NULL) return -2;
    for (int64_t m = 0; m < M; m++) {
        uint16_t *row = (uint16_t *)(xp + m * kp);
        row[2 * kp - 1] = 0; /* the pad of an odd K */
        for (int64_t k = 0; k < K; k++) {
            uint32_t u;
            memcpy(&u, x + m * ldx + k, sizeof u);
            row[k] = (uint16_t)(u >> 16);
        }
    }
    if (threads > nblocks) threads = (int)nblocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const uint16_t *wb = wp + b * kp * PAIR_BLOCK * 2;
        for (int64_t m0 = 0; m0 < M;) {
            const int64_t left = M - m0;
            int mt = (int)left;
            if (left > PAIR_ONE_PASS_ROWS) {
                const int64_t passes = (left + PAIR_PASS_ROWS - 1) / PAIR_PASS_ROWS;
                mt = (int)((left + passes - 1) / passes); /* 9 rows: 5 + 4, 32: 6 6 5 5 5 5 */
            }
            pair_rows(mt, xp + m0 * kp, kp, wb, kp, bias, y + m0 * N, N, b * PAIR_BLOCK, N);
            m0 += mt;
        }
    }
    free(xp);
    return 0;
#else
    (void)x, (void)wp, (void)bias, (void)y;
    return -3;
#endif
}
