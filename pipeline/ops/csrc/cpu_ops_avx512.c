/* AVX-512 versions of the CPU kernels: 16 float32 lanes, bfloat16 / float16 converted in
 * registers, masked loads and stores for any row length. Only called when the CPU reports
 * AVX-512 F/BW/VL/DQ (cpu_ops_module.c checks); the arithmetic is the generic file's.
 *
 * Compiled twice: as is (`avx512_kernels`), and by cpu_ops_avx512bf16.c with
 * RINGLLM_AVX512_BF16 defined (`avx512bf16_kernels`), where rounding float32 to bfloat16
 * is one instruction (VCVTNEPS2BF16, round to nearest even like torch) instead of seven. */
#ifdef RINGLLM_AVX512_BF16
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#define KERNELS avx512bf16_kernels
#define KERNELS_NAME "avx512bf16"
#define BF16_DOT 1 /* bfloat16 q.k products straight from the cache (VDPBF16PS) */
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#define KERNELS avx512_kernels
#define KERNELS_NAME "avx512"
#define BF16_DOT 0
#endif

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ops.h"

#define INLINE static inline __attribute__((always_inline))

INLINE __mmask16 lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

INLINE __m512 vload(const void *p, int64_t i, int dt, __mmask16 m) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* float32 -> bfloat16 bits (round to nearest even; NaN -> quiet NaN), in the high halves. */
#ifdef RINGLLM_AVX512_BF16
INLINE __m256i bf16_bits(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

INLINE __m512i bf16_high(__m512 v) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16);
}
#else
INLINE __m512i bf16_high(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

INLINE __m256i bf16_bits(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high(v), 16)); }
#endif

INLINE void vstore(void *p, int64_t i, __m512 v, int dt, __mmask16 m) {
    if (dt == DT_F32) {
        _mm512_mask_storeu_ps((float *)p + i, m, v);
        return;
    }
    const __m256i h = dt == DT_BF16
                          ? bf16_bits(v)
                          : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, h);
}

/* v rounded to the element type and back (torch rounds every op's output). */
INLINE __m512 vround(__m512 v, int dt) {
    if (dt == DT_F32) return v;
    if (dt == DT_BF16) return _mm512_castsi512_ps(bf16_high(v));
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* e^x, relative error ~2e-7: x = n ln2 + r (|r| <= ln2 / 2), e^r by its Taylor series to r^7,
 * then scaled by 2^n. Inputs are clamped to where float32 e^x is 0 .. finite. */
INLINE __m512 vexp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* ---- RMSNorm (+ residual add) ------------------------------------------------------- */

INLINE void rms_row(const rms_norm_args *a, int64_t r, int dt) {
    const int64_t n = a->cols;
    const int64_t x_off = (r / a->inner) * a->x_outer + (r % a->inner) * a->x_inner;
    const int64_t o_off = r * n;
    __m512 sq = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = lanes(n - j);
        __m512 h = vload(a->x, x_off + j, dt, m);
        if (a->residual_in) {
            h = vround(_mm512_add_ps(h, vload(a->residual_in, o_off + j, dt, m)), dt);
            vstore(a->residual_out, o_off + j, h, dt, m);
        }
        sq = _mm512_fmadd_ps(h, h, sq);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)n + a->eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    const void *src = a->residual_in ? a->residual_out : a->x;
    const int64_t s_off = a->residual_in ? o_off : x_off;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = lanes(n - j);
        const __m512 normed = vround(_mm512_mul_ps(vload(src, s_off + j, dt, m), vinv), dt);
        vstore(a->out, o_off + j, _mm512_mul_ps(vload(a->weight, j, dt, m), normed), dt, m);
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
            for (int64_t j = 0; j < half; j += 16) {
                const __mmask16 m = lanes(half - j);
                const __m512 c = _mm512_maskz_loadu_ps(m, cos + j);
                const __m512 s = _mm512_maskz_loadu_ps(m, sin + j);
                const __m512 x1 = vload(a->x, off + j, dt, m);
                const __m512 x2 = vload(a->x, off + half + j, dt, m);
                vstore(a->x, off + j, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)),
                       dt, m);
                vstore(a->x, off + half + j,
                       _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), dt, m);
            }
        }
    }
}

