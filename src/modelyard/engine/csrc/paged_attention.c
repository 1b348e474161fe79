/* Decode attention straight from the paged KV cache: no gather, no padding, no mask.
 *
 * One query token per sequence. Every query head is scored against every key of the
 * sequence's context, block by block through its block table (grouped-query heads share their
 * KV head's row), then the softmax-weighted values are summed. Keys and values are read once,
 * where they lie. The sequences are shared out over the thread pool (`thread_pool.c`).
 *
 * Built at run time by modelyard.engine.cpu_kernels (cc -O3 -march=native), called through
 * ctypes, which releases the GIL for the call. float32 and bfloat16 caches.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

typedef struct {
    const float *q;            /* [B, H, D] float32 */
    const void *k_cache;       /* [slots, KVH, D] */
    const void *v_cache;       /* [slots, KVH, D] */
    const int64_t *block_tables; /* [B, max_blocks] */
    const int64_t *context_lens; /* [B] */
    float *out;                /* [B, H, D] float32 */
    int64_t heads, kv_heads, dim, block_size, max_blocks;
    float scale;
    int bf16;
    atomic_int failed;         /* a task found no memory for its scores */
} Args;

/* Rows `first`..`first + n - 1` of one block (contiguous: `n * kv_heads * dim` values) as
 * float32, converted into `buf` for bfloat16. */
static inline const float *block_rows(const Args *a, const void *cache, int64_t first, int64_t n,
                                      float *buf) {
    const int64_t width = a->kv_heads * a->dim, offset = first * width;
    if (!a->bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    for (int64_t i = 0; i < n * width; i++) buf[i] = bf16_to_float(src[i]);
    return buf;
}

/* Blocks lie anywhere in the cache, so the hardware prefetcher loses the stream at every
 * block boundary: ask for the whole next block while this one is worked on. */
static inline void prefetch_block(const Args *a, const void *cache, int64_t first) {
    const int64_t row = a->kv_heads * a->dim * (a->bf16 ? 2 : 4), bytes = a->block_size * row;
    const char *start = (const char *)cache + first * row;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

/* Block by block: a block's rows are contiguous and stay in L1 while every head goes over
 * them, and each head's output sums a block in registers before it touches memory.
 * scores[head * len + t]. */
static inline __attribute__((always_inline)) void attend_dim(const Args *a, int64_t b,
                                                             float *scores, float *buf,
                                                             const int64_t dim) {
    const int64_t heads = a->heads, kv_heads = a->kv_heads, group = heads / kv_heads;
    const int64_t width = kv_heads * dim, bs = a->block_size, len = a->context_lens[b];
    const int64_t *table = a->block_tables + b * a->max_blocks;
    const float *q = a->q + b * heads * dim;
    float *out = a->out + b * heads * dim;
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        if (t0 + bs < len) prefetch_block(a, a->k_cache, table[t0 / bs + 1] * bs);
        const float *k = block_rows(a, a->k_cache, table[t0 / bs] * bs, n, buf);
        for (int64_t i = 0; i < n; i++) {
            for (int64_t kh = 0; kh < kv_heads; kh++) {
                const float *key = k + i * width + kh * dim;
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    const float *qh = q + h * dim;
                    float s = 0.0f;
                    for (int64_t d = 0; d < dim; d++) s += qh[d] * key[d];
                    scores[h * len + t0 + i] = s * a->scale;
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * len, m = s[0], total = 0.0f;
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            total += s[t];
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * heads * dim);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        if (t0 + bs < len) prefetch_block(a, a->v_cache, table[t0 / bs + 1] * bs);
        const float *v = block_rows(a, a->v_cache, table[t0 / bs] * bs, n, buf);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t kh = h / group; /* once per head and block, not per row */
            const float *p = scores + h * len + t0, *vh = v + kh * dim;
            float acc[dim];
            for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
            for (int64_t i = 0; i < n; i++)
                for (int64_t d = 0; d < dim; d++) acc[d] += p[i] * vh[i * width + d];
            float *oh = out + h * dim;
            for (int64_t d = 0; d < dim; d++) oh[d] += acc[d];
        }
    }
}

/* The common head sizes as constants, so the compiler unrolls and vectorises each dot product
 * whole (a cold-cache call 1.7x faster than with the size known only at run time). */
static void attend(const Args *a, int64_t b, float *scores, float *row) {
    switch (a->dim) {
    case 64: attend_dim(a, b, scores, row, 64); break;
    case 128: attend_dim(a, b, scores, row, 128); break;
    default: attend_dim(a, b, scores, row, a->dim);
    }
}

/* Sequences [first, last), with this thread's scratch (kept for its next call). */
static void run_range(const void *context, int64_t first, int64_t last) {
    Args *a = (Args *)context;
    int64_t longest = 1;
    for (int64_t b = first; b < last; b++)
        longest = a->context_lens[b] > longest ? a->context_lens[b] : longest;
    float *scratch = thread_scratch(a->heads * longest + a->block_size * a->kv_heads * a->dim);
    if (scratch == NULL) {
        atomic_store(&a->failed, 1);
        return;
    }
    for (int64_t b = first; b < last; b++) attend(a, b, scratch, scratch + a->heads * longest);
}

/* Returns 0, or -1 when memory for the scores could not be had. */
int my_paged_decode_attention(const my_attention *r) {
    Args a = {r->q,     r->k_cache,    r->v_cache,    r->block_tables, r->context_lens,
              r->out,   r->heads,      r->kv_heads,   r->dim,          r->block_size,
              r->max_blocks, r->scale, r->bf16,       0};
    pool_run(run_range, &a, r->batch, 1, r->n_threads);
    return atomic_load(&a.failed) ? -1 : 0;
}
