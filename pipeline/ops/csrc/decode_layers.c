/* A decode step's decoder layers in one call: see decode_layers.h. */
#include "decode_layers.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "quant/quant.h"

typedef int (*qlinear_fn)(const qlinear_args *);

#define PTR(v) ((void *)(uintptr_t)(v))

static int64_t max_part_columns(const decode_plan_matrix *mat) {
    int64_t most = 0;
    for (int64_t p = 0; p < mat->num_parts; p++)
        if (mat->parts[p].n > most) most = mat->parts[p].n;
    return most;
}

static const decode_plan_layer *layer_at(const int64_t *plan, int64_t l) {
    return (const decode_plan_layer *)(plan + DECODE_HEADER_WORDS + l * DECODE_LAYER_WORDS);
}

/* The workspace, in the order run_layer carves it:
 *     h [m, H] | qkv [m, q + 2kv] | q_normed [m, q] | k_normed [m, kv] | attn [m, q]
 *     | gate_up [m, max(2I, H)] | act [m, I] | part [m, widest part of a multi-part matrix]
 * (gate_up holds the MLP's output too, before a sandwich norm) */
static int64_t gate_up_floats(const decode_plan_header *hd) {
    return 2 * hd->inter > hd->hidden ? 2 * hd->inter : hd->hidden;
}

/* The dense part of the workspace (everything but a sparse layer's own). */
static int64_t dense_floats(const int64_t *plan, int64_t m) {
    const decode_plan_header *hd = (const decode_plan_header *)plan;
    const int64_t q = hd->num_heads * hd->head_dim, kv = hd->num_kv_heads * hd->head_dim;
    int64_t part = 0;
    for (int64_t l = 0; l < hd->num_layers; l++) {
        const decode_plan_layer *ly = layer_at(plan, l);
        const decode_plan_matrix *mats[4] = {&ly->qkv, &ly->o_proj, &ly->gate_up, &ly->down};
        for (int i = 0; i < 4; i++) {
            if (mats[i]->num_parts > 1 && max_part_columns(mats[i]) > part)
                part = max_part_columns(mats[i]);
        }
    }
    const int64_t floats =
        m * (hd->hidden + (q + 2 * kv) + q + kv + q + gate_up_floats(hd) + hd->inter + part);
    return floats + (floats & 1); /* a sparse layer's int64s follow */
}

int64_t decode_workspace_floats(const int64_t *plan, int64_t m) {
    const decode_plan_header *hd = (const decode_plan_header *)plan;
    int64_t moe = 0;
    for (int64_t l = 0; l < hd->num_layers; l++) {
        const decode_plan_layer *ly = layer_at(plan, l);
        if (ly->moe && moe_workspace_floats(PTR(ly->moe), m) > moe)
            moe = moe_workspace_floats(PTR(ly->moe), m);
    }
    return dense_floats(plan, m) + moe;
}

/* The profile's clock: `*t` moves to now, and the time since goes to `part`. */
static void mark(double *profile, int part, struct timespec *t) {
    if (!profile) return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    profile[part] += (double)(now.tv_sec - t->tv_sec) + 1e-9 * (double)(now.tv_nsec - t->tv_nsec);
    *t = now;
}

static int run_part(const cpu_kernels *k, const decode_plan_part *p, float *y, const float *x,
                    const float *bias, int64_t m, int64_t kdim, int threads) {
    if (p->kind == PART_QUANT) {
        const qlinear_args qa = {
            .y = y, .x = x, .w = (const uint8_t *)(uintptr_t)p->data, .bias = bias, .m = m,
            .n = p->n, .k = kdim, .ldx = kdim, .qtype = (int)p->type, .xtype = XT_F32,
            .threads = threads,
        };
        return ((qlinear_fn)(uintptr_t)p->fn)(&qa) ? -1 : 0;
    }
    if (p->kind == PART_W16) {
        const linear_args la = {
            .y = y, .x = x, .w = (const uint16_t *)(uintptr_t)p->data, .bias = bias, .m = m,
            .n = p->n, .k = kdim, .ldx = kdim, .ldy = p->n, .wdtype = (int)p->type,
            .threads = threads,
        };
        k->linear(&la);
        return 0;
    }
    return -2;
}

