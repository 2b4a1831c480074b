/* The SIMD CPU kernels, written once over a vector layer of VL float32 lanes
 * (simd_avx2.h: 8, simd_avx512.h: 16) and compiled once per instruction set:
 *
 *     cpu_ops_avx2.c        #pragma GCC target(avx2,fma,f16c)    + simd_avx2.h   -> avx2_kernels
 *     cpu_ops_avx512.c      #pragma GCC target(avx512f,bw,vl,dq) + simd_avx512.h -> avx512_kernels
 *     cpu_ops_avx512bf16.c  the same + avx512bf16, BF16_DOT      + simd_avx512.h -> avx512bf16_kernels
 *
 * Each file defines KERNELS, KERNELS_NAME and BF16_DOT, includes its layer, then this file.
 * The arithmetic is the generic file's (float32 throughout, one rounding to the output
 * type per op, as torch rounds each op's output); only the lane count differs.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ops.h"

/* ---- RMSNorm (+ residual add) ------------------------------------------------------- */

INLINE void rms_row(const rms_norm_args *a, int64_t r, int dt) {
    const int64_t n = a->cols;
    const int64_t x_off = (r / a->inner) * a->x_outer + (r % a->inner) * a->x_inner;
    const int64_t o_off = r * n;
    vf sq = vzero();
    for (int64_t j = 0; j < n; j += VL) {
        const vmask m = lanes(n - j);
        vf h = vload(a->x, x_off + j, dt, m);
        if (a->residual_in) {
            h = vround(vadd(h, vload(a->residual_in, o_off + j, dt, m)), dt);
            vstore(a->residual_out, o_off + j, h, dt, m);
        }
        sq = vfmadd(h, h, sq);
    }
    const float inv = 1.0f / sqrtf(vreduce_add(sq) / (float)n + a->eps);
    const vf vinv = vset1(inv);
    const void *src = a->residual_in ? a->residual_out : a->x;
    const int64_t s_off = a->residual_in ? o_off : x_off;
    for (int64_t j = 0; j < n; j += VL) {
        const vmask m = lanes(n - j);
        const vf normed = vround(vmul(vload(src, s_off + j, dt, m), vinv), dt);
        vstore(a->out, o_off + j, vmul(vload(a->weight, j, dt, m), normed), dt, m);
    }
}

/* The kernels' loops use orphaned `omp for`, inside a parallel region opened by a wrapper
 * per element type: the region's outlined body then calls the loop with a constant type,
 * so every load and store is specialized (a type passed into the region would be a
 * variable there, branched on at every vector). */
#define PER_DTYPE(NAME, ARGS, WORKER, PARALLEL_IF)                                         \
    static void NAME##_f32(const ARGS *a) {                                                \
        const int parallel = (PARALLEL_IF);                                                 \
        _Pragma("omp parallel num_threads(a->threads) if (parallel)") WORKER(a, DT_F32);    \
    }                                                                                       \
    static void NAME##_bf16(const ARGS *a) {                                               \
        const int parallel = (PARALLEL_IF);                                                 \
        _Pragma("omp parallel num_threads(a->threads) if (parallel)") WORKER(a, DT_BF16);    \
    }                                                                                       \
    static void NAME##_f16(const ARGS *a) {                                                \
        const int parallel = (PARALLEL_IF);                                                 \
        _Pragma("omp parallel num_threads(a->threads) if (parallel)") WORKER(a, DT_F16);    \
    }                                                                                       \
    static void NAME(const ARGS *a) {                                                      \
        switch (a->dtype) {                                                                 \
        case DT_F32: NAME##_f32(a); break;                                                  \
        case DT_BF16: NAME##_bf16(a); break;                                                \
        default: NAME##_f16(a); break;                                                      \
        }                                                                                   \
    }

INLINE void rms_worker(const rms_norm_args *a, int dt) {
    int64_t r;
#pragma omp for schedule(static)
    for (r = 0; r < a->rows; r++) rms_row(a, r, dt);
}

PER_DTYPE(v_rms_norm, rms_norm_args, rms_worker, a->rows * a->cols > (1 << 14))

/* ---- rotary ------------------------------------------------------------------------- */

INLINE void rotary_worker(const rotary_args *a, int dt) {
    const int64_t half = a->head_size / 2;
    int64_t t;
#pragma omp for schedule(static)
    for (t = 0; t < a->tokens; t++) {
        const float *cos = a->cos_sin + a->positions[t] * a->head_size;
        const float *sin = cos + half;
        for (int64_t h = 0; h < a->heads; h++) {
            const int64_t off = t * a->tok_stride + h * a->head_stride;
            for (int64_t j = 0; j < half; j += VL) {
                const vmask m = lanes(half - j);
                const vf c = vloadu_part(cos + j, m);
                const vf s = vloadu_part(sin + j, m);
                const vf x1 = vload(a->x, off + j, dt, m);
                const vf x2 = vload(a->x, off + half + j, dt, m);
                vstore(a->x, off + j, vsub(vmul(x1, c), vmul(x2, s)), dt, m);
                vstore(a->x, off + half + j, vadd(vmul(x2, c), vmul(x1, s)), dt, m);
            }
        }
    }
}

PER_DTYPE(v_rotary, rotary_args, rotary_worker, a->tokens * a->heads * a->head_size > (1 << 14))

/* ---- act(gate) * up: SiLU or GELU(tanh), a sigmoid each (see cpu_ops_generic.c) ------- */

#define GELU_C1 1.5957691216057308f
#define GELU_C2 0.07135481627260025f

INLINE void gated_act_worker(const gated_act_args *a, int dt) {
    const int gelu = a->act == ACT_GELU_TANH;
    const vf c1 = vset1(GELU_C1), c2 = vset1(GELU_C2);
    int64_t r;
#pragma omp for schedule(static)
    for (r = 0; r < a->rows; r++) {
        const int64_t x_off = r * a->x_stride, o_off = r * a->inter;
        for (int64_t j = 0; j < a->inter; j += VL) {
            const vmask m = lanes(a->inter - j);
            const vf g = vload(a->x, x_off + j, dt, m);
            const vf u = vload(a->x, x_off + a->inter + j, dt, m);
            const vf z = gelu ? vmul(g, vfmadd(vmul(g, g), c2, c1)) : g;
            const vf e = vexp(vsub(vzero(), z));
            const vf s = vround(vdiv(g, vadd(vset1(1.0f), e)), dt);
            vstore(a->out, o_off + j, vmul(s, u), dt, m);
        }
    }
}

PER_DTYPE(v_gated_act, gated_act_args, gated_act_worker, a->rows * a->inter > (1 << 16))

/* ---- paged attention ---------------------------------------------------------------- */

