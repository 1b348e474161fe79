/* Batched multi-LoRA for one wrapped projection: each row adds its own adapter's low-rank
 * update, y[row] += (x[row] @ A[slot]) @ B[slot], reading every adapter's A and B where they lie
 * in the stacked slot tensors (punica's "shrink" and "expand", one call for both).
 *
 * PyTorch had to gather A and B per row (a copy of every adapter's weights per projection and
 * step) or run a matmul pair per adapter (dispatches); with 50 adapters on every projection of
 * a 135M model that was 2 to 4 times the base model's own step. Here the weights are streamed
 * once per group of rows sharing an adapter (up to GROUP rows: a prefill chunk's rows of one
 * adapter share each read), in float32 arithmetic, on the thread pool (groups are the items).
 * A decode step with many adapters is bound by reading their weights, so they are kept in 16
 * bits (bfloat16 under a bfloat16 model, float16 under a float32 one: half the bytes of
 * float32), and only each adapter's own rank of rows is read (a rank-4 adapter in rank-8 slots
 * reads half). AVX-512 (with BF16 dot products for the shrink where the CPU has them), AVX2
 * with F16C, or plain C.
 *
 * Layout (layers.LoRALinear): per slot one block, `slot_stride` elements apart: A [parts * rank,
 * in] (as nn.Linear keeps its weight: the shrink is `rank` dot products along `in`), part p's
 * rows p*rank.., then B_p [rank, out_p] for each part; `rank` the largest, a slot's own rank on
 * a part its first rows. A group reads its slot's block front to back (every shrink, then every
 * expand) and a thread claims runs of neighbouring groups: one sequential stream. Part p's
 * output columns follow part p-1's in y. Weights float32, bfloat16 or float16; x and y float32 or bfloat16 each;
 * rows have contiguous columns, `*_stride` apart.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

#define GROUP 4 /* rows of one adapter sharing each read of its weights */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 512 /* elements ahead in a row of B */
#endif

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2 }; /* my_lora.w_dtype */

typedef struct {
    const void *x;
    void *y;
    int64_t x_stride, y_stride;
    const int64_t *rows;   /* the adapter rows, grouped by slot */
    const int64_t *groups; /* [n_groups + 1]: group g is rows[groups[g]..groups[g + 1]) */
    const int64_t *slots;  /* [n_groups]: each group's slot */
    const void *a;
    const void *const *b;
    int64_t slot_stride;
    const int64_t *part_sizes;
    const int32_t *part_rank; /* [slots, parts]: the slot's rank on the part (0: untouched) */
    int64_t in, in_padded, parts, rank;
    int x_bf16, y_bf16, w_dtype;
    atomic_int failed;
} Args;

static inline int64_t w_bytes(int w_dtype) { return w_dtype == W_F32 ? 4 : 2; }

/* Ask for weights ahead of use into L2 (each adapter's part is a short run the hardware
 * prefetchers barely train on). */
static inline void prefetch_l2(const void *w, int w_dtype, int64_t at) {
    __builtin_prefetch((const char *)w + at * w_bytes(w_dtype), 0, 2);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LANES 16 /* columns per accumulator: one AVX-512 register of floats */

/* 16 weights (or the first `n`, the rest zero) from element `at` of `w`, as floats. */
static inline __m512 load16(const void *w, int w_dtype, int64_t at, __mmask16 m) {
    if (w_dtype == W_BF16) {
        const __m256i v = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    if (w_dtype == W_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + at));
    return _mm512_maskz_loadu_ps(m, (const float *)w + at);
}

/* Four weight rows of A against `g_count` rows of x: each x chunk loaded once for four rows,
 * each weight chunk once for every x row. */
static inline __attribute__((always_inline)) void shrink4(const Args *a, const void *A,
                                                          int64_t w, int nw, const float *xs,
                                                          float *h, int64_t h_stride,
                                                          int g_count) {
    const int64_t in = a->in, xp = a->in_padded;
    __m512 acc[GROUP][4];
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < 4; k++) acc[g][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += LANES) {
        const __mmask16 m = in - i >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (in - i)) - 1);
        __m512 wv[4];
        for (int k = 0; k < nw; k++) prefetch_l2(A, a->w_dtype, (w + 4 + k) * in + i);
        for (int k = 0; k < 4; k++)
            wv[k] = k < nw ? load16(A, a->w_dtype, (w + k) * in + i, m) : _mm512_setzero_ps();
        for (int g = 0; g < g_count; g++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xs + g * xp + i);
            for (int k = 0; k < 4; k++) acc[g][k] = _mm512_fmadd_ps(xv, wv[k], acc[g][k]);
        }
    }
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < nw; k++) h[g * h_stride + w + k] = _mm512_reduce_add_ps(acc[g][k]);
}