/* y [m, n] = x [m, k] . W^T (+ bias): one part straight into y; several parts each into
 * `part` and then into their columns of y (a single row needs no copy: its parts' outputs
 * lie one after the other). */
static int run_matrix(const cpu_kernels *k, const decode_plan_matrix *mat, float *y,
                      const float *x, const float *bias, int64_t m, float *part, int threads) {
    if (mat->num_parts == 1) return run_part(k, &mat->parts[0], y, x, bias, m, mat->k, threads);
    int64_t col = 0;
    for (int64_t p = 0; p < mat->num_parts; p++) {
        const decode_plan_part *pp = &mat->parts[p];
        float *dst = m == 1 ? y + col : part;
        const int rc = run_part(k, pp, dst, x, NULL, m, mat->k, threads);
        if (rc) return rc;
        if (m > 1) {
            for (int64_t r = 0; r < m; r++)
                memcpy(y + r * mat->n + col, part + r * pp->n, (size_t)pp->n * sizeof(float));
        }
        col += pp->n;
    }
    if (bias) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < mat->n; j++) y[r * mat->n + j] += bias[j];
    }
    return 0;
}

/* y [m, n] += each token's LoRA delta of x [m, kdim] (nothing without slots or stacks);
 * y's columns are the parts ending at ends[0..parts-1] (q | k | v, gate | up). */
static int add_lora(const cpu_kernels *k, const decode_plan_lora *lo, const int32_t *slots,
                    float *y, const float *x, int64_t m, int64_t n, int64_t kdim, int threads,
                    int64_t parts, const int64_t *ends) {
    if (!slots || !lo || !lo->r) return 0;
    const int64_t floats = (m * parts * lo->r + 1) & ~(int64_t)1; /* then 3 m int64 */
    float *shrunk = thread_scratch(floats + 6 * m);
    if (!shrunk) return -1;
    lora_args la = {
        .y = y, .x = x, .a = PTR(lo->a), .b = PTR(lo->b), .slots = slots, .shrunk = shrunk,
        .m = m, .n = n, .k = kdim, .w = parts * lo->r, .r = lo->r, .x_stride = kdim,
        .y_stride = n, .num_parts = parts, .dtype = DT_F32, .threads = threads,
    };
    for (int64_t p = 0; p < parts; p++) la.part_end[p] = ends[p];
    lora_order(&la, (int64_t *)(shrunk + floats));
    k->lora(&la);
    return 0;
}

/* y [m, H] = act_mul(x . Wgate_up^T) . Wdown^T: a gated MLP (a dense layer's, or one
 * expert's), through gu [m, 2I], act [m, I] and part (run_matrix's); `lora` (a dense
 * layer's, NULL: none): its gate_up and down LoRA slots, for the tokens' `slots`. */
static int gated_mlp(const cpu_kernels *k, const decode_plan_matrix *gate_up,
                     const decode_plan_matrix *down, float *y, const float *x, int64_t m,
                     int64_t I, int act_kind, float *gu, float *act, float *part, int threads,
                     const decode_plan_lora *lora, const int32_t *slots, double *profile,
                     struct timespec *t) {
    int rc = run_matrix(k, gate_up, gu, x, NULL, m, part, threads);
    if (rc) return rc;
    mark(profile, PROF_GATE_UP, t);
    const int64_t halves[2] = {I, 2 * I};
    if (lora && (rc = add_lora(k, &lora[2], slots, gu, x, m, 2 * I, gate_up->k, threads, 2,
                               halves)))
        return rc;
    if (slots) mark(profile, PROF_LORA, t);
    const gated_act_args ga = {
        .out = act, .x = gu, .x_stride = 2 * I, .rows = m, .inter = I, .act = act_kind,
        .dtype = DT_F32, .threads = threads,
    };
    k->gated_act(&ga);
    mark(profile, PROF_ACT, t);
    if ((rc = run_matrix(k, down, y, act, NULL, m, part, threads))) return rc;
    mark(profile, PROF_DOWN, t);
    rc = lora ? add_lora(k, &lora[3], slots, y, act, m, down->n, I, threads, 1, &down->n) : 0;
    if (slots) mark(profile, PROF_LORA, t);
    return rc;
}