typedef struct {
    float *q, *acc, *kf, *vf, *scores;
    int64_t *key_at; /* cache offset of each key row of the chunk (bfloat16 dot path) */
    float *k_scale, *v_scale; /* each key row's block scales (an int8 cache), + a vector */
    int64_t scores_stride;    /* floats from one row's scores to the next's (a token's rows) */
} attn_scratch;

#if BF16_DOT
/* q . k of one bfloat16 row pair, d elements, as 16 partial float32 sums (VDPBF16PS: the
 * products are exact in float32, summed in float32). */
INLINE __m512 dot_bf16(const uint16_t *q, const uint16_t *k, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    if (d == 64) /* the common head size, unrolled */
        return _mm512_dpbf16_ps(
            _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k)),
            (__m512bh)_mm512_loadu_si512(q + 32), (__m512bh)_mm512_loadu_si512(k + 32));
    for (int64_t j = 0; j < d; j += 32) {
        const __mmask32 m = d - j >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (d - j)) - 1u);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, q + j),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, k + j));
    }
    return acc;
}

/* scores_i8_16's shape for a bfloat16 cache: q . k of nr bfloat16 query rows (q_stride
 * elements apart) against 16 key rows (keys from nk on read key 0 again), out[r] lane u =
 * q_r . k_u, each key loaded once for the rows and the 16 dots folded in registers by
 * vsum_lanes' tree in its order (the same sums, bit for bit, as one row at a time). */
#define BF16_SCORES_ROWS 2 /* 3 rows at once ran 2x slower (Zen 5, one thread: 4.8 ms a layer against 2.4) */
INLINE void scores_bf16_16(const uint16_t *q, int64_t q_stride, const uint16_t *cache,
                           const int64_t *key_at, int64_t nk, int64_t d, __m512 *out,
                           const int nr) {
#define BF16_PAIR_DOTS(k0, k1, a, b)                                                       \
    do {                                                                                   \
        for (int r = 0; r < nr; r++) {                                                     \
            a[r] = dot_bf16(q + r * q_stride, k0, d);                                      \
            b[r] = dot_bf16(q + r * q_stride, k1, d);                                      \
        }                                                                                  \
    } while (0)
    FOLD_16_KEYS(__m512, BF16_SCORES_ROWS, nr, cache, key_at, nk, out, BF16_PAIR_DOTS,
                 fold_pairs_32_ps, fold_pairs_64_ps, fold_lanes_ps);
#undef BF16_PAIR_DOTS
}

/* scores_bf16_16 for nr (1 or 2: BF16_SCORES_ROWS) rows, the count and head size 64 as
 * constants. */
INLINE void scores_bf16_rows(const uint16_t *q, int64_t q_stride, const uint16_t *cache,
                             const int64_t *key_at, int64_t nk, int64_t d, __m512 *out,
                             int64_t nr) {
#define SCORES_BF16(rows)                                                          \
    (d == 64 ? scores_bf16_16(q, q_stride, cache, key_at, nk, 64, out, rows)      \
             : scores_bf16_16(q, q_stride, cache, key_at, nk, d, out, rows))
    if (nr == 2)
        SCORES_BF16(2);
    else
        SCORES_BF16(1);
#undef SCORES_BF16
}
#endif

/* A cache row's elements as the attention kernel reads them: fp8 ones as value / 256 (one
 * product less per vector), the 256 put back in the query's scale and the output. */
INLINE vf vload_kv(const void *p, int64_t i, int cdt, vmask m) {
    return cdt == DT_FP8 ? vload_fp8_over_256(p, i, m) : vload(p, i, cdt, m);
}
#define KV_READ_UNIT(cdt) ((cdt) == DT_FP8 ? 256.0f : 1.0f)

/* A query row (float32, d values) as int8 values q and the scale they are read at:
 * max|x| / 127, q = rint(x / scale) (0 for a zero row). */