PER_DTYPE(v_rotary, rotary_args, rotary_worker, a->tokens * a->heads * a->head_size > (1 << 14))

/* ---- SiLU(gate) * up ---------------------------------------------------------------- */

INLINE void silu_mul_worker(const silu_mul_args *a, int dt) {
    int64_t r;
#pragma omp for schedule(static)
    for (r = 0; r < a->rows; r++) {
        const int64_t x_off = r * a->x_stride, o_off = r * a->inter;
        for (int64_t j = 0; j < a->inter; j += 16) {
            const __mmask16 m = lanes(a->inter - j);
            const __m512 g = vload(a->x, x_off + j, dt, m);
            const __m512 u = vload(a->x, x_off + a->inter + j, dt, m);
            const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 s = vround(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), dt);
            vstore(a->out, o_off + j, _mm512_mul_ps(s, u), dt, m);
        }
    }
}

PER_DTYPE(v_silu_mul, silu_mul_args, silu_mul_worker, a->rows * a->inter > (1 << 16))

/* ---- paged attention ---------------------------------------------------------------- */

/* The 16 horizontal sums of v[0..15], as one vector (lane u = sum of v[u]'s lanes): a
 * transposing tree of 15 adds and 30 shuffles instead of 16 separate reductions. */
INLINE __m512 sum16(const __m512 *v) {
    __m512 p[8], q[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        p[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sum of 4 vectors */
        const __m512d a = _mm512_castps_pd(p[2 * i]), b = _mm512_castps_pd(p[2 * i + 1]);
        q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* q[i] lane L holds the 128-bit lane L sums of vectors 4i..4i+3: add the 4 lanes */
    const __m512 r0 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], 0x88),
                                    _mm512_shuffle_f32x4(q[0], q[1], 0xdd));
    const __m512 r1 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], 0x88),
                                    _mm512_shuffle_f32x4(q[2], q[3], 0xdd));
    /* r0 = [q0 lanes 0+1, q0 2+3, q1 0+1, q1 2+3], r1 the same of q2, q3: one more round
     * leaves [q0 | q1 | q2 | q3] totals, i.e. the sums of v[0..15] in order */
    return _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x88), _mm512_shuffle_f32x4(r0, r1, 0xdd));
}