static void rms(const cpu_kernels *k, float *out, const float *x, int64_t x_outer,
                int64_t x_inner, const float *residual, float *residual_out, const void *weight,
                int64_t rows, int64_t inner, int64_t cols, float eps, int threads) {
    const rms_norm_args ra = {
        .out = out, .x = x, .x_outer = x_outer, .x_inner = x_inner, .residual_in = residual,
        .residual_out = residual_out, .weight = weight, .rows = rows, .inner = inner,
        .cols = cols, .eps = eps, .dtype = DT_F32, .threads = threads,
    };
    k->rms_norm(&ra);
}

static void rope(const cpu_kernels *k, float *x, int64_t tok_stride, int64_t heads,
                 const decode_plan_header *hd, const float *cos_sin, const int64_t *positions,
                 int64_t m, int threads) {
    const rotary_args ra = {
        .x = x, .tok_stride = tok_stride, .head_stride = hd->head_dim, .positions = positions,
        .cos_sin = cos_sin, .tokens = m, .heads = heads,
        .head_size = hd->head_dim, .dtype = DT_F32, .threads = threads,
    };
    k->rotary(&ra);
}

/* One layer: `x` in, the MLP's output into `out` (the next layer's x); `residual` [m, H]
 * is read and written in place (first: the layer takes x as the residual). */