static inline float quantize_row_i8(const float *x, int64_t d, int8_t *q) {
    float amax = 0.0f;
    for (int64_t j = 0; j < d; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float scale = amax / 127.0f;
    for (int64_t j = 0; j < d; j++) q[j] = scale > 0.0f ? (int8_t)rintf(x[j] / scale) : 0;
    return scale;
}

/* Blocks per chunk of keys: scores, softmax update and value sums run per chunk of about
 * 64 keys, so the fixed cost of an online-softmax step is paid once per 64 keys. */
static inline int64_t attention_chunk_blocks(int64_t block_size) {
    return block_size >= 64 ? 1 : 64 / block_size;
}

/* head_size rounded up to whole vectors: the float32 rows of the scratch buffers. */
static inline int64_t padded_head(int64_t head_size) { return (head_size + VL - 1) & ~(int64_t)(VL - 1); }

/* Keys first .. first + count - 1 of one request's KV head. Blocks lie anywhere in memory,
 * so the hardware prefetcher cannot guess the next one: a thread asks for each row itself,
 * ATTN_AHEAD rows before it reads it, one with each row it reads, so the requests never
 * pile up in the core's few miss buffers; past its item's last row it goes on into its
 * next item's first rows. A fixed distance, not the whole next item: at thousands of keys
 * an item's rows (0.5-2 MB) do not fit an L2 of 512 KB, so rows asked for that early
 * could be gone again before they are read. */
#define ATTN_AHEAD 128
typedef struct {
    const int32_t *blocks;
    int64_t kvh, first, count;
} kv_span;

/* Block and offset of key t: shifts for a power-of-two block size (shift >= 0), else a
 * division (a hardware division per key row would cost as much as the row's arithmetic). */
INLINE int64_t block_of(int64_t t, int64_t bs, int shift) { return shift >= 0 ? t >> shift : t / bs; }
INLINE int64_t offset_in(int64_t t, int64_t bs, int shift) {
    return shift >= 0 ? t & (bs - 1) : t % bs;
}

INLINE int block_shift(int64_t bs) {
    return bs > 0 && (bs & (bs - 1)) == 0 ? __builtin_ctzll((unsigned long long)bs) : -1;
}

/* The rows a thread asks for ahead of its reads, one after another: the next row is the
 * one after, until its block ends, so the block table is read and an address computed
 * once per block, not per row (a fifth of an int8 cache's kernel, Zen 5). */
typedef struct {
    const kv_span *sp;
    int64_t t;          /* the next row of sp to ask for */
    const char *k, *v;  /* its key and value rows, once looked up */
    int64_t block_left; /* rows of their block from there on; 0: look the next one up */
} row_cursor;

/* Rows asked for into L2 (T1), or into L1 (T0) where the ATTN_AHEAD rows in flight fit it
 * there: an 8-bit cache's (fp8, int8), 16 KB of keys and values at head size 64. Measured
 * (Zen 5, one layer's attention, 16 x 4,096 keys, 9 / 3 heads, alternated, 3 rounds): int8
 * 1.53-1.84 -> 1.40-1.43 ms, fp8 1.63-1.80 -> 1.41-1.49 (docs/performance.md); a bfloat16
 * cache's 32 KB into L1 moved within the noise, a float32 cache's 64 KB would not fit. */
INLINE void fetch_next_row(const attention_args *a, row_cursor *c, int64_t es, int shift) {
    const int64_t row = a->head_size * es;
    if (c->block_left == 0) {
        const int64_t bs = a->block_size, key = c->sp->first + c->t;
        const int64_t in = offset_in(key, bs, shift);
        const int64_t off =
            (((int64_t)c->sp->blocks[block_of(key, bs, shift)] * a->num_kv_heads + c->sp->kvh) * bs + in) * row;
        c->k = (const char *)a->key_cache + off;
        c->v = (const char *)a->value_cache + off;
        c->block_left = bs - in;
    }
    for (int64_t i = 0; i < row; i += 64) {
        if (es == 1) {
            _mm_prefetch(c->k + i, _MM_HINT_T0);
            _mm_prefetch(c->v + i, _MM_HINT_T0);
        } else {
            _mm_prefetch(c->k + i, _MM_HINT_T1);
            _mm_prefetch(c->v + i, _MM_HINT_T1);
        }
    }
    c->k += row;
    c->v += row;
    c->block_left--;
    c->t++;
}

/* Row t of sp alone (a cursor of one row). */
INLINE void prefetch_row(const attention_args *a, const kv_span *sp, int64_t t, int64_t es,
                         int shift) {
    row_cursor one = {sp, t, NULL, NULL, 0};
    fetch_next_row(a, &one, es, shift);
}

/* The last key position work item (r, t0, nt) reads. */
INLINE int64_t item_last_pos(const attention_args *a, int64_t r, int64_t t0, int64_t nt) {
    return a->seq_lens[r] - query_len(a, r) + t0 + nt - 1;
}

/* One row's weighted sum of a chunk's n value rows: o = o * alpha + sum_t p[t] * v[t].
 * 4 * VL columns at a time in 8 independent accumulators (even keys, odd keys): one chain
 * of dependent FMAs would wait out the FMA latency at every key. */
INLINE void accumulate_values(float *o, const float *p, const float *vrows, int64_t n,
                              int64_t dp, float alpha) {
    const vf va = vset1(alpha);
    int64_t j = 0;
    for (; j + 4 * VL <= dp; j += 4 * VL) {
        vf a0 = vmul(vloadu(o + j), va);
        vf a1 = vmul(vloadu(o + j + VL), va);
        vf a2 = vmul(vloadu(o + j + 2 * VL), va);
        vf a3 = vmul(vloadu(o + j + 3 * VL), va);
        vf b0 = vzero(), b1 = b0, b2 = b0, b3 = b0;
        int64_t t = 0;
        for (; t + 2 <= n; t += 2) {
            const vf pt = vset1(p[t]), pu = vset1(p[t + 1]);
            const float *v = vrows + t * dp + j, *w = v + dp;
            a0 = vfmadd(pt, vloadu(v), a0);
            a1 = vfmadd(pt, vloadu(v + VL), a1);
            a2 = vfmadd(pt, vloadu(v + 2 * VL), a2);
            a3 = vfmadd(pt, vloadu(v + 3 * VL), a3);
            b0 = vfmadd(pu, vloadu(w), b0);
            b1 = vfmadd(pu, vloadu(w + VL), b1);
            b2 = vfmadd(pu, vloadu(w + 2 * VL), b2);
            b3 = vfmadd(pu, vloadu(w + 3 * VL), b3);
        }
        if (t < n) {
            const vf pt = vset1(p[t]);
            const float *v = vrows + t * dp + j;
            a0 = vfmadd(pt, vloadu(v), a0);
            a1 = vfmadd(pt, vloadu(v + VL), a1);
            a2 = vfmadd(pt, vloadu(v + 2 * VL), a2);
            a3 = vfmadd(pt, vloadu(v + 3 * VL), a3);
        }
        vstoreu(o + j, vadd(a0, b0));
        vstoreu(o + j + VL, vadd(a1, b1));
        vstoreu(o + j + 2 * VL, vadd(a2, b2));
        vstoreu(o + j + 3 * VL, vadd(a3, b3));
    }
    for (; j < dp; j += VL) {
        vf acc = vmul(vloadu(o + j), va);
        for (int64_t t = 0; t < n; t++) acc = vfmadd(vset1(p[t]), vloadu(vrows + t * dp + j), acc);
        vstoreu(o + j, acc);
    }
}

#define ACC_ROWS 3 /* AVX2: 12 accumulators + 4 values in 16 registers (one spill; 2 rows measured slower) */
/* ACC_ROWS rows of one token (query heads that see the same keys) take their weighted
 * sums of a chunk's n value rows together, 4 vectors of columns at a time from column j:
 * o_r = o_r * alpha_r + sum_t p_r[t] v[t]. Each value vector is loaded once for all the
 * rows (once per row before: at 3 query heads per KV head a third of the loads). `nr` is a
 * constant where it is called, so the accumulators stay in registers. */
INLINE void accumulate_rows_block(float *o, int64_t dp, const float *p, int64_t p_stride,
                                  const float *alpha, const float *vrows, int64_t n, int64_t j,
                                  const int nr) {
    vf a[ACC_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) a[r][c] = vmul(vloadu(o + r * dp + j + c * VL), vset1(alpha[r]));
    for (int64_t t = 0; t < n; t++) {
        const float *v = vrows + t * dp + j;
        const vf v0 = vloadu(v), v1 = vloadu(v + VL), v2 = vloadu(v + 2 * VL), v3 = vloadu(v + 3 * VL);
        for (int r = 0; r < nr; r++) {
            const vf pr = vset1(p[r * p_stride + t]);
            a[r][0] = vfmadd(pr, v0, a[r][0]);
            a[r][1] = vfmadd(pr, v1, a[r][1]);
            a[r][2] = vfmadd(pr, v2, a[r][2]);
            a[r][3] = vfmadd(pr, v3, a[r][3]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) vstoreu(o + r * dp + j + c * VL, a[r][c]);
}

/* The weighted value sums of nr rows of one token (accumulate_values' sums, several rows
 * per pass): rows r of o, p (p_stride apart) and alpha. */
INLINE void accumulate_rows(float *o, int64_t dp, const float *p, int64_t p_stride,
                            const float *alpha, int64_t nr, const float *vrows, int64_t n) {
    for (int64_t r0 = 0; r0 < nr; r0 += ACC_ROWS) {
        const int64_t rb = nr - r0 < ACC_ROWS ? nr - r0 : ACC_ROWS;
        float *orow = o + r0 * dp;
        const float *prow = p + r0 * p_stride;
        int64_t j = 0;
        for (; j + 4 * VL <= dp; j += 4 * VL) {
            if (rb == ACC_ROWS)
                accumulate_rows_block(orow, dp, prow, p_stride, alpha + r0, vrows, n, j, ACC_ROWS);
            else if (rb == 2)
                accumulate_rows_block(orow, dp, prow, p_stride, alpha + r0, vrows, n, j, 2);
            else
                accumulate_rows_block(orow, dp, prow, p_stride, alpha + r0, vrows, n, j, 1);
        }
        for (int64_t r = 0; r < rb; r++) /* the last columns, under 4 vectors: row by row */
            for (int64_t jj = j; jj < dp; jj += VL) {
                vf acc = vmul(vloadu(orow + r * dp + jj), vset1(alpha[r0 + r]));
                for (int64_t t = 0; t < n; t++)
                    acc = vfmadd(vset1(prow[r * p_stride + t]), vloadu(vrows + t * dp + jj), acc);
                vstoreu(orow + r * dp + jj, acc);
            }
    }
}

/* Rows = query tokens t0..t0+nt-1 of request r x the `group` query heads of KV head kvh.
 * Keys come in chunks of about 64 (whole cache blocks): each chunk's values (and keys,
 * unless q.k runs as bfloat16 dot products straight from the cache) are converted to
 * float32 once ([token][dp], dp = head_size rounded up to whole vectors, zero padded) and
 * used by every row; the softmax is online (running max m and sum l per row), so any
 * context length needs only one chunk of scores. */
INLINE void attention_item(const attention_args *a, int64_t r, int64_t kvh, int64_t t0,
                           int64_t nt, const attn_scratch *s, const kv_span *next_item, int dt,
                           int cdt) {
    const int64_t d = a->head_size, bs = a->block_size, dp = padded_head(d);
    const int64_t group = a->num_heads / a->num_kv_heads, rows = nt * group;
    const int64_t cb = attention_chunk_blocks(bs), chunk = cb * bs; /* keys per chunk */
    const int64_t q_first = query_first(a, r), q_len = query_len(a, r);
    const int64_t first_pos = a->seq_lens[r] - q_len + t0;
    const int32_t *blocks = a->block_tables + r * a->bt_stride;
    /* fp8 keys read as value / 256 (vload_kv): the query carries the 256 */
    const vf scale = vset1(a->scale * KV_READ_UNIT(cdt));
    const int bf16_dot = BF16_DOT && dt == DT_BF16 && cdt == DT_BF16;
    /* int8 keys: q . k as integer dot products straight from the cache, each query row
     * quantized to int8 with a scale of its own (llama.cpp's 8-bit K cache does the same):
     * no float32 copy of the keys, and a third of the instructions per key. The rows live
     * where that copy would (kf), as int8 [rows][dp]. A row's VL partial sums add up in
     * float32 exactly while every partial total stays under 2^24: d x 255 x 127 with
     * dot_i8's offset (k + 128 against q), d x 127 x 127 without; larger heads take the
     * float32 keys. */
    const int i8_dot = cdt == DT_I8 && d % I8_DOT_STEP == 0 &&
                       d * (I8_DOT_OFFSET ? 255 : 127) * 127 < (1 << 24);
    int8_t *q_i8 = (int8_t *)s->kf;
#if I8_VALUE_DOT
    /* int8 values: weighted sums as int16 products (simd_avx512.h); the token pairs live
     * where the float32 values would (vf), the rows' weights after the int8 query rows */
    const int i8_values = i8_dot && d % I8_VALUE_COLS == 0 &&
                          ATTN_MAX_ROWS * dp + group * chunk * 2 <= chunk * dp * 4;
    int16_t *pairs = (int16_t *)s->vf, *w16 = (int16_t *)(q_i8 + ATTN_MAX_ROWS * dp);
#else
    const int i8_values = 0;
    (void)i8_values;
#endif
    float q_scale[ATTN_MAX_ROWS], q_off[ATTN_MAX_ROWS]; /* q_off: dot_i8's offset of a row */
    float m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS];
    int64_t pos[ATTN_MAX_ROWS]; /* each row's position: it sees keys first_key(pos)..pos */
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const int64_t off = tok * a->q_tok_stride + head * a->q_head_stride;
        pos[i] = first_pos + i / group;
        if (bf16_dot) /* q stays bfloat16 (the scale multiplies the dot products) */
            memcpy((uint16_t *)s->q + i * 2 * dp, (const uint16_t *)a->query + off,
                   (size_t)d * 2);
        for (int64_t j = 0; j < dp; j += VL) {
            const vf v = vload(a->query, off + j, dt, lanes(d - j));
            if (!bf16_dot) vstoreu(s->q + i * dp + j, vmul(v, scale));
            vstoreu(s->acc + i * dp + j, vzero());
        }
        if (i8_dot) {
            q_scale[i] = quantize_row_i8(s->q + i * dp, d, q_i8 + i * dp);
            int32_t sum = 0;
            for (int64_t j = 0; j < d; j++) sum += q_i8[i * dp + j];
            q_off[i] = (float)(I8_DOT_OFFSET * sum);
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t es = dtype_bytes(cdt);
    const int shift = block_shift(bs);
    /* chunks wholly before the first row's window are never read: keys k0 .. last_pos */
    const int64_t b_first = first_key(a, first_pos) / bs / cb * cb, k0 = b_first * bs;
    const int64_t last_pos = first_pos + nt - 1, keys = last_pos + 1 - k0;
    /* rows are asked for ATTN_AHEAD ahead of the one read, through this item's rows and on
     * into the next item's first ones (which the next item then finds on its way); this
     * item's first ATTN_AHEAD were asked for the same way by the item before */
    const kv_span self = {blocks, kvh, k0, keys};
    const int64_t stream = keys + (next_item->count < ATTN_AHEAD ? next_item->count : ATTN_AHEAD);
    int64_t fetched = keys < ATTN_AHEAD ? keys : ATTN_AHEAD;
    row_cursor own = {&self, fetched, NULL, NULL, 0}, next = {next_item, 0, NULL, NULL, 0};
    for (int64_t b0 = b_first; b0 * bs <= last_pos; b0 += cb) {
        /* one chunk: blocks b0 .. b0 + cb - 1, keys b0 * bs .. (capped at last_pos) */
        const int64_t c0 = b0 * bs;
        const int64_t n_chunk = last_pos - c0 + 1 < chunk ? last_pos - c0 + 1 : chunk;
#if I8_VALUE_DOT
        if (i8_values) { /* keys stay in the cache; values go in pairs of tokens */
            for (int64_t t = 0; t < n_chunk; t += bs) { /* each row's offset and scales */
                const int64_t n_rows = n_chunk - t < bs ? n_chunk - t : bs;
                const int64_t blk = (int64_t)blocks[b0 + t / bs] * a->num_kv_heads + kvh;
                const float ks = a->key_scales[blk], vs = a->value_scales[blk];
                for (int64_t u = 0; u < n_rows; u++) {
                    s->key_at[t + u] = (blk * bs + u) * d;
                    s->k_scale[t + u] = ks;
                    s->v_scale[t + u] = vs;
                }
            }
            const int8_t *vc = (const int8_t *)a->value_cache;
            for (int64_t ti = 0; ti < n_chunk; ti += 2) { /* two rows asked for per pair read */
                const int64_t ahead = c0 - k0 + ti + 2 + ATTN_AHEAD;
                const int64_t due = ahead < stream ? ahead : stream;
                for (; fetched < due && fetched < keys; fetched++) fetch_next_row(a, &own, es, shift);
                for (; fetched < due; fetched++) fetch_next_row(a, &next, es, shift);
                const int8_t *r0 = vc + s->key_at[ti];
                const int8_t *r1 = ti + 1 < n_chunk ? vc + s->key_at[ti + 1] : NULL;
                for (int64_t g = 0; g < d; g += I8_VALUE_COLS)
                    interleave_values_i8(r0 + g, r1 ? r1 + g : NULL, pairs + ti * d + g * 2);
            }
        }
        for (int64_t t = 0; t < (i8_values ? 0 : n_chunk); t += bs) { /* block by block */
#else
        for (int64_t t = 0; t < n_chunk; t += bs) { /* block by block */
#endif
            const int64_t n_rows = n_chunk - t < bs ? n_chunk - t : bs;
            const int64_t base = ((int64_t)blocks[b0 + t / bs] * a->num_kv_heads + kvh) * bs * d;
            if (cdt == DT_I8) { /* the rows stay unscaled; the dots and weights take these */
                const int64_t sc = (int64_t)blocks[b0 + t / bs] * a->num_kv_heads + kvh;
                const float ks = a->key_scales[sc], vs = a->value_scales[sc];
                for (int64_t u = 0; u < n_rows; u++) {
                    s->k_scale[t + u] = ks;
                    s->v_scale[t + u] = vs;
                }
            }
            for (int64_t u = 0; u < n_rows; u++) {
                /* one row asked for per row read: a burst of a block's worth would fill
                 * the core's miss buffers and stall (float32 rows: 10% slower) */
                const int64_t ahead = c0 - k0 + t + u + 1 + ATTN_AHEAD;
                const int64_t due = ahead < stream ? ahead : stream;
                for (; fetched < due && fetched < keys; fetched++) fetch_next_row(a, &own, es, shift);
                for (; fetched < due; fetched++) fetch_next_row(a, &next, es, shift);
                const int64_t at = base + u * d;
                float *kf = s->kf + (t + u) * dp, *vfl = s->vf + (t + u) * dp;
                s->key_at[t + u] = at;
                if (d == dp) { /* whole vectors, no lane masks: 3-7% of the kernel, Zen 3 */
                    for (int64_t j = 0; j < d; j += VL) {
                        if (!bf16_dot && !i8_dot)
                            vstoreu(kf + j, vload_kv(a->key_cache, at + j, cdt, lanes(VL)));
                        vstoreu(vfl + j, vload_kv(a->value_cache, at + j, cdt, lanes(VL)));
                    }
                    continue;
                }
                for (int64_t j = 0; j < dp; j += VL) {
                    const vmask mj = lanes(d - j);
                    if (!bf16_dot && !i8_dot) vstoreu(kf + j, vload_kv(a->key_cache, at + j, cdt, mj));
                    vstoreu(vfl + j, vload_kv(a->value_cache, at + j, cdt, mj));
                }
            }
        }
        /* token by token: its `group` rows see the same keys, so after each row's scores
         * and softmax they take their value sums together (accumulate_rows) */
        for (int64_t i0 = 0; i0 < rows; i0 += group) {
          int64_t n = pos[i0] - c0 + 1, from = first_key(a, pos[i0]) - c0;
          if (from < 0) from = 0;
          if (n > n_chunk) n = n_chunk;
          if (n <= from) continue; /* none of this chunk's keys is in the token's window */
          float alphas[ATTN_MAX_ROWS];
#ifdef I8_SCORES_ROWS
          if (i8_dot) /* every row of the token at once, each key loaded once */
              for (int64_t r0 = 0; r0 < group; r0 += I8_SCORES_ROWS) {
                  const int64_t rb = group - r0 < I8_SCORES_ROWS ? group - r0 : I8_SCORES_ROWS;
                  const int8_t *qr = q_i8 + (i0 + r0) * dp, *kc = (const int8_t *)a->key_cache;
                  for (int64_t t = 0; t < n; t += VL) {
                      __m512i dots[I8_SCORES_ROWS];
                      scores_i8_rows(qr, dp, kc, s->key_at + t, n - t, d, dots, rb);
                      for (int64_t r = 0; r < rb; r++) { /* as the one-row path below */
                          const int64_t i = i0 + r0 + r;
                          const vf kq = vsub(_mm512_cvtepi32_ps(dots[r]), vset1(q_off[i]));
                          vstoreu(s->scores + (r0 + r) * s->scores_stride + t,
                                  vmul(vmul(kq, vset1(q_scale[i])), vloadu(s->k_scale + t)));
                      }
                  }
              }
          int scored = i8_dot;
#else
          int scored = 0;
#endif
#if BF16_DOT
          if (bf16_dot) { /* the same for a bfloat16 cache: rows together, keys once */
              for (int64_t r0 = 0; r0 < group; r0 += BF16_SCORES_ROWS) {
                  const int64_t rb = group - r0 < BF16_SCORES_ROWS ? group - r0 : BF16_SCORES_ROWS;
                  const uint16_t *qb = (const uint16_t *)s->q + (i0 + r0) * 2 * dp;
                  for (int64_t t = 0; t < n; t += VL) {
                      __m512 dots[BF16_SCORES_ROWS];
                      scores_bf16_rows(qb, 2 * dp, (const uint16_t *)a->key_cache, s->key_at + t,
                                       n - t, d, dots, rb);
                      for (int64_t r = 0; r < rb; r++)
                          vstoreu(s->scores + (r0 + r) * s->scores_stride + t, vmul(dots[r], scale));
                  }
              }
              scored = 1;
          }
#endif
          for (int64_t i = i0; i < i0 + group; i++) {
            float *row_scores = s->scores + (i - i0) * s->scores_stride;
            const float *qi = s->q + i * dp;
            for (int64_t t = 0; t < (scored ? 0 : n); t += VL) {
                vf dots[VL];
                const int64_t ntv = n - t < VL ? n - t : VL;
#ifndef I8_SCORES_ROWS /* (with VNNI scores_i8_rows scored them above) */
                if (i8_dot) { /* the scales: the query row's, then each key's block's */
                    for (int64_t u = 0; u < VL; u++)
                        dots[u] = dot_i8(q_i8 + i * dp,
                                         (const int8_t *)a->key_cache + s->key_at[t + (u < ntv ? u : 0)], d);
                    const vf kq = vsub(vsum_lanes(dots), vset1(q_off[i])); /* exact */
                    vstoreu(row_scores + t,
                            vmul(vmul(kq, vset1(q_scale[i])), vloadu(s->k_scale + t)));
                    continue;
                }
#endif
                /* VL keys at once, each its own chain of FMAs (one key's chain alone would
                 * wait out the FMA latency at every step: 3x slower at head size 64). Keys
                 * past n (a partial chunk) read key t's row again: harmless, never read. */
                const float *krow[VL];
                for (int64_t u = 0; u < VL; u++) {
                    krow[u] = s->kf + (t + (u < ntv ? u : 0)) * dp;
                    dots[u] = vzero();
                }
                for (int64_t j = 0; j < dp; j += VL) {
                    const vf qj = vloadu(qi + j);
                    for (int64_t u = 0; u < VL; u++) dots[u] = vfmadd(qj, vloadu(krow[u] + j), dots[u]);
                }
                /* an int8 key's block scale: one product per VL keys, not per element */
                vstoreu(row_scores + t, cdt == DT_I8 ? vmul(vsum_lanes(dots), vloadu(s->k_scale + t))
                                                     : vsum_lanes(dots));
            }
            /* the keys this row sees: the chunk's from .. n - 1 (the dots before `from`,
             * outside its window, were computed with the others' and are left unread) */
            float *sc = row_scores + from;
            const int64_t ns = n - from;
            vf vmx = vset1(m[i]);
            for (int64_t t = 0; t < ns; t += VL)
                vmx = vmax(vmx, vloadu_fill(sc + t, lanes(ns - t), -INFINITY));
            const float mx = vreduce_max(vmx);
            const float alpha = expf(m[i] - mx);
            vf vsum = vzero();
            for (int64_t t = 0; t < ns; t += VL) {
                const vmask mt = lanes(ns - t);
                const vf p = vexp(vsub(vloadu_part(sc + t, mt), vset1(mx)));
                /* an int8 value's block scale rides on its weight (the sum l does not) */
                vstoreu_part(sc + t, mt,
                             cdt == DT_I8 ? vmul(p, vloadu_part(s->v_scale + from + t, mt)) : p);
                vsum = vadd(vsum, vkeep(p, mt));
            }
            l[i] = l[i] * alpha + vreduce_add(vsum);
            m[i] = mx;
            alphas[i - i0] = alpha;
          }
#if I8_VALUE_DOT
          if (i8_values) {
              float steps[ATTN_MAX_ROWS];
              for (int64_t i = 0; i < group; i++)
                  steps[i] = weights_i16(s->scores + i * s->scores_stride, from, n,
                                         w16 + i * chunk);
              sums_of_pairs(s->acc + i0 * dp, dp, w16, chunk, alphas, steps, pairs, d,
                            from / 2, (n + 1) / 2, group);
              continue;
          }
#endif
          if (group == 1) { /* one row: accumulate_values keeps two chains per column */
              accumulate_values(s->acc + i0 * dp, s->scores + from, s->vf + from * dp, n - from,
                                dp, alphas[0]);
          } else {
              accumulate_rows(s->acc + i0 * dp, dp, s->scores + from, s->scores_stride, alphas,
                              group, s->vf + from * dp, n - from);
          }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const int64_t off = tok * a->out_tok_stride + head * a->out_head_stride;
        const vf inv = vset1(KV_READ_UNIT(cdt) / l[i]); /* fp8 values read as value / 256 */
        for (int64_t j = 0; j < dp; j += VL)
            vstore(a->out, off + j, vmul(vloadu(s->acc + i * dp + j), inv), dt, lanes(d - j));
    }
}

typedef struct {
    const attention_args *a;
    const int64_t *start; /* first work item of each request */
    int64_t tile;         /* query tokens per work item */
    int64_t per_thread;   /* scratch floats each thread needs */
    int failed;           /* set by a thread that could not get its scratch */
} attention_run;

/* A thread's scratch, floats from its (64-byte aligned) start:
 *
 *   q, acc      ATTN_MAX_ROWS x dp each   the rows' query (scaled) and output sums
 *   kf, vf      chunk x dp each           the chunk's keys and values as float32
 *   key_at      chunk int64s              each key row's offset in the cache
 *   k_scale,    chunk + 16 each           each key row's block scales (int8 caches), and
 *   v_scale                               a vector of padding
 *   scores      group x (chunk + 16)      a token's rows' scores, then softmax weights
 */
static inline int64_t attn_scratch_floats(int64_t dp, int64_t chunk, int64_t group) {
    return 2 * ATTN_MAX_ROWS * dp + 2 * chunk * dp + 2 * chunk + 2 * (chunk + 16) +
           group * (chunk + 16);
}

static inline attn_scratch attn_scratch_at(float *base, int64_t dp, int64_t chunk) {
    float *after_rows = base + 2 * ATTN_MAX_ROWS * dp + 2 * chunk * dp; /* even: 8-aligned */
    const attn_scratch s = {
        .q = base,
        .acc = base + ATTN_MAX_ROWS * dp,
        .kf = base + 2 * ATTN_MAX_ROWS * dp,
        .vf = base + 2 * ATTN_MAX_ROWS * dp + chunk * dp,
        .key_at = (int64_t *)after_rows,
        .k_scale = after_rows + 2 * chunk,
        .v_scale = after_rows + 3 * chunk + 16,
        .scores = after_rows + 4 * chunk + 32,
        .scores_stride = chunk + 16,
    };
    return s;
}

#if ATTN_TILES
#include "attention_tiles.h"
#endif

/* One thread's share of the work items (orphaned `omp for`, see PER_DTYPE); `tiles`: on the
 * tile unit (attention_tiles.h), where tiles_fit. */
INLINE void attention_worker(const attention_run *run, int dt, int cdt, const int tiles) {
    const attention_args *a = run->a;
    const int64_t dp = padded_head(a->head_size);
    const int64_t total = run->start[a->num_reqs], tile = run->tile;
    const int64_t chunk = attention_chunk_blocks(a->block_size) * a->block_size;
    float *base = thread_scratch(run->per_thread);
    if (!base) {
#pragma omp atomic write
        ((attention_run *)run)->failed = 1;
    }
    const attn_scratch s = attn_scratch_at(base, dp, chunk);
#if ATTN_TILES
    at_scratch ts = {0};
    if (tiles && base) {
        ts = at_scratch_at((uint8_t *)base, a->head_size);
        amx_configure();
    }
#endif
    const int nth = omp_get_num_threads();
    int64_t r = 0, next_r = 0, item;
    /* Round robin: a thread knows its next item, and fetches that item's first keys from
     * memory while it computes this one. */
#pragma omp for schedule(static, 1)
    for (item = 0; item < total; item++) {
        if (!base) continue;
        int64_t kvh, t0, nt;
        locate_item(a, run->start, tile, item, &r, &kvh, &t0, &nt);
        kv_span next = {a->block_tables, 0, 0, 0};
        if (item + nth < total) {
            int64_t nt0, nnt;
            if (next_r < r) next_r = r;
            locate_item(a, run->start, tile, item + nth, &next_r, &next.kvh, &nt0, &nnt);
            next.blocks = a->block_tables + next_r * a->bt_stride;
            next.first = first_key(a, item_last_pos(a, next_r, nt0, 1));
            next.count = item_last_pos(a, next_r, nt0, nnt) + 1 - next.first;
        }
        if (item < nth) { /* the thread's first item: nobody fetched it; its first rows */
            const int64_t from = first_key(a, item_last_pos(a, r, t0, 1));
            const int64_t keys = item_last_pos(a, r, t0, nt) + 1 - from;
            const kv_span first = {a->block_tables + r * a->bt_stride, kvh, from,
                                   keys < ATTN_AHEAD ? keys : ATTN_AHEAD};
            for (int64_t t = 0; t < first.count; t++)
                prefetch_row(a, &first, t, dtype_bytes(cdt), block_shift(a->block_size));
        }
#if ATTN_TILES
        if (tiles) {
            attention_item_tiles(a, r, kvh, t0, nt, &ts, &next, dt);
            continue;
        }
#endif
        attention_item(a, r, kvh, t0, nt, &s, &next, dt, cdt);
    }
#if ATTN_TILES
    if (tiles && base) _tile_release();
#endif
}

static int v_attention(const attention_args *a) {
    const int64_t dp = padded_head(a->head_size);
    const int64_t group = a->num_heads / a->num_kv_heads;
    /* q and acc rows, one chunk of keys and of values, one chunk of scores (+ a vector of
     * padding) */
    const int64_t chunk = attention_chunk_blocks(a->block_size) * a->block_size;
    const int threads = a->threads > 0 ? a->threads : 1;
    attention_run run = {
        .a = a,
        .tile = attention_tile_tokens(group),
        .per_thread = attn_scratch_floats(dp, chunk, group),
    };
    int64_t *start = attention_items(a, run.tile);
    if (!start) return -1;
    run.start = start;
    const attention_run *rp = &run;
#if ATTN_TILES
    if (tiles_fit(a)) {
        run.per_thread = at_scratch_bytes(a->head_size) / 4;
        if (a->dtype == DT_F32) {
#pragma omp parallel num_threads(threads)
            attention_worker(rp, DT_F32, DT_BF16, 1);
        } else {
#pragma omp parallel num_threads(threads)
            attention_worker(rp, DT_BF16, DT_BF16, 1);
        }
        free(start);
        return run.failed ? -1 : 0;
    }
#endif
    /* the query's and the cache's types as constants, for the pairs engines run (a cache
     * of the activations' type, 16-bit or fp8 under float32, fp8 or int8 under any): their
     * loads then carry no branch on the type (16% of a bfloat16 decode at 4096 keys); any
     * other pair takes the same code with the types read at run time */
#define ATTN_PAIR(q, c) ((q) * 8 + (c))
#define ATTN_CASE(q, c)                                                                    \
    case ATTN_PAIR(q, c):                                                                  \
        _Pragma("omp parallel num_threads(threads)") attention_worker(rp, q, c, 0);        \
        break;
    switch (ATTN_PAIR(a->dtype, a->cache_dtype)) {
        ATTN_CASE(DT_F32, DT_F32)
        ATTN_CASE(DT_BF16, DT_BF16)
        ATTN_CASE(DT_F16, DT_F16)
        ATTN_CASE(DT_F32, DT_BF16)
        ATTN_CASE(DT_F32, DT_F16)
        ATTN_CASE(DT_F32, DT_FP8)
        ATTN_CASE(DT_BF16, DT_FP8)
        ATTN_CASE(DT_F16, DT_FP8)
        ATTN_CASE(DT_F32, DT_I8)
        ATTN_CASE(DT_BF16, DT_I8)
        ATTN_CASE(DT_F16, DT_I8)
    default:
#pragma omp parallel num_threads(threads)
        attention_worker(rp, a->dtype, a->cache_dtype, 0);
        break;
    }
#undef ATTN_CASE
#undef ATTN_PAIR
    free(start);
    return run.failed ? -1 : 0;
}

/* ---- argmax of float32 rows (greedy sampling) ------------------------------------------ */

INLINE void argmax_worker(const argmax_args *a, int dt) {
    (void)dt;
    int64_t r;
#pragma omp for schedule(static)
    for (r = 0; r < a->rows; r++) a->out[r] = argmax_row(a->x + r * a->row_stride, a->cols);
}

static void v_argmax(const argmax_args *a) {
    const int parallel = a->rows * a->cols > (1 << 16);
#pragma omp parallel num_threads(a->threads) if (parallel)
    argmax_worker(a, DT_F32);
}

/* ---- Exp(1) draws (the sampler's exponential race) ------------------------------------ */

INLINE void exponentials_worker(const exponential_args *a) {
    const int64_t per_row = (a->cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    uint32_t bits[DRAW_CHUNK + 2] __attribute__((aligned(64)));
    int64_t item;
#pragma omp for schedule(static)
    for (item = 0; item < a->rows * per_row; item++) {
        int64_t r, c0;
        const int64_t n = draw_chunk(bits, a->keys, a->cols, item, &r, &c0);
        float *out = a->out + r * a->row_stride + c0;
        int64_t c = 0;
        for (; c + VL <= n; c += VL) vstoreu(out + c, vexp_draw(bits + c));
        if (c < n) vstoreu_part(out + c, lanes(n - c), vexp_draw(bits + c));
    }
}

static void v_exponentials(const exponential_args *a) {
    const int parallel = a->rows * a->cols > (1 << 14);
#pragma omp parallel num_threads(a->threads) if (parallel)
    exponentials_worker(a);
}

INLINE void race_worker(const race_args *a, float *best, int64_t *best_at) {
    const int64_t per_row = (a->cols + DRAW_CHUNK - 1) / DRAW_CHUNK;
    uint32_t bits[DRAW_CHUNK + 2] __attribute__((aligned(64)));
    float score[DRAW_CHUNK] __attribute__((aligned(64)));
    int64_t item;
#pragma omp for schedule(static)
    for (item = 0; item < a->rows * per_row; item++) {
        int64_t r, c0;
        const int64_t n = draw_chunk(bits, a->keys, a->cols, item, &r, &c0);
        const float *l = a->logits + r * a->row_stride + c0;
        const vf it = vset1(a->inv_temp[r]);
        for (int64_t c = 0; c < n; c += VL) { /* past n: scores never read */
            const vf v = vmul(vloadu_part(l + c, lanes(n - c)), it);
            vf sc = vsub(v, vlog(vexp_draw(bits + c)));
            if (a->min_score) /* below the row's threshold: out of the race */
                sc = vselect_below(v, vset1(a->min_score[r]), sc, vset1(-INFINITY));
            vstoreu(score + c, sc);
        }
        const int64_t at = argmax_row(score, n);
        best[item] = score[at];
        best_at[item] = c0 + at;
    }
}

static void v_race_chunks(const race_args *a, float *best, int64_t *best_at) {
    const int parallel = a->rows * a->cols > (1 << 14);
#pragma omp parallel num_threads(a->threads) if (parallel)
    race_worker(a, best, best_at);
}

static int v_race(const race_args *a) { return race_with(a, v_race_chunks); }

static void v_exp_shift(float *e, const float *l, int64_t n, float m, float floor) {
    /* the floor, or the lowest finite float: a -inf logit gets 0, not vexp's clamped tiny */
    const vf vm = vset1(m), lo = vset1(floor > -3.4028235e38f ? floor : -3.4028235e38f);
    for (int64_t i = 0; i < n; i += VL) { /* e holds a vector past n */
        const vf x = vloadu_fill(l + i, lanes(n - i), -INFINITY);
        vstoreu(e + i, vselect_below(x, lo, vexp(vsub(x, vm)), vzero()));
    }
}

/* ---- LoRA: shrink (one rank row, every token), then expand (VL columns, every token) ---- */

INLINE float dot_x_a(const void *x, int64_t x_off, const void *a, int64_t a_off, int64_t n,
                     int dt) {
    vf acc = vzero();
    for (int64_t i = 0; i < n; i += VL) {
        const vmask m = lanes(n - i);
        acc = vfmadd(vload(x, x_off + i, dt, m), vload(a, a_off + i, dt, m), acc);
    }
    return vreduce_add(acc);
}

/* Tokens are taken in runs of up to LORA_BLOCK of one slot (a->order: the tokens with an
 * adapter, grouped by slot; a->runs: where each slot's tokens start and end), so each row
 * of a and each VL columns of b's rows are loaded once per run, not once per token. Work
 * items are rows of a (shrink) and VL columns of a part (expand). */
#define LORA_BLOCK 4

INLINE void lora_worker(const lora_args *a, int dt) {
    const int64_t w = a->w, n = a->n, k = a->k, r = a->r;
    int64_t item;
#pragma omp for schedule(static)
    for (item = 0; item < w; item++)
        for (int64_t g = 0; g < a->num_runs; g++) {
            const int64_t lo = a->runs[2 * g], hi = a->runs[2 * g + 1];
            const int s = a->slots[a->order[lo]];
            const int64_t a_off = ((int64_t)s * w + item) * k;
            for (int64_t b0 = lo; b0 < hi; b0 += LORA_BLOCK) {
                int64_t tok[LORA_BLOCK];
                for (int i = 0; i < LORA_BLOCK; i++)
                    tok[i] = a->order[b0 + i < hi ? b0 + i : hi - 1];
                if (hi - b0 == 1) { /* one token (a single user's decode): no block */
                    a->shrunk[tok[0] * w + item] =
                        dot_x_a(a->x, tok[0] * a->x_stride, a->a, a_off, k, dt);
                    continue;
                }
                vf acc[LORA_BLOCK];
                for (int i = 0; i < LORA_BLOCK; i++) acc[i] = vzero();
                for (int64_t c = 0; c < k; c += VL) {
                    const vmask m = lanes(k - c);
                    const vf av = vload(a->a, a_off + c, dt, m);
                    for (int i = 0; i < LORA_BLOCK; i++)
                        acc[i] = vfmadd(vload(a->x, tok[i] * a->x_stride + c, dt, m), av, acc[i]);
                }
                for (int i = 0; i < LORA_BLOCK && b0 + i < hi; i++)
                    a->shrunk[tok[i] * w + item] = vreduce_add(acc[i]);
            }
        }
    /* (the omp for's barrier: every shrunk row is complete) */
    int64_t first = 0;
    for (int64_t p = 0; p < a->num_parts; p++) {
        const int64_t end = a->part_end[p], chunks = (end - first + VL - 1) / VL;
#pragma omp for schedule(static)
        for (item = 0; item < chunks; item++) {
            const int64_t j0 = first + item * VL;
            const vmask mk = lanes(end - j0);
            for (int64_t g = 0; g < a->num_runs; g++) {
                const int64_t lo = a->runs[2 * g], hi = a->runs[2 * g + 1];
                const int s = a->slots[a->order[lo]];
                const int64_t b_off = (int64_t)s * r * n + j0;
                for (int64_t b0 = lo; b0 < hi; b0 += LORA_BLOCK) {
                    const float *u[LORA_BLOCK];
                    int64_t tok[LORA_BLOCK];
                    for (int i = 0; i < LORA_BLOCK; i++) {
                        tok[i] = a->order[b0 + i < hi ? b0 + i : hi - 1];
                        u[i] = a->shrunk + tok[i] * w + p * r;
                    }
                    vf acc[LORA_BLOCK];
                    for (int i = 0; i < LORA_BLOCK; i++) acc[i] = vzero();
                    for (int64_t q = 0; q < r; q++) {
                        const vf bv = vload(a->b, b_off + q * n, dt, mk);
                        for (int i = 0; i < LORA_BLOCK; i++)
                            acc[i] = vfmadd(bv, vset1(u[i][q]), acc[i]);
                    }
                    for (int i = 0; i < LORA_BLOCK && b0 + i < hi; i++) {
                        const int64_t y_off = tok[i] * a->y_stride + j0;
                        vstore(a->y, y_off, vadd(vload(a->y, y_off, dt, mk), acc[i]), dt, mk);
                    }
                }
            }
        }
        first = end;
    }
}

PER_DTYPE(v_lora, lora_args, lora_worker, a->m * a->w * (a->k + a->n) > (1 << 30))

#include "simd_gemm.h"

const cpu_kernels KERNELS = {
    .name = KERNELS_NAME,
    .rms_norm = v_rms_norm,
    .rotary = v_rotary,
    .gated_act = v_gated_act,
    .attention = v_attention,
    .argmax = v_argmax,
    .exponentials = v_exponentials,
    .race = v_race,
    .exp_shift = v_exp_shift,
    .linear = v_linear,
    .lora = v_lora,
};