typedef struct {
    float *q, *acc, *kf, *vf, *scores;
    int64_t *key_at; /* cache offset of each key row of the chunk (bfloat16 dot path) */
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
#endif

/* Blocks per chunk of keys: scores, softmax update and value sums run per chunk of about
 * 64 keys, so the fixed cost of an online-softmax step is paid once per 64 keys. */
static inline int64_t attention_chunk_blocks(int64_t block_size) {
    return block_size >= 64 ? 1 : 64 / block_size;
}

/* Keys first .. first + count - 1 of one request's KV head. Blocks lie anywhere in memory,
 * so the hardware prefetcher cannot guess the next one: a thread asks for the rows of its
 * next work item itself, a few with each row it reads of the current one, spread so the
 * requests never pile up in the core's few miss buffers. */
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

INLINE void prefetch_row(const attention_args *a, const kv_span *sp, int64_t t, int64_t es,
                         int shift) {
    const int64_t bs = a->block_size, d = a->head_size, key = sp->first + t;
    const int64_t off = (((int64_t)sp->blocks[block_of(key, bs, shift)] * a->num_kv_heads +
                          sp->kvh) * bs + offset_in(key, bs, shift)) * d * es;
    for (int64_t i = 0; i < d * es; i += 64) {
        _mm_prefetch((const char *)a->key_cache + off + i, _MM_HINT_T1);
        _mm_prefetch((const char *)a->value_cache + off + i, _MM_HINT_T1);
    }
}

/* The last key position work item (r, t0, nt) reads. */
INLINE int64_t item_last_pos(const attention_args *a, int64_t r, int64_t t0, int64_t nt) {
    return a->seq_lens[r] - query_len(a, r) + t0 + nt - 1;
}

/* Rows = query tokens t0..t0+nt-1 of request r x the `group` query heads of KV head kvh.
 * Keys come in chunks of about 64 (whole cache blocks): each chunk's values (and keys,
 * unless q.k runs as bfloat16 dot products straight from the cache) are converted to
 * float32 once ([token][dp], dp = head_size rounded up to 16 lanes, zero padded) and used
 * by every row; the softmax is online (running max m and sum l per row), so any context
 * length needs only one chunk of scores. */
INLINE void attention_item(const attention_args *a, int64_t r, int64_t kvh, int64_t t0,
                           int64_t nt, const attn_scratch *s, const kv_span *next_item, int dt) {
    const int64_t d = a->head_size, bs = a->block_size, dp = (d + 15) & ~(int64_t)15;
    const int64_t group = a->num_heads / a->num_kv_heads, rows = nt * group;
    const int64_t q_first = query_first(a, r), q_len = query_len(a, r);
    const int64_t first_pos = a->seq_lens[r] - q_len + t0;
    const int32_t *blocks = a->block_tables + r * a->bt_stride;
    const __m512 scale = _mm512_set1_ps(a->scale);
    const int bf16_dot = BF16_DOT && dt == DT_BF16;
    float m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS];
    int64_t pos[ATTN_MAX_ROWS]; /* each row's position: it sees keys 0..pos */
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const int64_t off = tok * a->q_tok_stride + head * a->q_head_stride;
        pos[i] = first_pos + i / group;
        if (bf16_dot) /* q stays bfloat16 (the scale multiplies the dot products) */
            memcpy((uint16_t *)s->q + i * 2 * dp, (const uint16_t *)a->query + off,
                   (size_t)d * 2);
        for (int64_t j = 0; j < dp; j += 16) {
            const __m512 v = vload(a->query, off + j, dt, lanes(d - j));
            if (!bf16_dot) _mm512_storeu_ps(s->q + i * dp + j, _mm512_mul_ps(v, scale));
            _mm512_storeu_ps(s->acc + i * dp + j, _mm512_setzero_ps());
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    const int64_t last_pos = first_pos + nt - 1, keys = last_pos + 1;
    const int64_t es = dt == DT_F32 ? 4 : 2;
    const int64_t cb = attention_chunk_blocks(bs), chunk = cb * bs;
    const int shift = block_shift(bs);
    /* the next item's rows are prefetched `step` (32.32 fixed point) per row of this one */
    const uint64_t step = ((uint64_t)next_item->count << 32) / (uint64_t)keys;
    int64_t fetched = 0;
    for (int64_t b0 = 0; b0 * bs <= last_pos; b0 += cb) {
        /* one chunk: blocks b0 .. b0 + cb - 1, keys b0 * bs .. (capped at last_pos) */
        const int64_t c0 = b0 * bs;
        const int64_t n_chunk = last_pos - c0 + 1 < chunk ? last_pos - c0 + 1 : chunk;
        for (int64_t t = 0; t < n_chunk; t++) {
            /* the thread's next work item, spread evenly over this item's rows */
            const int64_t due = (int64_t)(((uint64_t)(c0 + t + 1) * step) >> 32);
            for (; fetched < due; fetched++) prefetch_row(a, next_item, fetched, es, shift);
            const int64_t base = (((int64_t)blocks[b0 + block_of(t, bs, shift)] * a->num_kv_heads) +
                                  kvh) * bs * d + offset_in(t, bs, shift) * d;
            s->key_at[t] = base;
            for (int64_t j = 0; j < dp; j += 16) {
                const __mmask16 m16 = lanes(d - j);
                if (!bf16_dot)
                    _mm512_storeu_ps(s->kf + t * dp + j, vload(a->key_cache, base + j, dt, m16));
                _mm512_storeu_ps(s->vf + t * dp + j, vload(a->value_cache, base + j, dt, m16));
            }
        }
        for (int64_t i = 0; i < rows; i++) {
            int64_t n = pos[i] - c0 + 1;
            if (n <= 0) continue;
            if (n > n_chunk) n = n_chunk;
            const float *qi = s->q + i * dp;
            for (int64_t t = 0; t < n; t += 16) {
                __m512 dots[16];
                const int64_t nt16 = n - t < 16 ? n - t : 16;
#if BF16_DOT
                if (bf16_dot) {
                    const uint16_t *qb = (const uint16_t *)s->q + i * 2 * dp;
                    for (int64_t u = 0; u < 16; u++)
                        dots[u] = dot_bf16(
                            qb, (const uint16_t *)a->key_cache + s->key_at[t + (u < nt16 ? u : 0)], d);
                    _mm512_storeu_ps(s->scores + t, _mm512_mul_ps(sum16(dots), scale));
                    continue;
                }
#endif
                for (int64_t u = 0; u < 16; u++) {
                    /* rows past n (a partial block) are zeros in kf: harmless, never read */
                    const float *k = s->kf + (t + (u < nt16 ? u : 0)) * dp;
                    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qi), _mm512_loadu_ps(k));
                    for (int64_t j = 16; j < dp; j += 16)
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(qi + j), _mm512_loadu_ps(k + j), dot);
                    dots[u] = dot;
                }
                _mm512_storeu_ps(s->scores + t, sum16(dots));
            }
            __m512 vmax = _mm512_set1_ps(m[i]);
            for (int64_t t = 0; t < n; t += 16)
                vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                                lanes(n - t), s->scores + t));
            const float mx = _mm512_reduce_max_ps(vmax);
            const float alpha = expf(m[i] - mx);
            __m512 vsum = _mm512_setzero_ps();
            for (int64_t t = 0; t < n; t += 16) {
                const __mmask16 mt = lanes(n - t);
                const __m512 p = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mt, s->scores + t),
                                                    _mm512_set1_ps(mx)));
                _mm512_mask_storeu_ps(s->scores + t, mt, p);
                vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(mt, p));
            }
            l[i] = l[i] * alpha + _mm512_reduce_add_ps(vsum);
            m[i] = mx;
            float *o = s->acc + i * dp;
            const __m512 va = _mm512_set1_ps(alpha);
            int64_t j = 0;
            /* 64 columns at a time in 8 independent accumulators: one chain of dependent
             * FMAs would wait out the FMA latency at every key */
            for (; j + 64 <= dp; j += 64) {
                /* even keys into a0..a3, odd keys into b0..b3: two chains per column */
                __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(o + j), va);
                __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(o + j + 16), va);
                __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(o + j + 32), va);
                __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(o + j + 48), va);
                __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
                int64_t t = 0;
                for (; t + 2 <= n; t += 2) {
                    const __m512 pt = _mm512_set1_ps(s->scores[t]);
                    const __m512 pu = _mm512_set1_ps(s->scores[t + 1]);
                    const float *v = s->vf + t * dp + j, *w = v + dp;
                    a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v), a0);
                    a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16), a1);
                    a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 32), a2);
                    a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 48), a3);
                    b0 = _mm512_fmadd_ps(pu, _mm512_loadu_ps(w), b0);
                    b1 = _mm512_fmadd_ps(pu, _mm512_loadu_ps(w + 16), b1);
                    b2 = _mm512_fmadd_ps(pu, _mm512_loadu_ps(w + 32), b2);
                    b3 = _mm512_fmadd_ps(pu, _mm512_loadu_ps(w + 48), b3);
                }
                if (t < n) {
                    const __m512 pt = _mm512_set1_ps(s->scores[t]);
                    const float *v = s->vf + t * dp + j;
                    a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v), a0);
                    a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16), a1);
                    a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 32), a2);
                    a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 48), a3);
                }
                _mm512_storeu_ps(o + j, _mm512_add_ps(a0, b0));
                _mm512_storeu_ps(o + j + 16, _mm512_add_ps(a1, b1));
                _mm512_storeu_ps(o + j + 32, _mm512_add_ps(a2, b2));
                _mm512_storeu_ps(o + j + 48, _mm512_add_ps(a3, b3));
            }
            for (; j < dp; j += 16) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(o + j), va);
                for (int64_t t = 0; t < n; t++)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(s->scores[t]),
                                          _mm512_loadu_ps(s->vf + t * dp + j), acc);
                _mm512_storeu_ps(o + j, acc);
            }
        }
    }
    for (; fetched < next_item->count; fetched++) prefetch_row(a, next_item, fetched, es, shift);
    for (int64_t i = 0; i < rows; i++) {
        const int64_t tok = q_first + t0 + i / group, head = kvh * group + i % group;
        const int64_t off = tok * a->out_tok_stride + head * a->out_head_stride;
        const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
        for (int64_t j = 0; j < dp; j += 16)
            vstore(a->out, off + j, _mm512_mul_ps(_mm512_loadu_ps(s->acc + i * dp + j), inv), dt,
                   lanes(d - j));
    }
}

