/* The C kernels' interface: every function Python calls and every struct it fills, declared
 * once. Each .c file includes this header, so the compiler checks every definition against it
 * (the build also makes a function defined without a prototype an error); Python's ctypes
 * bindings are generated from it at load time (modelyard/engine/kernel_header.py), so there is
 * no second list of argument types to keep in step.
 *
 * Keep to the subset kernel_header.py reads (it refuses anything else): `typedef struct { ... }
 * name;` of scalars (int, float, int8_t, uint8_t, int32_t, int64_t), pointers and other such
 * structs, and `MY_API type name(parameters);` prototypes. Exported names start with `my_`;
 * the library is built with hidden visibility, so only MY_API functions are exported. Argument
 * lists of ten or more go in a struct passed by pointer. */
#ifndef MODELYARD_KERNELS_H
#define MODELYARD_KERNELS_H

#include <stdint.h>

#define MY_API __attribute__((visibility("default")))

/* ----- fused_ops.c ------------------------------------------------------------------------ */

/* out[r] = x[r] / rms(x[r]) * weight, rows of `cols` values (rows `x_stride` apart). */
MY_API void my_rms_norm(const float *x, const float *weight, float *out, int64_t rows,
                        int64_t cols, int64_t x_stride, float eps);

/* RoPE on the fused q|k|v rows, in place, then each token's key and value into its slot. */
typedef struct {
    float *qkv;                        /* [tokens, row_stride]: queries, keys, values */
    const float *cos_table, *sin_table; /* [max_positions, dim] */
    const int64_t *positions, *slots;  /* [tokens] */
    void *k_cache, *v_cache;           /* [slots, kv_heads, dim], float32 or bfloat16 (bf16) */
    int64_t tokens, heads, kv_heads, dim, row_stride, max_positions;
    int bf16;
} my_rope_kv;

/* Returns 0, or -1 (nothing written) when a position lies outside the tables. */
MY_API int my_rope_write_kv(const my_rope_kv *r);

/* w8a8's activations divided by the SmoothQuant factors (inv_smooth may be NULL), then each
 * row scaled to absmax 1; row_max keeps each row's scale. */
MY_API void my_smooth_rows(const float *x, const float *inv_smooth, float *out, float *row_max,
                           int64_t rows, int64_t cols, int64_t x_stride);

/* ----- paged_attention.c ------------------------------------------------------------------ */

/* One query token per sequence against its KV blocks where they lie in the cache. */
typedef struct {
    const float *q;                /* [batch, heads, dim] float32 */
    const void *k_cache, *v_cache; /* [slots, kv_heads, dim], float32 or bfloat16 (bf16) */
    const int64_t *block_tables;   /* [batch, max_blocks] */
    const int64_t *context_lens;   /* [batch], each >= 1 */
    float *out;                    /* [batch, heads, dim] float32 */
    int64_t batch, heads, kv_heads, dim, block_size, max_blocks;
    float scale;
    int bf16, n_threads;
} my_attention;

/* Returns 0, or -1 when memory for the scores could not be had. */
MY_API int my_paged_decode_attention(const my_attention *a);

/* ----- int8_matmul.c ---------------------------------------------------------------------- */

/* A w8a8 linear layer's weights in plain int8 rows. */
typedef struct {
    const int8_t *weight;       /* [out_features, in_features] */
    const int32_t *weight_sums; /* [out_features]: each row's sum */
    const float *scale;         /* [out_features] */
    const float *bias;          /* [out_features] or NULL */
    const float *inv_smooth;    /* [in_features] or NULL */
    const int8_t *amx_weight;   /* `weight` in AMX tile order (my_int8_amx_pack), or NULL */
    int64_t out_features, in_features;
} my_linear;

/* out[rows, out_features] = quantize(x * inv_smooth) . weight^T * scale (+ bias); x: [rows,
 * in_features]; xq: rows * in_features bytes and xscale: rows floats of scratch. */
MY_API void my_int8_matmul(const float *x, int64_t rows, const my_linear *w, float *out,
                           uint8_t *xq, float *xscale, int n_threads);

/* Whether this build has the vector product (where not, PyTorch's int8 matmul is faster). */
MY_API int my_int8_matmul_vectorized(void);

/* ----- amx_matmul.c ----------------------------------------------------------------------- */

/* Whether this build has the AMX product and the OS lets this process use the tiles (asked
 * once). Where it does, my_int8_matmul runs batches of rows on them when `amx_weight` is set. */
MY_API int my_int8_amx_available(void);

/* w [N, K] int8 rows into out (N * K bytes) in AMX tile order; N a multiple of 16, K of 64. */
MY_API void my_int8_amx_pack(const int8_t *w, int64_t N, int64_t K, int8_t *out);

/* ----- gguf_matmul.c ---------------------------------------------------------------------- */

