/* lora.c's shrink and expand in plain C, for CPUs without AVX2 (and for tests of this form):
 * the compiler vectorises what it can. Included by lora.c (Args, GROUP) in place of its AVX-512
 * forms. */
#ifndef MODELYARD_LORA_PLAIN_H
#define MODELYARD_LORA_PLAIN_H

#define LANES 16

/* IEEE half precision to float (normal, subnormal, zero, infinity, NaN). */
static inline float f16_to_float(uint16_t x) {
    const uint32_t sign = (uint32_t)(x & 0x8000u) << 16, exp = (x >> 10) & 0x1fu,
                   mant = x & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {
        const float f = (float)mant * 5.9604644775390625e-8f; /* 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float weight_at(const void *w, int w_dtype, int64_t at) {
    if (w_dtype == W_BF16) return bf16_to_float(((const uint16_t *)w)[at]);
    if (w_dtype == W_F16) return f16_to_float(((const uint16_t *)w)[at]);
    if (w_dtype == W_I8) return (float)((const int8_t *)w)[at];
    return ((const float *)w)[at];
}

/* `n` weights from `w` at element `at`, as floats; a whole register's worth with a constant
 * count, so that the common case compiles to one load. */
static inline __attribute__((always_inline)) void load_weights(const void *w, int w_dtype,
                                                               int64_t at, int64_t n, float *out) {
    if (n == LANES && w_dtype == W_F32) {
        memcpy(out, (const float *)w + at, sizeof(float) * LANES);
    } else if (n == LANES) {
        for (int j = 0; j < LANES; j++) out[j] = weight_at(w, w_dtype, at + j);
    } else {
        for (int64_t j = 0; j < n; j++) out[j] = weight_at(w, w_dtype, at + j);
    }
}

/* h[g][w] = xs[g] . A[w] for the part's first `rank` rows of A (each `in` long: a dot product
 * that vectorises over `in`, whatever the rank), for `g_count` rows (a compile-time constant
 * once inlined, so the loops over rows and lanes unroll into registers). */
static inline __attribute__((always_inline)) void shrink_rows(const Args *a, const void *A,
                                                              int64_t rank, const float *xs,
                                                              float *h, int64_t h_stride,
                                                              int g_count, int wd) {
    const int64_t in = a->in, xp = a->in_padded;
    for (int64_t w = 0; w < rank; w++) {
        float acc[GROUP][LANES] = {{0}}, tail[GROUP] = {0};
        float wv[LANES];
        int64_t i = 0;
        for (; i + LANES <= in; i += LANES) {
            load_weights(A, wd, w * in + i, LANES, wv);
            for (int g = 0; g < g_count; g++)
                for (int j = 0; j < LANES; j++) acc[g][j] += xs[g * xp + i + j] * wv[j];
        }
        for (; i < in; i++) {
            const float wi = weight_at(A, wd, w * in + i);
            for (int g = 0; g < g_count; g++) tail[g] += xs[g * xp + i] * wi;
        }
        for (int g = 0; g < g_count; g++) {
            float sum = tail[g];
            for (int j = 0; j < LANES; j++) sum += acc[g][j];
            h[g * h_stride + w] = sum;
        }
    }
}

/* y[rows[g]][col..col + out) += h[g][0..rank) @ B (B: [rank, out]) for the first `count` of
 * `g_count` rows (the others pad the group: computed, never written). */
static inline __attribute__((always_inline)) void expand(const Args *a, const void *B,
                                                         int64_t rank, const float *h,
                                                         int64_t h_stride, const int64_t *rows,
                                                         int64_t col, int64_t out, int g_count,
                                                         int64_t count, int wd) {
    for (int64_t j0 = 0; j0 < out; j0 += LANES) {
        const int64_t n = out - j0 < LANES ? out - j0 : LANES;
        float acc[GROUP][LANES] = {{0}};
        float wv[LANES] = {0};
        for (int64_t r = 0; r < rank; r++) {
            load_weights(B, wd, r * out + j0, n, wv);
            for (int g = 0; g < g_count; g++) {
                const float hv = h[g * h_stride + r];
                for (int j = 0; j < LANES; j++) acc[g][j] += hv * wv[j];
            }
        }
        for (int64_t g = 0; g < count; g++) {
            const int64_t at = rows[g] * a->y_stride + col + j0;
            if (a->y_bf16) {
                uint16_t *y = (uint16_t *)a->y + at;
                for (int64_t j = 0; j < n; j++)
                    y[j] = float_to_bf16(bf16_to_float(y[j]) + acc[g][j]);
            } else {
                float *y = (float *)a->y + at;
                for (int64_t j = 0; j < n; j++) y[j] += acc[g][j];
            }
        }
    }
}

#endif
