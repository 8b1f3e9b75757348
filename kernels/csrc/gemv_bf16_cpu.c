/* Small-batch products over bfloat16 weights in float32 arithmetic: y (M, N) = x (M, K) @ W^T (+ b)
 * with W (N, K) stored as bfloat16 in the tiled layout below, x, b and y float32, for the few rows
 * of a decode step.
 *
 * Why: at M = 1-8 a linear layer is a read of its weight, nothing more. On a CPU that computes in
 * float32 (no BF16 instructions) the engine holds a bf16 checkpoint's weights as float32 for
 * oneDNN, so every decode step reads twice the checkpoint's bytes. A bfloat16 value is the top
 * half of a float32, so widening it is a shift: this kernel reads the checkpoint's own bytes and
 * forms exactly the float32 products oneDNN forms from the widened weight. Only the summation
 * order differs (partial sums per output, reduced at the end), which float32 never promised.
 *
 * Layout (made once at load by kernels/gemv_bf16_cpu.py `pack`): W's rows in tiles of 4; inside a
 * tile, K in chunks of 8; chunk c of tile t holds rows 4t..4t+3, columns 8c..8c+7, row after row:
 * 32 values, one 64-byte cache line. Inside a row's 8 values the columns are interleaved as
 * 0 4 1 5 2 6 3 7 (slot() below), so that each 32-bit lane holds columns i and i + 4: one shift and
 * one mask widen 16 weights (tile_M). Both ends are zero padded (N to a multiple of 4, K to one of
 * 8). So a tile is one sequential run of memory the hardware prefetcher follows from its first
 * line, where the row-major layout made each thread chase 8 rows of 1.5-4 KB at once: on a 2-core
 * EPYC the 125M Llama's 49 products per decode step went 13.3 -> 8.8 ms at M = 1 (~1.5x, 30 GB/s
 * on the LM head), with no loss at any M up to 16 (benchmarks/gemv_bf16.py).
 *
 * Work split: tiles in blocks of 16 (64 output features) divided over the threads; inside a block
 * each tile is passed once per group of up to MAX_PASS_ROWS rows of x (the tile, 4 * K * 2 bytes,
 * stays in L1/L2 between passes), the rows spread evenly over the passes. Up to 5 rows a pass keeps
 * the step bound by the weight read on a 2-core AVX2 EPYC (the 49 products: 7.8 ms at M = 4, 8.3 at
 * 5, against 7.3-7.6 at M = 1-3); the earlier kernel, 3 rows a pass widened by vpmovzxwd, took
 * 9.6 / 10.2 ms there and ~1.2x this one's time at M = 7-32 (RESULTS.md, session 25).
 *
 * Built at first use by kernels/native.py (-O3 -march=native -fopenmp); the AVX2/FMA path needs
 * those instructions at build time, otherwise the portable loop below runs (the compiler
 * vectorizes it as far as the target allows). Returns 0, or a negative code on bad arguments.
 *
 * A bfloat16 model on a CPU with AVX512-BF16 multiplies its bf16 rows on dot-product instructions
 * over another layout instead (gemv_bf16_dot_cpu.c); these tiles serve float32 rows everywhere
 * and bf16 rows where the CPU has no such instructions.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 4
#define CHUNK 8
#define TILES_PER_BLOCK 16
/* Software prefetch this many weight values (1 KiB) ahead of the chunk being read: the hardware
 * prefetcher alone left ~10% on the table at block starts. Past the end of W is harmless: a
 * prefetch never faults. */
#define PREFETCH_AHEAD 512
#define MAX_PASS_ROWS 5

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Where column e (0..7) of a chunk's row sits among its 8 values: 0 4 1 5 2 6 3 7. */
static inline int slot(int e) { return (e & 3) * 2 + (e >> 2); }

/* Columns [8 * kfull, K) of one tile against rows of x: the partial last chunk. */
static inline float tail_dot(const float *xr, const uint16_t *chunk, int j, int64_t k0, int64_t K) {
    float s = 0.0f;
    for (int64_t k = k0; k < K; k++) s += xr[k] * bf16_to_f32(chunk[j * CHUNK + slot((int)(k - k0))]);
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The high bfloat16 of each 32-bit lane as a float32: a mask, or at 5 rows (whose 10 accumulators,
 * 4 weight vectors and 2 x broadcasts fill the 16 registers) a shift back and a subtraction, so
 * that no register holds the mask: with it the compiler spilled an accumulator to the stack, a
 * store and reload on every chunk's dependency chain (the 49 products at M = 5: 10.6 -> 8.4 ms,
 * M = 10: 20.0 -> 14.2; at M <= 4 the mask is the cheaper of the two). Each tile function is kept
 * out of line so that it gets its own register allocation (inlined into one function, the mask the
 * smaller ones use was hoisted and held a register in the 5-row loop too), and its loops over the
 * rows are unrolled so that the accumulators stay registers rather than a stack array. */
