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
 * float32), or in int8 where the base model's matmuls are quantized (a quarter: each weight row
 * symmetric, absmax / 127, with one float32 scale; A's and B's row scales multiply each h[r]
 * between shrink and expand; on AVX-512 VNNI both products run in int8, `lora_int8.h`), and
 * only each adapter's own rank of rows is read (a rank-4 adapter in rank-8 slots reads half).
 * AVX-512 (with BF16 dot products for the shrink where the CPU has them), AVX2 with F16C
 * (`lora_avx2.h`), or plain C (`lora_plain.h`).
 *
 * Layout (layers.LoRALinear): per slot one block, `slot_stride` elements apart: A [parts * rank,
 * in] (as nn.Linear keeps its weight: the shrink is `rank` dot products along `in`), part p's
 * rows p*rank.., then B_p [rank, out_p] for each part (int8: in quads, [rank / 4, out_p, 4]);
 * `rank` the largest, a slot's own rank on a part its first rows. A group reads its slot's
 * block front to back (every shrink, then every expand) and a thread claims runs of
 * neighbouring groups: one sequential stream, prefetched a block ahead by the int8 kernels
 * (`lora_int8.h`). Part p's output columns follow part p-1's in y.
 * Weights float32, bfloat16, float16 or int8 (then `scales` [slots, 2 * parts * rank]: A's
 * rows', then each part's B rows', rank apart); x and y float32 or bfloat16 each; rows have
 * contiguous columns, `*_stride` apart.
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

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_I8 = 3 }; /* my_lora.w_dtype */

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
    const float *scales;      /* int8 weights: [slots, 2 * parts * rank] */
    int64_t in, in_padded, parts, rank;
    int x_bf16, y_bf16, w_dtype;
    atomic_int failed;
} Args;

static inline int64_t w_bytes(int w_dtype) {
    return w_dtype == W_F32 ? 4 : w_dtype == W_I8 ? 1 : 2;
}

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
    if (w_dtype == W_I8) {
        const __m512i v = _mm512_maskz_loadu_epi8((__mmask64)m, (const int8_t *)w + at);
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(v)));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)w + at);
}

/* Weight rows w..w + nw of A against `g_count` rows of x: each x chunk loaded once for the
 * weight rows, each weight chunk once for every x row; up to four weight rows at a time for a
 * group of GROUP, eight for one row (a decode's: eight independent sums in flight). */
#define SHRINK_ROWS(g_count) ((g_count) == 1 ? 8 : 4)
static inline __attribute__((always_inline)) void shrink4(const Args *a, const void *A,
                                                          int64_t w, int nw, const float *xs,
                                                          float *h, int64_t h_stride,
                                                          int g_count, int wd) {
    const int64_t in = a->in, xp = a->in_padded;
    const int n = SHRINK_ROWS(g_count);
    __m512 acc[GROUP][8];
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < n; k++) acc[g][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += LANES) {
        const __mmask16 m = in - i >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (in - i)) - 1);
        __m512 wv[8];
        if (((i * w_bytes(wd)) & 63) == 0)
            for (int k = 0; k < nw; k++) prefetch_l2(A, wd, (w + n + k) * in + i);
        for (int k = 0; k < n; k++)
            wv[k] = k < nw ? load16(A, wd, (w + k) * in + i, m) : _mm512_setzero_ps();
        for (int g = 0; g < g_count; g++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xs + g * xp + i);
            for (int k = 0; k < n; k++) acc[g][k] = _mm512_fmadd_ps(xv, wv[k], acc[g][k]);
        }
    }
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < nw; k++) h[g * h_stride + w + k] = _mm512_reduce_add_ps(acc[g][k]);
}

/* y[at..] += v's lanes in `m`; a bfloat16 y rounded to nearest even. */
static inline void add16(const Args *a, int64_t at, __mmask16 m, __m512 v) {
    if (a->y_bf16) {
        uint16_t *y = (uint16_t *)a->y + at;
        const __m256i old = _mm256_maskz_loadu_epi16(m, y);
        const __m512 sum = _mm512_add_ps(
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), v);
        __m512i bits = _mm512_castps_si512(sum);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
    } else {
        float *y = (float *)a->y + at;
        _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), v));
    }
}

/* y[rows[g]][col..col + out) += h[g] @ B for the first `count` of `g_count` rows, 64 columns a
 * pass (four independent sums per row: one sum's chain of `rank` dependent FMAs left a
 * decode's single row waiting on their latency). */