typedef struct {
    const attention_args *a;
    const int64_t *start; /* first work item of each request */
    int64_t tile;         /* query tokens per work item */
    int64_t per_thread;   /* scratch floats each thread needs */
    int failed;           /* set by a thread that could not get its scratch */
} attention_run;

/* One thread's share of the work items (orphaned `omp for`, see PER_DTYPE). */
INLINE void attention_worker(const attention_run *run, int dt) {
    const attention_args *a = run->a;
    const int64_t dp = (a->head_size + 15) & ~(int64_t)15;
    const int64_t total = run->start[a->num_reqs], tile = run->tile;
    const int64_t chunk = attention_chunk_blocks(a->block_size) * a->block_size;
    float *base = thread_scratch(run->per_thread);
    if (!base) {
#pragma omp atomic write
        ((attention_run *)run)->failed = 1;
    }
    const attn_scratch s = {
        .q = base,
        .acc = base + ATTN_MAX_ROWS * dp,
        .kf = base + 2 * ATTN_MAX_ROWS * dp,
        .vf = base + 2 * ATTN_MAX_ROWS * dp + chunk * dp,
        .scores = base + 2 * ATTN_MAX_ROWS * dp + 2 * chunk * dp,
        .key_at = (int64_t *)(base + 2 * ATTN_MAX_ROWS * dp + 2 * chunk * dp + ((chunk + 17) & ~1)),
    };
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
            next.count = item_last_pos(a, next_r, nt0, nnt) + 1;
        }
        if (item < nth) { /* the thread's first item: nobody fetched it; its first 16 keys */
            const int64_t keys = item_last_pos(a, r, t0, nt) + 1;
            const kv_span first = {a->block_tables + r * a->bt_stride, kvh, 0, keys < 16 ? keys : 16};
            for (int64_t t = 0; t < first.count; t++)
                prefetch_row(a, &first, t, dt == DT_F32 ? 4 : 2, block_shift(a->block_size));
        }
        attention_item(a, r, kvh, t0, nt, &s, &next, dt);
    }
}

