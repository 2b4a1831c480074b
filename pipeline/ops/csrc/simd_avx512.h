/* The vector layer of the SIMD kernels (simd_kernels.h) for AVX-512 F/BW/VL/DQ: 16 float32
 * lanes, masked loads and stores for any row length, bfloat16 / float16 converted in
 * registers. With RINGLLM_AVX512_BF16 defined, rounding float32 to bfloat16 is one
 * instruction (VCVTNEPS2BF16, round to nearest even like torch) instead of seven.
 *
 * Included by a translation unit that has set `#pragma GCC target(...)` for the ISA first.
 */
#ifndef RINGLLM_SIMD_AVX512_H
#define RINGLLM_SIMD_AVX512_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu_ops.h"

#define INLINE static inline __attribute__((always_inline))
#define VL 16 /* float32 lanes */

typedef __m512 vf;
typedef __mmask16 vmask; /* the lanes a partial row uses */

INLINE vmask lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vloadu(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vstoreu(float *p, vf v) { _mm512_storeu_ps(p, v); }
INLINE float vreduce_add(vf v) { return _mm512_reduce_add_ps(v); }
INLINE float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }

/* float32 rows: masked lanes read as `fill` (or zero), are not written, and may lie past
 * the end of the row's memory. */
INLINE vf vloadu_part(const float *p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }
INLINE vf vloadu_fill(const float *p, vmask m, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), m, p);
}
INLINE void vstoreu_part(float *p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
INLINE vf vkeep(vf v, vmask m) { return _mm512_maskz_mov_ps(m, v); } /* the rest zeroed */

/* Lanes of element i.. of an fp8 e4m3fn row, as float32 values / 256: each byte's bits
 * moved into a float16's place (see cpu_ops.h; a NaN byte, never written, reads 480 / 256).
 * The byte << 8, shifted right by one with its sign: bit 14 (a copy of the sign) is masked
 * off, the other 7 bits sit at 13..7. The attention kernel folds the 256 into its query
 * scale and its output. */
INLINE vf vload_fp8_over_256(const void *p, int64_t i, vmask m) {
    const __m256i w = _mm256_srai_epi16(
        _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, (const uint8_t *)p + i)), 8), 1);
    return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16((short)0xbf80)));
}

/* Lanes of element i.. of an int8 row as float32, unscaled (the scale is its block's). */
INLINE vf vload_i8(const void *p, int64_t i, vmask m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)p + i)));
}

/* vsum_lanes' tree one level at a time, for sums that arrive a pair of vectors at a time
 * (the attention's scores: scores_*_16): fold_* (a, b) adds the lanes of a and b one
 * level further, in vsum_lanes' order, so the sums are the same bit for bit. */
