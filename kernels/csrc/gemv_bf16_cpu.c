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
 * 32 values, one 64-byte cache line. Both ends are zero padded (N to a multiple of 4, K to one of
 * 8). So a tile is one sequential run of memory the hardware prefetcher follows from its first
 * line, where the row-major layout made each thread chase 8 rows of 1.5-4 KB at once: on a 2-core
 * EPYC the 125M Llama's 49 products per decode step went 13.3 -> 8.8 ms at M = 1 (~1.5x, 30 GB/s
 * on the LM head), with no loss at any M up to 16 (benchmarks/gemv_bf16.py).
 *
 * Work split: tiles in blocks of 16 (64 output features) divided over the threads; inside a block
 * each tile is passed once per 3 rows of x (the tile, 4 * K * 2 bytes, stays in L1/L2 between
 * passes).
 *
 * Built at first use by kernels/native.py (-O3 -march=native -fopenmp); the AVX2/FMA path needs
 * those instructions at build time, otherwise the portable loop below runs (the compiler
 * vectorizes it as far as the target allows). Returns 0, or a negative code on bad arguments.
 */
#include <stdint.h>
#include <string.h>

#define TILE_ROWS 4
#define CHUNK 8
#define TILES_PER_BLOCK 16
/* Software prefetch this many weight values (1 KiB) ahead of the chunk being read: the hardware
 * prefetcher alone left ~10% on the table at block starts. Past the end of W is harmless: a
 * prefetch never faults. */
#define PREFETCH_AHEAD 512

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Columns [8 * kfull, K) of one tile against rows of x: the partial last chunk. */
static inline float tail_dot(const float *xr, const uint16_t *chunk, int j, int64_t k0, int64_t K) {
    float s = 0.0f;
    for (int64_t k = k0; k < K; k++) s += xr[k] * bf16_to_f32(chunk[j * CHUNK + (k - k0)]);
    return s;
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

/* One row of x against one tile over its kfull whole chunks: two chunks per iteration into two
 * sets of accumulators, so eight independent FMA chains keep the loads coming. out: 4 sums. */
static void tile_1(const float *x, const uint16_t *wt, int64_t kfull, float *out) {
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= kfull; c += 2) {
        const uint16_t *wc = wt + c * TILE_ROWS * CHUNK;
        _mm_prefetch((const char *)(wc + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(wc + PREFETCH_AHEAD + TILE_ROWS * CHUNK), _MM_HINT_T0);
        __m256 x0 = _mm256_loadu_ps(x + c * CHUNK), x1 = _mm256_loadu_ps(x + (c + 1) * CHUNK);
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_fmadd_ps(x0, load_bf16x8(wc + j * CHUNK), a[j]);
            b[j] = _mm256_fmadd_ps(x1, load_bf16x8(wc + TILE_ROWS * CHUNK + j * CHUNK), b[j]);
        }
    }
    for (; c < kfull; c++) {
        const uint16_t *wc = wt + c * TILE_ROWS * CHUNK;
        __m256 x0 = _mm256_loadu_ps(x + c * CHUNK);
        for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(x0, load_bf16x8(wc + j * CHUNK), a[j]);
    }
    for (int j = 0; j < 4; j++) a[j] = _mm256_add_ps(a[j], b[j]);
    _mm_storeu_ps(out, hsum4(a[0], a[1], a[2], a[3]));
}

/* MT (2 or 3) rows of x against one tile: each weight vector loaded and widened once for all MT
 * rows; 4 * MT accumulators + MT x vectors + 1 weight vector fit AVX2's 16 registers.
 * out: MT x 4 sums, row-major. */
