/* A decode step's decoder layers in one call (`cpu_kernels.decode_layers`).
 *
 * At a few rows a decoder layer's eleven kernels run for microseconds each, and the Python
 * around them (tensor allocation, checks, dispatch: ~300 calls a step on a 30-layer model)
 * cost as much as reading the weights. This driver runs the very same kernels, in the same
 * order and on the same float32 values, from C: the results are bit for bit those of the
 * layer-by-layer path (pipeline/models/llama.py `_layer`), which the tests hold it to.
 *
 * The plan is an array of int64 words written once, at the model's first decode step, by
 * pipeline/models/decode_plan.py (and written again when a weight or the KV cache was
 * replaced: sleep mode). Every pointer in it belongs to a tensor the model keeps alive.
 *
 *     decode_plan_header   (HEADER_WORDS)
 *     decode_plan_layer    x num_layers (LAYER_WORDS each)
 *         norms, q/k norms (0: none), the qkv bias (0: none), the layer's key / value cache,
 *         Gemma's sandwich norms (0: none), the layer's rotary table (0: the header's),
 *         sliding window (0: none) and KV group (its block table and slots: the step's
 *         tables and slots of group g start g * group stride in)
 *         four decode_plan_matrix: qkv, o_proj, gate_up, down
 *             up to DECODE_MAX_PARTS row parts, multiplied one after the other into
 *             consecutive output columns (a Q4_K_M file's q | k in Q4_K, v in Q6_K)
 *         four decode_plan_lora: the same four's LoRA slots (the step's token slots in
 *             decode_layers_args; each delta added after its product, as llama.py's
 *             `_project` adds it)
 *
 * One step, per layer (m tokens, one per request; activations float32):
 *
 *     h, residual = rms_norm(x (+ residual))          residual: in place
 *     qkv = h . Wqkv^T (+ bias)                       [m, q + 2 kv]
 *     q, k = q_norm(q), k_norm(k)  (Qwen3, Gemma 3)   into their own rows
 *     rotary(q, k); cache_write(k, v); attention      [m, q]; the layer's table and window
 *     o = attn . Wo^T
 *     h, residual = rms_norm(o + residual)            post_norm
 *       (sandwich: o = rms_norm(o) by post_norm, then h, residual = rms_norm(o + residual)
 *        by pre_ff_norm)
 *     x = act_mul(h . Wgate_up^T) . Wdown^T           the next layer's x; act: the header's
 *       (sandwich: x = rms_norm(x) by post_ff_norm)   SiLU or GELU(tanh)
 *
 * All 8-byte fields, so Python fills the words with numpy (the two doubles through a
 * float64 view) and checks their counts against DECODE_PLAN_WORDS.
 */
#ifndef RINGLLM_DECODE_LAYERS_H
#define RINGLLM_DECODE_LAYERS_H

#include <stdint.h>

#include "cpu_ops.h"

#define DECODE_PLAN_MAGIC 0x52474c4c44454335LL /* "RGLLDEC5" */
#define DECODE_MAX_PARTS 3

enum { PART_QUANT = 1, PART_W16 = 2 };

typedef struct {
    int64_t kind;  /* PART_QUANT: `fn` is a quant set's qlinear, `type` its qtype;
                      PART_W16: the cpu set's 16-bit product, `type` its DT_BF16 / DT_F16 */
    int64_t fn;    /* int (*)(const qlinear_args *), as an address (PART_QUANT) */
    int64_t data;  /* packed weights */
    int64_t type;
    int64_t n;     /* output columns of this part */
} decode_plan_part;

typedef struct {
    int64_t num_parts, n, k; /* n: the parts' columns together */
    decode_plan_part parts[DECODE_MAX_PARTS];
} decode_plan_matrix;

/* A projection's LoRA slots (pipeline/models/lora.py): float32 a [S, P * r, k] and
 * b [S, r, n] (S slots; P: the projection's parts, q | k | v or gate | up); r 0: the
 * projection takes no adapter. */
typedef struct {
    int64_t a, b, r;
} decode_plan_lora;

typedef struct {
    int64_t input_norm, post_norm, q_norm, k_norm, qkv_bias; /* float32 [H], [D], [q+2kv] */
    int64_t key_cache, value_cache; /* [num_blocks, kv_heads, block_size, D], cache_dtype */
    int64_t pre_ff_norm, post_ff_norm; /* float32 [H]; both or neither (Gemma 3) */
    int64_t moe;                       /* a moe record (below): the MLP; 0: gate_up, down */
    int64_t cos_sin;                   /* float32 [max_positions, D]; 0: the header's */
    int64_t window;                    /* keys a query sees (a sliding layer); 0: all */
    int64_t kv_group;                  /* its block table (pipeline/core/kv_groups.py) */
    decode_plan_matrix qkv, o_proj, gate_up, down;
    decode_plan_lora lora[4]; /* qkv, o_proj, gate_up, down: added after each product */
} decode_plan_layer;

