/* w8a8's int8 matmul on Intel AMX tiles, for batches of rows (wide decode steps, prefill).
 *
 * The AVX-512 VNNI product (`int8_matmul.c`) multiplies 64 byte pairs per instruction and is
 * compute-bound past a few rows (~65 G multiply-adds a second a core). An AMX tile multiply
 * (`tdpbusd`) takes 16 rows of x by 16 output channels by 64 inputs (16K multiply-adds) at once,
 * so from ~16 rows on the step reads its weights as fast as memory gives them. The tiles want
 * the weights in their own order: for each 16 output channels and 64 inputs, 16 rows of 4
 * inputs x 16 channels (`my_int8_amx_pack`, done once at load, one more byte a weight). x is the
 * same u8 (x + 128) the VNNI product takes, so the int32 sums are the same; the float scaling
 * after them may round differently in the last bit (the compiler orders each form's own way).
 * Used from `AMX_MIN_ROWS` (8) rows: below that both read the weights at memory speed.
 *
 * Each call runs pairs of 16-row tiles of x (2 x-tiles) against pairs of 16-channel tiles of
 * weights (4 accumulator tiles), the channels shared out over the thread pool. A thread loads
 * the tile configuration before its chunk and releases the tiles after it (the kernel keeps
 * no tile state between calls). Linux grants a process AMX only on request
 * (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): `my_int8_amx_available` asks once.
 */
#include <stdint.h>

#include "internal.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_BYTES 1024 /* 16 rows of 64 bytes */
#define AHEAD 2          /* weight tiles prefetched ahead of the one in use */

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

typedef struct {
    const uint8_t *xq; /* x quantized, plus 128 */
    const float *xscale;
    const my_linear *w;
    float *out;
    int64_t M;
} AmxJob;

/* Tiles 0-1: the first x-tile's sums (rows0 rows), 2-3: the second's (rows1, 0: none), 4 and
 * 5: the x-tiles, 6 and 7: two weight tiles. */
static void configure(int rows0, int rows1) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* out[m0 .. m0 + rows, n .. n + 16] from one tile of int32 sums, as `int8_matmul.c` does it:
 * (sum - 128 * sum(w)) * x's scale * w's scale (+ bias). */
static void finish(const AmxJob *j, const int32_t *sums, int64_t m0, int rows, int64_t n) {
    const my_linear *w = j->w;
    const int64_t N = w->out_features;
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w->weight_sums + n), 7);
    const __m512 wscale = _mm512_loadu_ps(w->scale + n);
    for (int i = 0; i < rows; i++) {
        const __m512i a = _mm512_sub_epi32(_mm512_load_si512(sums + 16 * i), offset);
        __m512 v = _mm512_mul_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(j->xscale[m0 + i])), wscale);
        if (w->bias) v = _mm512_add_ps(v, _mm512_loadu_ps(w->bias + n));
        _mm512_storeu_ps(j->out + (m0 + i) * N + n, v);
    }
}

/* Output channel tiles [t0, t1) (16 channels each) for every row of x. */
static void product(const AmxJob *j, int64_t t0, int64_t t1) {
    const int64_t K = j->w->in_features, chunks = K / 64;
    int32_t sums[4][256] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < j->M; m0 += 32) {
        const int64_t left = j->M - m0;
        const int rows0 = left >= 16 ? 16 : (int)left;
        const int rows1 = left > 32 ? 16 : (left > 16 ? (int)left - 16 : 0);
        configure(rows0, rows1);
        const uint8_t *a0 = j->xq + m0 * K, *a1 = a0 + 16 * K;
        for (int64_t t = t0; t < t1; t += 2) {
            const int two = t + 1 < t1;
            const int8_t *b0 = j->w->amx_weight + t * chunks * TILE_BYTES;
            const int8_t *b1 = b0 + chunks * TILE_BYTES;
            _tile_zero(0);
            _tile_zero(1);
            if (rows1) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t c = 0; c < chunks; c++) {
                /* The weights stream from memory once a call: fetch both streams a few tiles
                 * ahead (a tile load alone waits on its 16 lines). */
                for (int l = 0; l < TILE_BYTES; l += 64) {
                    _mm_prefetch((const char *)(b0 + (c + AHEAD) * TILE_BYTES + l), _MM_HINT_T0);
                    if (two)
                        _mm_prefetch((const char *)(b1 + (c + AHEAD) * TILE_BYTES + l),
                                     _MM_HINT_T0);
                }
                _tile_loadd(4, a0 + c * 64, K);
                _tile_loadd(6, b0 + c * TILE_BYTES, 64);
                _tile_dpbusd(0, 4, 6);
                if (two) {
                    _tile_loadd(7, b1 + c * TILE_BYTES, 64);
                    _tile_dpbusd(1, 4, 7);
                }
                if (rows1) {
                    _tile_loadd(5, a1 + c * 64, K);
                    _tile_dpbusd(2, 5, 6);
                    if (two) _tile_dpbusd(3, 5, 7);
                }
            }
            _tile_stored(0, sums[0], 64);
            finish(j, sums[0], m0, rows0, t * 16);
            if (two) {
                _tile_stored(1, sums[1], 64);
                finish(j, sums[1], m0, rows0, t * 16 + 16);
            }
            if (rows1) {
                _tile_stored(2, sums[2], 64);
                finish(j, sums[2], m0 + 16, rows1, t * 16);
                if (two) {
                    _tile_stored(3, sums[3], 64);
                    finish(j, sums[3], m0 + 16, rows1, t * 16 + 16);
                }
            }
        }
    }
    _tile_release();
}

static void product_task(const void *job, int64_t first, int64_t last) {
    product((const AmxJob *)job, first, last);
}

int my_int8_amx_available(void) {
    static int granted = -1; /* set once, on the first (single-threaded) call at load */
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

int amx_matmul(const uint8_t *xq, const float *xscale, int64_t M, const my_linear *w,
               float *out, int n_threads) {
    if (w->amx_weight == NULL || M < AMX_MIN_ROWS || !my_int8_amx_available()) return 0;
    const AmxJob job = {xq, xscale, w, out, M};
    const int64_t tiles = w->out_features / 16;
    /* Pairs of tiles; at least 4 chunks a thread so that the threads finish together. */
    const int64_t per = tiles / (4 * (n_threads > 1 ? n_threads : 1));
    const int64_t chunk = per >= 4 ? per / 2 * 2 : 2;
    pool_run(product_task, &job, tiles, chunk, n_threads);
    return 1;
}
#else
#define AMX 0

int my_int8_amx_available(void) { return 0; }

int amx_matmul(const uint8_t *xq, const float *xscale, int64_t M, const my_linear *w,
               float *out, int n_threads) {
    (void)xq, (void)xscale, (void)M, (void)w, (void)out, (void)n_threads;
    return 0;
}
#endif

/* out: for each tile of 16 output channels (rows of w), for each 64 inputs, 16 rows of (4
 * inputs of each of the 16 channels): the order `tdpbusd` reads its second operand in. */
void my_int8_amx_pack(const int8_t *w, int64_t N, int64_t K, int8_t *out) {
    const int64_t chunks = K / 64;
    for (int64_t t = 0; t < N / 16; t++)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t n = 0; n < 16; n++)
                    memcpy(out + (((t * chunks + c) * 16 + r) * 16 + n) * 4,
                           w + (t * 16 + n) * K + c * 64 + r * 4, 4);
}