/* A linear layer's weights as a GGUF file's quantized blocks, row after row. */
typedef struct {
    const uint8_t *blocks; /* [out_features, in_features / 32 blocks] */
    const float *bias;     /* [out_features] or NULL */
    int64_t out_features, in_features; /* in_features a multiple of 32 */
    int type;                          /* GGML's type: 2 Q4_0, 3 Q4_1, 8 Q8_0 */
} my_gguf_linear;

/* out[rows, out_features] = quantize(x) . W^T (+ bias), x [rows, in_features] quantized to int8
 * in blocks of 32; xq: rows * in_features bytes and xscale: 2 * rows * in_features / 32 floats
 * of scratch. Returns 0, or -1 (nothing written) for a type or in_features it does not take. */
MY_API int my_gguf_matmul(const float *x, int64_t rows, const my_gguf_linear *w, float *out,
                          int8_t *xq, float *xscale, int n_threads);

/* Bytes of one block of 32 weights of GGML type `type`; 0 for a type the matmul does not take. */
MY_API int my_gguf_block_bytes(int type);

/* The matmul's form in this build: 0 plain C, 2 AVX2, 3 AVX-512 VNNI. */
MY_API int my_gguf_matmul_isa(void);

/* ----- lora.c ----------------------------------------------------------------------------- */

/* Each adapter row's y[row] += x[row] @ A[slot] @ B[slot], rows grouped by slot. */
typedef struct {
    const void *x; /* [T, in_features] float32 or bfloat16 (x_bf16), rows x_stride apart */
    int64_t x_stride;
    int x_bf16;
    void *y; /* [T, sum(part_sizes)] float32 or bfloat16 (y_bf16): updated */
    int64_t y_stride;
    int y_bf16;
    const int64_t *rows;   /* the adapter rows, grouped by slot */
    const int64_t *groups; /* [n_groups + 1]: group g is rows[groups[g]..groups[g + 1]) */
    const int64_t *slots;  /* [n_groups]: each group's slot */
    int64_t n_groups;
    const void *a;             /* [slots, parts * rank, in_features], slots slot_stride apart */
    const void *const *b; /* [parts]: each part's B [slots, rank, part_size] (int8: in quads
                           * [slots, rank / 4, part_size, 4]), likewise */
    int64_t slot_stride;       /* elements */
    const int64_t *part_sizes; /* [parts] */
    const int32_t *part_rank;  /* [slots, parts]: the slot's rank on the part, 0: untouched */
    const float *scales; /* int8 weights: [slots, 2 * parts * rank], A's rows' then B's rows' */
    int64_t parts, in_features, rank; /* rank: the largest, A's and B's stride in rows */
    int w_dtype; /* the weights: 0 float32, 1 bfloat16, 2 float16, 3 int8 (row scales) */
    int n_threads;
} my_lora;

/* Returns 0, or -1 when a thread found no memory for its scratch (then some rows may lack
 * their update). */
MY_API int my_lora_add(const my_lora *l);

/* 1 where this build multiplies int8 adapter weights in int8 (AVX-512 VNNI), else 0 (they are
 * widened to floats). */
MY_API int my_lora_int8_dot(void);

/* ----- decode_step.c ---------------------------------------------------------------------- */

/* One of a layer's matmuls: GGUF blocks read in place where gguf.blocks is set, else w8a8. */
typedef struct {
    my_linear int8;
    my_gguf_linear gguf;
} my_projection;

typedef struct {
    const float *input_norm, *post_attention_norm;
    my_projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [slots, kv_heads, head_dim], float32 or bfloat16 */
} my_layer;

typedef struct {
    const my_layer *layers;
    int64_t n_layers, hidden, heads, kv_heads, head_dim, intermediate;
    const float *rope_cos, *rope_sin; /* [max_positions, head_dim] */
    int64_t max_positions, block_size;
    float eps, attention_scale;
    int bf16_cache, matmul_threads, attention_threads;
} my_model;

/* One step's decodes, one token per sequence, and the step's scratch. */
typedef struct {
    float *x; /* [tokens, hidden]: the embeddings in, the last layer's output out */
    int64_t tokens;
    const int64_t *positions, *slots; /* [tokens] */
    const int64_t *block_tables;      /* [tokens, max_blocks] */
    const int64_t *context_lens;      /* [tokens] */
    int64_t max_blocks;
    float *scratch; /* my_decode_step_scratch floats */
    uint8_t *xq;    /* tokens * the widest matmul input bytes */
    float *xscale;  /* tokens * (2 * the widest input / 32 + 1) floats */
    const int32_t *stop; /* nonzero (set by another thread): stop before the next layer; or NULL */
} my_step;

/* The floats of scratch a step of `tokens` needs. */
MY_API int64_t my_decode_step_scratch(const my_model *m, int64_t tokens);

/* Returns 0, or 1 for a position outside the RoPE table, 2 when attention found no memory, 3
 * when `stop` was raised. */
MY_API int my_decode_step(const my_model *m, const my_step *s);

#endif
