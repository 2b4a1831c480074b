/* Portable C versions of the CPU kernels (any x86-64 or other CPU gcc targets).
 * The AVX-512 file implements the same arithmetic; tests hold both to the torch reference. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_ops.h"

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays a quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float load_f(const void *p, int64_t i, int dt) {
    switch (dt) {
    case DT_F32: return ((const float *)p)[i];
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case DT_FP8: return fp8_e4m3_to_f32(((const uint8_t *)p)[i]);
    case DT_I8: return (float)((const int8_t *)p)[i]; /* unscaled: the caller scales */
    default: return (float)((const _Float16 *)p)[i];
    }
}

static inline void store_f(void *p, int64_t i, float v, int dt) {
    switch (dt) {
    case DT_F32: ((float *)p)[i] = v; break;
    case DT_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    case DT_FP8: ((uint8_t *)p)[i] = fp8_e4m3_from_f32(v); break;
    default: ((_Float16 *)p)[i] = (_Float16)v; break;
    }
}

/* x rounded to the element type and back, the way torch rounds an op's output. */
static inline float round_to(float v, int dt) {
    switch (dt) {
    case DT_F32: return v;
    case DT_BF16: return bf16_to_f32(f32_to_bf16(v));
    default: return (float)(_Float16)v;
    }
}

static void g_rms_norm(const rms_norm_args *a) {
    const int dt = a->dtype;
    const int64_t n = a->cols;
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->rows * n > (1 << 16))
    for (r = 0; r < a->rows; r++) {
        const int64_t x_off = (r / a->inner) * a->x_outer + (r % a->inner) * a->x_inner;
        const int64_t o_off = r * n;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float h = load_f(a->x, x_off + j, dt);
            if (a->residual_in) {
                h = round_to(h + load_f(a->residual_in, o_off + j, dt), dt);
                store_f(a->residual_out, o_off + j, h, dt);
            }
            sum += h * h;
        }
        const float inv = 1.0f / sqrtf(sum / (float)n + a->eps);
        const void *src = a->residual_in ? a->residual_out : a->x;
        const int64_t s_off = a->residual_in ? o_off : x_off;
        for (int64_t j = 0; j < n; j++) {
            const float normed = round_to(load_f(src, s_off + j, dt) * inv, dt);
            store_f(a->out, o_off + j, load_f(a->weight, j, dt) * normed, dt);
        }
    }
}

static void g_rotary(const rotary_args *a) {
    const int dt = a->dtype;
    const int64_t half = a->head_size / 2;
    int64_t t;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->tokens * a->heads * a->head_size > (1 << 16))
    for (t = 0; t < a->tokens; t++) {
        const float *cos = a->cos_sin + a->positions[t] * a->head_size;
        const float *sin = cos + half;
        for (int64_t h = 0; h < a->heads; h++) {
            const int64_t off = t * a->tok_stride + h * a->head_stride;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = load_f(a->x, off + j, dt);
                const float x2 = load_f(a->x, off + half + j, dt);
                store_f(a->x, off + j, x1 * cos[j] - x2 * sin[j], dt);
                store_f(a->x, off + half + j, x2 * cos[j] + x1 * sin[j], dt);
            }
        }
    }
}

/* 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)): GELU(tanh) is g times a sigmoid, as SiLU is, with
 * 2u = g (GELU_C1 + GELU_C2 g^2), GELU_C1 = 2 sqrt(2 / pi), GELU_C2 = GELU_C1 * 0.044715. */
#define GELU_C1 1.5957691216057308f
#define GELU_C2 0.07135481627260025f

static void g_gated_act(const gated_act_args *a) {
    const int dt = a->dtype, gelu = a->act == ACT_GELU_TANH;
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->rows * a->inter > (1 << 16))
    for (r = 0; r < a->rows; r++) {
        for (int64_t j = 0; j < a->inter; j++) {
            const float g = load_f(a->x, r * a->x_stride + j, dt);
            const float u = load_f(a->x, r * a->x_stride + a->inter + j, dt);
            const float z = gelu ? g * (GELU_C1 + GELU_C2 * g * g) : g;
            const float s = round_to(g / (1.0f + expf(-z)), dt);
            store_f(a->out, r * a->inter + j, s * u, dt);
        }
    }
}

/* One token's head row into its cache row: a copy, or a conversion (a 16-bit or fp8
 * cache under float32 activations) element by element. */
