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

/* out[r] = x[r] / sqrt(sum(x[r]^2) + n_eps), rows of n floats (the sqrt(n) of RMSNorm and its
 * weight are folded into the next matmul's weight: fast_decode.py). */
void rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t n, float n_eps, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float s = 0.f;
#pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < n; ++i) s += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(s + n_eps);
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
        for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
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

/* Greedy decoding's pick from logits rows [rows, V]: the first index of each row's largest logit
 * (torch.argmax's choice; rows are assumed free of NaN) and its log-probability,
 * -log(sum(exp(x - max))). */
void greedy_pick(const float *logits, int64_t stride, int64_t rows, int64_t V, int64_t *tokens, float *logp) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = logits + r * stride;
        float sum;
        const float top = max_and_sum(x, V, 1.f, &sum);
        int64_t first = 0;
        while (x[first] != top) ++first;
        tokens[r] = first;
        logp[r] = -logf(sum);
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

/* One decode step's attention for rows b < B: rotate the step's q and k heads, write k and v
 * into cache slot `slot`, attend every query head over slots 0..slot (its kv head's, grouped-query:
 * H / Hkv query heads per kv head) with the additive mask row mask + (b * Hkv + kv) * mask_stride
 * (NULL: every slot visible) -> out [B, H * d]. q carries attention's 1 / sqrt(d); d is a
 * multiple of 4 * LANES.
 *
 * The cache is paged by CHUNK slots, every (row, kv head) of a chunk together:
 *   keys [chunks, B, Hkv, d, CHUNK] (a page's keys transposed: its scores are d vector updates),
 *   values [chunks, B, Hkv, CHUNK, d],
 * so a step reads each page as one contiguous stream. Per (row, kv head) blocks of a few KB,
 * each in its own place, would restart the CPU's prefetcher every block: at large batches the
 * cache is bigger than the CPU's caches and the loop would wait on memory. The softmax is the
 * online one (a running max and sum per query head, the partial output rescaled when the max
 * grows), so each page is read once, keys and values together. Slots past `slot` are never read
 * into the result (their memory may hold anything). */