static inline __m256 high_half(__m256i u, __m256i odd, int rows) {
    if (rows < 5) return _mm256_castsi256_ps(_mm256_and_si256(u, odd));
    return _mm256_castsi256_ps(_mm256_sub_epi32(u, _mm256_srli_epi32(_mm256_slli_epi32(u, 16), 16)));
}

/* MT rows of x (1..MAX_PASS_ROWS) against one tile over its kfull whole chunks. A chunk is two
 * 32-byte loads, one per pair of tile rows; each 32-bit lane holds columns i and i + 4 of one row
 * (the interleave above), so a shift widens the first and a mask the second: two ALU operations
 * per 16 weights, where widening with vpmovzxwd + shift took two per 8 and shared the FMA ports.
 * x needs no preparation: its columns 8c..8c+3 and 8c+4..8c+7, broadcast to both 128-bit halves,
 * match the lanes. Accumulator (m, p) holds row 2p's partial sums in its low half and row 2p+1's
 * in its high half. Every row of x goes through the same sequence of operations whatever MT is,
 * so a row's result does not depend on how many rows share the call. out: MT x 4 sums. */
#define TILE_M(MT)                                                                                 \
    __attribute__((noinline)) static void tile_##MT(const float *x, int64_t ldx, const uint16_t *wt, \
                                                     int64_t kfull, float *out) {                  \
        const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);                                   \
        __m256 acc[MT][2];                                                                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps(); \
        for (int64_t c = 0; c < kfull; c++) {                                                      \
            const uint16_t *wc = wt + c * TILE_ROWS * CHUNK;                                       \
            _mm_prefetch((const char *)(wc + PREFETCH_AHEAD), _MM_HINT_T0);                        \
            const __m256i u0 = _mm256_loadu_si256((const __m256i *)wc);                            \
            const __m256i u1 = _mm256_loadu_si256((const __m256i *)(wc + 2 * CHUNK));              \
            const __m256 lo0 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));                     \
            const __m256 hi0 = high_half(u0, odd, MT);                                             \
            const __m256 lo1 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));                     \
            const __m256 hi1 = high_half(u1, odd, MT);                                             \
            _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                 \
                const float *xc = x + m * ldx + c * CHUNK;                                         \
                const __m256 xl = _mm256_broadcast_ps((const __m128 *)xc);                         \
                const __m256 xh = _mm256_broadcast_ps((const __m128 *)(xc + 4));                   \
                acc[m][0] = _mm256_fmadd_ps(xl, lo0, acc[m][0]);                                   \
                acc[m][1] = _mm256_fmadd_ps(xl, lo1, acc[m][1]);                                   \
                acc[m][0] = _mm256_fmadd_ps(xh, hi0, acc[m][0]);                                   \
                acc[m][1] = _mm256_fmadd_ps(xh, hi1, acc[m][1]);                                   \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; m++) {                                     \
            /* [r0 | r1] and [r2 | r3] -> r0, r1, r2, r3 */                                        \
            __m256 h = _mm256_hadd_ps(acc[m][0], acc[m][1]);                                       \
            h = _mm256_hadd_ps(h, h);                                                              \
            _mm_storeu_ps(out + m * 4, _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))); \
        }                                                                                          \
    }
TILE_M(1)
TILE_M(2)
TILE_M(3)
TILE_M(4)
TILE_M(5)
#endif

/* Rows of x against tile wt (whole chunks only): mt (1..MAX_PASS_ROWS) x 4 sums into out. */
static void tile_rows(const float *x, int64_t ldx, const uint16_t *wt, int64_t kfull, int mt, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    switch (mt) {
        case 1: tile_1(x, ldx, wt, kfull, out); return;
        case 2: tile_2(x, ldx, wt, kfull, out); return;
        case 3: tile_3(x, ldx, wt, kfull, out); return;
        case 4: tile_4(x, ldx, wt, kfull, out); return;
        default: tile_5(x, ldx, wt, kfull, out); return;
    }
#else
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) {
            float s = 0.0f;
            for (int64_t c = 0; c < kfull; c++)
                for (int e = 0; e < CHUNK; e++)
                    s += x[m * ldx + c * CHUNK + e] * bf16_to_f32(wt[(c * TILE_ROWS + j) * CHUNK + slot(e)]);
            out[m * 4 + j] = s;
        }
#endif
}

/* Rows m0 .. m0 + mt - 1 of tile t's 4 outputs: the whole chunks' sums from part (row stride
 * ldp), the partial last chunk of K from x's floats, the bias. A tile with neither (every tile of
 * a model's usual shapes but a padded last one) takes the short way: per row one 4-wide add and
 * store, which the compiler vectorizes. The general loop cost as much as a quarter of the
 * products' time at 16-64 rows (a call and a branch per output; RESULTS.md, session 27). */
