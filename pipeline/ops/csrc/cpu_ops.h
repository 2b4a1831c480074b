/* CPU kernels of the ops interface (pipeline/ops/interface.py), shared declarations.
 *
 * Every kernel has a portable implementation (cpu_ops_generic.c, plain C, any CPU gcc
 * targets) and, on x86-64, SIMD ones written once (simd_kernels.h) and compiled per
 * instruction set: AVX2 + FMA + F16C, AVX-512, AVX-512 + BF16. cpu_ops_module.c reports
 * which sets this CPU runs; Python (pipeline/ops/cpu.py) picks one and tests run each.
 *
 * Tensors arrive as raw pointers with element strides; element types are DT_* codes.
 * `threads` is the OpenMP team size a kernel may use (torch's setting, passed per call).
 * All arithmetic is float32; results are rounded to the output type once, the way torch
 * rounds each op's output (bfloat16: round to nearest even).
 */
#ifndef RINGLLM_CPU_OPS_H
#define RINGLLM_CPU_OPS_H

#include <stdint.h>

/* DT_FP8: float8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no
 * infinities, 0x7f / 0xff NaN, largest 448), the 8-bit KV cache (`--kv-cache-dtype fp8`).
 * DT_I8: int8 with a float32 scale per (block, KV head), `--kv-cache-dtype int8`: a KV
 * cache type only (pipeline/ops/kv_int8.py holds its layout and the write rule). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_FP8 = 3, DT_I8 = 4 };

static inline int64_t dtype_bytes(int dt) {
    return dt == DT_F32 ? 4 : dt == DT_FP8 || dt == DT_I8 ? 1 : 2;
}

/* An int8 cache's scales, float32 [num_blocks, kv_heads], follow its elements in the same
 * allocation (kv_int8.py); where a caller knows the cache's shape it finds them so. */
static inline float *int8_cache_scales(const void *cache, int64_t num_blocks, int64_t kv_heads,
                                       int64_t block_size, int64_t head_size) {
    return (float *)((char *)cache + num_blocks * kv_heads * block_size * head_size);
}

/* float32 -> e4m3fn, round to nearest even, saturating at +-448 (as torch's conversion
 * and vLLM's cache writes do; an infinity saturates too); NaN -> 0x7f. */
static inline uint8_t fp8_e4m3_from_f32(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (a < 0x3c800000u) { /* below 2^-6: a subnormal m * 2^-9, m = 0..8 (8: 2^-6) */
        float x;
        const uint32_t ax = a;
        __builtin_memcpy(&x, &ax, 4);
        return sign | (uint8_t)__builtin_nearbyintf(x * 512.0f);
    }
    /* a normal: exponent biased by 7, 3 mantissa bits, the 20 below rounded off */
    uint32_t r = (((a >> 23) - 120u) << 3) | ((a >> 20) & 7u);
    const uint32_t rem = a & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) r++;
    return sign | (uint8_t)(r > 0x7eu ? 0x7eu : r);
}

/* e4m3fn -> float32, exact: (8 + m) * 2^(e - 10), or m * 2^-9 for e = 0. */
static inline float fp8_e4m3_to_f32(uint8_t b) {
    if ((b & 0x7fu) == 0x7fu) return __builtin_nanf("");
    const int e = (b >> 3) & 15, m = b & 7;
    const float mag = __builtin_ldexpf((float)(e ? 8 + m : m), (e ? e : 1) - 10);
    return b & 0x80u ? -mag : mag;
}

/* RMSNorm over rows of `cols` elements. Row r = (r / inner, r % inner) is read at
 * x + (r / inner) * x_outer + (r % inner) * x_inner; out and the residual rows are dense.
 * With residual_in: h = round(x + residual_in) is written to residual_out and normalized. */
typedef struct {
    void *out;
    const void *x;
    int64_t x_outer, x_inner;
    const void *residual_in; /* NULL: no residual */
    void *residual_out;
    const void *weight;
    int64_t rows, inner, cols;
    float eps;
    int dtype, threads;
} rms_norm_args;

/* GPT-NeoX rotary, in place: x [tokens, heads, head_size] at x + t*tok_stride + h*head_stride;
 * cos_sin [max_pos, head_size] float32 (cos in the first half, sin in the second). */
typedef struct {
    void *x;
    int64_t tok_stride, head_stride;
    const int64_t *positions;
    const float *cos_sin;
    int64_t tokens, heads, head_size;
    int dtype, threads;
} rotary_args;

