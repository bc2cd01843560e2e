/* The fused decode path's work on CPU in fp32, one thread, in plain C (no torch headers, so it
 * builds in about a second; cpu_kernels.py compiles these files into one library and loads it):
 *   cpu_kernels.c    the norms, SiLU·up and the pick of the next tokens (generation.py);
 *   cpu_attention.c  RoPE, the KV cache writes and the attention of a decode step and a prefill;
 *   cpu_matmul.c     the panel matmul and its weights' packing (matmul_kernels.py);
 *   cpu_decode.c     a decode step through every layer in one call (fast_decode.py).
 * Each function is what a handful of torch ops do, in one pass over the data; torch's ops (the
 * fallback, and the reference in the tests) compute the same to float rounding.
 *
 * A decode step's q, k, v heads (row-major, strides in floats): row b at qkv + b * qkv_stride, heads
 * of d floats one after another (H query heads, then Hkv key heads, then Hkv value heads), q and k
 * in RoPE's paired order (element pairs (2i, 2i+1) rotate together); rot [B, d/2, 2]: cos, sin
 * of each pair's angle. The KV cache's layout: decode_attention.
 */
#ifndef HFLOW_CPU_KERNELS_H
#define HFLOW_CPU_KERNELS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight floats, loaded and stored unaligned: explicit SIMD that the compiler maps onto the CPU's
 * vectors (one AVX register, half an AVX-512 one, two NEON ones). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define LANES 8
#define CHUNK (4 * LANES)  /* cache slots per page (cpu_kernels.py: CHUNK) */

#define PANEL (4 * LANES)  /* output features per panel of a packed weight (cpu_kernels.py: PANEL) */

/* exp(x) to a few float ulps for x in [-86.9, 88] (clamped there, so 2.3e-38 below: no subnormal
 * results, which cost an assist each; nothing reads it as more than 0 — attention's values are
 * read up to the live slots only): 2^n · p(r), x = n·ln2 + r, p Cephes expf's polynomial, 2^n
 * built in the float's exponent bits. Inline and free of selects, so `omp simd` loops compute it
 * in vectors in place, a third faster than glibc's vector expf (a call per vector); gcc turns a
 * select in or around it into control flow, and the loop then stays scalar. For the decode
 * path's exps: attention's softmax, SiLU, the greedy pick's normaliser; sampling keeps expf. */
static inline float exp_fast(float x) {
    x = fminf(fmaxf(x, -86.9f), 88.f);
    const float t = x * 1.44269504f;
    const int32_t n = (int32_t)(t + copysignf(0.5f, t));  /* rounded */
    /* x - n·ln2 with ln2 in two parts, as fmas: -ffast-math may merge the parts of a plain
     * expression into one constant, which loses float precision of r as n grows */
    const float r = fmaf((float)n, -1.42860677e-6f, fmaf((float)n, -0.693145752f, x));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = (n + 127) << 23;  /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* 1 / sqrt(sum(x^2) + n_eps) over a row x of n floats: RMSNorm's scale (its sqrt(n) and weight
 * are folded into the next matmul's weight: fast_decode.py). */
static inline float inv_rms(const float *x, int64_t n, float n_eps) {
    float s = 0.f;
#pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
    return 1.f / sqrtf(s + n_eps);
}

/* Cache pages that rows b < B reach, each up to its slot slots[b] (decode_attention's layout). */
static inline int64_t live_pages(const int64_t *slots, int64_t B) {
    int64_t pages = 0;
    for (int64_t b = 0; b < B; ++b)
        pages = slots[b] / CHUNK + 1 > pages ? slots[b] / CHUNK + 1 : pages;
    return pages;
}

/* silu(g) = g / (1 + exp(-g)), finite where exp(-g) would overflow (exp_fast clamps; -ffast-math has no inf). */
static inline float silu(float g) {
    return g / (1.f + exp_fast(-g));
}

void decode_attention(const float *qkv, int64_t qkv_stride, const float *rot, int64_t rot_stride,
                      float *keys, float *values, const int64_t *slots, const float *mask, int64_t mask_stride,
                      int64_t B, int64_t H, int64_t Hkv, int64_t d, float *out, float *scratch);
void panel_matmul(const float *x, int64_t x_stride, int64_t rows, const float *wp, int64_t O, int64_t I,
                  const float *bias, const float *residual, int64_t res_stride, float *y, float norm_eps,
                  int64_t gated, int64_t *pick, float *pick_logp);
void panel_matmul_fetching(const float *x, int64_t x_stride, int64_t rows, const float *wp, int64_t O, int64_t I,
                           const float *bias, const float *residual, int64_t res_stride, float *y, float norm_eps,
                           int64_t gated, int64_t *pick, float *pick_logp, const void *bg, int64_t bg_bytes);

#endif
