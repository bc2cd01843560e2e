/* The fused decode path's work on CPU in fp32, one thread: attention, norms, SiLU·up, the token
 * pick and the matmuls (cpu_kernels.py builds and loads this file; fast_decode.py,
 * matmul_kernels.py and generation.py call it). Plain C: no torch headers, so it builds in well under
 * a second. Each function is what a handful of torch ops do, in one pass over the data; torch's
 * ops (the fallback, and the reference in the tests) compute the same to float rounding.
 *
 * A decode step's q, k, v heads (row-major, strides in floats): row b at qkv + b * qkv_stride, heads
 * of d floats one after another (H query heads, then Hkv key heads, then Hkv value heads), q and k
 * in RoPE's paired order (element pairs (2i, 2i+1) rotate together); rot [B, d/2, 2]: cos, sin
 * of each pair's angle. The KV cache's layout: decode_attention.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* silu(g) = g / (1 + exp(-g)), finite where exp(-g) would overflow (exp_fast clamps; -ffast-math has no inf). */
static inline float silu(float g) {
    return g / (1.f + exp_fast(-g));
}

/* out[r] = x[r] / sqrt(sum(x[r]^2) + n_eps), rows of n floats. */
void rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t n, float n_eps, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        const float inv = inv_rms(xr, n, n_eps);
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv;
    }
}

/* out[r] = silu(gate[r]) * up[r] where gu[r] = gate | up, each of n floats. */
void silu_mul(const float *gu, int64_t gu_stride, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * gu_stride, *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * u[i];
    }
}

/* The largest of x[i] * scale over a row of V logits, and sum(exp(x[i] * scale - largest)) in *sum:
 * the row's log-normaliser is largest + log(*sum). */
static inline float max_and_sum(const float *x, int64_t V, float scale, float *sum) {
    float top = x[0] * scale, total = 0.f;
#pragma omp simd reduction(max:top)
    for (int64_t i = 0; i < V; ++i) top = x[i] * scale > top ? x[i] * scale : top;
#pragma omp simd reduction(+:total)
    for (int64_t i = 0; i < V; ++i) total += expf(x[i] * scale - top);
    *sum = total;
    return top;
}

/* The first index of the largest of x[0..V-1] (torch.argmax's choice; x is assumed free of NaN),
 * in one vector pass: each of 16 lanes keeps its largest value and where it first saw it (a
 * strictly larger value replaces it), then the lanes holding the overall largest give their
 * smallest index. */
static inline int64_t first_argmax(const float *x, int64_t V) {
    typedef float f16 __attribute__((vector_size(64), aligned(4)));
    typedef int32_t i16 __attribute__((vector_size(64)));
    int64_t best = 0, i = 0;
    if (V >= 16) {
        f16 top = *(const f16 *)x;
        i16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, here = at;
        for (i = 16; i + 16 <= V; i += 16) {
            const f16 v = *(const f16 *)(x + i);
            here += 16;
            const i16 more = v > top;
            top = (f16)(((i16)v & more) | ((i16)top & ~more));
            at = (here & more) | (at & ~more);
        }
        best = at[0];
        for (int l = 1; l < 16; ++l)
            if (top[l] > x[best] || (top[l] == x[best] && at[l] < best)) best = at[l];
    }
    for (; i < V; ++i)  /* the tail (or a row shorter than a vector), after every earlier index */
        if (x[i] > x[best]) best = i;
    return best;
}

/* Greedy decoding's pick from logits rows [rows, V]: the first index of each row's largest logit
 * and its log-probability, -log(sum(exp(x - max))). */
void greedy_pick(const float *logits, int64_t stride, int64_t rows, int64_t V, int64_t *tokens, float *logp) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = logits + r * stride;
        const int64_t first = first_argmax(x, V);
        const float top = x[first];
        float total = 0.f;
#pragma omp simd reduction(+:total)
        for (int64_t i = 0; i < V; ++i) total += exp_fast(x[i] - top);
        tokens[r] = first;
        logp[r] = -logf(total);
    }
}

