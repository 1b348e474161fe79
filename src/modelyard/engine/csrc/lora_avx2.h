/* lora.c's shrink and expand for CPUs with AVX2, FMA and F16C (no AVX-512): weights float32,
 * bfloat16, float16 or int8 widened to floats 8 at a time. Included by lora.c (Args, GROUP,
 * prefetch_l2) in place of its AVX-512 forms. */
#ifndef MODELYARD_LORA_AVX2_H
#define MODELYARD_LORA_AVX2_H

#include <immintrin.h>
#define LANES 8 /* one AVX2 register of floats */

#define SHRINK_ROWS(g_count) 4 /* weight rows a shrink4 takes at once */

/* 8 weights from element `at` of `w`, as floats. */
static inline __m256 load8(const void *w, int w_dtype, int64_t at) {
    if (w_dtype == W_F32) return _mm256_loadu_ps((const float *)w + at);
    if (w_dtype == W_I8) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + at));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
    if (w_dtype == W_F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* The first `n` (< 8) weights from element `at`, the rest zero. */
static inline __m256 load8_tail(const void *w, int w_dtype, int64_t at, int64_t n) {
    float f[LANES] = {0};
    uint16_t half[LANES] = {0};
    int8_t q[LANES] = {0};
    if (w_dtype == W_F32) {
        memcpy(f, (const float *)w + at, sizeof(float) * (size_t)n);
        return _mm256_loadu_ps(f);
    }
    if (w_dtype == W_I8) {
        memcpy(q, (const int8_t *)w + at, (size_t)n);
        return load8(q, w_dtype, 0);
    }
    memcpy(half, (const uint16_t *)w + at, sizeof(uint16_t) * (size_t)n);
    return load8(half, w_dtype, 0);
}

/* Weight rows w..w + nw (nw <= 4) of A against `g_count` rows of x (floats, zero-padded to
 * `in_padded`): each x chunk loaded once for four rows, each weight chunk once per x row. */
static inline __attribute__((always_inline)) void shrink4(const Args *a, const void *A,
                                                          int64_t w, int nw, const float *xs,
                                                          float *h, int64_t h_stride,
                                                          int g_count, int wd) {
    const int64_t in = a->in, xp = a->in_padded;
    __m256 acc[GROUP][4];
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < 4; k++) acc[g][k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += LANES) {
        const int64_t n = in - i;
        __m256 wv[4];
        for (int k = 0; k < nw; k++) prefetch_l2(A, wd, (w + 4 + k) * in + i);
        for (int k = 0; k < 4; k++)
            wv[k] = k >= nw      ? _mm256_setzero_ps()
                    : n >= LANES ? load8(A, wd, (w + k) * in + i)
                                 : load8_tail(A, wd, (w + k) * in + i, n);
        for (int g = 0; g < g_count; g++) {
            const __m256 xv = _mm256_loadu_ps(xs + g * xp + i);
            for (int k = 0; k < 4; k++) acc[g][k] = _mm256_fmadd_ps(xv, wv[k], acc[g][k]);
        }
    }
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < nw; k++) h[g * h_stride + w + k] = sum8(acc[g][k]);
}

/* y[row][at..at + n) += v's first n (<= 8). */
static inline void add_to_y(const Args *a, int64_t row, int64_t at, __m256 v, int64_t n) {
    const int64_t o = row * a->y_stride + at;
    if (!a->y_bf16 && n == LANES) {
        float *y = (float *)a->y + o;
        _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), v));
        return;
    }
    float d[LANES];
    _mm256_storeu_ps(d, v);
    if (a->y_bf16) {
        uint16_t *y = (uint16_t *)a->y + o;
        for (int64_t j = 0; j < n; j++) y[j] = float_to_bf16(bf16_to_float(y[j]) + d[j]);
    } else {
        float *y = (float *)a->y + o;
        for (int64_t j = 0; j < n; j++) y[j] += d[j];
    }
}

/* y[rows[g]][col..col + out) += h[g] @ B for the first `count` of `g_count` rows: 16 columns
 * at a time (two independent sums per row), then the last few. */
static inline __attribute__((always_inline)) void expand(const Args *a, const void *B,
                                                         int64_t rank, const float *h,
                                                         int64_t h_stride, const int64_t *rows,
                                                         int64_t col, int64_t out, int g_count,
                                                         int64_t count, int wd) {
    int64_t j0 = 0;
    for (; j0 + 2 * LANES <= out; j0 += 2 * LANES) {
        __m256 acc[GROUP][2];
        for (int g = 0; g < g_count; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            prefetch_l2(B, wd, r * out + j0 + PREFETCH_AHEAD);
            const __m256 b0 = load8(B, wd, r * out + j0), b1 = load8(B, wd, r * out + j0 + LANES);
            for (int g = 0; g < g_count; g++) {
                const __m256 hv = _mm256_set1_ps(h[g * h_stride + r]);
                acc[g][0] = _mm256_fmadd_ps(hv, b0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(hv, b1, acc[g][1]);
            }
        }
        for (int64_t g = 0; g < count; g++) {
            add_to_y(a, rows[g], col + j0, acc[g][0], LANES);
            add_to_y(a, rows[g], col + j0 + LANES, acc[g][1], LANES);
        }
    }
    for (; j0 < out; j0 += LANES) {
        const int64_t n = out - j0 < LANES ? out - j0 : LANES;
        __m256 acc[GROUP];
        for (int g = 0; g < g_count; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            const __m256 bv =
                n == LANES ? load8(B, wd, r * out + j0) : load8_tail(B, wd, r * out + j0, n);
            for (int g = 0; g < g_count; g++)
                acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(h[g * h_stride + r]), bv, acc[g]);
        }
        for (int64_t g = 0; g < count; g++) add_to_y(a, rows[g], col + j0, acc[g], n);
    }
}

#endif
