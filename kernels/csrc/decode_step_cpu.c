/* Every decoder layer of a decode step in one call: the same C kernels the eager layer calls
 * (gemv_bf16_cpu.c, elementwise_cpu.c, paged_decode_cpu.c), in the same order on the same
 * arguments, so the result is bit for bit the eager one; only the Python between them is gone.
 *
 * Why: at batch 1 a 125M Llama's eager step makes ~3,300 Python calls (module calls, tensor
 * checks, views, ctypes argument conversion) around ~100 kernel calls: ~6-7 ms of a ~15-20 ms
 * step on a 2-core EPYC, all of it outside the weight reads the step is bound by. Here one call
 * walks an array of per-layer descriptors. The kernels are reached through function pointers the
 * caller passes (kernels/decode_step_cpu.py takes them from the libraries native.py built), so
 * each kernel keeps exactly one definition.
 *
 * Scope (the caller checks it, models/cpu_decode_step.py): dense pre-norm layers with
 * RMSNorm, a fused qkv projection (optional bias), per-head q/k RMSNorm or none (Qwen3), rotary
 * or none, paged attention over a float32
 * or bfloat16 cache, o_proj (optional bias), SiLU-gated MLP; every linear weight a bf16 decode
 * copy; one query token per request.
 *
 * bf16 (a bfloat16 model): the buffers stay float32 and hold bfloat16 values, rounded where the
 * eager layers' bfloat16 ops round: every product's output (the weights' tiles are the model's own
 * bfloat16 values, the sum float32, as oneDNN's bf16 GEMM does), the attention's output, and inside
 * the element-wise kernels their bf16 mode (elementwise_cpu.c). The caller widens the embeddings in
 * and narrows the result out, both exact. Returns 0, or the first failing kernel's code (the caller then
 * raises: by then the cache may have been written, so there is no silent fallback).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

typedef int (*gemv_fn)(const float *, int64_t, const uint16_t *, const float *, float *, int64_t, int64_t,
                       int64_t, int);
typedef int (*rms_fn)(const float *, int64_t, const float *, int64_t, const float *, float *, int64_t, float *,
                      int64_t, int64_t, int64_t, float, int, int);
typedef int (*rotary_fn)(const int64_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                         int64_t, int, int, int);
typedef int (*silu_fn)(const float *, int64_t, float *, int64_t, int64_t, int64_t, int, int);
typedef int (*paged_fn)(const float *, float *, const void *, const void *, int, const int32_t *, int64_t,
                        const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);

typedef struct {
    const float *ln1, *ln2;                      /* input / post-attention RMSNorm weights (H) */
    const uint16_t *qkv, *o, *gate_up, *down;    /* bf16 tiles (gemv_bf16_cpu.c layout) */
    const float *qkv_bias, *o_bias;              /* or NULL */
    const float *gate_up_bias, *down_bias;       /* or NULL (Llama's mlp_bias) */
    const float *q_norm, *k_norm;                /* per-head RMSNorm weights (D), Qwen3; or NULL */
    void *k_cache, *v_cache;                     /* (num_blocks, block_size, Hk, D) */
    int64_t window;                              /* 0: full attention */
    int64_t rotary;                              /* 1: rotate q and k */
} pd_layer;

typedef struct {
    int64_t hidden, inter, hq, hk, d, n_layers, block_size, cache_dtype; /* 0 float32, 1 bfloat16 */
    int64_t rot, max_pos, neox;
    int64_t bf16; /* 1: a bfloat16 model's step (below) */
    float eps, scale;
    float res_mult; /* Granite's residual_multiplier on each block's output (1: none) */
    const float *cos_sin;
    const float *final_ln;
    gemv_fn gemv;
    rms_fn rms;
    rotary_fn rotary;
    silu_fn silu;
    paged_fn paged;
} pd_model;

/* bf16 mode: a product's or the attention's n outputs rounded to bfloat16 values, as torch
 * rounds a bfloat16 linear's (float32-accumulated) result and the attention's .to(q.dtype). */
static void round_all(const pd_model *m, float *x, int64_t n) {
    if (!m->bf16) return;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = round_bf16(x[i]);
}

/* Granite: a block's output times residual_multiplier before it joins the residual stream, in the
 * model's dtype as the eager layer's `hidden * multiplier` is (the product rounded again). */
static void scale_all(const pd_model *m, float *x, int64_t n) {
    if (m->res_mult == 1.0f) return;
    const float s = m->res_mult;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] *= s;
    round_all(m, x, n);
}

/* The new tokens' K and V rows into their cache slots (slot < 0: not written): K from k (row
 * stride ldk), V from v (row stride ldv). */
static void write_cache(const pd_model *m, const pd_layer *l, const float *kbase, int64_t ldk, const float *vbase,
                        int64_t ldv, int64_t M, const int64_t *slots) {
    const int64_t row = m->hk * m->d;
    for (int64_t t = 0; t < M; t++) {
        if (slots[t] < 0) continue;
        const float *k = kbase + t * ldk, *v = vbase + t * ldv;
        if (m->cache_dtype == 0) {
            memcpy((float *)l->k_cache + slots[t] * row, k, (size_t)row * sizeof(float));
            memcpy((float *)l->v_cache + slots[t] * row, v, (size_t)row * sizeof(float));
        } else {
            uint16_t *kc = (uint16_t *)l->k_cache + slots[t] * row, *vc = (uint16_t *)l->v_cache + slots[t] * row;
            for (int64_t i = 0; i < row; i++) {
                kc[i] = (uint16_t)bf16_bits(k[i]);
                vc[i] = (uint16_t)bf16_bits(v[i]);
            }
        }
    }
}

