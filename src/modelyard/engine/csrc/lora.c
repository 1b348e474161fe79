/* Batched multi-LoRA for one wrapped projection: each row adds its own adapter's low-rank
 * update, y[row] += (x[row] @ A[slot]) @ B[slot], reading every adapter's A and B where they lie
 * in the stacked slot tensors (punica's "shrink" and "expand", one call for both).
 *
 * PyTorch had to gather A and B per row (a copy of every adapter's weights per projection and
 * step) or run a matmul pair per adapter (dispatches); with 50 adapters on every projection of
 * a 135M model that was 2 to 4 times the base model's own step. Here the weights are streamed
 * once per group of rows sharing an adapter (up to GROUP rows: a prefill chunk's rows of one
 * adapter share each read), in float32 arithmetic, on the thread pool (groups are the items).
 * AVX-512 (with BF16 dot products for the shrink where the CPU has them), or plain C.
 *
 * Layout (layers.LoRALinear): A [slots, parts * rank, in] (as nn.Linear keeps its weight: the
 * shrink is `rank` dot products along `in`), part p's rows p*rank..; B_p [slots, rank, out_p];
 * part p's output columns follow part p-1's in y. Weights float32 or bfloat16; x and y float32
 * or bfloat16 each; rows have contiguous columns, `*_stride` apart.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

#define GROUP 4  /* rows of one adapter sharing each read of its weights */
#define LANES 16 /* columns per accumulator: one AVX-512 register of floats */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 512 /* elements ahead in a row of B */
#endif

typedef struct {
    const void *x;
    void *y;
    int64_t x_stride, y_stride;
    const int64_t *rows;   /* the adapter rows, grouped by slot */
    const int64_t *groups; /* [n_groups + 1]: group g is rows[groups[g]..groups[g + 1]) */
    const int64_t *slots;  /* [n_groups]: each group's slot */
    const void *a;
    const void *const *b;
    const int64_t *part_sizes;
    const uint8_t *part_used; /* [slots, parts]: the slot's adapter targets the part */
    int64_t in, parts, rank;
    int x_bf16, y_bf16, w_bf16;
    atomic_int failed;
} Args;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 weights (or the first `n`, the rest zero) from element `at` of `w`, as floats. */
static inline __m512 load16(const void *w, int w_bf16, int64_t at, __mmask16 m) {
    if (w_bf16) {
        const __m256i v = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)w + at);
}

/* Ask for weights ahead of use into L2 (each adapter's part is a short run the hardware
 * prefetchers barely train on). */
static inline void prefetch_l2(const void *w, int w_bf16, int64_t at) {
    _mm_prefetch((const char *)w + at * (w_bf16 ? 2 : 4), _MM_HINT_T1);
}

/* Four weight rows of A against `g_count` rows of x: each x chunk loaded once for four rows,
 * each weight chunk once for every x row. */
static inline __attribute__((always_inline)) void shrink4(const Args *a, const void *A,
                                                          int64_t w, int nw, const float *xs,
                                                          float *h, int64_t h_stride,
                                                          int g_count) {
    const int64_t in = a->in;
    __m512 acc[GROUP][4];
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < 4; k++) acc[g][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += LANES) {
        const __mmask16 m = in - i >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (in - i)) - 1);
        __m512 wv[4];
        for (int k = 0; k < nw; k++) prefetch_l2(A, a->w_bf16, (w + 4 + k) * in + i);
        for (int k = 0; k < 4; k++)
            wv[k] = k < nw ? load16(A, a->w_bf16, (w + k) * in + i, m) : _mm512_setzero_ps();
        for (int g = 0; g < g_count; g++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xs + g * in + i);
            for (int k = 0; k < 4; k++) acc[g][k] = _mm512_fmadd_ps(xv, wv[k], acc[g][k]);
        }
    }
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < nw; k++) h[g * h_stride + w + k] = _mm512_reduce_add_ps(acc[g][k]);
}

