/* The panel matmul and its weights' packing (cpu_kernels.h: the set of files). */
#include "cpu_kernels.h"

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
 * - pick (not NULL): the outputs are logits, and instead of writing them (y unused) each row's
 *   greedy pick is taken from them as they are made — the first index of the largest, pick[r],
 *   and its log-probability, pick_logp[r] (greedy_pick's result, its sum of exps kept online:
 *   rescaled when a panel holds a larger logit), so a batch's logits never go to memory.
 * bias, residual: NULL when absent. */
#define TILE_MAX 8
#ifndef BG_LOCALITY
#define BG_LOCALITY 1
#endif
#ifndef PREFETCH_MIN_TILES
#define PREFETCH_MIN_TILES 2
#endif

/* acc [R, PANEL] = x [R rows of x_stride] @ the panel w [I, PANEL]; meanwhile rows 0..ahead-1 of
 * the panel at pf (NULL: none) fetched into L2, one per input feature, and the bgn cache lines
 * from bg (panel_matmul_fetching). The first input features, which fetch, are a loop of their own:
 * a branch per feature in the one loop costs the hot loop up to a tenth. */
static inline void panel_tile(const float *x, int64_t x_stride, int64_t R, const float *w, int64_t I, float *acc,
                              const float *pf, int64_t ahead, const char *bg, int64_t bgn) {
    const int64_t fetching = ahead > bgn ? ahead : bgn;
#define FETCH(i)                                                              \
    do {                                                                      \
        if ((i) < ahead) {                                                    \
            __builtin_prefetch(pf + (i) * PANEL, 0, 2);                       \
            __builtin_prefetch(pf + (i) * PANEL + 16, 0, 2);                  \
        }                                                                     \
        if ((i) < bgn) __builtin_prefetch(bg + (i) * 64, 0, BG_LOCALITY);      \
    } while (0)
#define FEATURES(STEP)                                                        \
    do {                                                                      \
        int64_t i = 0;                                                        \
        for (; i < fetching && i < I; ++i) {                                  \
            FETCH(i);                                                         \
            STEP(i);                                                          \
        }                                                                     \
        for (; i < I; ++i) STEP(i);                                           \
    } while (0)
#ifdef __AVX512F__
    typedef float v16 __attribute__((vector_size(64), aligned(4)));
    if (R == 8) {
        v16 a[8][2];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = (v16){0};
#define STEP16(i)                                                                                 \
    do {                                                                                          \
        const v16 w0 = *(const v16 *)(w + (i) * PANEL), w1 = *(const v16 *)(w + (i) * PANEL + 16); \
        _Pragma("GCC unroll 8") for (int r = 0; r < 8; ++r) {                                    \
            const float xi = x[r * x_stride + (i)];                                               \
            a[r][0] += xi * w0;                                                                   \
            a[r][1] += xi * w1;                                                                   \
        }                                                                                         \
    } while (0)
        FEATURES(STEP16);
#undef STEP16
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            *(v16 *)(acc + r * PANEL) = a[r][0];
            *(v16 *)(acc + r * PANEL + 16) = a[r][1];
        }
        return;
    }
#endif
    v8 a[4][4] = {{{0}}};
#define STEP8(i)                                                                  \
    do {                                                                          \
        const float *wi = w + (i) * PANEL;                                        \
        const v8 w0 = *(const v8 *)wi, w1 = *(const v8 *)(wi + LANES);            \
        const v8 w2 = *(const v8 *)(wi + 2 * LANES), w3 = *(const v8 *)(wi + 3 * LANES); \
        for (int64_t r = 0; r < R; ++r) {                                         \
            const float xi = x[r * x_stride + (i)];                               \
            a[r][0] += xi * w0;                                                   \
            a[r][1] += xi * w1;                                                   \
            a[r][2] += xi * w2;                                                   \
            a[r][3] += xi * w3;                                                   \
        }                                                                         \
    } while (0)
    FEATURES(STEP8);
#undef STEP8
#undef FEATURES
#undef FETCH
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

/* One row's logits of one panel, a[k] * s + b[k] for k < width (features from `first`), into its
 * running greedy pick: *top the largest so far, *at its first index, *total the sum of exp(logit -
 * *top), rescaled when this panel holds a larger one (a tie keeps the earlier index, as argmax). */