/* Sampling's pick from logits rows [rows, V] (generation.sample_tokens, the same rules): logits
 * scaled by inv_temp; the candidates: the top_k largest (0: every index, in index order, and then
 * top_p must be 1), cut to the smallest prefix holding top_p of their mass; one index drawn by
 * inverse CDF with the row's uniform u[r] in [0, 1); its log-probability under the whole scaled
 * distribution (before the cut). scratch: max(V, top_k) floats; slots: top_k indices. */
void sample_pick(const float *logits, int64_t stride, int64_t rows, int64_t V, float inv_temp,
                 int64_t top_k, float top_p, const float *u, int64_t *tokens, float *logp,
                 float *scratch, int64_t *slots) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = logits + r * stride;
        float sum;
        const float top = max_and_sum(x, V, inv_temp, &sum), log_z = top + logf(sum);
        int64_t n = 0;  /* candidates: values in scratch (descending for top-k), indices in slots */
        if (top_k > 0) {
            for (int64_t i = 0; i < V; ++i) {  /* insertion into the k best so far; equal values keep index order */
                const float z = x[i] * inv_temp;
                if (n == top_k && !(z > scratch[n - 1])) continue;
                int64_t j = n < top_k ? n++ : n - 1;
                for (; j > 0 && z > scratch[j - 1]; --j) {
                    scratch[j] = scratch[j - 1];
                    slots[j] = slots[j - 1];
                }
                scratch[j] = z;
                slots[j] = i;
            }
            const float best = scratch[0];
            float mass = 0.f;  /* exp(z - best) of each candidate, then their cut by top_p */
            for (int64_t j = 0; j < n; ++j) mass += scratch[j] = expf(scratch[j] - best);
            if (top_p < 1.f) {
                float before = 0.f;
                int64_t keep = 0;
                while (keep < n && before <= top_p * mass) before += scratch[keep++];
                n = keep;
            }
        } else {
            for (int64_t i = 0; i < V; ++i) scratch[i] = expf(x[i] * inv_temp - top);
            n = V;
        }
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) total += scratch[j];
        float point = u[r] * total, cdf = 0.f;
        if (point >= total) point = nextafterf(total, 0.f);  /* u < 1, but u * total may round up to it */
        int64_t pick = n - 1;
        for (int64_t j = 0; j < n; ++j) {
            cdf += scratch[j];
            if (cdf > point) {
                pick = j;
                break;
            }
        }
        tokens[r] = top_k > 0 ? slots[pick] : pick;
        logp[r] = x[tokens[r]] * inv_temp - log_z;
    }
}

/* Eight floats, loaded and stored unaligned: explicit SIMD that the compiler maps onto the CPU's
 * vectors (one AVX register, half an AVX-512 one, two NEON ones). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define LANES 8
#define CHUNK (4 * LANES)  /* cache slots per page (cpu_kernels.py: CHUNK) */

/* RoPE: the element pairs (2i, 2i+1) of a head x rotated by (cos, sin) cs[2i], cs[2i+1], into
 * out[2i * stride], out[(2i+1) * stride]. */
static inline void rope(const float *x, const float *cs, int64_t half, float *out, int64_t stride) {
    for (int64_t i = 0; i < half; ++i) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        out[(2 * i) * stride] = x[2 * i] * c - x[2 * i + 1] * s;
        out[(2 * i + 1) * stride] = x[2 * i] * s + x[2 * i + 1] * c;
    }
}

/* Attention's vectors: 16 floats where the CPU has AVX-512, else 8 (a page row of CHUNK slots is
 * CHUNK / VW of them). */
#ifdef __AVX512F__
#define VW 16
#else
#define VW LANES
#endif
typedef float vw __attribute__((vector_size(4 * VW), aligned(4)));
#define GROUP 4  /* query heads of one kv head that go over a cache block together */

/* G query heads q [G, d] (those of one kv head) over one page's block of that kv head: keys K
 * [d, CHUNK], values V [CHUNK, d], n live slots, additive mask m (or NULL); the online softmax's
 * running max top[G] and sum sum[G], and out [G, d] (unnormalised), updated. `ahead`: how many
 * floats on to touch for the prefetcher (below). Inlined with G a constant: every accumulator a
 * register. */
