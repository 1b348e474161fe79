/* The small per-layer ops of a decoder layer fused, float32: each replaces 5 to 20 PyTorch ops
 * (a dispatch and a tensor each) by one pass over rows that stay in L1.
 *
 * Built with paged_attention.c by modelyard.engine.cpu_kernels.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

/* out[r] = x[r] / rms(x[r]) * weight, rows of `cols` values (rows `x_stride` apart). */
void my_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t cols,
                 int64_t x_stride, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * cols;
        float sum = 0.0f;
        for (int64_t c = 0; c < cols; c++) sum += xr[c] * xr[c];
        const float inv = 1.0f / sqrtf(sum / (float)cols + eps);
        for (int64_t c = 0; c < cols; c++) o[c] = xr[c] * inv * weight[c];
    }
}

/* Rotate-half RoPE of each token's query and key heads, in place in the fused q|k|v rows
 * (`row_stride` apart: queries at 0, keys at `heads * dim`, values after them), then the
 * rotated key and the value written to the token's cache slot (float32, or bfloat16 when
 * `bf16`). cos/sin: [max_positions, dim]. Returns 0, or -1 (nothing written) when a position
 * lies outside the tables. */
static inline int rope_write_kv(float *qkv, const float *cos_table, const float *sin_table,
                                const int64_t *positions, const int64_t *slots, void *k_cache,
                                void *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads,
                                int64_t dim, int64_t row_stride, int64_t max_positions, int bf16) {
    const int64_t half = dim / 2, kv_width = kv_heads * dim;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_stride;
        const float *cos = cos_table + positions[t] * dim, *sin = sin_table + positions[t] * dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = b * cos[i + half] + a * sin[i + half];
            }
        }
        const float *k = row + heads * dim, *v = k + kv_width;
        const int64_t at = slots[t] * kv_width;
        if (bf16) {
            uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
            for (int64_t i = 0; i < kv_width; i++) {
                kc[i] = float_to_bf16(k[i]);
                vc[i] = float_to_bf16(v[i]);
            }
        } else {
            float *kc = (float *)k_cache + at, *vc = (float *)v_cache + at;
            for (int64_t i = 0; i < kv_width; i++) {
                kc[i] = k[i];
                vc[i] = v[i];
            }
        }
    }
    return 0;
}

int my_rope_write_kv(const my_rope_kv *r) {
    return rope_write_kv(r->qkv, r->cos_table, r->sin_table, r->positions, r->slots, r->k_cache,
                         r->v_cache, r->tokens, r->heads, r->kv_heads, r->dim, r->row_stride,
                         r->max_positions, r->bf16);
}

/* w8a8's activation preparation, one pass per row: divide by the SmoothQuant factors (when
 * given), then scale the row to absmax 1 for the per-tensor int8 kernel; `row_max` keeps each
 * row's scale to multiply back. */
void my_smooth_rows(const float *x, const float *inv_smooth, float *out, float *row_max,
                    int64_t rows, int64_t cols, int64_t x_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * cols, m = 0.0f;
        if (inv_smooth != 0) {
            for (int64_t c = 0; c < cols; c++) o[c] = xr[c] * inv_smooth[c];
        } else {
            for (int64_t c = 0; c < cols; c++) o[c] = xr[c];
        }
        for (int64_t c = 0; c < cols; c++) m = fabsf(o[c]) > m ? fabsf(o[c]) : m;
        m = m > 1e-12f ? m : 1e-12f;
        for (int64_t c = 0; c < cols; c++) o[c] /= m; /* divided, as PyTorch does: bit for bit */
        row_max[r] = m;
    }
}