#define TILE_M(MT)                                                                                 \
    static void tile_##MT(const float *x, int64_t ldx, const uint16_t *wt, int64_t kfull, float *out) { \
        __m256 acc[MT][4];                                                                         \
        for (int m = 0; m < MT; m++)                                                               \
            for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();                           \
        for (int64_t c = 0; c < kfull; c++) {                                                      \
            const uint16_t *wc = wt + c * TILE_ROWS * CHUNK;                                       \
            _mm_prefetch((const char *)(wc + PREFETCH_AHEAD), _MM_HINT_T0);                        \
            __m256 xv[MT];                                                                         \
            for (int m = 0; m < MT; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + c * CHUNK);        \
            for (int j = 0; j < 4; j++) {                                                          \
                __m256 wv = load_bf16x8(wc + j * CHUNK);                                           \
                for (int m = 0; m < MT; m++) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);    \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < MT; m++) _mm_storeu_ps(out + m * 4, hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3])); \
    }
TILE_M(2)
TILE_M(3)
#endif

/* Rows m0..m0+mt-1 of x against tile wt (whole chunks only): mt x 4 sums into out. */
static void tile_rows(const float *x, int64_t ldx, const uint16_t *wt, int64_t kfull, int mt, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    switch (mt) {
        case 1: tile_1(x, wt, kfull, out); return;
        case 2: tile_2(x, ldx, wt, kfull, out); return;
        default: tile_3(x, ldx, wt, kfull, out); return;
    }
#else
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 4; j++) {
            float s = 0.0f;
            for (int64_t c = 0; c < kfull; c++)
                for (int e = 0; e < CHUNK; e++)
                    s += x[m * ldx + c * CHUNK + e] * bf16_to_f32(wt[(c * TILE_ROWS + j) * CHUNK + e]);
            out[m * 4 + j] = s;
        }
#endif
}

/* x (M, K) with row stride ldx, wp the tiled W (ceil(N / 4) tiles of 4 x ceil(K / 8) * 8 values),
 * bias (N,) or NULL, y (M, N) contiguous. */
int pd_gemv_bf16(const float *x, int64_t ldx, const uint16_t *wp, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || threads < 1) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t kfull = K / CHUNK, kchunks = (K + CHUNK - 1) / CHUNK;
    const int64_t tile_len = TILE_ROWS * CHUNK * kchunks; /* values per tile */
    const int64_t ntiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t nblocks = (ntiles + TILES_PER_BLOCK - 1) / TILES_PER_BLOCK;
    if (threads > nblocks) threads = (int)nblocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        float part[3 * 4];
        const int64_t t_end = (b + 1) * TILES_PER_BLOCK < ntiles ? (b + 1) * TILES_PER_BLOCK : ntiles;
        for (int64_t t = b * TILES_PER_BLOCK; t < t_end; t++) {
            const uint16_t *wt = wp + t * tile_len;
            const uint16_t *last = wt + kfull * TILE_ROWS * CHUNK; /* the partial chunk, if any */
            for (int64_t m0 = 0; m0 < M;) {
                const int mt = M - m0 >= 3 ? 3 : (int)(M - m0);
                tile_rows(x + m0 * ldx, ldx, wt, kfull, mt, part);
                for (int m = 0; m < mt; m++)
                    for (int j = 0; j < TILE_ROWS; j++) {
                        const int64_t col = t * TILE_ROWS + j;
                        if (col >= N) break; /* the zero rows that pad N */
                        const float *xr = x + (m0 + m) * ldx;
                        float v = part[m * 4 + j] + tail_dot(xr, last, j, kfull * CHUNK, K);
                        y[(m0 + m) * N + col] = bias ? v + bias[col] : v;
                    }
                m0 += mt;
            }
        }
    }
    return 0;
}

/* W (N, K) float32, row-major with row stride ldw, into the tiled bfloat16 layout above (`out`:
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
                for (int e = 0; e < CHUNK; e++) {
                    const int64_t k = c * CHUNK + e;
                    uint32_t u = 0;
                    if (row < N && k < K) memcpy(&u, w + row * ldw + k, sizeof u);
                    inexact |= (u & 0xFFFFu) != 0;
                    d[e] = (uint16_t)(u >> 16);
                }
            }
        }
    }
    return inexact;
}
