/* The vector layer of the AVX-512 sets (F/BW/VL/DQ): panels of 16 rows, one zmm of
 * 4 k x 16 rows per chunk. The including file picks DOT_U (maddubs + madd, or vpdpbusd)
 * and its `#pragma GCC target`. AVX-512 has no vpsignb: the sign trick negates q under
 * the mask of w's sign bits. */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "quant.h"

#define QR 16
#define MK_MR 8 /* 8 rows: 8 float + 16 int accumulators of the 32 zmm registers */
typedef __m512i vi;
typedef __m512 vf;
typedef __mmask64 vsm;

static inline vi bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

#define VI_ZERO() _mm512_setzero_si512()
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_BCAST32(p) bcast32(p)
#define VSM(w) _mm512_movepi8_mask(w)
#define VI_ABS8(w) _mm512_abs_epi8(w)
#define VI_APPLYSIGN(a, sm) _mm512_mask_sub_epi8((a), (sm), _mm512_setzero_si512(), (a))
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_STORE(p, v) _mm512_storeu_ps((p), (v))
#define VF_SET1(x) _mm512_set1_ps(x)
#define VF_MUL(a, b) _mm512_mul_ps((a), (b))
#define VF_ADD(a, b) _mm512_add_ps((a), (b))
#define VF_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VF_CVT(v) _mm512_cvtepi32_ps(v)
/* the GEMV's in-register decoding (quant_gemm.h gemv_panels) */
#define VI_AND(a, b) _mm512_and_si512((a), (b))
#define VI_OR(a, b) _mm512_or_si512((a), (b))
#define VI_SLL16(a, n) _mm512_slli_epi16((a), (n))
#define VI_SRL16(a, n) _mm512_srli_epi16((a), (n))
#define VI_SET1_8(x) _mm512_set1_epi8(x)
/* the K-quants' integer scales (quant_kq.h) */
#define VI_SET1_32(x) _mm512_set1_epi32(x)
#define VI_ADD32(a, b) _mm512_add_epi32((a), (b))
#define VI_SUB32(a, b) _mm512_sub_epi32((a), (b))
#define VI_SLLI32(a, n) _mm512_slli_epi32((a), (n))
#define VI_MADD16(a, b) _mm512_madd_epi16((a), (b))
#define VI_MULLO32(a, b) _mm512_mullo_epi32((a), (b))
#define VI_CVTU8_32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VI_CVTS8_32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define VF_NEG(v) _mm512_xor_ps((v), _mm512_set1_ps(-0.0f))
#define VF_H2F(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VF_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF_S8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

static inline void h2f_row(float *dst, const uint8_t *src) {
    _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src)));
}

static inline void u8_to_float_row(float *dst, const uint8_t *src) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
}

static inline void s8_to_float_row(float *dst, const uint8_t *src) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
}