static int run_layer(const cpu_kernels *k, const decode_layers_args *a,
                     const decode_plan_layer *ly, const float *x, int first, float *out,
                     float *moe_ws) {
    const decode_plan_header *hd = (const decode_plan_header *)a->plan;
    const int64_t m = a->m, H = hd->hidden, D = hd->head_dim, I = hd->inter;
    const int64_t q = hd->num_heads * D, kv = hd->num_kv_heads * D, nqkv = q + 2 * kv;
    const float eps = (float)hd->eps;
    const int t = a->threads;
    float *h = a->workspace, *qkv = h + m * H, *qn = qkv + m * nqkv, *kn = qn + m * q;
    float *attn = kn + m * kv, *gu = attn + m * q, *act = gu + m * gate_up_floats(hd);
    float *part = act + m * I;
    int rc;
    double *prof = a->profile;
    struct timespec clk = {0, 0};
    if (prof) clock_gettime(CLOCK_MONOTONIC, &clk);

    if (first && !a->residual_in) {
        memcpy(a->residual_out, x, (size_t)(m * H) * sizeof(float));
        rms(k, h, x, H, 0, NULL, NULL, PTR(ly->input_norm), m, 1, H, eps, t);
    } else {
        const float *res = first ? a->residual_in : a->residual_out;
        rms(k, h, x, H, 0, res, a->residual_out, PTR(ly->input_norm), m, 1, H, eps, t);
    }
    mark(prof, PROF_NORMS, &clk);
    if ((rc = run_matrix(k, &ly->qkv, qkv, h, PTR(ly->qkv_bias), m, part, t))) return rc;
    mark(prof, PROF_QKV, &clk);
    const int64_t qkv_ends[3] = {q, q + kv, nqkv};
    if ((rc = add_lora(k, &ly->lora[0], a->lora_slots, qkv, h, m, nqkv, H, t, 3, qkv_ends)))
        return rc;
    if (a->lora_slots) mark(prof, PROF_LORA, &clk);

    /* q and k: views of qkv's rows, or (Qwen3) their normed copies */
    float *qp = qkv, *kp = qkv + q;
    int64_t q_stride = nqkv, k_stride = nqkv;
    if (ly->q_norm) {
        rms(k, qn, qkv, nqkv, D, NULL, NULL, PTR(ly->q_norm), m * hd->num_heads,
            hd->num_heads, D, eps, t);
        rms(k, kn, qkv + q, nqkv, D, NULL, NULL, PTR(ly->k_norm), m * hd->num_kv_heads,
            hd->num_kv_heads, D, eps, t);
        qp = qn, kp = kn, q_stride = q, k_stride = kv;
    }
    const float *cos_sin = PTR(ly->cos_sin ? ly->cos_sin : hd->cos_sin);
    rope(k, qp, q_stride, hd->num_heads, hd, cos_sin, a->positions, m, t);
    rope(k, kp, k_stride, hd->num_kv_heads, hd, cos_sin, a->positions, m, t);
    mark(prof, PROF_ROTARY, &clk);

    const int64_t *slots = a->slots + ly->kv_group * a->group_slot_stride;
    const int32_t *tables = a->block_tables + ly->kv_group * a->group_bt_stride;
    /* an int8 cache's scales follow its values (kv_int8.py); the plan's shape finds them */
    float *key_scales = NULL, *value_scales = NULL;
    if (hd->cache_dtype == DT_I8) {
        key_scales = int8_cache_scales(PTR(ly->key_cache), hd->num_blocks, hd->num_kv_heads,
                                       hd->block_size, D);
        value_scales = int8_cache_scales(PTR(ly->value_cache), hd->num_blocks,
                                         hd->num_kv_heads, hd->block_size, D);
    }
    const cache_write_args cw = {
        .key = kp, .value = qkv + q + kv, .key_tok_stride = k_stride, .key_head_stride = D,
        .value_tok_stride = nqkv, .value_head_stride = D, .key_cache = PTR(ly->key_cache),
        .value_cache = PTR(ly->value_cache), .slots = slots, .tokens = m,
        .kv_heads = hd->num_kv_heads, .head_size = D, .block_size = hd->block_size,
        .num_blocks = hd->num_blocks, .src_dtype = DT_F32,
        .cache_dtype = (int)hd->cache_dtype, .key_scales = key_scales,
        .value_scales = value_scales,
    };
    cache_write(&cw);
    mark(prof, PROF_KV_WRITE, &clk);
    /* the decodes' rows, then the prompt chunks' (one call each, as the layer path's
     * models/attention.py makes them: the same items, so the same bits) */
    const int64_t nd = a->num_decodes;
    attention_args at = {
        .out = attn, .query = qp, .q_tok_stride = q_stride, .q_head_stride = D,
        .out_tok_stride = q, .out_head_stride = D, .key_cache = PTR(ly->key_cache),
        .value_cache = PTR(ly->value_cache), .block_tables = tables,
        .bt_stride = a->bt_stride, .query_start_loc = NULL, .seq_lens = a->seq_lens,
        .num_reqs = nd, .num_heads = hd->num_heads, .num_kv_heads = hd->num_kv_heads,
        .head_size = D, .block_size = hd->block_size, .window = ly->window,
        .scale = (float)hd->scale, .dtype = DT_F32,
        .cache_dtype = (int)hd->cache_dtype, .key_scales = key_scales,
        .value_scales = value_scales, .tiles = (int)hd->attn_tiles, .threads = t,
    };
    if (nd > 0 && k->attention(&at)) return -1;
    if (a->num_reqs > nd) {
        at.out = attn + nd * q;
        at.query = qp + nd * q_stride;
        at.block_tables = tables + nd * a->bt_stride;
        at.query_start_loc = a->prefill_qsl;
        at.seq_lens = a->seq_lens + nd;
        at.num_reqs = a->num_reqs - nd;
        if (k->attention(&at)) return -1;
    }

    mark(prof, PROF_ATTENTION, &clk);
    if ((rc = run_matrix(k, &ly->o_proj, out, attn, NULL, m, part, t))) return rc;
    mark(prof, PROF_O, &clk);
    if ((rc = add_lora(k, &ly->lora[1], a->lora_slots, out, attn, m, H, q, t, 1, &H))) return rc;
    if (a->lora_slots) mark(prof, PROF_LORA, &clk);
    if (ly->pre_ff_norm) { /* sandwich: the sublayer's output normed before the residual */
        rms(k, h, out, H, 0, NULL, NULL, PTR(ly->post_norm), m, 1, H, eps, t);
        rms(k, h, h, H, 0, a->residual_out, a->residual_out, PTR(ly->pre_ff_norm), m, 1, H,
            eps, t);
    } else {
        rms(k, h, out, H, 0, a->residual_out, a->residual_out, PTR(ly->post_norm), m, 1, H,
            eps, t);
    }
    /* the MLP (a sparse layer's: its moe record) into the next layer's x, or (sandwich)
     * into gu, consumed by then, and normed from there */
    mark(prof, PROF_NORMS, &clk);
    float *mlp = ly->post_ff_norm ? gu : out;
    rc = ly->moe ? moe_forward(k, PTR(ly->moe), h, m, mlp, moe_ws, t)
                 : gated_mlp(k, &ly->gate_up, &ly->down, mlp, h, m, I, (int)hd->act, gu, act,
                             part, t, ly->lora, a->lora_slots, prof, &clk);
    if (rc) return rc;
    if (ly->moe) mark(prof, PROF_EXPERTS, &clk); /* a dense MLP's parts marked theirs */
    if (ly->post_ff_norm) rms(k, out, gu, H, 0, NULL, NULL, PTR(ly->post_ff_norm), m, 1, H, eps, t);
    mark(prof, PROF_NORMS, &clk);
    return 0;
}