static void cache_row(void *cache, int64_t dst, const void *src, int64_t at, int64_t d,
                      int sdt, int cdt) {
    if (sdt == cdt) {
        const int64_t es = dtype_bytes(cdt);
        memcpy((char *)cache + dst * es, (const char *)src + at * es, (size_t)(d * es));
        return;
    }
    if (sdt == DT_F32 && cdt == DT_BF16) { /* the common pair: one loop gcc vectorizes (the
                                             * element-wise switch below cost 4% of a prefill) */
        const float *from = (const float *)src + at;
        uint16_t *to = (uint16_t *)cache + dst;
        for (int64_t j = 0; j < d; j++) to[j] = f32_to_bf16(from[j]);
        return;
    }
    for (int64_t j = 0; j < d; j++) store_f(cache, dst + j, load_f(src, at + j, sdt), cdt);
}

/* One token's head row into row `offset` of an int8 cache's (block, head): the write rule
 * of pipeline/ops/kv_int8.py. `rows` is the (block, head)'s first row, `scale` its scale. */
static void cache_row_i8(int8_t *rows, float *scale, int64_t offset, const void *src,
                         int64_t at, int64_t d, int sdt) {
    float amax = 0.0f;
    for (int64_t j = 0; j < d; j++) {
        const float v = fabsf(load_f(src, at + j, sdt));
        amax = v > amax ? v : amax;
    }
    const float wanted = amax / 127.0f;
    if (offset == 0) {
        *scale = wanted;
    } else if (wanted > *scale) { /* the earlier rows re-rounded to the larger scale */
        const float ratio = *scale / wanted;
        for (int64_t j = 0; j < offset * d; j++) rows[j] = (int8_t)rintf((float)rows[j] * ratio);
        *scale = wanted;
    }
    const float s = *scale;
    int8_t *row = rows + offset * d;
    for (int64_t j = 0; j < d; j++) {
        float q = s > 0.0f ? rintf(load_f(src, at + j, sdt) / s) : 0.0f;
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        row[j] = (int8_t)q;
    }
}

/* NOTE: one thread, tokens in order: an int8 block's rows must be written in order (its
 * scale may grow and re-round the rows before), and a step writes one row per request
 * and layer, or a prompt chunk's, so the copy is a small part of the step. */
void cache_write(const cache_write_args *a) {
    const int64_t d = a->head_size;
    for (int64_t t = 0; t < a->tokens; t++) {
        const int64_t slot = a->slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / a->block_size, offset = slot % a->block_size;
        if (block >= a->num_blocks) continue; /* checked by the caller; never write outside */
        for (int64_t h = 0; h < a->kv_heads; h++) {
            const int64_t key_at = t * a->key_tok_stride + h * a->key_head_stride;
            const int64_t value_at = t * a->value_tok_stride + h * a->value_head_stride;
            if (a->cache_dtype == DT_I8) {
                const int64_t first = (block * a->kv_heads + h) * a->block_size * d;
                const int64_t sc = block * a->kv_heads + h;
                cache_row_i8((int8_t *)a->key_cache + first, a->key_scales + sc, offset, a->key,
                             key_at, d, a->src_dtype);
                cache_row_i8((int8_t *)a->value_cache + first, a->value_scales + sc, offset,
                             a->value, value_at, d, a->src_dtype);
                continue;
            }
            const int64_t dst = ((block * a->kv_heads + h) * a->block_size + offset) * d;
            cache_row(a->key_cache, dst, a->key, key_at, d, a->src_dtype, a->cache_dtype);
            cache_row(a->value_cache, dst, a->value, value_at, d, a->src_dtype, a->cache_dtype);
        }
    }
}

void swap_blocks(const swap_blocks_args *a) {
    const int64_t copies = a->num_caches * a->num_pairs;
    int64_t i;
    /* one memcpy per (cache, pair); libc's memcpy already moves a block at the copy speed of
     * the memory, so the threads only add the bandwidth of a second core's loads */
#pragma omp parallel for schedule(static) num_threads(a->threads) if (copies * a->block_bytes > (1 << 20))
    for (i = 0; i < copies; i++) {
        const int64_t c = i / a->num_pairs, p = i % a->num_pairs;
        const char *src = (const char *)(uintptr_t)a->src_caches[c];
        char *dst = (char *)(uintptr_t)a->dst_caches[c];
        memcpy(dst + a->mapping[2 * p + 1] * a->block_bytes,
               src + a->mapping[2 * p] * a->block_bytes, (size_t)a->block_bytes);
    }
}

