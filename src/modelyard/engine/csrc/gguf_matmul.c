/* y = x W^T with W kept in a GGUF file's own quantized blocks (Q4_0, Q4_1, Q8_0), so a decode
 * step reads the file's bytes per weight (Q4_0 0.56, Q4_1 0.63, Q8_0 1.06) instead of w8a8's
 * 1 or float32's 4.
 *
 * A row of W is in_features / 32 blocks, each a float16 scale d (Q4_1: and a float16 minimum
 * m) and 32 quants: Q8_0 int8 q (w = d q), Q4_0 nibbles n (w = d (n - 8)), Q4_1 nibbles
 * (w = d n + m); a Q4 block's byte j holds element j in its low nibble, j + 16 in its high.
 * x is quantized here in blocks of 32 too (int8, symmetric, a float scale dx each, and xs = dx
 * times the block's integer sum), so that each block's product is integer but for an offset:
 * for Q4_0 d dx sum n q - 8 d xs, for Q4_1 d dx sum n q + m xs, for Q8_0 d dx sum w q; the
 * blocks' products add in float.
 *
 * Vector forms: AVX2 (vpmaddubsw, unsigned nibbles by signed activations; Q8_0's signs moved
 * onto the activations), and with AVX-512 VNNI the same on vpdpbusd (256-bit, AVX512VL). Each
 * weight row is read once for up to 4 rows of x; output rows are shared out over the thread
 * pool in chunks.
 */
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

#define QK 32            /* values per block, of W and of x */
#define TILE 4           /* rows of x each pass over a weight row serves */
#define PREFETCH_ROWS 4  /* weight rows fetched ahead while the current one is multiplied */

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* GGML's type numbers */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && \
    defined(__F16C__) && defined(__FMA__)
#define GGUF_ISA 3
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define GGUF_ISA 2
#else
#define GGUF_ISA 0
#endif

/* A build asked for a form (a test's compile-only check of the AVX-512 form) must get it. */
#if defined(MY_EXPECT_GGUF_ISA) && MY_EXPECT_GGUF_ISA != GGUF_ISA
#error "the GGUF matmul did not compile the vector form this build asked for"
#endif

#if GGUF_ISA
#include <immintrin.h>
#endif

int my_gguf_block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
    }
}

int my_gguf_matmul_isa(void) { return GGUF_ISA; }

/* float16 bits (unaligned) to float. */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if GGUF_ISA
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | mant << 13;
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | mant << 13;
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalised into float's range */
        exp = 113;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | exp << 23 | (mant & 0x3ffu) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* ----- quantizing x ------------------------------------------------------------------------ */

/* Each block of 32: xq = round(x / d) (half away from zero), d = max|x| / 127; xd[b] = d and
 * xs[b] = d times the block's integer sum (the nibble formats' offset terms take it whole). */
static void quantize_blocks(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd,
                            float *xs) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + m * K + b * QK;
            int8_t *q = xq + m * K + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) {
                const float a = v[i] < 0 ? -v[i] : v[i];
                amax = a > amax ? a : amax;
            }
            const float inv = amax > 0 ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                const float s = v[i] * inv;
                int r = s >= 0 ? (int)(s + 0.5f) : -(int)(-s + 0.5f);
                r = r > 127 ? 127 : r < -127 ? -127 : r;
                q[i] = (int8_t)r;
                sum += r;
            }
            xd[m * nb + b] = amax / 127.0f;
            xs[m * nb + b] = amax / 127.0f * (float)sum;
        }
    }
}

/* ----- the product over a range of output rows ------------------------------------------- */

typedef struct {
    const int8_t *xq;
    const float *xd, *xs;
    const uint8_t *w;
    const float *bias;
    float *out;
    int64_t M, K, N, row_bytes;
    int type;
} Job;

