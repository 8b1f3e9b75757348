/* The element-wise ops of a decoder layer on the CPU in float32: RMSNorm (with the residual add
 * fused), rotary position embedding in place, SiLU-and-mul.
 *
 * Why: in eager torch each of these is 3-8 aten calls (RMSNorm: pow, mean, add, rsqrt, two
 * multiplies), and at decode sizes (a few rows of 64-4096 values) every call costs its dispatch,
 * not its arithmetic: about 20 calls per layer, ~2 ms of a 125M model's batch-1 step on a 2-core
 * AVX2 EPYC. Here each op is one call. Rows are independent; OpenMP splits them only when a call
 * has enough work to repay waking the threads (PARALLEL_MIN elements).
 *
 * Numerics follow the torch references in kernels/*.py (float32 throughout): RMSNorm
 * x * (1 / sqrt(mean(x^2) + eps)) * w, the residual sum rounded once; rotary
 * x1 cos - x2 sin, x2 cos + x1 sin; silu(g) * u. Only the order of the mean's sum and the
 * contraction of multiply-adds differ, i.e. last-bit differences. Returns 0, or a negative code on
 * arguments the kernel cannot take (the caller then runs the torch reference).
 *
 * bf16 != 0: the inputs hold bfloat16 values (float32 memory) and every result is rounded to a
 * bfloat16 value where torch's bfloat16 ops round: RMSNorm's residual sum, its normalised value
 * before the weight (`(x * r).to(bf16) * w`) and the product; silu(g) before the multiply by u and
 * the product; each rotated value. So a bfloat16 model's decode step runs these kernels on widened
 * values and gets what its bfloat16 ops give, up to the same last-bit differences before rounding.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

#define PARALLEL_MIN 65536 /* elements per call below which one thread does all */

/* out[t] = rms_norm(x[t] (+ res[t])) * w, and res_out[t] = x[t] + res[t] when res is given.
 * Row strides in elements; the last dimension contiguous. */
int pd_rms_norm(const float *x, int64_t ldx, const float *res, int64_t ldr, const float *w, float *out,
                int64_t ldo, float *res_out, int64_t ldro, int64_t T, int64_t H, float eps, int bf16, int threads) {
    if (T < 0 || H <= 0 || threads < 1) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        float *o = out + t * ldo;
        const float *src = xr;
        if (res != NULL) {
            const float *rr = res + t * ldr;
            float *ro = res_out + t * ldro;
#pragma omp simd
            for (int64_t i = 0; i < H; i++) ro[i] = BF16_ROUND(bf16, xr[i] + rr[i]);
            src = ro;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += src[i] * src[i];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = BF16_ROUND(bf16, BF16_ROUND(bf16, src[i] * r) * w[i]);
    }
    return 0;
}

/* Rotate, in place, the first `rot` channels of every head of x (T, nh, D), token t at
 * positions[t], with cos_sin (max_pos, rot): cos in the first rot/2 columns, sin in the last.
 * NeoX pairs (i, i + rot/2); GPT-J pairs (2i, 2i + 1). A position outside [0, max_pos) is an error
 * (-2) before anything is written. */
int pd_rotary(const int64_t *positions, float *x, int64_t ldt, int64_t ldh, int64_t T, int64_t nh, int64_t rot,
              const float *cos_sin, int64_t max_pos, int neox, int bf16, int threads) {
    if (T < 0 || nh < 0 || rot <= 0 || rot % 2 || threads < 1) return -1;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -2;
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * nh * rot >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * rot, *s = c + half;
        for (int64_t h = 0; h < nh; h++) {
            float *v = x + t * ldt + h * ldh;
            if (neox) {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = BF16_ROUND(bf16, x1 * c[i] - x2 * s[i]);
                    v[i + half] = BF16_ROUND(bf16, x2 * c[i] + x1 * s[i]);
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = v[2 * i], x2 = v[2 * i + 1];
                    v[2 * i] = BF16_ROUND(bf16, x1 * c[i] - x2 * s[i]);
                    v[2 * i + 1] = BF16_ROUND(bf16, x2 * c[i] + x1 * s[i]);
                }
            }
        }
    }
    return 0;
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i]. silu(g) = g / (1 + e^-g), computed from e = e^-|g|
 * (an exponent <= 0, the vectorized helper): g / (1 + e) for g >= 0, g e / (1 + e) below. */
int pd_silu_and_mul(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t T, int64_t I, int bf16,
                    int threads) {
    if (T < 0 || I < 0 || threads < 1) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * I >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * ldx, *u = g + I;
        float *o = out + t * ldo;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float gi = g[i];
            const float e = exp_nonpositive(-fabsf(gi));
            const float sig = (gi >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = BF16_ROUND(bf16, BF16_ROUND(bf16, gi * sig) * u[i]);
        }
    }
    return 0;
}