static inline __attribute__((always_inline)) void attend_block(
    const int G, const float *K, const float *V, const float *m, int64_t n, const float *q, int64_t d,
    int64_t ahead, float *top, float *sum, float *out) {
    enum { NV = CHUNK / VW };
    /* scores: d vector updates per head; even and odd e in separate accumulators, so that 2·G·NV
     * chains of FMAs are in flight (a chain of d dependent FMAs would wait on each one's latency) */
    vw a[GROUP][2][NV];
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) a[j][0][v] = a[j][1][v] = (vw){0};
    for (int64_t e = 0; e < d; e += 2) {
        const float *ke = K + e * CHUNK;
        /* The next blocks' lines into L2 while this one computes: the cache is read from memory
         * (it outgrows the CPU's caches at large batches), and without this the loads wait, the
         * hardware prefetcher restarting at every 4 KB page. */
        for (int u = 0; u < 2 * CHUNK; u += 64 / sizeof(float)) __builtin_prefetch(ke + ahead + u, 0, 2);
        vw k0[NV], k1[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            k0[v] = *(const vw *)(ke + v * VW);
            k1[v] = *(const vw *)(ke + CHUNK + v * VW);
        }
#pragma GCC unroll 4
        for (int j = 0; j < G; ++j) {
            const float q0 = q[j * d + e], q1 = q[j * d + e + 1];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) {
                a[j][0][v] += q0 * k0[v];
                a[j][1][v] += q1 * k1[v];
            }
        }
    }
    float p[GROUP][CHUNK], scale[GROUP];  /* per head: the slots' weights, the rescale of out */
    for (int j = 0; j < G; ++j) {
        float *pj = p[j], best = top[j], total = 0.f;
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) *(vw *)(pj + v * VW) = a[j][0][v] + a[j][1][v];
        if (m)
            for (int64_t l = 0; l < n; ++l) pj[l] += m[l];
        /* dead slots (only on the last page, which holds the step's own slot, never masked, so
         * best is a real score): weight exp_fast's floor, below float rounding of the sum, and the
         * values loop stops at the live slots (a dead one's memory may hold anything) */
        for (int64_t l = n; l < CHUNK; ++l) pj[l] = -FLT_MAX;
        /* over the whole page (a constant count: whole vectors, no scalar remainder) */
#pragma omp simd reduction(max:best)
        for (int l = 0; l < CHUNK; ++l) best = pj[l] > best ? pj[l] : best;
#pragma omp simd reduction(+:total)
        for (int l = 0; l < CHUNK; ++l) {
            pj[l] = exp_fast(pj[l] - best);
            total += pj[l];
        }
        scale[j] = exp_fast(top[j] - best);
        top[j] = best;
        sum[j] = sum[j] * scale[j] + total;
    }
    /* out = out * scale + p · V, a row of V (2·CHUNK floats of it, then a CHUNK tail) per slot */
    for (int64_t e = 0; e < d; e += 2 * CHUNK) {
        const int wide = d - e >= 2 * CHUNK;
        vw o[GROUP][2 * NV];
#pragma GCC unroll 4
        for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
            for (int u = 0; u < 2 * NV; ++u) o[j][u] = u < NV || wide ? *(vw *)(out + j * d + e + u * VW) * scale[j] : (vw){0};
        if (wide)
            for (int64_t l = 0; l < n; ++l) {
                const float *vl = V + l * d + e;
                for (int u = 0; u < 2 * CHUNK; u += 64 / sizeof(float)) __builtin_prefetch(vl + ahead + u, 0, 2);
                vw x[2 * NV];
#pragma GCC unroll 8
                for (int u = 0; u < 2 * NV; ++u) x[u] = *(const vw *)(vl + u * VW);
#pragma GCC unroll 4
                for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
                    for (int u = 0; u < 2 * NV; ++u) o[j][u] += p[j][l] * x[u];
            }
        else
            for (int64_t l = 0; l < n; ++l) {
                const float *vl = V + l * d + e;
                for (int u = 0; u < CHUNK; u += 64 / sizeof(float)) __builtin_prefetch(vl + ahead + u, 0, 2);
                vw x[NV];
#pragma GCC unroll 4
                for (int u = 0; u < NV; ++u) x[u] = *(const vw *)(vl + u * VW);
#pragma GCC unroll 4
                for (int j = 0; j < G; ++j)
#pragma GCC unroll 4
                    for (int u = 0; u < NV; ++u) o[j][u] += p[j][l] * x[u];
            }
#pragma GCC unroll 4
        for (int j = 0; j < G; ++j)
#pragma GCC unroll 8
            for (int u = 0; u < 2 * NV; ++u)
                if (u < NV || wide) *(vw *)(out + j * d + e + u * VW) = o[j][u];
    }
}