/* y[rows[g]][col..col + out) += h[g] @ B for the first `count` of `g_count` rows; bfloat16 y
 * rounded to nearest even. */
static inline __attribute__((always_inline)) void expand(const Args *a, const void *B,
                                                         int64_t rank, const float *h,
                                                         int64_t h_stride, const int64_t *rows,
                                                         int64_t col, int64_t out, int g_count,
                                                         int64_t count) {
    for (int64_t j0 = 0; j0 < out; j0 += LANES) {
        const __mmask16 m =
            out - j0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (out - j0)) - 1);
        __m512 acc[GROUP];
        for (int g = 0; g < g_count; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            prefetch_l2(B, a->w_dtype, r * out + j0 + PREFETCH_AHEAD);
            const __m512 bv = load16(B, a->w_dtype, r * out + j0, m);
            for (int g = 0; g < g_count; g++)
                acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(h[g * h_stride + r]), bv, acc[g]);
        }
        for (int64_t g = 0; g < count; g++) {
            const int64_t at = rows[g] * a->y_stride + col + j0;
            if (a->y_bf16) {
                uint16_t *y = (uint16_t *)a->y + at;
                const __m256i old = _mm256_maskz_loadu_epi16(m, y);
                const __m512 sum = _mm512_add_ps(
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)),
                    acc[g]);
                __m512i bits = _mm512_castps_si512(sum);
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16),
                                                     _mm512_set1_epi32(1));
                bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
                _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
            } else {
                float *y = (float *)a->y + at;
                _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), acc[g]));
            }
        }
    }
}

#if defined(__AVX512BF16__)
#define BF16_DOT 1
/* The shrink for bfloat16 x and A on CPUs with AVX-512 BF16: each instruction multiplies 32
 * pairs straight from the bfloat16 rows (no conversion, twice the products of an FMA), summed
 * in float32; x read in place. */
static inline __attribute__((always_inline)) void shrink4_bf16(const Args *a, const uint16_t *A,
                                                               int64_t w, int nw,
                                                               const uint16_t *const *xr, float *h,
                                                               int64_t h_stride, int g_count) {
    const int64_t in = a->in;
    __m512 acc[GROUP][4];
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < 4; k++) acc[g][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
        const __mmask32 m = in - i >= 32 ? (__mmask32)0xffffffffu
                                         : (__mmask32)((1ull << (in - i)) - 1);
        __m512bh wv[4];
        for (int k = 0; k < nw; k++) prefetch_l2(A, W_BF16, (w + 4 + k) * in + i);
        for (int k = 0; k < 4; k++)
            wv[k] = (__m512bh)(k < nw ? _mm512_maskz_loadu_epi16(m, A + (w + k) * in + i)
                                      : _mm512_setzero_si512());
        for (int g = 0; g < g_count; g++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xr[g] + i);
            for (int k = 0; k < 4; k++) acc[g][k] = _mm512_dpbf16_ps(acc[g][k], xv, wv[k]);
        }
    }
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < nw; k++) h[g * h_stride + w + k] = _mm512_reduce_add_ps(acc[g][k]);
}