static inline __attribute__((always_inline)) void expand(const Args *a, const void *B,
                                                         int64_t rank, const float *h,
                                                         int64_t h_stride, const int64_t *rows,
                                                         int64_t col, int64_t out, int g_count,
                                                         int64_t count, int wd) {
    for (int64_t j0 = 0; j0 < out; j0 += 4 * LANES) {
        __mmask16 m[4];
        for (int c = 0; c < 4; c++) {
            const int64_t left = out - j0 - c * LANES;
            m[c] = left >= LANES ? (__mmask16)0xffff
                   : left > 0    ? (__mmask16)((1u << left) - 1)
                                 : (__mmask16)0;
        }
        __m512 acc[GROUP][4];
        for (int g = 0; g < g_count; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t r = 0; r < rank; r++) {
            prefetch_l2(B, wd, r * out + j0 + PREFETCH_AHEAD);
            __m512 bv[4];
            for (int c = 0; c < 4; c++)
                bv[c] = load16(B, wd, r * out + j0 + c * LANES, m[c]);
            for (int g = 0; g < g_count; g++) {
                const __m512 hv = _mm512_set1_ps(h[g * h_stride + r]);
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(hv, bv[c], acc[g][c]);
            }
        }
        for (int64_t g = 0; g < count; g++)
            for (int c = 0; c < 4 && m[c]; c++)
                add16(a, rows[g] * a->y_stride + col + j0 + c * LANES, m[c], acc[g][c]);
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

#if defined(__AVX512VNNI__)
#define I8_DOT 1 /* int8 weights multiplied in int8 (lora_int8.h) */
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "lora_avx2.h"
#else /* plain C: the compiler vectorises what it can */
#include "lora_plain.h"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) || \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The part's first `rank` rows of A, SHRINK_ROWS at a time. */
static inline __attribute__((always_inline)) void shrink_rows(const Args *a, const void *A,
                                                              int64_t rank, const float *xs,
                                                              float *h, int64_t h_stride,
                                                              int g_count, int wd) {
    const int n = SHRINK_ROWS(g_count);
    int64_t w = 0;
    for (; w + n <= rank; w += n) shrink4(a, A, w, n, xs, h, h_stride, g_count, wd);
    if (w < rank) shrink4(a, A, w, (int)(rank - w), xs, h, h_stride, g_count, wd);
}
#endif

#include "lora_int8.h"

/* One group: its rows' x as floats (zero rows pad a group to the unrolled count, zero columns
 * each row to `in_padded`), then every part's shrink, then every part's expand (the order the
 * slot's block holds A and the Bs), over the slot's own rank, skipping parts the slot's adapter
 * does not target. h: [GROUP, parts * rank]. */
static inline __attribute__((always_inline)) void run_group(const Args *a, int64_t group,
                                                            float *xs, int8_t *xq, int32_t *hq,
                                                            float *h, int g_count, int wd,
                                                            int64_t next) {
    const int64_t first = a->groups[group], count = a->groups[group + 1] - first;
    const int64_t *rows = a->rows + first, slot = a->slots[group];
    const int64_t in = a->in, xp = a->in_padded, width = a->parts * a->rank;
    const int64_t wb = w_bytes(wd);
    const int32_t *ranks = a->part_rank + slot * a->parts;
#ifdef BF16_DOT
    const int bf16_dot = a->x_bf16 && wd == W_BF16;
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
#ifdef I8_DOT
    float xscale[GROUP];
    int32_t xsum[GROUP];
    for (int g = 0; g < g_count && wd == W_I8; g++)
        xscale[g] = quantize_x(xs + g * xp, in, xq + g * xp, &xsum[g]);
#else
    (void)xq, (void)hq, (void)next;
#endif
    for (int64_t p = 0; p < a->parts; p++) {
        if (ranks[p] == 0) continue;
        const void *A = (const char *)a->a + (slot * a->slot_stride + p * a->rank * in) * wb;
        float *hp = h + p * a->rank;
#ifdef BF16_DOT
        if (bf16_dot) {
            shrink_bf16(a, (const uint16_t *)A, ranks[p], xr, hp, width, g_count);
        } else
#endif
#ifdef I8_DOT
        if (wd == W_I8) {
            shrink_rows_vnni(a, A, ranks[p], xq, xp, xscale, xsum, hp, width, g_count, next);
        } else
#endif
        {
            shrink_rows(a, A, ranks[p], xs, hp, width, g_count, wd);
        }
        if (wd == W_I8) { /* h[r] * A's row scale * B's row scale */
            const float *sa = a->scales + slot * 2 * width + p * a->rank, *sb = sa + width;
            for (int g = 0; g < g_count; g++)
                for (int64_t r = 0; r < ranks[p]; r++) hp[g * width + r] *= sa[r] * sb[r];
        }
    }
    int64_t col = 0;
    for (int64_t p = 0; p < a->parts; p++) {
        const int64_t out = a->part_sizes[p];
        if (ranks[p] > 0) {
            const void *B = (const char *)a->b[p] + slot * a->slot_stride * wb;
            const float *hp = h + p * a->rank;
            if (wd != W_I8)
                expand(a, B, ranks[p], hp, width, rows, col, out, g_count, count, wd);
            else
#ifdef I8_DOT
                expand_vnni(a, B, ranks[p], hp, width, rows, col, out, g_count, count, hq, next);
#else
                expand_quads(a, B, ranks[p], hp, width, rows, col, out, g_count, count);
#endif
        }
        col += out;
    }
}

static inline __attribute__((always_inline)) void run_range(const Args *a, int64_t first,
                                                            int64_t last, float *xs, int8_t *xq,
                                                            int32_t *hq, float *h, int wd) {
    for (int64_t g = first; g < last; g++) {
        /* bytes from this group's block to the next one's in the run (0: none) */
        const int64_t next =
            g + 1 < last ? (a->slots[g + 1] - a->slots[g]) * a->slot_stride * w_bytes(wd) : 0;
        if (a->groups[g + 1] - a->groups[g] == 1)
            run_group(a, g, xs, xq, hq, h, 1, wd, next);
        else
            run_group(a, g, xs, xq, hq, h, GROUP, wd, next);
    }
}

static void run_groups(const void *context, int64_t first, int64_t last) {
    Args *a = (Args *)context;
    /* x as floats, h, h in int8 quads (int8 weights), x as int8 (in_padded bytes a row) */
    const int64_t xp = a->in_padded, hs = GROUP * a->parts * a->rank, quads = (a->rank + 3) / 4;
    float *scratch = thread_scratch(GROUP * (xp + quads + xp / 4) + hs);
    if (scratch == NULL) {
        atomic_store(&a->failed, 1);
        return;
    }
    float *xs = scratch, *h = scratch + GROUP * xp;
    int32_t *hq = (int32_t *)(h + hs);
    int8_t *xq = (int8_t *)(hq + GROUP * quads);
    switch (a->w_dtype) { /* each weight type's loop compiled for it alone */
    case W_I8: run_range(a, first, last, xs, xq, hq, h, W_I8); break;
    case W_F16: run_range(a, first, last, xs, xq, hq, h, W_F16); break;
    case W_BF16: run_range(a, first, last, xs, xq, hq, h, W_BF16); break;
    default: run_range(a, first, last, xs, xq, hq, h, W_F32);
    }
}

/* Returns 0, or -1 when a thread found no memory for its scratch (then some rows may lack
 * their update). A group holds at most GROUP rows, all of one slot. */
int my_lora_add(const my_lora *l) {
    Args args = {l->x,           l->y,           l->x_stride,    l->y_stride,
                 l->rows,        l->groups,      l->slots,       l->a,
                 l->b,           l->slot_stride, l->part_sizes,  l->part_rank,
                 l->scales,      l->in_features, (l->in_features + 7) / 8 * 8,   l->parts,
                 l->rank,        l->x_bf16,      l->y_bf16,      l->w_dtype,
                 0};
    /* Runs of neighbouring groups per claim: with every slot in use, a thread streams a run
     * of neighbouring slots' blocks, one long read, each group's block prefetched while the
     * one before it is computed (int8). */
    const int64_t n_threads = l->n_threads > 0 ? l->n_threads : 1;
    int64_t run = l->n_groups / (4 * n_threads);
    pool_run(run_groups, &args, l->n_groups, run > 0 ? run : 1, l->n_threads);
    return atomic_load(&args.failed) ? -1 : 0;
}

int my_lora_int8_dot(void) {
#ifdef I8_DOT
    return 1;
#else
    return 0;
#endif
}