/* attend_block for the g query heads of one kv head, GROUP at a time. */
static void attend_heads(int64_t g, const float *K, const float *V, const float *m, int64_t n, const float *q,
                         int64_t d, int64_t ahead, float *top, float *sum, float *out) {
    for (int64_t j = 0; j < g; j += GROUP) {
        const float *qj = q + j * d;
        float *oj = out + j * d;
        switch (g - j < GROUP ? g - j : GROUP) {
        case 1: attend_block(1, K, V, m, n, qj, d, ahead, top + j, sum + j, oj); break;
        case 2: attend_block(2, K, V, m, n, qj, d, ahead, top + j, sum + j, oj); break;
        case 3: attend_block(3, K, V, m, n, qj, d, ahead, top + j, sum + j, oj); break;
        default: attend_block(4, K, V, m, n, qj, d, ahead, top + j, sum + j, oj); break;
        }
    }
}

/* One decode step's attention for rows b < B: rotate the step's q and k heads, write k and v
 * into cache slot `slot`, attend every query head over slots 0..slot (its kv head's, grouped-query:
 * H / Hkv query heads per kv head) with the additive mask row mask + (b * Hkv + kv) * mask_stride
 * (NULL: every slot visible) -> out [B, H * d]. q carries attention's 1 / sqrt(d); d is a
 * multiple of CHUNK. scratch: B * H * (d + 2) floats.
 *
 * The cache is paged by CHUNK slots, every (row, kv head) of a chunk together:
 *   keys [chunks, B, Hkv, d, CHUNK] (a page's keys transposed: its scores are d vector updates),
 *   values [chunks, B, Hkv, CHUNK, d],
 * so a step reads the keys and the values each as one contiguous stream, page after page (the
 * next block's lines are prefetched the same distance on in either). Per (row, kv head) blocks
 * each in its own place would restart the CPU's prefetcher every block. The softmax is the online
 * one (a running max and sum per query head, the partial output rescaled when the max grows), so
 * each page is read once, keys and values together. The step's k and v go into the last page just
 * before its block is read (in cache then). Slots past `slot` are never read into the result
 * (their memory may hold anything). */
void decode_attention(const float *qkv, int64_t qkv_stride, const float *rot, int64_t rot_stride,
                      float *keys, float *values, int64_t slot, const float *mask, int64_t mask_stride,
                      int64_t B, int64_t H, int64_t Hkv, int64_t d, float *out, float *scratch) {
    const int64_t g = H / Hkv, half = d / 2, block = d * CHUNK, page = B * Hkv * block, last = slot / CHUNK;
    float *q = scratch, *top = scratch + B * H * d, *sum = top + B * H;  /* rotated q; running max, sum */
    for (int64_t b = 0; b < B; ++b) {
        const float *row = qkv + b * qkv_stride, *cs = rot + b * rot_stride;
        for (int64_t h = 0; h < H; ++h) {
            rope(row + h * d, cs, half, q + (b * H + h) * d, 1);
            top[b * H + h] = -FLT_MAX;
            sum[b * H + h] = 0.f;
        }
    }
    for (int64_t i = 0; i < B * H * d; ++i) out[i] = 0.f;
    for (int64_t c = 0; c <= last; ++c) {
        const int64_t n = c < last ? CHUNK : slot % CHUNK + 1;  /* live slots of this page */
        for (int64_t r = 0; r < B * Hkv; ++r) {  /* r = b * Hkv + kv */
            float *K = keys + c * page + r * block, *V = values + c * page + r * block;
            if (c == last) {
                const float *row = qkv + (r / Hkv) * qkv_stride, *cs = rot + (r / Hkv) * rot_stride;
                const float *v = row + (H + Hkv + r % Hkv) * d;
                rope(row + (H + r % Hkv) * d, cs, half, K + slot % CHUNK, CHUNK);  /* transposed */
                for (int64_t e = 0; e < d; ++e) V[(slot % CHUNK) * d + e] = v[e];
            }
            const float *m = mask ? mask + r * mask_stride + c * CHUNK : 0;
            attend_heads(g, K, V, m, n, q + r * g * d, d, 2 * block, top + r * g, sum + r * g, out + r * g * d);
        }
    }
    for (int64_t head = 0; head < B * H; ++head) {
        const float inv = 1.f / sum[head];
        for (int64_t e = 0; e < d; ++e) out[head * d + e] *= inv;
    }
}