int64_t cpu_l2_bytes(void) {
    static int64_t bytes = 0;
    if (bytes == 0) { /* a race here stores the same value twice */
        const long got = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = got >= (64 << 10) && got <= (64 << 20) ? (int64_t)got : (512 << 10);
    }
    return bytes;
}

float *thread_scratch(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, sizeof(float) * (size_t)floats)) return NULL;
        free(buffer);
        buffer = grown;
        capacity = floats;
    }
    return buffer;
}

int64_t attention_tile_tokens(int64_t group) {
    const int64_t tile = ATTN_MAX_ROWS / (group > 0 ? group : 1);
    return tile > 0 ? tile : 1;
}

int64_t *attention_items(const attention_args *a, int64_t tile) {
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(a->num_reqs + 1));
    if (!start) return NULL;
    start[0] = 0;
    for (int64_t r = 0; r < a->num_reqs; r++)
        start[r + 1] = start[r] + a->num_kv_heads * ((query_len(a, r) + tile - 1) / tile);
    return start;
}

/* One item: the rows (query tokens t0..t0+nt-1 of request r, heads of KV head kvh) attend
 * with an online softmax over the cache blocks, keys and values read in place. */
static void g_attention_item(const attention_args *a, int64_t r, int64_t kvh, int64_t t0,
                             int64_t nt, float *q, float *acc, float *scores) {
    const int dt = a->dtype, cdt = a->cache_dtype;
    const int64_t d = a->head_size, bs = a->block_size;
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t rows = nt * group;
    const int64_t q_first = query_first(a, r), q_len = query_len(a, r);
    const int64_t seq_len = a->seq_lens[r];
    const int32_t *blocks = a->block_tables + r * a->bt_stride;
    float m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS];
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        for (int64_t j = 0; j < d; j++)
            q[i * d + j] =
                load_f(a->query, tok * a->q_tok_stride + head * a->q_head_stride + j, dt) *
                a->scale;
        memset(acc + i * d, 0, sizeof(float) * (size_t)d);
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t last_pos = seq_len - q_len + t0 + nt - 1;
    /* blocks wholly before the first row's window are never read */
    for (int64_t b = first_key(a, seq_len - q_len + t0) / bs; b * bs <= last_pos; b++) {
        const int64_t base = (((int64_t)blocks[b] * a->num_kv_heads) + kvh) * bs * d;
        /* an int8 block's scales: the keys' on the dot products, the values' on the weights */
        const int64_t sc = (int64_t)blocks[b] * a->num_kv_heads + kvh;
        const float k_scale = cdt == DT_I8 ? a->key_scales[sc] : 1.0f;
        const float v_scale = cdt == DT_I8 ? a->value_scales[sc] : 1.0f;
        for (int64_t i = 0; i < rows; i++) {
            const int64_t pos = seq_len - q_len + t0 + i / group;
            int64_t n = pos - b * bs + 1, from = first_key(a, pos) - b * bs;
            if (from < 0) from = 0;
            if (n > bs) n = bs;
            if (n <= from) continue; /* none of this block's keys is in the row's window */
            float mx = m[i];
            for (int64_t t = from; t < n; t++) {
                float s = 0.0f;
                for (int64_t j = 0; j < d; j++)
                    s += q[i * d + j] * load_f(a->key_cache, base + t * d + j, cdt);
                s *= k_scale;
                scores[t] = s;
                if (s > mx) mx = s;
            }
            const float alpha = expf(m[i] - mx);
            float sum = 0.0f;
            for (int64_t t = from; t < n; t++) {
                scores[t] = expf(scores[t] - mx);
                sum += scores[t];
            }
            l[i] = l[i] * alpha + sum;
            m[i] = mx;
            float *o = acc + i * d;
            for (int64_t j = 0; j < d; j++) o[j] *= alpha;
            for (int64_t t = from; t < n; t++) {
                const float p = scores[t] * v_scale;
                for (int64_t j = 0; j < d; j++)
                    o[j] += p * load_f(a->value_cache, base + t * d + j, cdt);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const float inv = 1.0f / l[i];
        for (int64_t j = 0; j < d; j++)
            store_f(a->out, tok * a->out_tok_stride + head * a->out_head_stride + j,
                    acc[i * d + j] * inv, dt);
    }
}

static int g_attention(const attention_args *a) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t tile = attention_tile_tokens(group);
    const int64_t per_thread = 2 * ATTN_MAX_ROWS * a->head_size + a->block_size;
    const int threads = a->threads > 0 ? a->threads : 1;
    int64_t *start = attention_items(a, tile);
    if (!start) return -1;
    const int64_t total = start[a->num_reqs];
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *q = thread_scratch(per_thread);
        if (!q) {
#pragma omp atomic write
            failed = 1;
        }
        float *acc = q + ATTN_MAX_ROWS * a->head_size;
        float *scores = acc + ATTN_MAX_ROWS * a->head_size;
        int64_t r = 0, item;
#pragma omp for schedule(dynamic, 1)
        for (item = 0; item < total; item++) {
            if (!q) continue;
            int64_t kvh, t0, nt;
            locate_item(a, start, tile, item, &r, &kvh, &t0, &nt);
            g_attention_item(a, r, kvh, t0, nt, q, acc, scores);
        }
    }
    free(start);
    return failed ? -1 : 0;
}

