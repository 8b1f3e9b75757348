/* Small math helpers shared by the C kernels of this folder (header-only, static inline). */
#ifndef PDCLUSTER_CPU_MATH_H
#define PDCLUSTER_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 (a score minus its row's maximum), in a form the compiler vectorizes (libm's expf
 * is a scalar call per score: a third of the kernel's time before this). Range reduction
 * x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes' coefficients), 2^n through
 * the exponent bits; relative error ~2 float32 ulp. Below -87 the result is clamped to e^-87
 * (~1e-38, a weight that cannot move a float32 sum); a NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale2;
    memcpy(&scale2, &bits, sizeof scale2);
    return p * scale2;
}

/* float32 -> the nearest bfloat16, as a float32 (round to nearest even; a NaN stays a quiet NaN):
 * the value torch's .to(torch.bfloat16) keeps. The kernels' bfloat16 mode rounds with it at the
 * points where torch's bfloat16 ops round, so buffers stay float32 and hold bfloat16 values. */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x0040u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

static inline float round_bf16(float f) {
    const uint32_t u = bf16_bits(f) << 16;
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* x = round_bf16(x) when bf16 is set: a kernel output rounded as torch rounds a bfloat16 result. */
#define BF16_ROUND(bf16, x) ((bf16) ? round_bf16(x) : (x))

#endif