/* The prompts' attention (a prefill) on their tokens' rows only: sequence b's tokens are rows
 * first[b] .. first[b+1]-1 of qkv (left padding has no rows) and take its last cache slots,
 * S - n .. S-1 (n of them); rot [rows, d/2, 2] per row. Writes each sequence's k and v into its
 * slots and zeros into the padding slots before them (decode steps read those under a mask: they
 * must be finite), and each token's attention over its sequence's tokens up to itself -> out
 * [rows, H * d]. The same cache layout and per-page online softmax as decode_attention (one query
 * at a time: a prompt is a page or two). scratch: (H / Hkv) * (d + 2) floats. */
void prefill_attention(const float *qkv, int64_t qkv_stride, const float *rot, int64_t rot_stride,
                       const int64_t *first, int64_t S, float *keys, float *values,
                       int64_t B, int64_t H, int64_t Hkv, int64_t d, float *out, float *scratch) {
    const int64_t g = H / Hkv, half = d / 2, block = d * CHUNK, page = B * Hkv * block;
    float *q = scratch, *top = scratch + g * d, *sum = top + g, pad[CHUNK];
    for (int64_t r = 0; r < B * Hkv; ++r) {  /* r = b * Hkv + kv */
        const int64_t b = r / Hkv, kv = r % Hkv, start = S - (first[b + 1] - first[b]);
        for (int64_t t = 0; t < S; ++t) {
            float *K = keys + (t / CHUNK) * page + r * block + t % CHUNK;  /* transposed: stride CHUNK */
            float *V = values + (t / CHUNK) * page + r * block + (t % CHUNK) * d;
            const int64_t i = first[b] + t - start;
            if (t < start) {
                for (int64_t e = 0; e < d; ++e) K[e * CHUNK] = V[e] = 0.f;
                continue;
            }
            rope(qkv + i * qkv_stride + (H + kv) * d, rot + i * rot_stride, half, K, CHUNK);
            for (int64_t e = 0; e < d; ++e) V[e] = qkv[i * qkv_stride + (H + Hkv + kv) * d + e];
        }
        for (int l = 0; l < CHUNK; ++l) pad[l] = l < start % CHUNK ? -FLT_MAX : 0.f;
        for (int64_t t = start; t < S; ++t) {
            const int64_t i = first[b] + t - start;
            float *o = out + i * H * d + kv * g * d;
            for (int64_t j = 0; j < g; ++j) {
                rope(qkv + i * qkv_stride + (kv * g + j) * d, rot + i * rot_stride, half, q + j * d, 1);
                top[j] = -FLT_MAX;
                sum[j] = 0.f;
            }
            for (int64_t e = 0; e < g * d; ++e) o[e] = 0.f;
            for (int64_t c = start / CHUNK; c <= t / CHUNK; ++c)
                attend_heads(g, keys + c * page + r * block, values + c * page + r * block,
                             c == start / CHUNK ? pad : 0, c < t / CHUNK ? CHUNK : t % CHUNK + 1, q, d, 0, top, sum, o);
            for (int64_t j = 0; j < g; ++j)
                for (int64_t e = 0; e < d; ++e) o[j * d + e] /= sum[j];
        }
    }
}