#if !GGUF_ISA
/* One weight row by rows m0 .. m0 + MB of x, plain C. */
static void row_plain(const Job *j, int64_t n, int64_t m0, int MB, float *acc) {
    const int64_t nb = j->K / QK;
    const uint8_t *row = j->w + n * j->row_bytes;
    const int bytes = my_gguf_block_bytes(j->type);
    for (int i = 0; i < MB; i++) acc[i] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes;
        const float d = half(blk);
        for (int i = 0; i < MB; i++) {
            const int8_t *x = j->xq + (m0 + i) * j->K + b * QK;
            const float dx = j->xd[(m0 + i) * nb + b], xs = j->xs[(m0 + i) * nb + b];
            int32_t s = 0;
            if (j->type == Q8_0) {
                const int8_t *q = (const int8_t *)(blk + 2);
                for (int k = 0; k < QK; k++) s += q[k] * x[k];
                acc[i] += d * dx * (float)s;
            } else {
                const uint8_t *q = blk + (j->type == Q4_1 ? 4 : 2);
                for (int k = 0; k < QK / 2; k++)
                    s += (q[k] & 15) * x[k] + (q[k] >> 4) * x[k + QK / 2];
                if (j->type == Q4_0)
                    acc[i] += d * dx * (float)s - 8.0f * d * xs;
                else
                    acc[i] += d * dx * (float)s + half(blk + 2) * xs;
            }
        }
    }
}
#endif

#if GGUF_ISA
/* 32 int8 activations by one block's 32 unsigned bytes u (x's signs already adjusted for
 * Q8_0): eight int32 partial sums. */
static inline __m256i block_dot(__m256i u, __m256i x) {
#if GGUF_ISA == 3
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    /* pairs of products fit int16: 2 * 128 * 127 < 32768 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* Block b of a weight row (at blk) into MB rows of x from m0 (MB and the type are constants at
 * each call, so the accumulators stay in registers). acc collects d dx sum(w q) per row;
 * extra the nibble formats' offset terms: Q4_0 sum d xs (times -8 at the end), Q4_1 sum m xs. */
static inline __attribute__((always_inline)) void block_into(const Job *j, const uint8_t *blk,
                                                             int64_t b, int64_t m0, const int MB,
                                                             const int type, __m256 *acc,
                                                             float *extra) {
    const int64_t nb = j->K / QK;
    uint32_t head;
    memcpy(&head, blk, sizeof head);
    /* d, and for Q4_1 m, converted together (Q4_0's second half is quants: unused) */
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)head));
    const __m256 d = _mm256_broadcastss_ps(dm);
    if (type == Q8_0) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        const __m256i wabs = _mm256_sign_epi8(w, w);
        for (int i = 0; i < MB; i++) {
            const int64_t r = (m0 + i) * nb + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(j->xq + r * QK));
            const __m256 ddx = _mm256_mul_ps(d, _mm256_broadcast_ss(j->xd + r));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(wabs, _mm256_sign_epi8(x, w))),
                                     ddx, acc[i]);
        }
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                         _mm256_set1_epi8(0x0f));
    const float offset = type == Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) : _mm_cvtss_f32(dm);
    for (int i = 0; i < MB; i++) {
        const int64_t r = (m0 + i) * nb + b;
        const __m256i x = _mm256_loadu_si256((const __m256i *)(j->xq + r * QK));
        const __m256 ddx = _mm256_mul_ps(d, _mm256_broadcast_ss(j->xd + r));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(nib, x)), ddx, acc[i]);
        extra[i] += offset * j->xs[r];
    }
}

/* One weight row by MB rows of x from m0: even and odd blocks into separate accumulators, so
 * that consecutive blocks' FMAs (one chain a row at MB = 1) do not wait on each other. */