INLINE __m512i fold_pairs_32(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
INLINE __m512i fold_pairs_64(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
INLINE __m512i fold_lanes(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}
INLINE __m512 fold_pairs_32_ps(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
INLINE __m512 fold_pairs_64_ps(__m512 a, __m512 b) {
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
INLINE __m512 fold_lanes_ps(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
}

/* The body of a scores_*_16: for each pair of the 16 keys (key_at[u], key_at[u + 1]; keys
 * from nk on read key 0 again) PAIR_DOTS(k0, k1, a, b) leaves each row's two dot vectors in
 * a[r], b[r]; they fold as they come, and out[r] lane u ends up q_r . k_u. T: the vector
 * type, ROWS: the most rows, FOLD_*: its three levels. */
#define FOLD_16_KEYS(T, ROWS, nr, cache, key_at, nk, out, PAIR_DOTS, FOLD_32, FOLD_64, FOLD_LANES) \
    do {                                                                                       \
        T l2_[ROWS][4];                                                                        \
        for (int u4 = 0; u4 < 16; u4 += 4) {                                                   \
            T l1_[ROWS][2];                                                                    \
            for (int h = 0; h < 2; h++) {                                                      \
                const int u = u4 + 2 * h;                                                      \
                T a_[ROWS], b_[ROWS];                                                          \
                PAIR_DOTS((cache) + (key_at)[u < (nk) ? u : 0],                                \
                          (cache) + (key_at)[u + 1 < (nk) ? u + 1 : 0], a_, b_);               \
                for (int r = 0; r < (nr); r++) l1_[r][h] = FOLD_32(a_[r], b_[r]);              \
            }                                                                                  \
            for (int r = 0; r < (nr); r++) l2_[r][u4 / 4] = FOLD_64(l1_[r][0], l1_[r][1]);     \
        }                                                                                      \
        for (int r = 0; r < (nr); r++)                                                         \
            (out)[r] = FOLD_LANES(FOLD_LANES(l2_[r][0], l2_[r][1]),                            \
                                  FOLD_LANES(l2_[r][2], l2_[r][3]));                           \
    } while (0)

/* q . k of two int8 rows of d elements (d a multiple of I8_DOT_STEP) as VL partial sums,
 * exact in int32, plus I8_DOT_OFFSET times the sum of q's elements (the caller takes it
 * back once per query row, simd_kernels.h attention_item). With VNNI (the avx512bf16 set:
 * every CPU with AVX512_BF16 has it) one VPDPBUSD (unsigned x signed, summed in fours)
 * takes k + 128 (k ^ 0x80) against q: k . q + 128 sum(q), in two instructions where the
 * sign trick below takes six. Without VNNI: |k| times q with k's sign (VPMADDUBSW:
 * unsigned x signed; no saturation, |q|, |k| <= 127), no offset. */
#define I8_DOT_STEP 64
#ifdef __AVX512VNNI__
#define I8_DOT_OFFSET 128
INLINE vf dot_i8(const int8_t *q, const int8_t *k, int64_t d) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t j = 0; j < d; j += 64)
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(k + j), flip),
                                  _mm512_loadu_si512(q + j));
    return _mm512_cvtepi32_ps(acc);
}

/* q . k of nr int8 query rows (q, q_stride bytes apart) against 16 int8 key rows (cache +
 * key_at[u]; keys from nk on read key 0 again), d a multiple of 64: out[r] lane u =
 * q_r . k_u + 128 sum(q_r) (dot_i8's sums, exact in int32). Each key is loaded and
 * flipped once for every row, and the 16 keys' partial sums fold into one vector as they
 * come (vsum_lanes' tree), so nothing goes through memory. */
#define I8_SCORES_ROWS 4 /* rows at once: 4 x 4 tree vectors + 2 keys + 4 queries (2 measured the same) */
INLINE void scores_i8_16(const int8_t *q, int64_t q_stride, const int8_t *cache,
                         const int64_t *key_at, int64_t nk, int64_t d, __m512i *out,
                         const int nr) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#define I8_PAIR_DOTS(k0, k1, a, b)                                                         \
    do {                                                                                   \
        for (int r = 0; r < nr; r++) a[r] = b[r] = _mm512_setzero_si512();                 \
        for (int64_t j = 0; j < d; j += 64) {                                              \
            const __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(k0 + j), flip);         \
            const __m512i x1 = _mm512_xor_si512(_mm512_loadu_si512(k1 + j), flip);         \
            for (int r = 0; r < nr; r++) {                                                 \
                const __m512i qr = _mm512_loadu_si512(q + r * q_stride + j);               \
                a[r] = _mm512_dpbusd_epi32(a[r], x0, qr);                                  \
                b[r] = _mm512_dpbusd_epi32(b[r], x1, qr);                                  \
            }                                                                              \
        }                                                                                  \
    } while (0)
    FOLD_16_KEYS(__m512i, I8_SCORES_ROWS, nr, cache, key_at, nk, out, I8_PAIR_DOTS, fold_pairs_32,
                 fold_pairs_64, fold_lanes);
#undef I8_PAIR_DOTS
}

