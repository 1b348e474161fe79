/* lora.c's int8 adapter weights (included by it after its shrink and expand; Args, GROUP).
 *
 * Each weight row symmetric int8 with one float32 scale; lora.c multiplies each h[r] by A's row
 * scale and B's row scale between shrink and expand. B_p is kept in quads, [rank / 4][out][4]
 * (rank rounded up to 4, the padding zeros): element (r, j) at ((r / 4) * out + j) * 4 + r % 4,
 * so that four ranks of one output column lie in one 32-bit word, as VPDPBUSD multiplies them.
 *
 * On CPUs with AVX-512 VNNI (I8_DOT) both products run in int8: the shrink quantizes each row
 * of x (symmetric, absmax / 127, as the w8a8 base quantizes its activations), the expand each
 * row's h (over the part's rank), and each instruction multiplies 64 pairs of bytes into int32
 * sums. The float forms spent three vector operations (two conversions and an FMA) on every 16
 * weights, and a decode step of many adapters, bound by them on a core, waited on those more
 * than on memory. VPDPBUSD multiplies unsigned bytes by signed ones: the weights' bytes are read
 * with their top bit flipped, as w + 128 unsigned, and 128 * sum(q) taken off each sum (a sum
 * stays under 2^31 for inputs up to 66,000 wide). Elsewhere, A's rows go through lora.c's float
 * shrink and the expand below reads the quads in plain C.
 *
 * Each line the VNNI shrink and expand read, they prefetch the same line of the block of the
 * run's next group, `next` bytes on (0: none), into L2: left to the hardware prefetchers (which
 * retrain on every short run of lines), a core waited on memory about as long as it computed
 * (a SmolLM2 step of 50 adapters, one core: 18 -> 15 ms).
 */
#ifndef MODELYARD_LORA_INT8_H
#define MODELYARD_LORA_INT8_H

/* y[at..at + n) += v[0..n). */
static inline void add_floats(const Args *a, int64_t at, const float *v, int64_t n) {
    if (a->y_bf16) {
        uint16_t *y = (uint16_t *)a->y + at;
        for (int64_t j = 0; j < n; j++) y[j] = float_to_bf16(bf16_to_float(y[j]) + v[j]);
    } else {
        float *y = (float *)a->y + at;
        for (int64_t j = 0; j < n; j++) y[j] += v[j];
    }
}

/* lora.c's expand for B in quads, in plain C (builds without VNNI). */
static inline __attribute__((always_inline)) void expand_quads(const Args *a, const int8_t *B,
                                                               int64_t rank, const float *h,
                                                               int64_t h_stride,
                                                               const int64_t *rows, int64_t col,
                                                               int64_t out, int g_count,
                                                               int64_t count) {
    for (int64_t j0 = 0; j0 < out; j0 += 16) {
        const int64_t n = out - j0 < 16 ? out - j0 : 16;
        float acc[GROUP][16] = {{0}};
        for (int64_t r = 0; r < rank; r++) {
            const int8_t *b = B + ((r / 4) * out + j0) * 4 + r % 4;
            float wv[16] = {0};
            for (int64_t j = 0; j < n; j++) wv[j] = (float)b[4 * j];
            for (int g = 0; g < g_count; g++) {
                const float hv = h[g * h_stride + r];
                for (int j = 0; j < 16; j++) acc[g][j] += hv * wv[j];
            }
        }
        for (int64_t g = 0; g < count; g++)
            add_floats(a, rows[g] * a->y_stride + col + j0, acc[g], n);
    }
}

#ifdef I8_DOT
static inline void prefetch_next(const int8_t *w, int64_t next) {
    __builtin_prefetch(w + next, 0, 2);
}

/* xq[0..in) = x[0..in) / scale rounded (to nearest even), scale = absmax / 127 (0 for a zero
 * row: all zeros); returns the scale, and the sum of xq in *sum. */
static inline float quantize_x(const float *x, int64_t in, int8_t *xq, int32_t *sum) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        const __mmask16 m = in - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (in - i)) - 1);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + i)));
    }
    const float top = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int64_t i = 0; i < in; i += 16) {
        const __mmask16 m = in - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (in - i)) - 1);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
        total = _mm512_add_epi32(total, q);
        _mm_mask_storeu_epi8(xq + i, m, _mm512_cvtsepi32_epi8(q));
    }
    *sum = _mm512_reduce_add_epi32(total);
    return top / 127.0f;
}

/* h[g][w..w + nw) = each group row's dot products with A's int8 rows w..: xscale[g] *
 * sum(A * xq) (A's row scales come later); eight weight rows at a time for one x row, four for
 * a group. */