typedef struct {
    int64_t magic, num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    int64_t cos_sin; /* float32 [max_positions, D] */
    int64_t num_blocks, block_size;
    int64_t act;         /* the MLP's gate: ACT_SILU or ACT_GELU_TANH (cpu_ops.h) */
    int64_t cache_dtype; /* the KV cache's DT_* (DT_F32, a 16-bit type, DT_FP8 or DT_I8) */
    int64_t attn_tiles;  /* attention_args.tiles: on the tile unit where the set has it */
    double eps, scale;
} decode_plan_header;

#define DECODE_HEADER_WORDS ((int64_t)(sizeof(decode_plan_header) / 8))
#define DECODE_LAYER_WORDS ((int64_t)(sizeof(decode_plan_layer) / 8))

typedef struct {
    const int64_t *plan;
    int64_t m;                                /* tokens */
    /* requests: the first num_decodes take one token each (tokens 0 .. num_decodes - 1),
     * the others a prompt chunk each, from prefill_qsl (int32 [num_reqs - num_decodes + 1],
     * counted from token num_decodes; NULL when every request decodes) */
    int64_t num_reqs, num_decodes;
    const int32_t *prefill_qsl;
    const float *x, *residual_in;             /* [m, H]; residual_in NULL: the first layer's */
    float *hidden_out, *residual_out;         /* [m, H] */
    const int64_t *positions, *slots;         /* [m] */
    const int32_t *block_tables, *seq_lens;   /* [num_reqs, bt_stride], [num_reqs] */
    int64_t bt_stride;
    int64_t group_bt_stride, group_slot_stride; /* group g's table and slots: + g * stride */
    float *workspace;                         /* decode_workspace_floats(plan, m) floats */
    const int32_t *lora_slots;                /* [m] each token's LoRA slot (-1: none);
                                                 NULL: no token of the step has one */
    double *profile;                          /* NULL, or DECODE_PROFILE_PARTS seconds:
                                                 each part's wall time is added to its own */
    int threads;
} decode_layers_args;

/* Where a step's time inside the call goes (`ringllm bench step`): the parts, in the order
 * of decode_layers_args.profile and of pipeline/worker/profiling.py's labels. */
enum {
    PROF_NORMS,     /* the layers' RMSNorms (input, post, Gemma's sandwich) */
    PROF_QKV,       /* the q | k | v product */
    PROF_ROTARY,    /* q / k norms and the rotary embedding */
    PROF_KV_WRITE,  /* the new tokens' keys and values into the cache */
    PROF_ATTENTION, /* decodes' and prompt chunks' attention */
    PROF_O,         /* the o product */
    PROF_GATE_UP,   /* the MLP's gate | up product */
    PROF_ACT,       /* SiLU / GELU and the product of the halves */
    PROF_DOWN,      /* the MLP's down product */
    PROF_LORA,      /* LoRA deltas */
    PROF_EXPERTS,   /* a sparse layer's MLP, whole */
    DECODE_PROFILE_PARTS
};

/* A mixture-of-experts layer's MLP (pipeline/models/moe.py), whole, for m rows of normed
 * activations x [m, H] into out [m, H]:
 *
 *     logits = x . Wrouter^T [m, E] -> softmax -> the top k per row (the first on ties)
 *       (-> divided by their sum: renormalize)
 *     rows grouped by expert (a counting sort: each expert's rows in row order), gathered
 *     each expert with rows: act_mul(rows . Wgate_up_e^T) . Wdown_e^T, one product each
 *     out[t] = sum of weight[t, j] * y[t, j] over t's k experts, in the order chosen
 *
 * The record is int64 words: moe_record_header (MOE_HEADER_WORDS), then 2 * E
 * decode_plan_matrix records (expert e's gate_up, then its down). The layer-by-layer path
 * and the decode plan both call this, so they give the same bits. */
typedef struct {
    int64_t num_experts, top_k, renormalize, inter, hidden;
    int64_t router; /* float32 [E, H], dense */
    int64_t act;    /* ACT_SILU / ACT_GELU_TANH */
    int64_t reserved;
} moe_record_header;

#define MOE_HEADER_WORDS ((int64_t)(sizeof(moe_record_header) / 8))

/* Floats of workspace moe_forward needs for m rows. */
int64_t moe_workspace_floats(const int64_t *record, int64_t m);

/* 0, -1: a product failed, -2: a bad record (a part's kind, or top_k not in 1..E). */
int moe_forward(const cpu_kernels *k, const int64_t *record, const float *x, int64_t m,
                float *out, float *workspace, int threads);

/* Floats of workspace a step of m tokens needs. */
int64_t decode_workspace_floats(const int64_t *plan, int64_t m);

/* 0, -1: out of memory (attention), -2: a bad plan (magic or a part's kind). */
int decode_layers(const cpu_kernels *k, const decode_layers_args *a);

#endif