/* scores_i8_16 for nr (1 .. I8_SCORES_ROWS) rows, each count and the common head size 64
 * as constants (so the loops unroll and the partial sums stay in registers). */
INLINE void scores_i8_rows(const int8_t *q, int64_t q_stride, const int8_t *cache,
                           const int64_t *key_at, int64_t nk, int64_t d, __m512i *out,
                           int64_t nr) {
#define SCORES_I8(rows)                                                            \
    (d == 64 ? scores_i8_16(q, q_stride, cache, key_at, nk, 64, out, rows)        \
             : scores_i8_16(q, q_stride, cache, key_at, nk, d, out, rows))
    switch (nr) {
    case 4: SCORES_I8(4); break;
    case 3: SCORES_I8(3); break;
    case 2: SCORES_I8(2); break;
    default: SCORES_I8(1); break;
    }
#undef SCORES_I8
}
#else
#define I8_DOT_OFFSET 0
INLINE vf dot_i8(const int8_t *q, const int8_t *k, int64_t d) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t j = 0; j < d; j += 64) {
        const __m512i kj = _mm512_loadu_si512(k + j), qj = _mm512_loadu_si512(q + j);
        const __m512i signed_q =
            _mm512_mask_sub_epi8(qj, _mm512_movepi8_mask(kj), _mm512_setzero_si512(), qj);
        const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(kj), signed_q);
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
    }
    return _mm512_cvtepi32_ps(acc);
}
#endif

/* An int8 cache's weighted value sums as integer products (attention_item): each chunk's
 * softmax weights (times their blocks' value scales) rounded to int16 against the chunk's
 * largest, the value rows sign-extended to int16 and laid out in pairs of tokens, and one
 * VPDPWSSD (VNNI; else VPMADDWD + VPADDD) per 16 columns adds two tokens' products: a
 * third of the float path's instructions per key, and no float32 copy of the values. */
#define I8_VALUE_DOT 1
#define I8_VALUE_COLS 64 /* columns per group of pair vectors; d must be a multiple */

/* Columns j .. j + 63 of two int8 value rows (tokens t, t + 1; r1 NULL: a zero row) as 4
 * vectors of int16 pairs (r0[c], r1[c]) at out. Pairs are made within 128-bit lanes
 * (VPUNPCKLWD / HWD), so vector 0 holds columns 0-3, 8-11, 16-19, 24-27, vector 1 the
 * 4-7, 12-15 ... between them, vectors 2 and 3 the same 32 columns on; sums_of_pairs puts
 * them back in order. */
INLINE void interleave_values_i8(const int8_t *r0, const int8_t *r1, int16_t *out) {
    for (int h = 0; h < 2; h++) {
        const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r0 + 32 * h)));
        const __m512i b = r1 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r1 + 32 * h)))
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 64 * h, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(out + 64 * h + 32, _mm512_unpackhi_epi16(a, b));
    }
}

/* p[from .. n) (>= 0) as int16 weights w[t] = rint(p[t] * 32767 / max p), w zero over the
 * rest of its pairs (from & ~1 .. n rounded up to even); returns max p / 32767, the value
 * of one step (0 with every weight 0). Each weight is off by at most half a step: over a
 * chunk of c keys, c / 65534 of the chunk's largest weight. */
INLINE float weights_i16(const float *p, int64_t from, int64_t n, int16_t *w) {
    const int64_t lo = from & ~(int64_t)1, hi = (n + 1) & ~(int64_t)1;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t t = lo; t < hi; t += 16) {
        const int64_t a = from - t > 0 ? from - t : 0, b = n - t < 16 ? n - t : 16;
        const __mmask16 m = (__mmask16)(lanes(b) & ~lanes(a));
        mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(m, p + t));
    }
    const float top = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    for (int64_t t = lo; t < hi; t += 16) {
        const int64_t a = from - t > 0 ? from - t : 0, b = n - t < 16 ? n - t : 16;
        const __mmask16 m = (__mmask16)(lanes(b) & ~lanes(a));
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + t), inv));
        _mm256_mask_storeu_epi16(w + t, lanes(hi - t), _mm512_cvtepi32_epi16(q));
    }
    return top / 32767.0f;
}