static inline void pick_panel(const float *a, float s, const float *b, int64_t width, int64_t first, int64_t *at,
                              float *top, float *total) {
    float l[PANEL], best = -FLT_MAX, part = 0.f;
#pragma omp simd
    for (int64_t k = 0; k < width; ++k) l[k] = a[k] * s + b[k];
#pragma omp simd reduction(max:best)
    for (int64_t k = 0; k < width; ++k) best = l[k] > best ? l[k] : best;
    if (best > *top) {
        int64_t k = 0;
        while (l[k] != best) ++k;
        *at = first + k;
        *total *= exp_fast(*top - best);
        *top = best;
    }
    const float m = *top;
#pragma omp simd reduction(+:part)
    for (int64_t k = 0; k < width; ++k) part += exp_fast(l[k] - m);
    *total += part;
}

void panel_matmul(const float *x, int64_t x_stride, int64_t rows, const float *wp, int64_t O, int64_t I,
                  const float *bias, const float *residual, int64_t res_stride, float *y, float norm_eps,
                  int64_t gated, int64_t *pick, float *pick_logp) {
    panel_matmul_fetching(x, x_stride, rows, wp, O, I, bias, residual, res_stride, y, norm_eps, gated, pick, pick_logp,
                          0, 0);
}

/* The cache lines a row tile fetches from `at` on: `most`, or what is left before `end`. */
static inline int64_t fetch_share(const char *at, const char *end, int64_t most) {
    const int64_t left = (end - at) / 64;
    return left < most ? (left > 0 ? left : 0) : most;
}

/* panel_matmul that meanwhile fetches bg_bytes from bg into the CPU's caches, spread over its row
 * tiles (a line per input feature of each, its share of the whole), where several tiles pass over
 * each panel (a compute-bound matmul, whose loads leave the memory idle): decode_layers fetches a
 * layer's KV cache so, which its attention would otherwise wait on. */
void panel_matmul_fetching(const float *x, int64_t x_stride, int64_t rows, const float *wp, int64_t O, int64_t I,
                           const float *bias, const float *residual, int64_t res_stride, float *y, float norm_eps,
                           int64_t gated, int64_t *pick, float *pick_logp, const void *bg, int64_t bg_bytes) {
    enum { BLOCK = 256 };  /* rows per pass over the panels: their norms and picks fit on the stack */
    const int64_t panels = (O + PANEL - 1) / PANEL, tile = panel_tile_rows();  /* rows per tile: 8 or 4 */
    float inv[BLOCK], top[BLOCK], total[BLOCK], acc[TILE_MAX * PANEL], up[TILE_MAX * PANEL];
    /* the rows in blocks of about equal size, whole tiles (1540 rows: seven of at most 224, not six
     * of 256 and then a pass over every panel for the last four) */
    const int64_t blocks = rows > 0 ? (rows + BLOCK - 1) / BLOCK : 1, step = ((rows + blocks - 1) / blocks + 7) / 8 * 8;
    const int64_t tiles_all = (rows + tile - 1) / tile, calls = panels * tiles_all * (gated ? 2 : 1);
    const int64_t per = tiles_all >= PREFETCH_MIN_TILES ? (bg_bytes / 64 + calls - 1) / calls : 0;
    const int64_t bgn = per < I ? per : I;
    const char *bgp = (const char *)bg;
    const char *const bge = bgp + bg_bytes;
    for (int64_t r1 = 0; r1 < rows; r1 += step) {
        const int64_t end = rows - r1 < step ? rows : r1 + step;
        for (int64_t r = r1; r < end; ++r) {  /* the rows' 1 / RMS (or 1); their picks' start */
            inv[r - r1] = norm_eps >= 0.f ? inv_rms(x + r * x_stride, I, norm_eps) : 1.f;
            top[r - r1] = -FLT_MAX;
            total[r - r1] = 0.f;
        }
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
                int64_t n = fetch_share(bgp, bge, bgn);
                panel_tile(xr, x_stride, R, w, I, acc, w + I * PANEL + from * PANEL, count, bgp, n);
                bgp += n * 64;
                if (gated) {
                    n = fetch_share(bgp, bge, bgn);
                    panel_tile(xr, x_stride, R, wp + (panels + p) * I * PANEL, I, up,
                               wp + (panels + p + 1) * I * PANEL + from * PANEL, count, bgp, n);
                    bgp += n * 64;
                }
                for (int64_t r = 0; r < R; ++r) {
                    const float *a = acc + r * PANEL, *u = up + r * PANEL, s = inv[r0 + r - r1];
                    if (pick) {
                        pick_panel(a, s, b, width, p * PANEL, pick + r0 + r, top + r0 + r - r1, total + r0 + r - r1);
                        continue;
                    }
                    float *out = y + (r0 + r) * O + p * PANEL;
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
        if (pick)
            for (int64_t r = r1; r < end; ++r) pick_logp[r] = -logf(total[r - r1]);
    }
}
