/* The vector layer of the SIMD kernels (simd_kernels.h) for AVX2 + FMA + F16C: 8 float32
 * lanes, bfloat16 widened by a shift and float16 by VCVTPH2PS in registers.
 *
 * AVX2 has no masked loads of 16-bit elements, so a partial row (the tail of a row whose
 * length is not a multiple of 8) is a lane count here, not a mask register: full vectors
 * take the plain load; a tail is copied through a zeroed 32-byte buffer (float32 tails use
 * VMASKMOVPS, which faults on no masked-off lane). Rows the models use (head sizes 64 and
 * 128, hidden sizes that are multiples of 64) have no tail.
 *
 * Included by a translation unit that has set `#pragma GCC target(...)` for the ISA first.
 */
#ifndef RINGLLM_SIMD_AVX2_H
#define RINGLLM_SIMD_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu_ops.h"

#define INLINE static inline __attribute__((always_inline))
#define VL 8 /* float32 lanes */

typedef __m256 vf;
typedef int vmask; /* lanes in use, 0..8 */

INLINE vmask lanes(int64_t n) { return n >= 8 ? 8 : n < 0 ? 0 : (int)n; }

/* Lane i is all ones where i < m. */
INLINE __m256i lane_bits(vmask m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
INLINE vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vloadu(const float *p) { return _mm256_loadu_ps(p); }
INLINE void vstoreu(float *p, vf v) { _mm256_storeu_ps(p, v); }

INLINE float vreduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float vreduce_max(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* float32 rows: lanes past m read as zero (or `fill`) and are not written. */
INLINE vf vloadu_part(const float *p, vmask m) {
    return m == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_bits(m));
}

INLINE vf vloadu_fill(const float *p, vmask m, float fill) {
    if (m == 8) return _mm256_loadu_ps(p);
    const __m256i bits = lane_bits(m);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, bits),
                            _mm256_castsi256_ps(bits));
}

INLINE void vstoreu_part(float *p, vmask m, vf v) {
    if (m == 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, lane_bits(m), v);
}

INLINE vf vkeep(vf v, vmask m) {
    return m == 8 ? v : _mm256_and_ps(v, _mm256_castsi256_ps(lane_bits(m)));
}

/* 8 16-bit elements of p + i, the lanes past m zero. */
INLINE __m128i load_halves(const void *p, int64_t i, vmask m) {
    const uint16_t *src = (const uint16_t *)p + i;
    if (m == 8) return _mm_loadu_si128((const __m128i *)src);
    uint16_t buf[8] = {0};
    memcpy(buf, src, (size_t)m * 2);
    return _mm_loadu_si128((const __m128i *)buf);
}

INLINE void store_halves(void *p, int64_t i, __m128i h, vmask m) {
    uint16_t *dst = (uint16_t *)p + i;
    if (m == 8) {
        _mm_storeu_si128((__m128i *)dst, h);
        return;
    }
    uint16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, h);
    memcpy(dst, buf, (size_t)m * 2);
}

/* 8 fp8 e4m3fn elements (the low 8 bytes of b) as float32 values / 256: each byte's bits
 * moved into a float16's place (sign to bit 15, the rest up by 7) are its value / 2^8
 * (cpu_ops.h), which VCVTPH2PS widens. A NaN byte (never written: the cache saturates)
 * reads 480 / 256. */
INLINE vf fp8_to_vf_over_256(__m128i b) {
    /* byte << 8, shifted right by one with its sign: the sign stays at bit 15 and lands on
     * bit 14 too, which the mask clears; the other 7 bits sit at 13..7 */
    const __m128i w = _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1);
    return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16((short)0xbf80)));
}

/* Lanes of element i.. of an fp8 row, as float32 values / 256 (the attention kernel folds
 * the 256 into its query scale and its output instead: one product less per vector). */
INLINE vf vload_fp8_over_256(const void *p, int64_t i, vmask m) {
    const uint8_t *src = (const uint8_t *)p + i;
    if (m == 8) return fp8_to_vf_over_256(_mm_loadl_epi64((const __m128i *)src));
    uint8_t buf[16] = {0};
    memcpy(buf, src, (size_t)m);
    return fp8_to_vf_over_256(_mm_loadu_si128((const __m128i *)buf));
}

/* Lanes of element i.. of an int8 row as float32, unscaled (the scale is its block's):
 * a whole vector is one sign-extending load (VPMOVSXBD) and one conversion. */
INLINE vf vload_i8(const void *p, int64_t i, vmask m) {
    const int8_t *src = (const int8_t *)p + i;
    if (m == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
    int8_t buf[16] = {0};
    memcpy(buf, src, (size_t)m);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)buf)));
}

/* q . k of two int8 rows of d elements (d a multiple of I8_DOT_STEP) as VL partial sums
 * (their total is the dot product, exact in int32): VPMADDUBSW takes an unsigned and a
 * signed operand, so k's sign moves onto q and |k| is the unsigned one. No saturation:
 * |q|, |k| <= 127, so a pair of products is at most 32,258. */
#define I8_DOT_STEP 32
#define I8_DOT_OFFSET 0 /* no offset in the sums (simd_avx512.h: VNNI's has one) */
INLINE vf dot_i8(const int8_t *q, const int8_t *k, int64_t d) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = 0; j < d; j += 32) {
        const __m256i kj = _mm256_loadu_si256((const __m256i *)(k + j));
        const __m256i qj = _mm256_loadu_si256((const __m256i *)(q + j));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(kj, kj), _mm256_sign_epi8(qj, kj));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    return _mm256_cvtepi32_ps(acc);
}

