/* Attention: a decode step's and a prefill's (cpu_kernels.h: the set of files). */
#include "cpu_kernels.h"

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
 * into the row's cache slot slots[b], attend every query head over its slots 0..slots[b] (its kv
 * head's, grouped-query: H / Hkv query heads per kv head) with the additive mask row mask + (b *
 * Hkv + kv) * mask_stride (NULL: every slot visible) -> out [B, H * d]. q carries attention's
 * 1 / sqrt(d); d is a multiple of CHUNK. scratch: B * H * (d + 2) floats. Rows' slots differ where
 * the cache holds each row's own tokens from slot 0 (prefill_attention's layout: a left-padded
 * prompt's padding never stored, so never read); a cache with the padding in it has one slot for
 * every row and a mask hiding the padding.
 *
 * The cache is paged by CHUNK slots, every (row, kv head) of a chunk together:
 *   keys [chunks, B, Hkv, d, CHUNK] (a page's keys transposed: its scores are d vector updates),
 *   values [chunks, B, Hkv, CHUNK, d],
 * so a step reads the keys and the values each as one contiguous stream, page after page (the
 * next block's lines are prefetched the same distance on in either). Per (row, kv head) blocks
 * each in its own place would restart the CPU's prefetcher every block. The softmax is the online
 * one (a running max and sum per query head, the partial output rescaled when the max grows), so
 * each page is read once, keys and values together. The step's k and v go into the row's last
 * page just before its block is read (in cache then). Slots past a row's slot are never read into
 * the result (their memory may hold anything). */
void decode_attention(const float *qkv, int64_t qkv_stride, const float *rot, int64_t rot_stride,
                      float *keys, float *values, const int64_t *slots, const float *mask, int64_t mask_stride,
                      int64_t B, int64_t H, int64_t Hkv, int64_t d, float *out, float *scratch) {
    const int64_t g = H / Hkv, half = d / 2, block = d * CHUNK, page = B * Hkv * block;
    float *q = scratch, *top = scratch + B * H * d, *sum = top + B * H;  /* rotated q; running max, sum */
    const int64_t pages = live_pages(slots, B);
    for (int64_t b = 0; b < B; ++b) {
        const float *row = qkv + b * qkv_stride, *cs = rot + b * rot_stride;
        for (int64_t h = 0; h < H; ++h) {
            rope(row + h * d, cs, half, q + (b * H + h) * d, 1);
            top[b * H + h] = -FLT_MAX;
            sum[b * H + h] = 0.f;
        }
    }
    for (int64_t i = 0; i < B * H * d; ++i) out[i] = 0.f;
    for (int64_t c = 0; c < pages; ++c)
        for (int64_t r = 0; r < B * Hkv; ++r) {  /* r = b * Hkv + kv */
            const int64_t slot = slots[r / Hkv], last = slot / CHUNK;
            if (c > last)
                continue;
            float *K = keys + c * page + r * block, *V = values + c * page + r * block;
            if (c == last) {
                const float *row = qkv + (r / Hkv) * qkv_stride, *cs = rot + (r / Hkv) * rot_stride;
                const float *v = row + (H + Hkv + r % Hkv) * d;
                rope(row + (H + r % Hkv) * d, cs, half, K + slot % CHUNK, CHUNK);  /* transposed */
                for (int64_t e = 0; e < d; ++e) V[(slot % CHUNK) * d + e] = v[e];
            }
            const float *m = mask ? mask + r * mask_stride + c * CHUNK : 0;
            attend_heads(g, K, V, m, c < last ? CHUNK : slot % CHUNK + 1, q + r * g * d, d, 2 * block, top + r * g,
                         sum + r * g, out + r * g * d);
        }
    for (int64_t head = 0; head < B * H; ++head) {
        const float inv = 1.f / sum[head];
        for (int64_t e = 0; e < d; ++e) out[head * d + e] *= inv;
    }
}

/* The prompts' attention (a prefill) on their tokens' rows only: sequence b's tokens are rows
 * first[b] .. first[b+1]-1 of qkv (a left-padded prompt's padding has no rows) and take its cache
 * slots from 0 (decode_attention's per-row slots go on from there); rot [rows, d/2, 2] per row.
 * Writes each sequence's k and v into its slots, and each token's attention over its sequence's
 * tokens up to itself -> out [rows, H * d]. The same cache layout and per-page online softmax as
 * decode_attention (one query at a time: a prompt is a page or a few). scratch: (H / Hkv) * (d +
 * 2) floats. */
void prefill_attention(const float *qkv, int64_t qkv_stride, const float *rot, int64_t rot_stride,
                       const int64_t *first, float *keys, float *values,
                       int64_t B, int64_t H, int64_t Hkv, int64_t d, float *out, float *scratch) {
    const int64_t g = H / Hkv, half = d / 2, block = d * CHUNK, page = B * Hkv * block;
    float *q = scratch, *top = scratch + g * d, *sum = top + g;
    for (int64_t r = 0; r < B * Hkv; ++r) {  /* r = b * Hkv + kv */
        const int64_t b = r / Hkv, kv = r % Hkv, n = first[b + 1] - first[b];
        for (int64_t t = 0; t < n; ++t) {
            const float *row = qkv + (first[b] + t) * qkv_stride;
            float *K = keys + (t / CHUNK) * page + r * block + t % CHUNK;  /* transposed: stride CHUNK */
            float *V = values + (t / CHUNK) * page + r * block + (t % CHUNK) * d;
            rope(row + (H + kv) * d, rot + (first[b] + t) * rot_stride, half, K, CHUNK);
            for (int64_t e = 0; e < d; ++e) V[e] = row[(H + Hkv + kv) * d + e];
        }
        for (int64_t t = 0; t < n; ++t) {
            const int64_t i = first[b] + t;
            float *o = out + i * H * d + kv * g * d;
            for (int64_t j = 0; j < g; ++j) {
                rope(qkv + i * qkv_stride + (kv * g + j) * d, rot + i * rot_stride, half, q + j * d, 1);
                top[j] = -FLT_MAX;
                sum[j] = 0.f;
            }
            for (int64_t e = 0; e < g * d; ++e) o[e] = 0.f;
            for (int64_t c = 0; c <= t / CHUNK; ++c)
                attend_heads(g, keys + c * page + r * block, values + c * page + r * block, 0,
                             c < t / CHUNK ? CHUNK : t % CHUNK + 1, q, d, 0, top, sum, o);
            for (int64_t j = 0; j < g; ++j)
                for (int64_t e = 0; e < d; ++e) o[j * d + e] /= sum[j];
        }
    }
}
