/* The AVX2 + FMA + F16C set (`quant_avx2`): panels of 8 rows, one ymm of 4 k x 8 rows per
 * chunk; u8 x s8 dot products by maddubs (pairs into int16) + madd by ones (into int32).
 * 4-6 bit weights times |q| <= 127 stay far from int16's limit; the 8-bit types take the
 * sign trick (|w| times q with w's sign: at most 2 x 128 x 127 = 32512). */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "quant.h"

#define QR 8
#define MK_MR 4 /* 4 rows: 4 float + 8 int accumulators of the 16 ymm registers */
typedef __m256i vi;
typedef __m256 vf;
typedef __m256i vsm;

static inline vi bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* a row sum held in a register at this point (quant_gemm.h mk_body) */
#define VI_PIN(v) __asm__("" : "+x"(v))
#define VI_ZERO() _mm256_setzero_si256()
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_BCAST32(p) bcast32(p)
#define DOT_MADDUBS 1 /* int16 runs of chunks before widening (quant_gemm.h run_of) */
#define VI_MADDUBS(w, a) _mm256_maddubs_epi16((w), (a))
#define VI_ADD16(a, b) _mm256_add_epi16((a), (b))
#define VI_WIDEN_ADD(acc, t) _mm256_add_epi32((acc), _mm256_madd_epi16((t), _mm256_set1_epi16(1)))
#define DOT_U(acc, w, a)                                                                   \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (a)),              \
                                              _mm256_set1_epi16(1)))
#define VSM(w) (w)
#define VI_ABS8(w) _mm256_abs_epi8(w)
#define VI_APPLYSIGN(a, sm) _mm256_sign_epi8((a), (sm))
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_STORE(p, v) _mm256_storeu_ps((p), (v))
#define VF_SET1(x) _mm256_set1_ps(x)
#define VF_MUL(a, b) _mm256_mul_ps((a), (b))
#define VF_ADD(a, b) _mm256_add_ps((a), (b))
#define VF_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VF_CVT(v) _mm256_cvtepi32_ps(v)
/* the GEMV's in-register decoding (quant_gemm.h gemv_panels) */
#define VI_AND(a, b) _mm256_and_si256((a), (b))
#define VI_OR(a, b) _mm256_or_si256((a), (b))
#define VI_SLL16(a, n) _mm256_slli_epi16((a), (n))
#define VI_SRL16(a, n) _mm256_srli_epi16((a), (n))
#define VI_SET1_8(x) _mm256_set1_epi8(x)
/* the K-quants' integer scales (quant_kq.h) */
#define VI_SET1_32(x) _mm256_set1_epi32(x)
#define VI_ADD32(a, b) _mm256_add_epi32((a), (b))
#define VI_SUB32(a, b) _mm256_sub_epi32((a), (b))
#define VI_SLLI32(a, n) _mm256_slli_epi32((a), (n))
#define VI_MADD16(a, b) _mm256_madd_epi16((a), (b))
#define VI_CVTU8_32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VI_CVTS8_32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define VF_NEG(v) _mm256_xor_ps((v), _mm256_set1_ps(-0.0f))
#define VF_H2F(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VF_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF_S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

static inline void h2f_row(float *dst, const uint8_t *src) {
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)));
}

static inline void u8_to_float_row(float *dst, const uint8_t *src) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)src);
    _mm256_storeu_ps(dst, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
}

static inline void s8_to_float_row(float *dst, const uint8_t *src) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)src);
    _mm256_storeu_ps(dst, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
}

#include "quant_decode.h"
#include "quant_gemm.h"

QUANT_SET(quant_avx2, "avx2")
#endif
