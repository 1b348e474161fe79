/* Int8 x int8 matmul for decode-sized batches: y = x W^T with W int8 [N, K] and a float scale
 * per output channel, x quantized here per row (symmetric int8, after w8a8's smoothing).
 *
 * A decode step multiplies a few rows by every weight once: the time is reading W. FBGEMM's
 * dynamic linear costs ~60 us a call at one row (quantizing, packing, a GEMM built for large
 * batches) and does not split one row over threads. Here each block of weight rows is read once
 * for all M rows of x, and the output channels are shared out over the thread pool
 * (`thread_pool.c`) in chunks.
 */
#include <stdint.h>

#include "internal.h"
#include "kernels.h"

#define ROWS 4 /* weight rows per block: their reads are shared by the M rows of x */
#define PREFETCH_BLOCKS 16

/* ----- quantizing x ------------------------------------------------------------------------ */

/* xq[m] = 128 + round(x[m] * inv_smooth / s_m), s_m = max|x[m] * inv_smooth| / 127 (inv_smooth
 * may be NULL): unsigned, as vpdpbusd takes it. Returns s_m in scale[m]. */
static void quantize_rows(const float *x, int64_t M, int64_t K, const float *inv_smooth,
                          uint8_t *xq, float *scale) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = inv_smooth ? row[k] * inv_smooth[k] : row[k];
            v = v < 0 ? -v : v;
            amax = v > amax ? v : amax;
        }
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        uint8_t *q = xq + m * K;
        for (int64_t k = 0; k < K; k++) {
            const float v = (inv_smooth ? row[k] * inv_smooth[k] : row[k]) * inv;
            /* round half away from zero; |v| <= 127 */
            q[k] = (uint8_t)(128 + (v >= 0 ? (int)(v + 0.5f) : -(int)(-v + 0.5f)));
        }
        scale[m] = amax / 127.0f;
    }
}

/* ----- the product over a range of output channels ------------------------------------------ */

typedef struct {
    const uint8_t *xq; /* x quantized, plus 128 */
    const float *xscale;
    const int8_t *w;
    const int32_t *wsum; /* per output channel: the sum of its int8 weights */
    const float *wscale;
    const float *bias;
    float *out;
    int64_t M, K, N;
} Job;

