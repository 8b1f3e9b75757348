/* Greedy sampling's argmax over float32 logits, one index per row: what torch.argmax(x, dim=-1)
 * returns, the first index of the row's maximum, or of its first NaN (torch orders NaN above
 * every number), -0.0 and 0.0 equal.
 *
 * Why: torch's argmax over (rows, vocab) float32 on the CPU ran ~37 us per 32,000-entry row on a
 * 2-core Zen 3 and ~1 ms at 8 rows, ~3 ms at 32 (one step of the 125M bench Llama at batch 32 is
 * ~30 ms): its reduction carries (value, index) pairs through every lane. Here a row is two
 * vectorizable passes over memory the LM head just wrote (in cache): the maximum (and whether any
 * NaN is present), then the first index holding it. Rows are split over the threads.
 *
 * Built at first use by kernels/native.py. Returns 0, or -1 on bad arguments.
 */
#include <stdint.h>

#define SCAN 64 /* values tested at once while looking for the first hit */

/* The first index i < n with x[i] == m (nan: with x[i] a NaN), in blocks of SCAN whose test
 * vectorizes (a loop that stops at its first hit does not); -1 if none. */
static int64_t first_hit(const float *x, int64_t n, float m, int nan) {
    int64_t i = 0;
    for (; i + SCAN <= n; i += SCAN) {
        int hit = 0;
        if (nan) {
#pragma omp simd reduction(| : hit)
            for (int j = 0; j < SCAN; j++) hit |= x[i + j] != x[i + j];
        } else {
#pragma omp simd reduction(| : hit)
            for (int j = 0; j < SCAN; j++) hit |= x[i + j] == m;
        }
        if (hit) break;
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return -1;
}

static int64_t row_argmax(const float *x, int64_t n) {
    float m = x[0];
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    return first_hit(x, n, m, nan); /* found: m is one of the row's values, or a NaN is */
}

/* x (rows, n) with row stride ldx, n >= 1; out (rows,). */
int pd_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out, int threads) {
    if (rows < 0 || n < 1 || ldx < n || threads < 1) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1 && threads > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * ldx, n);
    return 0;
}