static inline __attribute__((always_inline)) void shrink(const Args *a, const void *A,
                                                         const float *xs, float *h,
                                                         int64_t h_stride, int g_count) {
    int64_t w = 0;
    for (; w + 4 <= a->rank; w += 4) shrink4(a, A, w, 4, xs, h, h_stride, g_count);
    if (w < a->rank) shrink4(a, A, w, (int)(a->rank - w), xs, h, h_stride, g_count);
}

/* y[rows[g]][col..col + out) += h[g] @ B for the first `count` of `g_count` rows; bfloat16 y
 * rounded to nearest even. */
static inline __attribute__((always_inline)) void expand(const Args *a, const void *B,
                                                         const float *h, int64_t h_stride,
                                                         const int64_t *rows, int64_t col,
                                                         int64_t out, int g_count, int64_t count) {
    const int64_t rank = a->rank;
    for (int64_t j0 = 0; j0 < out; j0 += LANES) {
        const __mmask16 m =
            out - j0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (out - j0)) - 1);
        __m512 acc[GROUP];
        for (int g = 0; g < g_count; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            prefetch_l2(B, a->w_bf16, r * out + j0 + PREFETCH_AHEAD);
            const __m512 bv = load16(B, a->w_bf16, r * out + j0, m);
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
        for (int k = 0; k < nw; k++) prefetch_l2(A, 1, (w + 4 + k) * in + i);
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
                                                              const uint16_t *const *xr, float *h,
                                                              int64_t h_stride, int g_count) {
    int64_t w = 0;
    for (; w + 4 <= a->rank; w += 4) shrink4_bf16(a, A, w, 4, xr, h, h_stride, g_count);
    if (w < a->rank) shrink4_bf16(a, A, w, (int)(a->rank - w), xr, h, h_stride, g_count);
}
#endif

#else /* plain C: the compiler vectorises what it can */

/* `n` weights from `w` (float32 or bfloat16) at element `at`, as floats; a whole register's
 * worth with a constant count, so that the common case compiles to one load. */
static inline __attribute__((always_inline)) void load_weights(const void *w, int w_bf16,
                                                               int64_t at, int64_t n, float *out) {
    if (n == LANES) {
        if (w_bf16) {
            const uint16_t *p = (const uint16_t *)w + at;
            for (int j = 0; j < LANES; j++) out[j] = bf16_to_float(p[j]);
        } else {
            memcpy(out, (const float *)w + at, sizeof(float) * LANES);
        }
    } else if (w_bf16) {
        const uint16_t *p = (const uint16_t *)w + at;
        for (int64_t j = 0; j < n; j++) out[j] = bf16_to_float(p[j]);
    } else {
        memcpy(out, (const float *)w + at, sizeof(float) * (size_t)n);
    }
}

/* h[g][w] = xs[g] . A[w] for the part's `rank` rows of A (each `in` long: a dot product that
 * vectorises over `in`, whatever the rank), for `g_count` rows (a compile-time constant once
 * inlined, so the loops over rows and lanes unroll into registers). */
