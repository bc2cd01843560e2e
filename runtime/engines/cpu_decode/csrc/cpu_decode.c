/* A decode step through every layer in one call (cpu_kernels.h: the set of files). */
#include "cpu_kernels.h"

/* Fields of one layer's row in decode_layers' table (addresses, 0 where a bias is absent). */
enum { QKV, QKV_BIAS, O, O_BIAS, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, KEYS, VALUES, FIELDS };

/* x [B, hidden] (its rows' hidden states; updated in place) through L pre-norm decoder layers:
 * per layer q|k|v = norm(x) @ Wqkv.T + b (the norm's weight folded into the panels), the step's
 * attention (decode_attention: RoPE rot, its k, v into each row's cache slot slots[b], mask), x += attn @ Wo.T
 * + b, x += silu·up(norm(x) @ Wgu.T + b) @ Wd.T + b — fast_decode.FusedDecoder.decode's layer loop,
 * with no call back into Python between the matmuls. layers: L rows of FIELDS addresses, the
 * weights packed as panels (cpu_matmul.c; gate|up gated) of F MLP features. Buffers: qkv [B, (H +
 * 2·Hkv)·d], attn [B, H·d], mlp [B, F], mid [B, hidden]; scratch: decode_attention's. A layer's
 * KV cache is fetched while the matmuls before its attention compute: the keys during the down
 * projection before it (the last layer's: the first layer's for the next step), the values during
 * its q|k|v (panel_matmul_fetching) — at large batches the cache outgrows the CPU's caches. */
void decode_layers(int64_t L, const int64_t *layers, float *x, int64_t B, int64_t hidden, int64_t F,
                   const float *rot, int64_t rot_stride, const int64_t *slots, const float *mask, int64_t mask_stride,
                   int64_t H, int64_t Hkv, int64_t d, float norm_eps, float *qkv, float *attn, float *mlp,
                   float *mid, float *scratch) {
    const int64_t width = (H + 2 * Hkv) * d;
    const int64_t kv_bytes = live_pages(slots, B) * B * Hkv * d * CHUNK * (int64_t)sizeof(float);
    for (int64_t l = 0; l < L; ++l) {
        const int64_t *w = layers + l * FIELDS;
#define AT(field) ((const float *)w[field])
        panel_matmul_fetching(x, hidden, B, AT(QKV), width, hidden, AT(QKV_BIAS), 0, 0, qkv, norm_eps, 0, 0, 0,
                              (const void *)w[VALUES], kv_bytes);
        decode_attention(qkv, width, rot, rot_stride, (float *)w[KEYS], (float *)w[VALUES], slots, mask, mask_stride,
                         B, H, Hkv, d, attn, scratch);
        panel_matmul(attn, H * d, B, AT(O), hidden, H * d, AT(O_BIAS), x, hidden, mid, -1.f, 0, 0, 0);
        const int64_t *next = layers + (l + 1 < L ? l + 1 : 0) * FIELDS;
        panel_matmul(mid, hidden, B, AT(GATE_UP), F, hidden, AT(GATE_UP_BIAS), 0, 0, mlp, norm_eps, 1, 0, 0);
        panel_matmul_fetching(mlp, F, B, AT(DOWN), hidden, F, AT(DOWN_BIAS), mid, hidden, x, -1.f, 0, 0, 0,
                              (const void *)next[KEYS], kv_bytes);
#undef AT
    }
}