/* acc + two tokens' products: lane c of x times w's two int16 weights (broadcast). */
INLINE __m512i dot_pairs_i16(__m512i acc, __m512i x, __m512i w) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, x, w);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}

/* ACC_ROWS_I16 rows' sums over token pairs P0 .. P1 - 1 of one group of 64 columns (g):
 * o_r = o_r * alpha_r + step_r * sum_t w_r[t] v[t], in int32 (exact: 2 x 32767 x 128 per
 * pair, at most 128 pairs a chunk) until the chunk's end. */
#define ACC_ROWS_I16 4
INLINE void sums_of_pairs_block(float *o, int64_t dp, const int16_t *w, int64_t w_stride,
                                const float *alpha, const float *step, const int16_t *pairs,
                                int64_t pair_stride, int64_t P0, int64_t P1, int64_t g,
                                const int nr) {
    __m512i acc[ACC_ROWS_I16][4];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
    for (int64_t P = P0; P < P1; P++) {
        const int16_t *x = pairs + P * pair_stride + g * 128;
        const __m512i x0 = _mm512_loadu_si512(x), x1 = _mm512_loadu_si512(x + 32);
        const __m512i x2 = _mm512_loadu_si512(x + 64), x3 = _mm512_loadu_si512(x + 96);
        for (int r = 0; r < nr; r++) {
            int32_t both;
            memcpy(&both, w + r * w_stride + 2 * P, 4);
            const __m512i wr = _mm512_set1_epi32(both);
            acc[r][0] = dot_pairs_i16(acc[r][0], x0, wr);
            acc[r][1] = dot_pairs_i16(acc[r][1], x1, wr);
            acc[r][2] = dot_pairs_i16(acc[r][2], x2, wr);
            acc[r][3] = dot_pairs_i16(acc[r][3], x3, wr);
        }
    }
    for (int r = 0; r < nr; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]), s = _mm512_set1_ps(step[r]);
        float *orow = o + r * dp + g * 64;
        for (int h = 0; h < 2; h++) { /* back in column order (interleave_values_i8) */
            const __m512 lo = _mm512_cvtepi32_ps(acc[r][2 * h]), hi = _mm512_cvtepi32_ps(acc[r][2 * h + 1]);
            const __m512 first = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
            const __m512 second = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
            const __m512 cols[2] = {_mm512_shuffle_f32x4(first, first, _MM_SHUFFLE(3, 1, 2, 0)),
                                    _mm512_shuffle_f32x4(second, second, _MM_SHUFFLE(3, 1, 2, 0))};
            for (int k = 0; k < 2; k++) {
                float *oc = orow + 32 * h + 16 * k;
                _mm512_storeu_ps(oc, _mm512_fmadd_ps(cols[k], s, _mm512_mul_ps(_mm512_loadu_ps(oc), a)));
            }
        }
    }
}

/* sums_of_pairs_block over every group of 64 columns, for nr rows (any count). */
INLINE void sums_of_pairs(float *o, int64_t dp, const int16_t *w, int64_t w_stride,
                          const float *alpha, const float *step, const int16_t *pairs,
                          int64_t d, int64_t P0, int64_t P1, int64_t nr) {
    for (int64_t r0 = 0; r0 < nr; r0 += ACC_ROWS_I16) {
        const int64_t rb = nr - r0 < ACC_ROWS_I16 ? nr - r0 : ACC_ROWS_I16;
        float *orow = o + r0 * dp;
        const int16_t *wr = w + r0 * w_stride;
        for (int64_t g = 0; g < d / 64; g++) {
#define SUMS(rows) \
    sums_of_pairs_block(orow, dp, wr, w_stride, alpha + r0, step + r0, pairs, 2 * d, P0, P1, g, rows)
            switch (rb) {
            case 4: SUMS(4); break;
            case 3: SUMS(3); break;
            case 2: SUMS(2); break;
            default: SUMS(1); break;
            }
#undef SUMS
        }
    }
}

