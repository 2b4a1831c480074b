/* The AVX-512 VNNI set (`quant_avx512vnni`): one vpdpbusd per chunk and row, u8 x s8
 * summed in fours straight into int32 (no int16 step to saturate). */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define FLIP8 0x80 /* vpdpbusd takes u8 x s8 without saturation: q8_0 / i8 as w + 128 */
#include "quant_avx512.h"

#define DOT_U(acc, w, a) _mm512_dpbusd_epi32((acc), (w), (a))
/* acc + a.lo16 x b.lo16 + a.hi16 x b.hi16: a sum within int16 times a scale (hi16 0) */
#define VI_DPWSSD(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))

#include "quant_decode.h"
#include "quant_gemm.h"

QUANT_SET(quant_avx512vnni, "avx512vnni")
#endif