static inline __attribute__((always_inline)) void shrink_vnni(const Args *a, const int8_t *A,
                                                              int64_t w, int nw,
                                                              const int8_t *xq, int64_t xp,
                                                              const float *xscale,
                                                              const int32_t *xsum, float *h,
                                                              int64_t h_stride, int g_count,
                                                              int64_t next) {
    const int64_t in = a->in;
    const int n = g_count == 1 ? 8 : 4;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[GROUP][8];
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < n; k++) acc[g][k] = _mm512_setzero_si512();
    for (int64_t i = 0; i < in; i += 64) {
        const __mmask64 m = in - i >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (in - i)) - 1;
        __m512i wv[8];
        for (int k = 0; k < nw && next; k++) prefetch_next(A + (w + k) * in + i, next);
        for (int k = 0; k < n; k++) /* masked-off bytes read as 128: times xq's zeros */
            wv[k] = k < nw ? _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, A + (w + k) * in + i),
                                              flip)
                           : _mm512_setzero_si512();
        for (int g = 0; g < g_count; g++) {
            const __m512i xv = _mm512_maskz_loadu_epi8(m, xq + g * xp + i);
            for (int k = 0; k < n; k++) acc[g][k] = _mm512_dpbusd_epi32(acc[g][k], wv[k], xv);
        }
    }
    for (int g = 0; g < g_count; g++)
        for (int k = 0; k < nw; k++)
            h[g * h_stride + w + k] =
                xscale[g] * (float)(_mm512_reduce_add_epi32(acc[g][k]) - 128 * xsum[g]);
}

/* The part's first `rank` rows of A. */
static inline __attribute__((always_inline)) void shrink_rows_vnni(
    const Args *a, const int8_t *A, int64_t rank, const int8_t *xq, int64_t xp,
    const float *xscale, const int32_t *xsum, float *h, int64_t h_stride, int g_count,
    int64_t next) {
    const int n = g_count == 1 ? 8 : 4;
    int64_t w = 0;
    for (; w + n <= rank; w += n)
        shrink_vnni(a, A, w, n, xq, xp, xscale, xsum, h, h_stride, g_count, next);
    if (w < rank)
        shrink_vnni(a, A, w, (int)(rank - w), xq, xp, xscale, xsum, h, h_stride, g_count, next);
}

/* The expand: each group row's h[0..rank) quantized (to nearest, absmax / 127) into quads of
 * bytes, then y[rows[g]][col..col + out) += scale * (sum(B * hq)), 64 columns a pass. hq:
 * [GROUP, (rank + 3) / 4] words of scratch. */
static inline __attribute__((always_inline)) void expand_vnni(const Args *a, const int8_t *B,
                                                              int64_t rank, const float *h,
                                                              int64_t h_stride,
                                                              const int64_t *rows, int64_t col,
                                                              int64_t out, int g_count,
                                                              int64_t count, int32_t *hq,
                                                              int64_t next) {
    const int64_t quads = (rank + 3) / 4;
    float scale[GROUP];
    __m512i correction[GROUP];
    for (int g = 0; g < g_count; g++) {
        const float *hg = h + g * h_stride;
        float top = 0.0f;
        for (int64_t r = 0; r < rank; r++) top = hg[r] > top ? hg[r] : -hg[r] > top ? -hg[r] : top;
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0;
        for (int64_t q = 0; q < quads; q++) {
            uint32_t word = 0;
            for (int k = 0; k < 4; k++) {
                const float v = 4 * q + k < rank ? hg[4 * q + k] * inv : 0.0f;
                const int32_t b = (int32_t)(v >= 0.0f ? v + 0.5f : v - 0.5f);
                sum += b;
                word |= (uint32_t)(uint8_t)(int8_t)b << (8 * k);
            }
            hq[g * quads + q] = (int32_t)word;
        }
        scale[g] = top / 127.0f;
        correction[g] = _mm512_set1_epi32(128 * sum);
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t j0 = 0; j0 < out; j0 += 64) {
        __mmask16 m[4];
        __mmask64 mb[4]; /* four bytes a column */
        for (int c = 0; c < 4; c++) {
            const int64_t left = out - j0 - c * 16, n = left >= 16 ? 16 : left > 0 ? left : 0;
            m[c] = (__mmask16)((1u << n) - 1);
            mb[c] = n == 16 ? ~(__mmask64)0 : ((__mmask64)1 << (4 * n)) - 1;
        }
        __m512i acc[GROUP][4];
        for (int g = 0; g < g_count; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_si512();
        for (int64_t q = 0; q < quads; q++) {
            const int8_t *bq = B + (q * out + j0) * 4;
            for (int c = 0; c < 4 && next; c++) prefetch_next(bq + 64 * c, next);
            __m512i bv[4];
            for (int c = 0; c < 4; c++) /* masked-off bytes read as 128: columns never stored */
                bv[c] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mb[c], bq + 64 * c), flip);
            for (int g = 0; g < g_count; g++) {
                const __m512i hv = _mm512_set1_epi32(hq[g * quads + q]);
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_dpbusd_epi32(acc[g][c], bv[c], hv);
            }
        }
        for (int64_t g = 0; g < count; g++)
            for (int c = 0; c < 4 && m[c]; c++) {
                const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[g][c], correction[g]));
                add16(a, rows[g] * a->y_stride + col + j0 + c * 16, m[c],
                      _mm512_mul_ps(_mm512_set1_ps(scale[g]), v));
            }
    }
}
#endif

#endif