/* A gated MLP's activation: out [rows, inter] dense = act(x[:, :inter]) * x[:, inter:], x rows
 * `x_stride` apart; act(g) is computed in float32 and rounded to the element type before the
 * product (torch rounds each op's output):
 *     ACT_SILU        g / (1 + exp(-g))                                 (Llama, Qwen, Phi)
 *     ACT_GELU_TANH   g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3)))   (Gemma) */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    void *out;
    const void *x;
    int64_t x_stride, rows, inter;
    int act, dtype, threads;
} gated_act_args;

/* LoRA adapters (pipeline/models/lora.py), per token t with s = slots[t] >= 0 (< 0: the
 * row is left alone):  u = a[s] . x[t] [w = P * r];
 *     y[t, j] += sum over q < r of u[p*r + q] * b[s, q, j]    for j in part p
 * (parts: y's columns [part_end[p-1], part_end[p]), P <= LORA_MAX_PARTS; b is each slot's
 * B transposed, so the expand reads its rows along y's columns).
 * x [m, k] and y [m, n] rows x_stride / y_stride apart; a [S, w, k] and b [S, r, n] dense;
 * all in `dtype`; slots int32 [m]. u accumulates in float32 into `shrunk` [m, w] (never
 * rounded); each delta accumulates in float32 and is added to y in float32, rounded once
 * (TorchOps.lora_apply). */
#define LORA_MAX_PARTS 4
typedef struct {
    void *y;
    const void *x, *a, *b;
    const int32_t *slots;
    float *shrunk;
    int64_t m, n, k, w, r, x_stride, y_stride;
    int64_t num_parts, part_end[LORA_MAX_PARTS];
    /* the tokens with a slot, grouped by slot (lora_order), and each slot's [start, end) */
    const int64_t *order, *runs;
    int64_t num_runs;
    int dtype, threads;
} lora_args;

/* Fills a->order and a->runs (room for m and 2 * m int64 at `ints`) from a->slots. */
void lora_order(lora_args *a, int64_t *ints);

/* key/value [tokens, kv_heads, head_size] (strided, src_dtype) into the paged caches
 * [num_blocks, kv_heads, block_size, head_size] (cache_dtype) at slot_mapping (-1:
 * skipped); rows are copied as they are, or converted where the two types differ. */
typedef struct {
    const void *key, *value;
    int64_t key_tok_stride, key_head_stride, value_tok_stride, value_head_stride;
    void *key_cache, *value_cache;
    float *key_scales, *value_scales; /* DT_I8 caches' [num_blocks, kv_heads]; else NULL */
    const int64_t *slots;
    int64_t tokens, kv_heads, head_size, block_size, num_blocks;
    int src_dtype, cache_dtype;
} cache_write_args;

/* Whole blocks between two sets of caches (swap_blocks: the device tier and the host tier):
 * for cache c and pair p, block_bytes bytes from src_caches[c] + mapping[2p] * block_bytes
 * to dst_caches[c] + mapping[2p + 1] * block_bytes. The caller checks the block ids and
 * that no destination block repeats, so the copies never overlap. */
typedef struct {
    const int64_t *src_caches, *dst_caches; /* base addresses, num_caches each */
    const int64_t *mapping;                 /* [num_pairs, 2]: (src block, dst block) */
    int64_t num_caches, num_pairs, block_bytes;
    int threads;
} swap_blocks_args;

/* Paged attention over the caches for a flat batch of query tokens.
 * Request r owns query tokens query_start_loc[r] .. query_start_loc[r + 1] (NULL: one token
 * each, the decode case), has seq_lens[r] tokens cached (its new ones included); query token i
 * of r sits at position seq_lens[r] - q_len + i and sees the cached tokens 0..that position,
 * or with a window W > 0 (a sliding-window layer) the last W of them (first_key). */
typedef struct {
    void *out;
    const void *query;
    int64_t q_tok_stride, q_head_stride, out_tok_stride, out_head_stride;
    const void *key_cache, *value_cache;
    const float *key_scales, *value_scales; /* DT_I8 caches' [num_blocks, kv_heads] */
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *query_start_loc;
    const int32_t *seq_lens;
    int64_t num_reqs, num_heads, num_kv_heads, head_size, block_size;
    int64_t window; /* keys a query sees, its own included; 0: all before it */
    float scale;
    int dtype;       /* the query's and the output's */
    int cache_dtype; /* the keys' and values' (the same, or 16-bit / fp8 / int8 under float32) */
    int tiles;       /* 1: on the AMX tile unit where the set has it (attention_tiles.h) */
    int threads;
} attention_args;