/* The Exp(1) draw of a 32-bit value b: -ln u for u = (b + 1/2) / 2^32, in (0, 1). Computed
 * from the distance f = min(u, 1 - u) (exact in float32 to 24 significant bits), as -ln f
 * below 1/2 and -ln(1 - f) = -log1p(-f) above: the draws near 0 (u near 1) keep their
 * relative precision instead of rounding to 0, which would let any token win the race.
 * Every draw is in [1.16e-10, 22.9]. The vector layers' vexp_draw computes the same (with
 * their own logarithm). */
static inline float exp_draw_of(uint32_t b) {
    const uint32_t t = b >> 31 ? ~b : b; /* 2^32 - 1 - b above one half */
    const float f = ((float)t + 0.5f) * 0x1p-32f;
    return b >> 31 ? -log1pf(-f) : -logf(f);
}

static void g_exponentials(const exponential_args *a) {
    const int64_t per_row = (a->cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    int64_t item;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->rows * a->cols > (1 << 14))
    for (item = 0; item < a->rows * per_row; item++) {
        uint32_t bits[DRAW_CHUNK + 2] __attribute__((aligned(64)));
        int64_t r, c0;
        const int64_t n = draw_chunk(bits, a->keys, a->cols, item, &r, &c0);
        float *out = a->out + r * a->row_stride + c0;
        for (int64_t i = 0; i < n; i++) out[i] = exp_draw_of(bits[i]);
    }
}

