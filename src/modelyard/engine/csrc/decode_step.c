/* A decode step's decoder layers in one call (Llama family, w8a8 weights, one token per
 * sequence): for each layer, RMSNorm, the q|k|v matmul, RoPE with the KV-cache write, paged
 * attention, the output matmul and residual, RMSNorm, gate|up, SiLU(gate) * up, down and
 * residual, through the same kernels the model calls one by one from Python otherwise.
 *
 * Why one call: at batch 1 a step of SmolLM2 (30 layers) made ~300 Python-level calls, each a
 * few microseconds of module dispatch and ctypes argument conversion: ~3 ms of a ~10 ms step,
 * spent while the cores that should be reading weights wait.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const int8_t *weight; /* [out, in] */
    const int32_t *weight_sums;
    const float *scale;
    const float *bias;       /* or NULL */
    const float *inv_smooth; /* or NULL */
    int64_t out, in;
} Linear;

typedef struct {
    const float *input_norm, *post_attention_norm;
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [slots, kv_heads, head_dim], float32 or bfloat16 */
} Layer;

typedef struct {
    const Layer *layers;
    int64_t n_layers, hidden, heads, kv_heads, head_dim, intermediate;
    const float *rope_cos, *rope_sin; /* [max_positions, head_dim] */
    int64_t max_positions, block_size;
    float eps, attention_scale;
    int bf16_cache, matmul_threads, attention_threads;
} Model;

/* The floats of scratch a step of `tokens` needs. */
int64_t decode_step_scratch(const Model *m, int64_t tokens) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return tokens * (2 * m->hidden + q + 2 * kv + 2 * q + 3 * m->intermediate);
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* x: [tokens, hidden], the embeddings in, the last layer's output out. Returns 0, or 1 for a
 * position outside the RoPE table, 2 when attention found no memory. `xq`: tokens * the widest
 * matmul input bytes; `scratch`: decode_step_scratch floats. */
static int run_layers(const Model *m, float *x, int64_t tokens, const int64_t *positions,
                      const int64_t *slots, const int64_t *block_tables,
                      const int64_t *context_lens, int64_t max_blocks, float *scratch,
                      uint8_t *xq, float *xscale) {
    const int64_t H = m->hidden, I = m->intermediate, T = tokens;
    const int64_t q_width = m->heads * m->head_dim, kv_width = m->kv_heads * m->head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    float *normed = scratch;                /* [T, H] */
    float *qkv = normed + T * H;            /* [T, q | k | v] */
    float *queries = qkv + T * qkv_width;   /* [T, q] contiguous for attention */
    float *attended = queries + T * q_width; /* [T, q] */
    float *projected = attended + T * q_width; /* [T, H] */
    float *gate_up = projected + T * H;     /* [T, 2I] */
    float *act = gate_up + 2 * T * I;       /* [T, I] */
    const int threads = m->matmul_threads;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const Layer *L = &m->layers[l];
        rms_norm(x, L->input_norm, normed, T, H, H, m->eps);
        int8_matmul(normed, T, H, L->qkv.inv_smooth, L->qkv.weight, L->qkv.weight_sums,
                    L->qkv.scale, L->qkv.bias, qkv_width, qkv, xq, xscale, threads);
        if (rope_write_kv(qkv, m->rope_cos, m->rope_sin, positions, slots, L->k_cache,
                          L->v_cache, T, m->heads, m->kv_heads, m->head_dim, qkv_width,
                          m->max_positions, m->bf16_cache))
            return 1;
        for (int64_t t = 0; t < T; t++)
            memcpy(queries + t * q_width, qkv + t * qkv_width, q_width * sizeof(float));
        if (paged_decode_attention(queries, L->k_cache, L->v_cache, block_tables, context_lens,
                                   attended, T, m->heads, m->kv_heads, m->head_dim,
                                   m->block_size, max_blocks, m->attention_scale, m->bf16_cache,
                                   m->attention_threads))
            return 2;
        int8_matmul(attended, T, q_width, L->o.inv_smooth, L->o.weight, L->o.weight_sums,
                    L->o.scale, L->o.bias, H, projected, xq, xscale, threads);
        add_into(x, projected, T * H);
        rms_norm(x, L->post_attention_norm, normed, T, H, H, m->eps);
        int8_matmul(normed, T, H, L->gate_up.inv_smooth, L->gate_up.weight,
                    L->gate_up.weight_sums, L->gate_up.scale, L->gate_up.bias, 2 * I, gate_up,
                    xq, xscale, threads);
        for (int64_t t = 0; t < T; t++) {
            const float *g = gate_up + t * 2 * I, *u = g + I;
            float *a = act + t * I;
            for (int64_t i = 0; i < I; i++) { /* SiLU(g) * u; e^-|g| vectorises, libm's expf not */
                const float e = exp_nonpositive(-fabsf(g[i]));
                const float sigmoid = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
                a[i] = g[i] * sigmoid * u[i];
            }
        }
        int8_matmul(act, T, I, L->down.inv_smooth, L->down.weight, L->down.weight_sums,
                    L->down.scale, L->down.bias, H, projected, xq, xscale, threads);
        add_into(x, projected, T * H);
    }
    return 0;
}

int decode_step(const Model *m, float *x, int64_t tokens, const int64_t *positions,
                const int64_t *slots, const int64_t *block_tables, const int64_t *context_lens,
                int64_t max_blocks, float *scratch, uint8_t *xq, float *xscale) {
    pool_spin(1); /* the layers' pool calls come back to back: keep the workers polling */
    const int failed = run_layers(m, x, tokens, positions, slots, block_tables, context_lens,
                                  max_blocks, scratch, xq, xscale);
    pool_spin(0);
    return failed;
}