/* hidden (M, H): in, the embeddings; out, the final norm's output. scratch: at least
 * pd_decode_scratch_floats(m, M) floats. */
int64_t pd_decode_scratch_floats(const pd_model *m, int64_t M) {
    const int64_t qkv = (m->hq + 2 * m->hk) * m->d;
    return M * (3 * m->hidden + qkv + 2 * m->hq * m->d + m->hk * m->d + 3 * m->inter);
}

int pd_decode_layers(const pd_model *m, const pd_layer *layers, float *hidden, int64_t M, const int64_t *positions,
                     const int64_t *slots, const int32_t *tables, int64_t table_stride, const int64_t *seq_lens,
                     float *scratch, int threads) {
    const int64_t H = m->hidden, I = m->inter, qd = m->hq * m->d, kvd = m->hk * m->d, nqkv = qd + 2 * kvd;
    float *residual = scratch, *x = residual + M * H, *y = x + M * H, *qkv = y + M * H;
    float *q = qkv + M * nqkv, *attn = q + M * qd, *kn = attn + M * qd, *gu = kn + M * kvd, *act = gu + M * 2 * I;
    const int B = (int)m->bf16;
    int rc;
    for (int64_t i = 0; i < m->n_layers; i++) {
        const pd_layer *l = layers + i;
        /* x = norm(hidden) (layer 0: the embeddings are the residual stream), or
         * x, residual = norm(mlp_out + residual), residual + mlp_out */
        if (i == 0) {
            memcpy(residual, hidden, (size_t)(M * H) * sizeof(float));
            rc = m->rms(hidden, H, NULL, 0, l->ln1, x, H, NULL, 0, M, H, m->eps, B, threads);
        } else {
            rc = m->rms(y, H, residual, H, l->ln1, x, H, residual, H, M, H, m->eps, B, threads);
        }
        if (rc) return rc;
        if ((rc = m->gemv(x, H, l->qkv, l->qkv_bias, qkv, M, nqkv, H, threads))) return rc;
        round_all(m, qkv, M * nqkv);
        const float *k = qkv + qd; /* row stride nqkv, or kvd once normed into kn */
        int64_t ldk = nqkv;
        if (l->q_norm != NULL) {
            /* Qwen3: RMSNorm over each head's D values (the eager layer's rows of D), into q and kn;
             * then q and k rotated apart (eager rotates the two copies in two calls). */
            for (int64_t t = 0; t < M; t++) {
                if ((rc = m->rms(qkv + t * nqkv, m->d, NULL, 0, l->q_norm, q + t * qd, m->d, NULL, 0, m->hq, m->d,
                                 m->eps, B, threads)) ||
                    (rc = m->rms(qkv + t * nqkv + qd, m->d, NULL, 0, l->k_norm, kn + t * kvd, m->d, NULL, 0, m->hk,
                                 m->d, m->eps, B, threads)))
                    return rc;
            }
            if (l->rotary &&
                ((rc = m->rotary(positions, q, qd, m->d, M, m->hq, m->rot, m->cos_sin, m->max_pos, (int)m->neox, B,
                                 threads)) ||
                 (rc = m->rotary(positions, kn, kvd, m->d, M, m->hk, m->rot, m->cos_sin, m->max_pos, (int)m->neox, B,
                                 threads))))
                return rc;
            k = kn;
            ldk = kvd;
        } else {
            /* q and k side by side in the projection's output, rotated in place as one call */
            if (l->rotary &&
                (rc = m->rotary(positions, qkv, nqkv, m->d, M, m->hq + m->hk, m->rot, m->cos_sin, m->max_pos,
                                (int)m->neox, B, threads)))
                return rc;
            for (int64_t t = 0; t < M; t++) memcpy(q + t * qd, qkv + t * nqkv, (size_t)qd * sizeof(float));
        }
        write_cache(m, l, k, ldk, qkv + qd + kvd, nqkv, M, slots);
        if ((rc = m->paged(q, attn, l->k_cache, l->v_cache, (int)m->cache_dtype, tables, table_stride, seq_lens, M,
                           m->hq, m->hk, m->d, m->block_size, l->window, m->scale, threads)))
            return rc;
        round_all(m, attn, M * qd);
        if ((rc = m->gemv(attn, qd, l->o, l->o_bias, y, M, H, qd, threads))) return rc;
        round_all(m, y, M * H);
        scale_all(m, y, M * H);
        if ((rc = m->rms(y, H, residual, H, l->ln2, x, H, residual, H, M, H, m->eps, B, threads))) return rc;
        if ((rc = m->gemv(x, H, l->gate_up, l->gate_up_bias, gu, M, 2 * I, H, threads))) return rc;
        round_all(m, gu, M * 2 * I);
        if ((rc = m->silu(gu, 2 * I, act, I, M, I, B, threads))) return rc;
        if ((rc = m->gemv(act, I, l->down, l->down_bias, y, M, H, I, threads))) return rc;
        round_all(m, y, M * H);
        scale_all(m, y, M * H);
    }
    return m->rms(y, H, residual, H, m->final_ln, hidden, H, residual, H, M, H, m->eps, B, threads);
}