/* y [rows, O] = x [rows, I] @ W.T (+ bias [O]) (+ residual, rows of res_stride floats). W comes
 * packed in panels of PANEL output features, wp [ceil(O / PANEL), I, PANEL] (the last panel's
 * missing features zero): a panel is one contiguous stream, and each input feature i updates a
 * panel's PANEL outputs for several rows with vector FMAs (x[r, i] broadcast), no horizontal sums.
 * With AVX-512, rows go eight at a time (sixteen 16-float accumulators: the FMA units kept busy
 * from L1, where the panel's rows stay while the eight rows pass over them); the rest, and every
 * row without AVX-512, four at a time (sixteen 8-float accumulators). A decode step of a few rows
 * is bound by streaming the weights from memory, which this loop does at about the memory's speed;
 * at many rows it is compute-bound (matmul_kernels.matmul_kind says where it is used).
 *
 * Two steps around a matmul fused into it (each a separate pass over the rows otherwise, and at a
 * decode step's few rows a separate call costing more than its arithmetic):
 * - norm_eps >= 0: x's rows RMS-normalised first, x / sqrt(sum(x^2) + norm_eps) (rms_norm), applied
 *   to the row's outputs ((x / s) @ W.T = (x @ W.T) / s);
 * - gated: W is gate | up, packed as the gate's panels then the up's (each [ceil(O / PANEL), I,
 *   PANEL]; bias [2 * O] likewise), and y = silu(gate) * up [rows, O] (silu_mul); no residual.
 * bias, residual: NULL when absent. */
#define PANEL (4 * LANES)
#define TILE_MAX 8
#ifndef PREFETCH_MIN_TILES
#define PREFETCH_MIN_TILES 2
#endif

/* acc [R, PANEL] = x [R rows of x_stride] @ the panel w [I, PANEL]; meanwhile rows 0..ahead-1 of
 * the panel at pf (NULL: none) fetched into L2, one per input feature. */
static inline void panel_tile(const float *x, int64_t x_stride, int64_t R, const float *w, int64_t I, float *acc,
                              const float *pf, int64_t ahead) {
#ifdef __AVX512F__
    typedef float v16 __attribute__((vector_size(64), aligned(4)));
    if (R == 8) {
        v16 a[8][2];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = (v16){0};
        for (int64_t i = 0; i < I; ++i) {
            if (i < ahead) {
                __builtin_prefetch(pf + i * PANEL, 0, 2);
                __builtin_prefetch(pf + i * PANEL + 16, 0, 2);
            }
            const v16 w0 = *(const v16 *)(w + i * PANEL), w1 = *(const v16 *)(w + i * PANEL + 16);
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) {
                const float xi = x[r * x_stride + i];
                a[r][0] += xi * w0;
                a[r][1] += xi * w1;
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            *(v16 *)(acc + r * PANEL) = a[r][0];
            *(v16 *)(acc + r * PANEL + 16) = a[r][1];
        }
        return;
    }
#endif
    v8 a[4][4] = {{{0}}};
    for (int64_t i = 0; i < I; ++i) {
        if (i < ahead) {
            __builtin_prefetch(pf + i * PANEL, 0, 2);
            __builtin_prefetch(pf + i * PANEL + 16, 0, 2);
        }
        const float *wi = w + i * PANEL;
        const v8 w0 = *(const v8 *)wi, w1 = *(const v8 *)(wi + LANES);
        const v8 w2 = *(const v8 *)(wi + 2 * LANES), w3 = *(const v8 *)(wi + 3 * LANES);
        for (int64_t r = 0; r < R; ++r) {
            const float xi = x[r * x_stride + i];
            a[r][0] += xi * w0;
            a[r][1] += xi * w1;
            a[r][2] += xi * w2;
            a[r][3] += xi * w3;
        }
    }
    for (int64_t r = 0; r < R; ++r)
        for (int v = 0; v < 4; ++v) *(v8 *)(acc + r * PANEL + v * LANES) = a[r][v];
}

/* panel_matmul's operand wp [ceil(O / PANEL), I, PANEL] from a weight given row by row: output
 * feature o is the I floats at address rows[o] (0: zeros, as the last panel's missing features)
 * times scale[o], and input feature i also times col[i] (col NULL: 1). One pass over the weight,
 * wherever its rows are (fast_decode.py packs q|k|v and gate|up from the separate projections,
 * their rows permuted and scaled, with the norm's weight folded in, without concatenating them). */
