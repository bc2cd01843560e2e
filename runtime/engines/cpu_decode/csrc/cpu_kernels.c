/* Norms, SiLU·up and the token picks (cpu_kernels.h: the set of files). */
#include "cpu_kernels.h"

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