int decode_layers(const cpu_kernels *k, const decode_layers_args *a) {
    const decode_plan_header *hd = (const decode_plan_header *)a->plan;
    if (hd->magic != DECODE_PLAN_MAGIC) return -2;
    const float *x = a->x;
    float *moe_ws = a->workspace + dense_floats(a->plan, a->m);
    for (int64_t l = 0; l < hd->num_layers; l++) {
        /* the MLP's output goes to hidden_out, which the next layer reads as its x: each
         * kernel reads its input whole before the next one writes over it */
        const int rc = run_layer(k, a, layer_at(a->plan, l), x, l == 0, a->hidden_out, moe_ws);
        if (rc) return rc;
        x = a->hidden_out;
    }
    return 0;
}

/* ---- a mixture of experts' MLP (decode_layers.h moe_forward) --------------------------- */

static const decode_plan_matrix *expert_matrix(const int64_t *record, int64_t e, int down) {
    return (const decode_plan_matrix *)(record + MOE_HEADER_WORDS) + 2 * e + down;
}

/* int64: chosen [m k] | slot [m k] | counts [E] | starts [E] | active [E]   floats: logits [m E] | weight [m k] | rows
 * [m k H] | ys [m k H] | gate_up [m 2I] | act [m I] | part [m, widest part] (an expert has
 * at most m rows: a row picks k distinct experts) */
#define MOE_EXPERT_PARALLEL_ROWS 32 /* rows per expert, on average, at most */

static int64_t moe_widest_part(const int64_t *record) {
    const moe_record_header *hd = (const moe_record_header *)record;
    int64_t part = 0;
    for (int64_t i = 0; i < 2 * hd->num_experts; i++) {
        const decode_plan_matrix *mat = (const decode_plan_matrix *)(record + MOE_HEADER_WORDS) + i;
        if (mat->num_parts > 1 && max_part_columns(mat) > part) part = max_part_columns(mat);
    }
    return part;
}

int64_t moe_workspace_floats(const int64_t *record, int64_t m) {
    const moe_record_header *hd = (const moe_record_header *)record;
    const int64_t E = hd->num_experts, K = hd->top_k, H = hd->hidden, I = hd->inter;
    const int64_t ints = 2 * m * K + 3 * E;
    return 2 * ints + m * E + m * K + 2 * m * K * H + 3 * m * I + m * moe_widest_part(record);
}

/* dot of n floats in 8 running sums (one order, vectorizable without reassociation) */
static float dot8(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static int moe_experts_in_turn(const cpu_kernels *k, const int64_t *record,
                               const int64_t *counts, const float *rows, float *ys, float *gu,
                               float *act, float *part, int threads) {
    const moe_record_header *hd = (const moe_record_header *)record;
    const int64_t E = hd->num_experts, H = hd->hidden, I = hd->inter;
    int64_t start = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        const int rc = gated_mlp(k, expert_matrix(record, e, 0), expert_matrix(record, e, 1),
                                 ys + start * H, rows + start * H, n, I, (int)hd->act, gu, act,
                                 part, threads, NULL, NULL, NULL, NULL);
        if (rc) return rc;
        start += n;
    }
    return 0;
}

/* each row's k outputs, weighted, in the order they were chosen (slot of pair p: slots[p]) */
static void combine(const moe_record_header *hd, int64_t m, const float *weight,
                    const int64_t *slots, const float *ys, float *out, int threads) {
    const int64_t K = hd->top_k, H = hd->hidden;
    int64_t t;
#pragma omp parallel for schedule(static) num_threads(threads) if (m * K * H > (1 << 18))
    for (t = 0; t < m; t++) {
        float *o = out + t * H;
        for (int64_t j = 0; j < K; j++) {
            const float w = weight[t * K + j];
            const float *y = ys + slots[t * K + j] * H;
            if (j == 0)
                for (int64_t i = 0; i < H; i++) o[i] = w * y[i];
            else
                for (int64_t i = 0; i < H; i++) o[i] += w * y[i];
        }
    }
}

