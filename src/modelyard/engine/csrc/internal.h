/* What the C kernels share among themselves and Python never calls: the bfloat16 and exp
 * helpers (static inline: no call across files) and the thread pool. Hidden from the library's
 * exports (the build's -fvisibility=hidden); Python's interface is kernels.h. */
#ifndef MODELYARD_KERNELS_INTERNAL_H
#define MODELYARD_KERNELS_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

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

/* The sum of a vector's eight floats (the AVX2 forms of the GGUF and LoRA kernels). */
#if defined(__AVX2__)
#include <immintrin.h>
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

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

/* amx_matmul.c: out = the int8 product of x (already quantized: xq, xscale) on AMX tiles, if
 * `w` has its AMX copy, x at least AMX_MIN_ROWS rows and the tiles are usable; 1 if it ran,
 * 0 if the caller's VNNI product must. */
#define AMX_MIN_ROWS 8
int amx_matmul(const uint8_t *xq, const float *xscale, int64_t M, const my_linear *w,
               float *out, int n_threads);

/* thread_pool.c */
typedef void (*pool_task)(const void *context, int64_t first, int64_t last);
void pool_run(pool_task task, const void *context, int64_t items, int64_t chunk, int n_threads);
void pool_spin(int on);
float *thread_scratch(int64_t floats);

#endif