static inline __attribute__((always_inline)) void row_vector(const Job *j, int64_t n,
                                                             int64_t m0, const int MB,
                                                             const int type, float *out) {
    const int64_t nb = j->K / QK;
    const int bytes = type == Q8_0 ? 34 : type == Q4_1 ? 20 : 18;
    const uint8_t *row = j->w + n * j->row_bytes;
    const int64_t ahead = PREFETCH_ROWS * j->row_bytes;
    __m256 even[TILE], odd[TILE];
    float extra_even[TILE], extra_odd[TILE];
    for (int i = 0; i < MB; i++) {
        even[i] = odd[i] = _mm256_setzero_ps();
        extra_even[i] = extra_odd[i] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *blk = row + b * bytes;
        _mm_prefetch((const char *)(blk + ahead), _MM_HINT_T0);
        block_into(j, blk, b, m0, MB, type, even, extra_even);
        block_into(j, blk + bytes, b + 1, m0, MB, type, odd, extra_odd);
    }
    if (b < nb) block_into(j, row + b * bytes, b, m0, MB, type, even, extra_even);
    const float sign = type == Q4_0 ? -8.0f : 1.0f;
    for (int i = 0; i < MB; i++)
        out[i] = sum8(_mm256_add_ps(even[i], odd[i])) + sign * (extra_even[i] + extra_odd[i]);
}

#define ROW_TILE_OF(TYPE)                                                                      \
    static void row_tile_##TYPE(const Job *j, int64_t n, int64_t m0, int MB, float *acc) {    \
        switch (MB) {                                                                          \
        case 4: row_vector(j, n, m0, 4, TYPE, acc); break;                                     \
        case 3: row_vector(j, n, m0, 3, TYPE, acc); break;                                     \
        case 2: row_vector(j, n, m0, 2, TYPE, acc); break;                                     \
        default: row_vector(j, n, m0, 1, TYPE, acc); break;                                    \
        }                                                                                      \
    }
ROW_TILE_OF(Q4_0)
ROW_TILE_OF(Q4_1)
ROW_TILE_OF(Q8_0)

static void row_tile(const Job *j, int64_t n, int64_t m0, int MB, float *acc) {
    switch (j->type) {
    case Q4_0: row_tile_Q4_0(j, n, m0, MB, acc); break;
    case Q4_1: row_tile_Q4_1(j, n, m0, MB, acc); break;
    default: row_tile_Q8_0(j, n, m0, MB, acc); break;
    }
}
#else
static void row_tile(const Job *j, int64_t n, int64_t m0, int MB, float *acc) {
    row_plain(j, n, m0, MB, acc);
}
#endif

static void product(const Job *j, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float bias = j->bias ? j->bias[n] : 0.0f;
        for (int64_t m = 0; m < j->M; m += TILE) {
            const int MB = j->M - m < TILE ? (int)(j->M - m) : TILE;
            float acc[TILE];
            row_tile(j, n, m, MB, acc);
            for (int i = 0; i < MB; i++) j->out[(m + i) * j->N + n] = acc[i] + bias;
        }
    }
}

static void product_task(const void *job, int64_t first, int64_t last) {
    product((const Job *)job, first, last);
}

/* out[M, N] = quantize(x[M, K]) . W^T (+ bias); 0, or -1 for a type or shape it does not take
 * (nothing written). */
int my_gguf_matmul(const float *x, int64_t M, const my_gguf_linear *w, float *out, int8_t *xq,
                   float *xscale, int n_threads) {
    const int64_t K = w->in_features, N = w->out_features;
    const int bytes = my_gguf_block_bytes(w->type);
    if (bytes == 0 || K % QK != 0) return -1;
    if (M <= 0) return 0; /* no rows: nothing to write */
    const int64_t nb = K / QK;
    quantize_blocks(x, M, K, xq, xscale, xscale + M * nb);
    const Job job = {xq, xscale, xscale + M * nb, w->blocks, w->bias, out, M, K, N, nb * bytes,
                     w->type};
    /* Chunks of ~32K multiply-adds, but at least 4 a thread, so that one row's memory-bound
     * product is shared out. */
    int64_t chunk = 32768 / (M * K) + 1;
    const int64_t spread = N / (4 * (n_threads > 1 ? n_threads : 1));
    if (chunk > spread) chunk = spread > 1 ? spread : 1;
    pool_run(product_task, &job, N, chunk, n_threads);
    return 0;
}