static inline __attribute__((always_inline)) void shrink_bf16(const Args *a, const uint16_t *A,
                                                              int64_t rank,
                                                              const uint16_t *const *xr, float *h,
                                                              int64_t h_stride, int g_count) {
    int64_t w = 0;
    for (; w + 4 <= rank; w += 4) shrink4_bf16(a, A, w, 4, xr, h, h_stride, g_count);
    if (w < rank) shrink4_bf16(a, A, w, (int)(rank - w), xr, h, h_stride, g_count);
}
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LANES 8 /* one AVX2 register of floats */

/* 8 weights from element `at` of `w`, as floats. */
static inline __m256 load8(const void *w, int w_dtype, int64_t at) {
    if (w_dtype == W_F32) return _mm256_loadu_ps((const float *)w + at);
    const __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + at));
    if (w_dtype == W_F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* The first `n` (< 8) weights from element `at`, the rest zero. */
static inline __m256 load8_tail(const void *w, int w_dtype, int64_t at, int64_t n) {
    float f[LANES] = {0};
    uint16_t half[LANES] = {0};
    if (w_dtype == W_F32) {
        memcpy(f, (const float *)w + at, sizeof(float) * (size_t)n);
        return _mm256_loadu_ps(f);
    }
    memcpy(half, (const uint16_t *)w + at, sizeof(uint16_t) * (size_t)n);
    return load8(half, w_dtype, 0);
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weight rows w..w + nw (nw <= 4) of A against `g_count` rows of x (floats, zero-padded to
 * `in_padded`): each x chunk loaded once for four rows, each weight chunk once per x row. */
static inline __attribute__((always_inline)) void shrink4(const Args *a, const void *A,
                                                          int64_t w, int nw, const float *xs,
                                                          float *h, int64_t h_stride,
                                                          int g_count) {
    const int64_t in = a->in, xp = a->in_padded;
    const int wd = a->w_dtype;
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
                                                         int64_t count) {
    const int wd = a->w_dtype;
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

#else /* plain C: the compiler vectorises what it can */
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
                                                              int g_count) {
    const int64_t in = a->in, xp = a->in_padded;
    for (int64_t w = 0; w < rank; w++) {
        float acc[GROUP][LANES] = {{0}}, tail[GROUP] = {0};
        float wv[LANES];
        int64_t i = 0;
        for (; i + LANES <= in; i += LANES) {
            load_weights(A, a->w_dtype, w * in + i, LANES, wv);
            for (int g = 0; g < g_count; g++)
                for (int j = 0; j < LANES; j++) acc[g][j] += xs[g * xp + i + j] * wv[j];
        }
        for (; i < in; i++) {
            const float wi = weight_at(A, a->w_dtype, w * in + i);
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
                                                         int64_t count) {
    for (int64_t j0 = 0; j0 < out; j0 += LANES) {
        const int64_t n = out - j0 < LANES ? out - j0 : LANES;
        float acc[GROUP][LANES] = {{0}};
        float wv[LANES] = {0};
        for (int64_t r = 0; r < rank; r++) {
            load_weights(B, a->w_dtype, r * out + j0, n, wv);
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

#if defined(__AVX512F__) && defined(__AVX512BW__) || \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The part's first `rank` rows of A, four at a time. */
static inline __attribute__((always_inline)) void shrink_rows(const Args *a, const void *A,
                                                              int64_t rank, const float *xs,
                                                              float *h, int64_t h_stride,
                                                              int g_count) {
    int64_t w = 0;
    for (; w + 4 <= rank; w += 4) shrink4(a, A, w, 4, xs, h, h_stride, g_count);
    if (w < rank) shrink4(a, A, w, (int)(rank - w), xs, h, h_stride, g_count);
}
#endif

/* One group: its rows' x as floats (zero rows pad a group to the unrolled count, zero columns
 * each row to `in_padded`), then every part's shrink, then every part's expand (the order the
 * slot's block holds A and the Bs), over the slot's own rank, skipping parts the slot's adapter
 * does not target. h: [GROUP, parts * rank]. */
static inline __attribute__((always_inline)) void run_group(const Args *a, int64_t group,
                                                            float *xs, float *h, int g_count) {
    const int64_t first = a->groups[group], count = a->groups[group + 1] - first;
    const int64_t *rows = a->rows + first, slot = a->slots[group];
    const int64_t in = a->in, xp = a->in_padded, width = a->parts * a->rank;
    const int64_t wb = w_bytes(a->w_dtype);
    const int32_t *ranks = a->part_rank + slot * a->parts;
#ifdef BF16_DOT
    const int bf16_dot = a->x_bf16 && a->w_dtype == W_BF16;
    const uint16_t *xr[GROUP]; /* x rows in place; padding repeats the last */
    for (int g = 0; g < g_count; g++)
        xr[g] = (const uint16_t *)a->x + rows[g < count ? g : count - 1] * a->x_stride;
#else
    const int bf16_dot = 0;
#endif
    for (int g = 0; g < g_count && !bf16_dot; g++) {
        float *xg = xs + g * xp;
        if (g >= count) {
            memset(xg, 0, sizeof(float) * (size_t)xp);
            continue;
        }
        if (a->x_bf16) {
            const uint16_t *x = (const uint16_t *)a->x + rows[g] * a->x_stride;
            for (int64_t i = 0; i < in; i++) xg[i] = bf16_to_float(x[i]);
        } else {
            memcpy(xg, (const float *)a->x + rows[g] * a->x_stride, sizeof(float) * (size_t)in);
        }
        memset(xg + in, 0, sizeof(float) * (size_t)(xp - in));
    }
    for (int64_t p = 0; p < a->parts; p++) {
        if (ranks[p] == 0) continue;
        const void *A = (const char *)a->a + (slot * a->slot_stride + p * a->rank * in) * wb;
        float *hp = h + p * a->rank;
#ifdef BF16_DOT
        if (bf16_dot)
            shrink_bf16(a, (const uint16_t *)A, ranks[p], xr, hp, width, g_count);
        else
#endif
            shrink_rows(a, A, ranks[p], xs, hp, width, g_count);
    }
    int64_t col = 0;
    for (int64_t p = 0; p < a->parts; p++) {
        const int64_t out = a->part_sizes[p];
        if (ranks[p] > 0) {
            const void *B = (const char *)a->b[p] + slot * a->slot_stride * wb;
            expand(a, B, ranks[p], h + p * a->rank, width, rows, col, out, g_count, count);
        }
        col += out;
    }
}

static void run_groups(const void *context, int64_t first, int64_t last) {
    Args *a = (Args *)context;
    float *scratch = thread_scratch(GROUP * (a->in_padded + a->parts * a->rank));
    if (scratch == NULL) {
        atomic_store(&a->failed, 1);
        return;
    }
    float *xs = scratch, *h = scratch + GROUP * a->in_padded;
    for (int64_t g = first; g < last; g++) {
        if (a->groups[g + 1] - a->groups[g] == 1)
            run_group(a, g, xs, h, 1);
        else
            run_group(a, g, xs, h, GROUP);
    }
}

/* Returns 0, or -1 when a thread found no memory for its scratch (then some rows may lack
 * their update). A group holds at most GROUP rows, all of one slot. */
int my_lora_add(const my_lora *l) {
    Args args = {l->x,           l->y,           l->x_stride,    l->y_stride,
                 l->rows,        l->groups,      l->slots,       l->a,
                 l->b,           l->slot_stride, l->part_sizes,  l->part_rank,
                 l->in_features, (l->in_features + 7) / 8 * 8,   l->parts,
                 l->rank,        l->x_bf16,      l->y_bf16,      l->w_dtype,
                 0};
    /* Runs of neighbouring groups per claim: with every slot in use, a thread streams a run
     * of neighbouring slots' blocks, one long read the hardware prefetchers follow. */
    const int64_t n_threads = l->n_threads > 0 ? l->n_threads : 1;
    int64_t run = l->n_groups / (4 * n_threads);
    pool_run(run_groups, &args, l->n_groups, run > 0 ? run : 1, l->n_threads);
    return atomic_load(&args.failed) ? -1 : 0;
}