void decode_attention(const float *qkv, int64_t qkv_stride, const float *rot, int64_t rot_stride,
                      float *keys, float *values, int64_t slot, const float *mask, int64_t mask_stride,
                      int64_t B, int64_t H, int64_t Hkv, int64_t d, float *out, float *scratch) {
    const int64_t g = H / Hkv, L = slot + 1, half = d / 2, page = B * Hkv * d * CHUNK;
    float *q = scratch, *top = scratch + B * H * d, *sum = top + B * H;  /* rotated q; running max, sum */
    for (int64_t b = 0; b < B; ++b) {  /* rotate q and k; write k and v into the slot */
        const float *row = qkv + b * qkv_stride, *cs = rot + b * rot_stride;
        for (int64_t kv = 0; kv < Hkv; ++kv) {
            float *K = keys + (slot / CHUNK) * page + (b * Hkv + kv) * d * CHUNK + slot % CHUNK;
            float *V = values + (slot / CHUNK) * page + ((b * Hkv + kv) * CHUNK + slot % CHUNK) * d;
            const float *v = row + (H + Hkv + kv) * d;
            rope(row + (H + kv) * d, cs, half, K, CHUNK);  /* the page's keys are transposed */
            for (int64_t e = 0; e < d; ++e) V[e] = v[e];
        }
        for (int64_t h = 0; h < H; ++h) {
            rope(row + h * d, cs, half, q + (b * H + h) * d, 1);
            top[b * H + h] = -FLT_MAX;
            sum[b * H + h] = 0.f;
        }
    }
    for (int64_t i = 0; i < B * H * d; ++i) out[i] = 0.f;
    for (int64_t c = 0; c * CHUNK < L; ++c) {
        const int64_t n = L - c * CHUNK < CHUNK ? L - c * CHUNK : CHUNK;  /* live slots of this page */
        for (int64_t r = 0; r < B * Hkv; ++r) {
            const float *K = keys + c * page + r * d * CHUNK, *V = values + c * page + r * CHUNK * d;
            const float *m = mask ? mask + r * mask_stride + c * CHUNK : 0;
            for (int64_t j = 0; j < g; ++j) {
                const int64_t head = r * g + j;  /* = b * H + kv * g + j */
                const float *qr = q + head * d;
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};  /* the page's CHUNK = 4 * LANES scores */
                for (int64_t e = 0; e < d; ++e) {
                    const float *ke = K + e * CHUNK;
                    const float qe = qr[e];
                    a0 += qe * *(const v8 *)ke;
                    a1 += qe * *(const v8 *)(ke + LANES);
                    a2 += qe * *(const v8 *)(ke + 2 * LANES);
                    a3 += qe * *(const v8 *)(ke + 3 * LANES);
                }
                float sc[CHUNK];
                *(v8 *)sc = a0;
                *(v8 *)(sc + LANES) = a1;
                *(v8 *)(sc + 2 * LANES) = a2;
                *(v8 *)(sc + 3 * LANES) = a3;
                float best = top[head];
                for (int64_t l = 0; l < n; ++l) {
                    if (m) sc[l] += m[l];
                    best = sc[l] > best ? sc[l] : best;
                }
                const float scale = expf(top[head] - best);
                float total = 0.f;
#pragma omp simd reduction(+:total)
                for (int64_t l = 0; l < n; ++l) {
                    sc[l] = expf(sc[l] - best);
                    total += sc[l];
                }
                top[head] = best;
                sum[head] = sum[head] * scale + total;
                float *o = out + head * d;
                for (int64_t e = 0; e < d; e += 4 * LANES) {  /* o = o * scale + p . V, four vectors at a time */
                    v8 o0 = *(v8 *)(o + e) * scale, o1 = *(v8 *)(o + e + LANES) * scale;
                    v8 o2 = *(v8 *)(o + e + 2 * LANES) * scale, o3 = *(v8 *)(o + e + 3 * LANES) * scale;
                    for (int64_t l = 0; l < n; ++l) {
                        const float *vl = V + l * d + e;
                        const float p = sc[l];
                        o0 += p * *(const v8 *)vl;
                        o1 += p * *(const v8 *)(vl + LANES);
                        o2 += p * *(const v8 *)(vl + 2 * LANES);
                        o3 += p * *(const v8 *)(vl + 3 * LANES);
                    }
                    *(v8 *)(o + e) = o0;
                    *(v8 *)(o + e + LANES) = o1;
                    *(v8 *)(o + e + 2 * LANES) = o2;
                    *(v8 *)(o + e + 3 * LANES) = o3;
                }
            }
        }
    }
    for (int64_t head = 0; head < B * H; ++head) {
        const float inv = 1.f / sum[head];
        for (int64_t e = 0; e < d; ++e) out[head * d + e] *= inv;
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
 * bias, residual: NULL when absent. */
#define PANEL (4 * LANES)

/* out[k] = res[k] + (acc[k] + bias[k]) for the `width` live features of one panel row. */
static inline void panel_store(const float *acc, int64_t width, const float *bias, const float *res, float *out) {
    for (int64_t k = 0; k < width; ++k) out[k] = (res ? res[k] : 0.f) + (acc[k] + (bias ? bias[k] : 0.f));
}

int64_t panel_tile_rows(void) {
#ifdef __AVX512F__
    return 8;
#else
    return 4;
#endif
}

void panel_matmul(const float *x, int64_t x_stride, int64_t rows, const float *wp, int64_t O, int64_t I,
                  const float *bias, const float *residual, int64_t res_stride, float *y) {
    for (int64_t p = 0; p * PANEL < O; ++p) {
        const float *w = wp + p * I * PANEL, *b = bias ? bias + p * PANEL : 0;
        const int64_t width = O - p * PANEL < PANEL ? O - p * PANEL : PANEL;
        int64_t r0 = 0;
#ifdef __AVX512F__
        typedef float v16 __attribute__((vector_size(64), aligned(4)));
        for (; r0 + 8 <= rows; r0 += 8) {
            const float *xr = x + r0 * x_stride;
            v16 a[8][2];
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = (v16){0};
            for (int64_t i = 0; i < I; ++i) {
                const v16 w0 = *(const v16 *)(w + i * PANEL), w1 = *(const v16 *)(w + i * PANEL + 16);
#pragma GCC unroll 8
                for (int r = 0; r < 8; ++r) {
                    const float xi = xr[r * x_stride + i];
                    a[r][0] += xi * w0;
                    a[r][1] += xi * w1;
                }
            }
            for (int r = 0; r < 8; ++r) {
                float acc[PANEL];
                *(v16 *)acc = a[r][0];
                *(v16 *)(acc + 16) = a[r][1];
                panel_store(acc, width, b, residual ? residual + (r0 + r) * res_stride + p * PANEL : 0,
                            y + (r0 + r) * O + p * PANEL);
            }
        }
#endif
        for (; r0 < rows; r0 += 4) {
            const int64_t R = rows - r0 < 4 ? rows - r0 : 4;
            const float *xr = x + r0 * x_stride;
            v8 a[4][4] = {{{0}}};
            for (int64_t i = 0; i < I; ++i) {
                const float *wi = w + i * PANEL;
                const v8 w0 = *(const v8 *)wi, w1 = *(const v8 *)(wi + LANES);
                const v8 w2 = *(const v8 *)(wi + 2 * LANES), w3 = *(const v8 *)(wi + 3 * LANES);
                for (int64_t r = 0; r < R; ++r) {
                    const float xi = xr[r * x_stride + i];
                    a[r][0] += xi * w0;
                    a[r][1] += xi * w1;
                    a[r][2] += xi * w2;
                    a[r][3] += xi * w3;
                }
            }
            for (int64_t r = 0; r < R; ++r) {
                float acc[PANEL];
                *(v8 *)acc = a[r][0];
                *(v8 *)(acc + LANES) = a[r][1];
                *(v8 *)(acc + 2 * LANES) = a[r][2];
                *(v8 *)(acc + 3 * LANES) = a[r][3];
                panel_store(acc, width, b, residual ? residual + (r0 + r) * res_stride + p * PANEL : 0,
                            y + (r0 + r) * O + p * PANEL);
            }
        }
    }
}