void pack_panels(const int64_t *rows, const float *scale, const float *col, int64_t O, int64_t I, float *wp) {
    for (int64_t p = 0; p < (O + PANEL - 1) / PANEL; ++p) {
        float *w = wp + p * I * PANEL;
        for (int64_t j = 0; j < PANEL; ++j) {
            const int64_t o = p * PANEL + j;
            const float *src = o < O ? (const float *)rows[o] : 0;
            const float *next = o + PANEL < O ? (const float *)rows[o + PANEL] : 0;
            if (next)
                for (int64_t i = 0; i < I; i += 16) __builtin_prefetch(next + i, 0, 1);
            const float s = src ? scale[o] : 0.f;
            for (int64_t i = 0; i < I; ++i)
                w[i * PANEL + j] = src ? src[i] * s * (col ? col[i] : 1.f) : 0.f;
        }
    }
}

int64_t panel_tile_rows(void) {
#ifdef __AVX512F__
    return TILE_MAX;
#else
    return 4;
#endif
}

void panel_matmul(const float *x, int64_t x_stride, int64_t rows, const float *wp, int64_t O, int64_t I,
                  const float *bias, const float *residual, int64_t res_stride, float *y, float norm_eps,
                  int64_t gated) {
    enum { BLOCK = 256 };  /* rows per pass over the panels: their norms fit on the stack */
    const int64_t panels = (O + PANEL - 1) / PANEL, tile = panel_tile_rows();  /* rows per tile: 8 or 4 */
    float inv[BLOCK], acc[TILE_MAX * PANEL], up[TILE_MAX * PANEL];
    for (int64_t r1 = 0; r1 < rows; r1 += BLOCK) {
        const int64_t end = rows - r1 < BLOCK ? rows : r1 + BLOCK;
        for (int64_t r = r1; r < end; ++r)  /* the rows' 1 / RMS, or 1 */
            inv[r - r1] = norm_eps >= 0.f ? inv_rms(x + r * x_stride, I, norm_eps) : 1.f;
        for (int64_t p = 0; p < panels; ++p) {
            /* An absent bias or residual reads as zeros: a select per element instead becomes a
             * masked load from NULL, which AMD CPUs run as a slow fault-suppressing assist. */
            static const float zeros[PANEL];
            const float *w = wp + p * I * PANEL, *b = bias ? bias + p * PANEL : zeros;
            const float *bu = gated && bias ? bias + O + p * PANEL : zeros;
            const int64_t width = O - p * PANEL < PANEL ? O - p * PANEL : PANEL;
            /* Where several row tiles pass over a panel (compute-bound), the next panel comes from
             * memory (a step's weights outgrow the CPU's caches) while this one computes, each tile
             * fetching its share: otherwise the first tile over each panel waits on memory. A single
             * tile streams the panels as fast as the CPU's own prefetcher brings them. */
            const int64_t tiles = (end - r1 + tile - 1) / tile;
            const int64_t ahead = p + 1 < panels && tiles >= PREFETCH_MIN_TILES ? (I + tiles - 1) / tiles : 0;
            for (int64_t r0 = r1, t = 0; r0 < end; ++t) {
                const int64_t R = end - r0 >= tile ? tile : end - r0 < 4 ? end - r0 : 4;
                const int64_t from = t * ahead < I ? t * ahead : I, count = I - from < ahead ? I - from : ahead;
                const float *xr = x + r0 * x_stride;
                panel_tile(xr, x_stride, R, w, I, acc, w + I * PANEL + from * PANEL, count);
                if (gated)
                    panel_tile(xr, x_stride, R, wp + (panels + p) * I * PANEL, I, up,
                               wp + (panels + p + 1) * I * PANEL + from * PANEL, count);
                for (int64_t r = 0; r < R; ++r) {
                    float *out = y + (r0 + r) * O + p * PANEL;
                    const float *a = acc + r * PANEL, *u = up + r * PANEL, s = inv[r0 + r - r1];
                    if (gated) {
#pragma omp simd
                        for (int64_t k = 0; k < width; ++k) {
                            const float g = a[k] * s + b[k], h = u[k] * s + bu[k];
                            out[k] = silu(g) * h;
                        }
                    } else {
                        const float *res = residual ? residual + (r0 + r) * res_stride + p * PANEL : zeros;
#pragma omp simd
                        for (int64_t k = 0; k < width; ++k) out[k] = res[k] + (a[k] * s + b[k]);
                    }
                }
                r0 += R;
            }
        }
    }
}