static int v_attention(const attention_args *a) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t dp = (a->head_size + 15) & ~(int64_t)15;
    /* q and acc rows, one chunk of keys and of values, one chunk of scores (+ a lane pad) */
    const int64_t chunk = attention_chunk_blocks(a->block_size) * a->block_size;
    const int threads = a->threads > 0 ? a->threads : 1;
    attention_run run = {
        .a = a,
        .tile = attention_tile_tokens(group),
        /* + the chunk's key offsets (int64: two floats each) */
        .per_thread = 2 * ATTN_MAX_ROWS * dp + 2 * chunk * dp + ((chunk + 17) & ~1) + 2 * chunk,
    };
    int64_t *start = attention_items(a, run.tile);
    if (!start) return -1;
    run.start = start;
    const attention_run *rp = &run;
    switch (a->dtype) {
    case DT_F32:
#pragma omp parallel num_threads(threads)
        attention_worker(rp, DT_F32);
        break;
    case DT_BF16:
#pragma omp parallel num_threads(threads)
        attention_worker(rp, DT_BF16);
        break;
    default:
#pragma omp parallel num_threads(threads)
        attention_worker(rp, DT_F16);
        break;
    }
    free(start);
    return run.failed ? -1 : 0;
}

/* ---- argmax of float32 rows (greedy sampling) ------------------------------------------ */

INLINE int64_t argmax_row(const float *x, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i at = best_at;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = lanes(n - j);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
        nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
        const __mmask16 up = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ); /* strict: first wins */
        best = _mm512_mask_mov_ps(best, up, v);
        best_at = _mm512_mask_mov_epi32(best_at, up, at);
        at = _mm512_add_epi32(at, step);
    }
    if (nan) { /* torch: the first NaN */
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) return j;
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    /* the smallest index among the lanes holding the maximum */
    return _mm512_mask_reduce_min_epi32(ties, best_at);
}

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

const cpu_kernels KERNELS = {
    .name = KERNELS_NAME,
    .rms_norm = v_rms_norm,
    .rotary = v_rotary,
    .silu_mul = v_silu_mul,
    .attention = v_attention,
    .argmax = v_argmax,
};