int race_with(const race_args *a, void (*chunks)(const race_args *, float *, int64_t *)) {
    const int64_t per_row = (a->cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    float *best = malloc(sizeof(float) * (size_t)(a->rows * per_row));
    int64_t *best_at = malloc(sizeof(int64_t) * (size_t)(a->rows * per_row));
    if (best && best_at) {
        chunks(a, best, best_at);
        for (int64_t r = 0; r < a->rows; r++) {
            int64_t pick = r * per_row;
            for (int64_t i = r * per_row; i < (r + 1) * per_row; i++) {
                if (isnan(best[i])) {
                    pick = i;
                    break;
                }
                if (best[i] > best[pick]) pick = i;
            }
            a->out[r] = best_at[pick];
        }
    }
    const int failed = !best || !best_at;
    free(best);
    free(best_at);
    return failed ? -1 : 0;
}

static void g_race_chunks(const race_args *a, float *best, int64_t *best_at) {
    const int64_t per_row = (a->cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    int64_t item;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->rows * a->cols > (1 << 14))
    for (item = 0; item < a->rows * per_row; item++) {
        uint32_t bits[DRAW_CHUNK + 2] __attribute__((aligned(64)));
        int64_t r, c0;
        const int64_t n = draw_chunk(bits, a->keys, a->cols, item, &r, &c0);
        const float *l = a->logits + r * a->row_stride + c0;
        float top = -INFINITY;
        int64_t at = 0;
        for (int64_t i = 0; i < n; i++) {
            const float x = l[i] * a->inv_temp[r];
            const float v = a->min_score && !(x >= a->min_score[r])
                                ? -INFINITY
                                : x - logf(exp_draw_of(bits[i]));
            if (isnan(v)) {
                top = v;
                at = i;
                break;
            }
            if (v > top || i == 0) {
                top = v;
                at = i;
            }
        }
        best[item] = top;
        best_at[item] = c0 + at;
    }
}

static int g_race(const race_args *a) { return race_with(a, g_race_chunks); }

/* A float's bits as an unsigned key in the floats' order (NaN aside). */
static inline uint32_t order_key(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

#define TOP_P_HI 4096 /* level-1 buckets: the key's top 12 bits */
#define TOP_P_MID 1024 /* level 2: the next 10 */

typedef struct {
    float l;
    double e;
} logit_mass;

static int by_logit_desc(const void *x, const void *y) {
    const float a = ((const logit_mass *)x)->l, b = ((const logit_mass *)y)->l;
    return (a < b) - (a > b);
}

/* Row r's threshold (top_p_args). Levels: the mass per bucket of the key's top 12 bits,
 * from the top down to the bucket where the mass reaches the target; that bucket's tokens
 * (`members`, room for a row) by the next 10 bits the same way; then the tokens of that
 * bucket sorted and walked. e: room for a row's exp(l - max), by the set's `exp_shift`. */
static void top_p_row(const top_p_args *a, int64_t r, double *hist, float *e,
                      logit_mass *members) {
    const float *l = a->logits + r * a->row_stride;
    const float floor = a->floor ? a->floor[r] : -INFINITY, p = a->top_p[r];
    if (!(p < 1.0f)) {
        a->out[r] = floor;
        return;
    }
    float m = -INFINITY;
    for (int64_t i = 0; i < a->cols; i++)
        if (l[i] >= floor && l[i] > m) m = l[i];
    a->exp_shift(e, l, a->cols, m, floor);
    double total = 0.0;
    double *hi = hist, *mid = hist + TOP_P_HI;
    memset(hi, 0, sizeof(double) * TOP_P_HI);
    for (int64_t i = 0; i < a->cols; i++)
        if (e[i] > 0.0f) {
            total += e[i];
            hi[order_key(l[i]) >> 20] += e[i];
        }
    const double target = (double)p * total;
    double before = 0.0;
    int64_t b1 = TOP_P_HI - 1;
    for (; b1 > 0 && before + hi[b1] < target; b1--) before += hi[b1];
    int64_t n = 0;
    for (int64_t i = 0; i < a->cols; i++)
        if (e[i] > 0.0f && order_key(l[i]) >> 20 == (uint32_t)b1)
            members[n++] = (logit_mass){l[i], e[i]};
    memset(mid, 0, sizeof(double) * TOP_P_MID);
    for (int64_t j = 0; j < n; j++) mid[order_key(members[j].l) >> 10 & (TOP_P_MID - 1)] += members[j].e;
    int64_t b2 = TOP_P_MID - 1;
    for (; b2 > 0 && before + mid[b2] < target; b2--) before += mid[b2];
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++)
        if ((order_key(members[j].l) >> 10 & (TOP_P_MID - 1)) == (uint32_t)b2)
            members[kept++] = members[j];
    qsort(members, (size_t)kept, sizeof(logit_mass), by_logit_desc);
    float last = m; /* the largest token always stays */
    for (int64_t j = 0; j < kept && before < target; j++) {
        last = members[j].l;
        before += members[j].e;
    }
    a->out[r] = last;
}

int top_p_thresholds(const top_p_args *a) {
    int failed = 0;
#pragma omp parallel num_threads(a->threads) if (a->rows > 1)
    {
        const size_t cols = (size_t)(a->cols > 0 ? a->cols : 1);
        double *hist = malloc(sizeof(double) * (TOP_P_HI + TOP_P_MID));
        float *e = malloc(sizeof(float) * (cols + 16)); /* + a vector: whole-vector stores */
        logit_mass *members = malloc(sizeof(logit_mass) * cols);
        int64_t r;
#pragma omp for schedule(dynamic, 1)
        for (r = 0; r < a->rows; r++) {
            if (hist && e && members)
                top_p_row(a, r, hist, e, members);
            else {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(hist);
        free(e);
        free(members);
    }
    return failed ? -1 : 0;
}

/* e[i] = exp(l[i] - m) where l[i] >= floor (and is finite), else 0: the scalar set's. */
static void g_exp_shift(float *e, const float *l, int64_t n, float m, float floor) {
    for (int64_t i = 0; i < n; i++) e[i] = l[i] >= floor ? expf(l[i] - m) : 0.0f;
}

static void g_argmax(const argmax_args *a) {
    int64_t r;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->rows * a->cols > (1 << 16))
    for (r = 0; r < a->rows; r++) {
        const float *x = a->x + r * a->row_stride;
        int64_t best = 0;
        for (int64_t j = 0; j < a->cols; j++) {
            if (isnan(x[j])) {
                best = j;
                break;
            }
            if (x[j] > x[best]) best = j;
        }
        a->out[r] = best;
    }
}

void pack_linear_weight(uint16_t *dst, const uint16_t *src, int64_t n, int64_t k, int64_t ld) {
    const int64_t panels = (n + 15) / 16;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t c = 0; c < 16; c++) {
                const int64_t col = p * 16 + c;
                dst[(p * k + kk) * 16 + c] = col < n ? src[col * ld + kk] : 0;
            }
}

/* The products summed as the SIMD files sum them (blocks of 128 k, block sums added in
 * order), but each step is a multiply and an add, where they fuse it into one FMA. */
static void g_linear(const linear_args *a) {
    int64_t col;
#pragma omp parallel for schedule(static) num_threads(a->threads) if (a->n * a->k > (1 << 16))
    for (col = 0; col < a->n; col++) {
        const uint16_t *w = a->w + (col / 16) * a->k * 16 + col % 16;
        for (int64_t r = 0; r < a->m; r++) {
            const float *x = a->x + r * a->ldx;
            float total = a->bias ? a->bias[col] : 0.0f;
            for (int64_t k0 = 0; k0 < a->k; k0 += 128) {
                const int64_t k1 = k0 + 128 < a->k ? k0 + 128 : a->k;
                float sum = 0.0f;
                for (int64_t kk = k0; kk < k1; kk++) {
                    const uint16_t h = w[kk * 16];
                    float wf;
                    if (a->wdtype == DT_BF16) {
                        wf = bf16_to_f32(h);
                    } else {
                        _Float16 f;
                        memcpy(&f, &h, 2);
                        wf = (float)f;
                    }
                    sum += x[kk] * wf;
                }
                total += sum;
            }
            a->y[r * a->ldy + col] = total;
        }
    }
}

void lora_order(lora_args *a, int64_t *ints) {
    int64_t *order = ints, *runs = ints + a->m, count = 0, num_runs = 0;
    /* a stable grouping by slot, the slots in order of first appearance (m is a decode
     * step's: a few dozen tokens) */
    for (int64_t t = 0; t < a->m; t++) {
        const int s = a->slots[t];
        if (s < 0) continue;
        int64_t seen = 0;
        for (int64_t u = 0; u < t && !seen; u++) seen = a->slots[u] == s;
        if (seen) continue;
        runs[2 * num_runs] = count;
        for (int64_t u = t; u < a->m; u++)
            if (a->slots[u] == s) order[count++] = u;
        runs[2 * num_runs + 1] = count;
        num_runs++;
    }
    a->order = order, a->runs = runs, a->num_runs = num_runs;
}

static void g_lora(const lora_args *a) {
    const int dt = a->dtype;
    const int64_t w = a->w, n = a->n, k = a->k, rk = a->r;
    int64_t item;
    const int parallel = a->m * w * (k + n) > (1 << 15);
#pragma omp parallel num_threads(a->threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (item = 0; item < a->m * w; item++) {
            const int64_t t = item / w, r = item % w;
            const int s = a->slots[t];
            if (s < 0) continue;
            const int64_t x_off = t * a->x_stride, a_off = ((int64_t)s * w + r) * k;
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc += load_f(a->x, x_off + i, dt) * load_f(a->a, a_off + i, dt);
            a->shrunk[item] = acc;
        }
#pragma omp for schedule(static)
        for (item = 0; item < a->m * n; item++) {
            const int64_t t = item / n, j = item % n;
            const int s = a->slots[t];
            if (s < 0) continue;
            int64_t p = 0;
            while (p + 1 < a->num_parts && j >= a->part_end[p]) p++;
            const float *u = a->shrunk + t * w + p * rk;
            float delta = 0.0f;
            for (int64_t r = 0; r < rk; r++)
                delta += load_f(a->b, ((int64_t)s * rk + r) * n + j, dt) * u[r];
            const int64_t y_off = t * a->y_stride + j;
            store_f(a->y, y_off, load_f(a->y, y_off, dt) + delta, dt);
        }
    }
}

const cpu_kernels generic_kernels = {
    .name = "generic",
    .rms_norm = g_rms_norm,
    .rotary = g_rotary,
    .gated_act = g_gated_act,
    .attention = g_attention,
    .argmax = g_argmax,
    .exponentials = g_exponentials,
    .race = g_race,
    .exp_shift = g_exp_shift,
    .linear = g_linear,
    .lora = g_lora,
};