/* Lanes of element i.. of a row of dtype dt, as float32 (int8: unscaled). */
INLINE vf vload(const void *p, int64_t i, int dt, vmask m) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    if (dt == DT_FP8) return vmul(vload_fp8_over_256(p, i, m), vset1(256.0f));
    if (dt == DT_I8) return vload_i8(p, i, m);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* A whole vector of 16-bit elements (bfloat16 / float16) at element i, as float32. */
INLINE vf vload16_full(const uint16_t *p, int64_t i, int dt) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)(p + i));
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* float32 -> bfloat16 bits (round to nearest even; NaN -> quiet NaN), in the high halves. */
#ifdef RINGLLM_AVX512_BF16
INLINE __m256i bf16_bits(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }

INLINE __m512i bf16_high(vf v) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16);
}
#else
INLINE __m512i bf16_high(vf v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

INLINE __m256i bf16_bits(vf v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high(v), 16));
}
#endif

INLINE void vstore(void *p, int64_t i, vf v, int dt, vmask m) {
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
INLINE vf vround(vf v, int dt) {
    if (dt == DT_F32) return v;
    if (dt == DT_BF16) return _mm512_castsi512_ps(bf16_high(v));
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* e^x, relative error ~2e-7: x = n ln2 + r (|r| <= ln2 / 2), e^r by its Taylor series to r^7,
 * then scaled by 2^n. Inputs are clamped to where float32 e^x is 0 .. finite. */
INLINE vf vexp(vf x) {
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

/* Lanes of v below t (or NaN) take b's value, the others a's. */
INLINE vf vselect_below(vf v, vf t, vf a, vf b) {
    return _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(v, t, _CMP_NGE_UQ), b);
}

/* ln x for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s) for
 * s = (m - 1) / (m + 1), |s| <= 0.172, by its series to s^9 (the next term under 1e-9). */
INLINE vf vlog(vf x) {
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __m512 e = _mm512_getexp_ps(x);
    const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
    const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.0f)),
                                   _mm512_add_ps(m, _mm512_set1_ps(1.0f)));
    const __m512 z = _mm512_mul_ps(s, s);
    __m512 p = _mm512_set1_ps(2.0f / 9.0f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.0f / 7.0f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.0f / 5.0f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.0f / 3.0f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.0f));
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147180559945f), _mm512_mul_ps(s, p));
}

/* VL Exp(1) draws of 32-bit values (cpu_ops_generic.c exp_draw_of, the same arithmetic):
 * below one half -ln f; above, -ln(1 - f) as -(ln y - ((y - 1) + f) / y) for y = fl(1 - f),
 * the rounding of y corrected to first order (y - 1 is exact). */
INLINE vf vexp_draw(const uint32_t *bits) {
    const __m512i b = _mm512_loadu_si512(bits);
    const __mmask16 hi = _mm512_movepi32_mask(b);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i t = _mm512_xor_si512(b, _mm512_srai_epi32(b, 31));
    const __m512 f = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(0.5f)),
                                   _mm512_set1_ps(0x1p-32f));
    const __m512 y = _mm512_mask_sub_ps(f, hi, one, f);
    const __m512 c = _mm512_maskz_div_ps(hi, _mm512_add_ps(_mm512_sub_ps(y, one), f), y);
    return _mm512_sub_ps(c, vlog(y));
}

/* The 16 horizontal sums of v[0..15], as one vector (lane u = sum of v[u]'s lanes): a
 * transposing tree of 15 adds and 30 shuffles instead of 16 separate reductions. */
INLINE vf vsum_lanes(const vf *v) {
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

/* Index of the largest of x[0..n) (the first on ties; the first NaN if any, as torch). */
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

#endif