/* Lanes of element i.. of a row of dtype dt, as float32 (int8: unscaled). */
INLINE vf vload(const void *p, int64_t i, int dt, vmask m) {
    if (dt == DT_F32) return vloadu_part((const float *)p + i, m);
    if (dt == DT_FP8) return vmul(vload_fp8_over_256(p, i, m), vset1(256.0f));
    if (dt == DT_I8) return vload_i8(p, i, m);
    const __m128i h = load_halves(p, i, m);
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* A whole vector of 16-bit elements (bfloat16 / float16) at element i, as float32. */
INLINE vf vload16_full(const uint16_t *p, int64_t i, int dt) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(p + i));
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* float32 -> bfloat16 (round to nearest even; NaN -> quiet NaN), in the high halves. */
INLINE __m256i bf16_high(vf v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
}

/* The 8 bfloat16 of v packed into 128 bits (the high halves of each lane, in order). */
INLINE __m128i bf16_bits(vf v) {
    const __m256i hi = _mm256_srli_epi32(bf16_high(v), 16); /* 0x0000hhhh per lane */
    return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}

INLINE void vstore(void *p, int64_t i, vf v, int dt, vmask m) {
    if (dt == DT_F32) {
        vstoreu_part((float *)p + i, m, v);
        return;
    }
    const __m128i h = dt == DT_BF16
                          ? bf16_bits(v)
                          : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    store_halves(p, i, h, m);
}

/* v rounded to the element type and back (torch rounds every op's output). */
INLINE vf vround(vf v, int dt) {
    if (dt == DT_F32) return v;
    if (dt == DT_BF16) return _mm256_castsi256_ps(bf16_high(v));
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* e^x, the same series as the AVX-512 layer's; 2^n (n in -150..128) is applied as two
 * exact powers 2^(n/2) and 2^(n - n/2), each a normal float, so a result in the subnormal
 * range is rounded once, as VSCALEFPS rounds it. */
INLINE vf vexp(vf x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* Lanes of v below t (or NaN) take b's value, the others a's. */
INLINE vf vselect_below(vf v, vf t, vf a, vf b) {
    return _mm256_blendv_ps(a, b, _mm256_cmp_ps(v, t, _CMP_NGE_UQ));
}

/* ln x for normal x > 0, the AVX-512 layer's series; m and e from the float's bits. */
INLINE vf vlog(vf x) {
    const __m256i bits = _mm256_castps_si256(x);
    __m256 e = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
    const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
    const __m256 s = _mm256_div_ps(_mm256_sub_ps(m, _mm256_set1_ps(1.0f)),
                                   _mm256_add_ps(m, _mm256_set1_ps(1.0f)));
    const __m256 z = _mm256_mul_ps(s, s);
    __m256 p = _mm256_set1_ps(2.0f / 9.0f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.0f / 7.0f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.0f / 5.0f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.0f / 3.0f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.0f));
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693147180559945f), _mm256_mul_ps(s, p));
}

/* VL Exp(1) draws of 32-bit values: the AVX-512 layer's vexp_draw. */
INLINE vf vexp_draw(const uint32_t *bits) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)bits);
    const __m256i sign = _mm256_srai_epi32(b, 31);
    const __m256 hi = _mm256_castsi256_ps(sign), one = _mm256_set1_ps(1.0f);
    const __m256 f = _mm256_mul_ps(
        _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_xor_si256(b, sign)), _mm256_set1_ps(0.5f)),
        _mm256_set1_ps(0x1p-32f));
    const __m256 y = _mm256_blendv_ps(f, _mm256_sub_ps(one, f), hi);
    const __m256 c = _mm256_and_ps(hi, _mm256_div_ps(_mm256_add_ps(_mm256_sub_ps(y, one), f), y));
    return _mm256_sub_ps(c, vlog(y));
}

/* The 8 horizontal sums of v[0..7], as one vector (lane u = sum of v[u]'s lanes). */
INLINE vf vsum_lanes(const vf *v) {
    /* hadd(a, b) per 128-bit half = [a0+a1, a2+a3, b0+b1, b2+b3]; two rounds leave, per
     * half, the half-sums of four vectors, and the halves of the two results are added */
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t, u, 0x20), _mm256_permute2f128_ps(t, u, 0x31));
}

/* Index of the largest of x[0..n) (the first on ties; the first NaN if any, as torch). */
INLINE int64_t argmax_row(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i best_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i at = best_at;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        /* lanes past the row read as -inf: never NaN, never above the best */
        const __m256 v = vloadu_fill(x + j, lanes(n - j), -INFINITY);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 up = _mm256_cmp_ps(v, best, _CMP_GT_OQ); /* strict: the first wins */
        best = _mm256_blendv_ps(best, v, up);
        best_at = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), up));
        at = _mm256_add_epi32(at, step);
    }
    if (_mm256_movemask_ps(nan)) { /* torch: the first NaN */
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) return j;
    }
    const float top = vreduce_max(best);
    float vals[8];
    int32_t at_lane[8];
    _mm256_storeu_ps(vals, best);
    _mm256_storeu_si256((__m256i *)at_lane, best_at);
    int64_t first = -1; /* the smallest index among the lanes holding the maximum */
    for (int u = 0; u < 8; u++)
        if (vals[u] == top && (first < 0 || at_lane[u] < first)) first = at_lane[u];
    return first;
}

#endif