int moe_forward(const cpu_kernels *k, const int64_t *record, const float *x, int64_t m,
                float *out, float *workspace, int threads) {
    const moe_record_header *hd = (const moe_record_header *)record;
    const int64_t E = hd->num_experts, K = hd->top_k, H = hd->hidden, I = hd->inter;
    if (K < 1 || K > E) return -2;
    const float *router = (const float *)(uintptr_t)hd->router;
    int64_t *chosen = (int64_t *)workspace, *slot = chosen + m * K, *counts = slot + m * K;
    int64_t *starts = counts + E, *active = starts + E;
    float *logits = workspace + 2 * (2 * m * K + 3 * E), *weight = logits + m * E;
    float *rows = weight + m * K, *ys = rows + m * K * H, *gu = ys + m * K * H;
    float *act = gu + m * 2 * I, *part = act + m * I;

    /* route: softmax over E (float32, max subtracted), the top k, their weights; rows
     * apart on the threads (each writes its own), the counts after */
    int64_t t;
#pragma omp parallel for schedule(static) num_threads(threads) if (m * E * H > (1 << 18))
    for (t = 0; t < m; t++) {
        float *lg = logits + t * E, most = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            lg[e] = dot8(x + t * H, router + e * H, H);
            if (lg[e] > most) most = lg[e];
        }
        for (int64_t e = 0; e < E; e++) sum += (lg[e] = expf(lg[e] - most));
        float picked = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (lg[e] >= 0.0f && (best < 0 || lg[e] > lg[best])) best = e;
            if (best < 0) /* NaN logits: the first expert not taken yet */
                for (best = 0; lg[best] == -1.0f; best++) {}
            chosen[t * K + j] = best;
            weight[t * K + j] = lg[best] / sum;
            picked += weight[t * K + j];
            lg[best] = -1.0f; /* taken */
        }
        if (hd->renormalize)
            for (int64_t j = 0; j < K; j++) weight[t * K + j] /= picked;
    }
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (int64_t p = 0; p < m * K; p++) counts[chosen[p]]++;
    /* group: pair p = t * K + j goes to slot starts[expert]++ (rows of an expert in row
     * order); its row of x gathered there */
    int64_t at = 0;
    for (int64_t e = 0; e < E; e++) starts[e] = at, at += counts[e];
    for (int64_t p = 0; p < m * K; p++) slot[p] = starts[chosen[p]]++;
    int64_t p;
#pragma omp parallel for schedule(static) num_threads(threads) if (m * K * H > (1 << 18))
    for (p = 0; p < m * K; p++)
        memcpy(rows + slot[p] * H, x + (p / K) * H, (size_t)H * sizeof(float));
    /* each expert with rows: gate_up, act, down. At least two experts with rows per thread
     * and few rows each (decode, a short prefill): the experts shared out among the
     * threads, each product on one (a product of a few rows is too short to split, and
     * its team's start and join cost more than it); else the experts one after the other,
     * each product on every thread */
    int64_t nact = 0;
    for (int64_t e = 0; e < E; e++)
        if (counts[e]) active[nact++] = e;
    if (threads > 1 && nact >= 2 * threads && m * K <= MOE_EXPERT_PARALLEL_ROWS * nact) {
        const int64_t widest = moe_widest_part(record);
        int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t i = 0; i < nact; i++) {
            const int64_t e = active[i], n = counts[e], first = starts[e] - n;
            float *tgu = thread_scratch(n * (3 * I + widest));
            const int rc = !tgu ? -1
                           : gated_mlp(k, expert_matrix(record, e, 0), expert_matrix(record, e, 1),
                                       ys + first * H, rows + first * H, n, I, (int)hd->act, tgu,
                                       tgu + n * 2 * I, tgu + n * 3 * I, 1, NULL, NULL, NULL,
                                       NULL);
            if (rc) {
#pragma omp atomic write
                failed = rc;
            }
        }
        if (failed) return failed;
    } else {
        int rc = moe_experts_in_turn(k, record, counts, rows, ys, gu, act, part, threads);
        if (rc) return rc;
    }
    combine(hd, m, weight, slot, ys, out, threads);
    return 0;
}