static inline void store_rows(const float *x, int64_t ldx, const uint16_t *wt, const float *bias, float *y,
                              int64_t m0, int mt, int64_t t, int64_t N, int64_t K, int64_t kfull,
                              const float *part, int ldp) {
    const int64_t col0 = t * TILE_ROWS;
    if (kfull * CHUNK == K && col0 + TILE_ROWS <= N) {
        float b[TILE_ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (bias) memcpy(b, bias + col0, sizeof b);
        for (int m = 0; m < mt; m++) {
            float *yr = y + (m0 + m) * N + col0;
            const float *pr = part + m * ldp;
            for (int j = 0; j < TILE_ROWS; j++) yr[j] = pr[j] + b[j];
        }
        return;
    }
    const uint16_t *last = wt + kfull * TILE_ROWS * CHUNK; /* the partial chunk, if any */
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < TILE_ROWS; j++) {
            const int64_t col = t * TILE_ROWS + j;
            if (col >= N) break; /* the zero rows that pad N */
            const float *xr = x + (m0 + m) * ldx;
            float v = part[m * ldp + j] + tail_dot(xr, last, j, kfull * CHUNK, K);
            y[(m0 + m) * N + col] = bias ? v + bias[col] : v;
        }
}

/* The product's work split: tiles in blocks over the threads, each tile passed once per group of
 * up to MAX_PASS_ROWS rows; the partial last chunk of K summed from x's floats. */
static void gemv_tiles(const float *x, int64_t ldx, const uint16_t *wp, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int threads) {
    const int64_t kfull = K / CHUNK, kchunks = (K + CHUNK - 1) / CHUNK;
    const int64_t tile_len = TILE_ROWS * CHUNK * kchunks; /* values per tile */
    const int64_t ntiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t nblocks = (ntiles + TILES_PER_BLOCK - 1) / TILES_PER_BLOCK;
    if (threads > nblocks) threads = (int)nblocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        float part[MAX_PASS_ROWS * 4];
        const int64_t t_end = (b + 1) * TILES_PER_BLOCK < ntiles ? (b + 1) * TILES_PER_BLOCK : ntiles;
        for (int64_t t = b * TILES_PER_BLOCK; t < t_end; t++) {
            for (int64_t m0 = 0; m0 < M;) {
                const int64_t left = M - m0, passes = (left + MAX_PASS_ROWS - 1) / MAX_PASS_ROWS;
                const int mt = (int)((left + passes - 1) / passes); /* 6 rows: 3 + 3, 7: 4 + 3 */
                tile_rows(x + m0 * ldx, ldx, wp + t * tile_len, kfull, mt, part);
                store_rows(x, ldx, wp + t * tile_len, bias, y, m0, mt, t, N, K, kfull, part, 4);
                m0 += mt;
            }
        }
    }
}

/* x (M, K) with row stride ldx, wp the tiled W (ceil(N / 4) tiles of 4 x ceil(K / 8) * 8 values),
 * bias (N,) or NULL, y (M, N) contiguous. */
int pd_gemv_bf16(const float *x, int64_t ldx, const uint16_t *wp, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || threads < 1) return -1;
    if (M > 0 && N > 0) gemv_tiles(x, ldx, wp, bias, y, M, N, K, threads);
    return 0;
}

/* W (N, K) float32, row-major with row stride ldw, into the tiled, interleaved bfloat16 layout above (`out`:
 * ceil(N / 4) * 4 * ceil(K / 8) * 8 values, padding written as zeros), in one pass and without a
 * temporary. Returns 0, or 1 when some value is not a bfloat16 (its low 16 bits are not zero:
 * the copy would round it, so the caller keeps no copy; `out` is then garbage), or -1 on bad
 * arguments. Tiles are split over `threads`. */
int pd_pack_bf16_from_f32(const float *w, int64_t ldw, int64_t N, int64_t K, uint16_t *out, int threads) {
    if (N < 0 || K < 0 || ldw < K || threads < 1) return -1;
    const int64_t kchunks = (K + CHUNK - 1) / CHUNK, ntiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t tile_len = TILE_ROWS * CHUNK * kchunks;
    int inexact = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : inexact)
    for (int64_t t = 0; t < ntiles; t++) {
        uint16_t *dst = out + t * tile_len;
        for (int j = 0; j < TILE_ROWS; j++) {
            const int64_t row = t * TILE_ROWS + j;
            for (int64_t c = 0; c < kchunks; c++) {
                uint16_t *d = dst + (c * TILE_ROWS + j) * CHUNK;
                for (int e = 0; e < CHUNK; e++) { /* column e of the chunk, into its slot */
                    const int64_t k = c * CHUNK + e;
                    uint32_t u = 0;
                    if (row < N && k < K) memcpy(&u, w + row * ldw + k, sizeof u);
                    inexact |= (u & 0xFFFFu) != 0;
                    d[slot(e)] = (uint16_t)(u >> 16);
                }
            }
        }
    }
    return inexact;
}