/* out[r] = index of the largest x[r, :] (the first one on ties; the first NaN if any, as
 * torch.argmax), x float32 rows `row_stride` apart. */
typedef struct {
    int64_t *out;
    const float *x;
    int64_t rows, cols, row_stride;
    int threads;
} argmax_args;

/* out[r, i] = an Exp(1) draw (the sampler's exponential race: pipeline/sample/sampler.py),
 * the i-th of the stream keyed by keys[r]: a row's draws depend on its key only, never on
 * its row, its batch, the kernel's threads or how its columns are split among them. */
typedef struct {
    float *out;
    const uint64_t *keys;
    int64_t rows, cols, row_stride;
    int threads;
} exponential_args;

/* out[r] = the token the exponential race picks in row r: argmax_i p_i / E_i for p =
 * softmax(logits[r] * inv_temp[r]) and E_i row r's Exp(1) draws (those `exponentials`
 * writes for keys[r]), computed as its Gumbel-max form argmax_i logits_i * inv_temp - ln E_i
 * (no softmax, no draws written). With min_score, only the tokens whose logits * inv_temp
 * reach min_score[r] race (top-k / top-p / min-p as a threshold). A -inf logit (a token
 * filtered out) never wins; a NaN one does where no threshold is given, as torch's argmax
 * picks a NaN. */
typedef struct {
    int64_t *out;
    const float *logits, *inv_temp;
    const float *min_score; /* NULL: every token races */
    const uint64_t *keys;
    int64_t rows, cols, row_stride;
    int threads;
} race_args;

/* out[r] = row r's top-p threshold on its logits: of the tokens whose logits reach
 * floor[r] (top-k's threshold, or -inf), sorted by logit descending, a token is kept while
 * the mass of those before it is under top_p[r] of theirs; out[r] is the last kept one's
 * logit (a token tied with it is kept too). top_p[r] >= 1: out[r] = floor[r]. Found by
 * radix selection on the logits' bits (histograms of mass, no sort of the row). */
typedef struct {
    float *out;
    const float *logits, *top_p, *floor;
    int64_t rows, cols, row_stride;
    /* the kernel set's exp_shift (e may be written a vector past n) */
    void (*exp_shift)(float *e, const float *l, int64_t n, float m, float floor);
    int threads;
} top_p_args;

/* Every set's (cpu_ops_generic.c): 0, or -1 out of memory. */
int top_p_thresholds(const top_p_args *a);

#define DRAW_CHUNK 4096 /* draws of a row one thread takes at a time (a multiple of VL) */

/* The 32-bit values 2p .. 2p + 2 pairs - 1 of key's stream into out: value i is half i % 2
 * (low, then high) of SplitMix64's output (i / 2) + 1 from the state `key`, the counter-based
 * form of Steele, Lea and Flood's generator (each output a function of key and index, so
 * any run of them is computed alone). */
static inline void draw_bits(uint32_t *out, uint64_t key, int64_t p, int64_t pairs) {
    for (int64_t j = 0; j < pairs; j++) {
        uint64_t z = key + (uint64_t)(p + j + 1) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        out[2 * j] = (uint32_t)z;
        out[2 * j + 1] = (uint32_t)(z >> 32);
    }
}

/* Work item `item` of a draw kernel (each row split in chunks of DRAW_CHUNK columns, an item
 * a chunk): its row r and first column c0, its columns' 32-bit values drawn into bits (room
 * for DRAW_CHUNK + 2); returns its number of columns. */