/* One output channel for every row of x, in plain C. */
static void product_row(const Job *j, int64_t n) {
    const int64_t K = j->K;
    const int8_t *w = j->w + n * K;
    for (int64_t m = 0; m < j->M; m++) {
        const uint8_t *x = j->xq + m * K;
        int32_t a = 0;
        for (int64_t k = 0; k < K; k++) a += (int16_t)x[k] * (int16_t)w[k];
        a -= 128 * j->wsum[n];
        const float v = (float)a * j->xscale[m] * j->wscale[n];
        j->out[m * j->N + n] = j->bias ? v + j->bias[n] : v;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1

/* ROWS (4) weight rows by MB rows of x, MB a constant at each call so that the accumulators stay
 * in registers. vpdpbusd multiplies unsigned by signed bytes: x comes as x + 128, and
 * 128 * sum(w[n]) comes off at the end. */
static inline __attribute__((always_inline)) void block(const Job *j, int64_t n, int64_t m0,
                                                        const int MB) {
    const int64_t K = j->K;
    const int8_t *w0 = j->w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const int64_t ahead = PREFETCH_BLOCKS * ROWS * K;
    __m512i acc[4][ROWS];
    for (int i = 0; i < MB; i++)
        for (int r = 0; r < ROWS; r++) acc[i][r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        const int64_t left = K - k;
        const __mmask64 mask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        /* The weights stream from memory once a step: fetch 16 blocks ahead into L2 (the
         * hardware prefetcher alone reached 9 GB/s where a core can read ~30-60; 8 blocks into
         * L1 16 GB/s, 16 into L2 21-23 GB/s over SmolLM2's layers at one row, AMD EPYC). */
        _mm_prefetch((const char *)(w0 + ahead + k), _MM_HINT_T1);
        _mm_prefetch((const char *)(w1 + ahead + k), _MM_HINT_T1);
        _mm_prefetch((const char *)(w2 + ahead + k), _MM_HINT_T1);
        _mm_prefetch((const char *)(w3 + ahead + k), _MM_HINT_T1);
        const __m512i v0 = _mm512_maskz_loadu_epi8(mask, w0 + k);
        const __m512i v1 = _mm512_maskz_loadu_epi8(mask, w1 + k);
        const __m512i v2 = _mm512_maskz_loadu_epi8(mask, w2 + k);
        const __m512i v3 = _mm512_maskz_loadu_epi8(mask, w3 + k);
        for (int i = 0; i < MB; i++) {
            /* masked-off lanes: x and w both 0 */
            const __m512i xv = _mm512_maskz_loadu_epi8(mask, j->xq + (m0 + i) * K + k);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], xv, v0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], xv, v1);
            acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], xv, v2);
            acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], xv, v3);
        }
    }
    const __m128i offset = _mm_slli_epi32(_mm_loadu_si128((const __m128i *)(j->wsum + n)), 7);
    const __m128 wscale = _mm_loadu_ps(j->wscale + n);
    for (int i = 0; i < MB; i++) {
        /* the four accumulators' sums side by side, in a few shuffles and adds */
        const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[i][0], acc[i][1]),
                                            _mm512_unpackhi_epi32(acc[i][0], acc[i][1]));
        const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[i][2], acc[i][3]),
                                            _mm512_unpackhi_epi32(acc[i][2], acc[i][3]));
        const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1),
                                           _mm512_unpackhi_epi64(t0, t1));
        const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(t),
                                           _mm512_extracti64x4_epi64(t, 1));
        const __m128i q = _mm_sub_epi32(
            _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)), offset);
        __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(q), _mm_set1_ps(j->xscale[m0 + i])),
                              wscale);
        if (j->bias) v = _mm_add_ps(v, _mm_loadu_ps(j->bias + n));
        _mm_storeu_ps(j->out + (m0 + i) * j->N + n, v);
    }
}

static void product(const Job *j, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + ROWS <= n1; n += ROWS) {
        int64_t m = 0;
        for (; m + 4 <= j->M; m += 4) block(j, n, m, 4);
        switch (j->M - m) {
        case 3: block(j, n, m, 3); break;
        case 2: block(j, n, m, 2); break;
        case 1: block(j, n, m, 1); break;
        default: break;
        }
    }
    for (; n < n1; n++) product_row(j, n); /* N not a multiple of ROWS */
}
#else
#define VNNI 0

static void product(const Job *j, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) product_row(j, n);
}
#endif

/* Whether this build has the vector product (where not, PyTorch's int8 matmul is faster). */
int my_int8_matmul_vectorized(void) { return VNNI; }

static void product_task(const void *job, int64_t first, int64_t last) {
    product((const Job *)job, first, last);
}

/* out[M, N] = quantize(x[M, K] * inv_smooth) . w[N, K]^T * scales (+ bias). xq: M*K scratch. */
void my_int8_matmul(const float *x, int64_t M, const my_linear *w, float *out, uint8_t *xq,
                    float *xscale, int n_threads) {
    const int64_t K = w->in_features, N = w->out_features;
    if (M <= 0 || K <= 0) return; /* no rows (a step of prompt chunks needs no logits) */
    quantize_rows(x, M, K, w->inv_smooth, xq, xscale);
    if (amx_matmul(xq, xscale, M, w, out, n_threads)) return;
    const Job job = {xq, xscale, w->weight, w->weight_sums, w->scale, w->bias, out, M, K, N};
    /* Chunks of ~64K multiply-adds, whole blocks of ROWS: a claim is an atomic on a line both
     * cores write, and at 16K (~0.2 us of work) the claims cost a 32-row batch's matmuls ~20 %;
     * but at least 4 chunks a thread, so that one row's memory-bound product is shared out. */
    int64_t chunk = (65536 / (M * K) + 1) * ROWS;
    const int64_t spread = N / (4 * (n_threads > 1 ? n_threads : 1)) / ROWS * ROWS;
    if (chunk > spread) chunk = spread > ROWS ? spread : ROWS;
    pool_run(product_task, &job, N, chunk, n_threads);
}
