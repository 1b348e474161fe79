/* A decode step's decoder layers in one call (Llama family, w8a8 weights or GGUF blocks read
 * in place, one token per sequence): for each layer, RMSNorm, the q|k|v matmul, RoPE with the
 * KV-cache write, paged attention, the output matmul and residual, RMSNorm, gate|up,
 * SiLU(gate) * up, down and residual, through the same kernels the model calls one by one
 * from Python otherwise.
 *
 * Why one call: at batch 1 a step of SmolLM2 (30 layers) made ~300 Python-level calls, each a
 * few microseconds of module dispatch and ctypes argument conversion: ~3 ms of a ~10 ms step,
 * spent while the cores that should be reading weights wait.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "kernels.h"

/* The floats of scratch a step of `tokens` needs. */
int64_t my_decode_step_scratch(const my_model *m, int64_t tokens) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return tokens * (2 * m->hidden + q + 2 * kv + 2 * q + 3 * m->intermediate);
}

/* out = x W^T through the projection's own kernel (xscale holds either kernel's scratch). The
 * GGUF type was checked when the layer was described, so the matmul cannot refuse it here. */
static void project(const my_projection *p, const float *x, int64_t T, float *out, uint8_t *xq,
                    float *xscale, int threads) {
    if (p->gguf.blocks != NULL)
        my_gguf_matmul(x, T, &p->gguf, out, (int8_t *)xq, xscale, threads);
    else
        my_int8_matmul(x, T, &p->int8, out, xq, xscale, threads);
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* Returns 0, or 1 for a position outside the RoPE table, 2 when attention found no memory, 3
 * when `stop` was raised (the step stopped between two layers; its KV writes so far are those a
 * rerun of the step writes again). */
static int run_layers(const my_model *m, const my_step *s) {
    const int64_t H = m->hidden, I = m->intermediate, T = s->tokens;
    float *const x = s->x, *const scratch = s->scratch, *const xscale = s->xscale;
    uint8_t *const xq = s->xq;
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
        if (s->stop != NULL && __atomic_load_n(s->stop, __ATOMIC_RELAXED)) return 3;
        const my_layer *L = &m->layers[l];
        my_rms_norm(x, L->input_norm, normed, T, H, H, m->eps);
        project(&L->qkv, normed, T, qkv, xq, xscale, threads);
        const my_rope_kv rope = {qkv,       m->rope_cos, m->rope_sin, s->positions,
                                 s->slots,  L->k_cache,  L->v_cache,  T,
                                 m->heads,  m->kv_heads, m->head_dim, qkv_width,
                                 m->max_positions, m->bf16_cache};
        if (my_rope_write_kv(&rope)) return 1;
        for (int64_t t = 0; t < T; t++)
            memcpy(queries + t * q_width, qkv + t * qkv_width, q_width * sizeof(float));
        const my_attention attention = {
            queries,       L->k_cache,         L->v_cache,  s->block_tables, s->context_lens,
            attended,      T,                  m->heads,    m->kv_heads,     m->head_dim,
            m->block_size, s->max_blocks,      m->attention_scale, m->bf16_cache,
            m->attention_threads};
        if (my_paged_decode_attention(&attention)) return 2;
        project(&L->o, attended, T, projected, xq, xscale, threads);
        add_into(x, projected, T * H);
        my_rms_norm(x, L->post_attention_norm, normed, T, H, H, m->eps);
        project(&L->gate_up, normed, T, gate_up, xq, xscale, threads);
        for (int64_t t = 0; t < T; t++) {
            const float *g = gate_up + t * 2 * I, *u = g + I;
            float *a = act + t * I;
            for (int64_t i = 0; i < I; i++) { /* SiLU(g) * u; e^-|g| vectorises, libm's expf not */
                const float e = exp_nonpositive(-fabsf(g[i]));
                const float sigmoid = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
                a[i] = g[i] * sigmoid * u[i];
            }
        }
        project(&L->down, act, T, projected, xq, xscale, threads);
        add_into(x, projected, T * H);
    }
    return 0;
}

int my_decode_step(const my_model *m, const my_step *s) {
    pool_spin(1); /* the layers' pool calls come back to back: keep the workers polling */
    const int failed = run_layers(m, s);
    pool_spin(0);
    return failed;
}
