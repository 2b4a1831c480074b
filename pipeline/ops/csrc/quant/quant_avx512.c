/* The AVX-512 F/BW/VL/DQ set (`quant_avx512`): u8 x s8 dot products by maddubs + madd on
 * zmm (quant_avx512.h). */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "quant_avx512.h"

#define DOT_MADDUBS 1 /* int16 runs of chunks before widening (quant_gemm.h run_of) */
#define VI_MADDUBS(w, a) _mm512_maddubs_epi16((w), (a))
#define VI_ADD16(a, b) _mm512_add_epi16((a), (b))
#define VI_WIDEN_ADD(acc, t) _mm512_add_epi32((acc), _mm512_madd_epi16((t), _mm512_set1_epi16(1)))
#define DOT_U(acc, w, a)                                                                   \
    _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((w), (a)),              \
                                              _mm512_set1_epi16(1)))

#include "quant_decode.h"
#include "quant_gemm.h"

QUANT_SET(quant_avx512, "avx512")
#endif