static inline int64_t draw_chunk(uint32_t *bits, const uint64_t *keys, int64_t cols,
                                 int64_t item, int64_t *r, int64_t *c0) {
    const int64_t per_row = (cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    *r = item / per_row;
    *c0 = item % per_row * DRAW_CHUNK;
    const int64_t n = cols - *c0 < DRAW_CHUNK ? cols - *c0 : DRAW_CHUNK;
    draw_bits(bits, keys[*r], *c0 / 2, (n + 1) / 2);
    return n;
}


/* y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) . W^T (+ bias [n]), x / y / bias
 * float32, W [n, k] 16-bit (wdtype DT_BF16 or DT_F16) packed by pack_linear_weight:
 * ceil(n / 16) panels of 16 columns, each k-major (see simd_gemm.h). */
typedef struct {
    float *y;
    const float *x;
    const uint16_t *w;
    const float *bias; /* NULL: none */
    int64_t m, n, k, ldx, ldy;
    int wdtype, threads;
} linear_args;

typedef struct {
    const char *name;
    void (*rms_norm)(const rms_norm_args *);
    void (*rotary)(const rotary_args *);
    void (*gated_act)(const gated_act_args *);
    int (*attention)(const attention_args *); /* 0, or -1: out of memory */
    void (*argmax)(const argmax_args *);
    void (*exponentials)(const exponential_args *);
    int (*race)(const race_args *); /* 0, or -1: out of memory */
    /* e[i] = exp(l[i] - m) where l[i] >= floor and is finite, else 0 (top_p_thresholds) */
    void (*exp_shift)(float *e, const float *l, int64_t n, float m, float floor);
    void (*linear)(const linear_args *);
    void (*lora)(const lora_args *);
} cpu_kernels;

extern const cpu_kernels generic_kernels;
#if defined(__x86_64__)
extern const cpu_kernels avx2_kernels;
extern const cpu_kernels avx512_kernels;
extern const cpu_kernels avx512bf16_kernels;
#endif

/* Shared by every implementation (cpu_ops_generic.c). */
void cache_write(const cache_write_args *a);
void swap_blocks(const swap_blocks_args *a);

/* W [n, k] (16-bit, rows ld apart) into the panels linear_args.w expects:
 * dst holds ceil(n / 16) * 16 * k elements. */
void pack_linear_weight(uint16_t *dst, const uint16_t *src, int64_t n, int64_t k, int64_t ld);

/* The race's rows split in chunks of DRAW_CHUNK columns (one work item each): `chunks`
 * writes each item's best score and where it is (a set's own loop, its own parallel
 * region), then each row's pick (first NaN, else the first of the largest) goes to a->out.
 * 0, or -1: out of memory. */
int race_with(const race_args *a, void (*chunks)(const race_args *, float *, int64_t *));

/* The CPU's L2 cache per core in bytes (sysconf, asked once; 512 KiB where unknown). */
int64_t cpu_l2_bytes(void);

/* A scratch buffer of at least `floats` floats owned by the calling thread, kept (and grown
 * when needed) across calls: the OpenMP threads live as long as the process, and a fresh
 * allocation per call would be fresh pages, faulted in on every step. NULL: out of memory. */
float *thread_scratch(int64_t floats);

/* Work split of attention: one item per (request, kv head, tile of query tokens).
 * item_start[r] is the first item of request r (num_reqs + 1 entries, malloc'd). */
int64_t attention_tile_tokens(int64_t group);
int64_t *attention_items(const attention_args *a, int64_t tile);

/* Query tokens of request r, and its first one in the flat batch (decode: one each). */
static inline int64_t query_len(const attention_args *a, int64_t r) {
    return a->query_start_loc ? a->query_start_loc[r + 1] - a->query_start_loc[r] : 1;
}

static inline int64_t query_first(const attention_args *a, int64_t r) {
    return a->query_start_loc ? a->query_start_loc[r] : r;
}

/* The first key a query at position pos sees. */
static inline int64_t first_key(const attention_args *a, int64_t pos) {
    return a->window > 0 && pos >= a->window ? pos - a->window + 1 : 0;
}

/* The request, KV head and query tokens t0 .. t0 + nt - 1 of work item `item`; *r is a
 * request at or before the item's (items are visited in increasing order). */
static inline void locate_item(const attention_args *a, const int64_t *start, int64_t tile,
                               int64_t item, int64_t *r, int64_t *kvh, int64_t *t0,
                               int64_t *nt) {
    while (start[*r + 1] <= item) (*r)++;
    const int64_t k = item - start[*r], q_len = query_len(a, *r);
    *kvh = k % a->num_kv_heads;
    *t0 = (k / a->num_kv_heads) * tile;
    *nt = q_len - *t0 < tile ? q_len - *t0 : tile;
}

#define ATTN_MAX_ROWS 64 /* query rows (tokens x heads of a group) one item holds at most */

#endif