static inline __attribute__((always_inline)) void shrink(const Args *a, const void *A,
                                                         const float *xs, float *h,
                                                         int64_t h_stride, int g_count) {
    const int64_t in = a->in;
    for (int64_t w = 0; w < a->rank; w++) {
        float acc[GROUP][LANES] = {{0}}, tail[GROUP] = {0};
        float wv[LANES];
        int64_t i = 0;
        for (; i + LANES <= in; i += LANES) {
            load_weights(A, a->w_bf16, w * in + i, LANES, wv);
            for (int g = 0; g < g_count; g++)
                for (int j = 0; j < LANES; j++) acc[g][j] += xs[g * in + i + j] * wv[j];
        }
        for (; i < in; i++) {
            load_weights(A, a->w_bf16, w * in + i, 1, wv);
            for (int g = 0; g < g_count; g++) tail[g] += xs[g * in + i] * wv[0];
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
                                                         const float *h, int64_t h_stride,
                                                         const int64_t *rows, int64_t col,
                                                         int64_t out, int g_count, int64_t count) {
    const int64_t rank = a->rank;
    for (int64_t j0 = 0; j0 < out; j0 += LANES) {
        const int64_t n = out - j0 < LANES ? out - j0 : LANES;
        float acc[GROUP][LANES] = {{0}};
        float wv[LANES] = {0};
        for (int64_t r = 0; r < rank; r++) {
            load_weights(B, a->w_bf16, r * out + j0, n, wv);
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

/* One group: its rows' x as floats (zero rows pad a group to the unrolled count), then per
 * part its shrink and expand, skipped where the slot's adapter does not target the part. */
static inline __attribute__((always_inline)) void run_group(const Args *a, int64_t group,
                                                            float *xs, float *h, int g_count) {
    const int64_t first = a->groups[group], count = a->groups[group + 1] - first;
    const int64_t *rows = a->rows + first, slot = a->slots[group];
    const int64_t in = a->in, width = a->parts * a->rank;
#ifdef BF16_DOT
    const int bf16_dot = a->x_bf16 && a->w_bf16;
    const uint16_t *xr[GROUP]; /* x rows in place; padding repeats the last */
    for (int g = 0; g < g_count; g++)
        xr[g] = (const uint16_t *)a->x + rows[g < count ? g : count - 1] * a->x_stride;
#else
    const int bf16_dot = 0;
#endif
    for (int g = 0; g < g_count && !bf16_dot; g++) {
        float *xg = xs + g * in;
        if (g >= count) {
            memset(xg, 0, sizeof(float) * (size_t)in);
        } else if (a->x_bf16) {
            const uint16_t *xr = (const uint16_t *)a->x + rows[g] * a->x_stride;
            for (int64_t i = 0; i < in; i++) xg[i] = bf16_to_float(xr[i]);
        } else {
            memcpy(xg, (const float *)a->x + rows[g] * a->x_stride, sizeof(float) * (size_t)in);
        }
    }
    int64_t col = 0;
    for (int64_t p = 0; p < a->parts; p++) {
        const int64_t out = a->part_sizes[p];
        if (a->part_used[slot * a->parts + p]) {
            const int64_t a_at = (slot * width + p * a->rank) * in, b_at = slot * a->rank * out;
            const void *A = a->w_bf16 ? (const void *)((const uint16_t *)a->a + a_at)
                                      : (const void *)((const float *)a->a + a_at);
            const void *B = a->w_bf16 ? (const void *)((const uint16_t *)a->b[p] + b_at)
                                      : (const void *)((const float *)a->b[p] + b_at);
#ifdef BF16_DOT
            if (bf16_dot)
                shrink_bf16(a, (const uint16_t *)A, xr, h, a->rank, g_count);
            else
#endif
                shrink(a, A, xs, h, a->rank, g_count);
            expand(a, B, h, a->rank, rows, col, out, g_count, count);
        }
        col += out;
    }
}

static void run_groups(const void *context, int64_t first, int64_t last) {
    Args *a = (Args *)context;
    float *scratch = thread_scratch(GROUP * (a->in + a->rank));
    if (scratch == NULL) {
        atomic_store(&a->failed, 1);
        return;
    }
    float *xs = scratch, *h = scratch + GROUP * a->in; /* h: [GROUP, rank] */
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
    Args args = {l->x,         l->y,         l->x_stride,    l->y_stride, l->rows,
                 l->groups,    l->slots,     l->a,           l->b,        l->part_sizes,
                 l->part_used, l->in_features, l->parts,     l->rank,     l->x_bf16,
                 l->y_bf16,    l->w_bf16,    0};
    pool_run(run_groups, &args, l->n_groups, 1, l->n_threads);
    return atomic_load(&args.failed) ? -1 : 0;
}
