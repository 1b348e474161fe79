/* What the C kernels call of one another (each defined in the file named), in one place so
 * that the compiler checks every definition against its declaration. */
#ifndef MODELYARD_KERNELS_H
#define MODELYARD_KERNELS_H

#include <stdint.h>
#include <string.h>

/* bfloat16 <-> float32, shared by the kernels (static inline: no call across files). */
static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rounded to nearest even, as PyTorch's conversion does. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0 (a softmax score minus the largest; SiLU's e^-|x|), in plain arithmetic the
 * compiler vectorises (libm's expf is scalar: it was 45 % of the attention kernel). x = n ln2 + r
 * with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 1e-7), 2^n
 * through the exponent bits. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* e^-87 ~ 1.6e-38, still a normal float */
    const int32_t n = (int32_t)(x * 1.44269504f - 0.5f); /* rounds to nearest for x <= 0 */
    const float r = x - (float)n * 0.693145752f - (float)n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* thread_pool.c */
typedef void (*pool_task)(const void *context, int64_t first, int64_t last);
void pool_run(pool_task task, const void *context, int64_t items, int64_t chunk, int n_threads);
void pool_spin(int on);
float *thread_scratch(int64_t floats);

/* fused_ops.c */
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t cols,
              int64_t x_stride, float eps);
int rope_write_kv(float *qkv, const float *cos_table, const float *sin_table,
                  const int64_t *positions, const int64_t *slots, void *k_cache, void *v_cache,
                  int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                  int64_t row_stride, int64_t max_positions, int bf16);

/* paged_attention.c */
int paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                           int64_t block_size, int64_t max_blocks, float scale, int bf16,
                           int n_threads);

/* int8_matmul.c */
void int8_matmul(const float *x, int64_t M, int64_t K, const float *inv_smooth, const int8_t *w,
                 const int32_t *wsum, const float *wscale, const float *bias, int64_t N,
                 float *out, uint8_t *xq, float *xscale, int n_threads);

/* lora.c */
int lora_add(const void *x, int64_t x_stride, int x_bf16, void *y, int64_t y_stride, int y_bf16,
             const int64_t *rows, const int64_t *groups, const int64_t *slots, int64_t n_groups,
             const void *a, const void *const *b, const int64_t *part_sizes,
             const uint8_t *part_used, int64_t parts, int64_t in, int64_t rank, int w_bf16,
             int n_threads);

#endif
