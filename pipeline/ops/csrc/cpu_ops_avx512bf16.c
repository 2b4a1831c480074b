/* The SIMD kernels (simd_kernels.h) for AVX-512 with AVX512_BF16: `avx512bf16_kernels`.
 * float32 -> bfloat16 rounding is one instruction, and bfloat16 q.k products run straight
 * from the cache (VDPBF16PS), int8 ones by VPDPBUSD. Only called when the CPU reports
 * AVX512_BF16 and AVX512_VNNI (every CPU with the first has the second: Cooper Lake,
 * Sapphire Rapids and later, AMD Zen 4 and 5). */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma,f16c,amx-tile,amx-bf16")
#define RINGLLM_AVX512_BF16 1
#define KERNELS avx512bf16_kernels
#define KERNELS_NAME "avx512bf16"
#define BF16_DOT 1
#define ATTN_TILES 1 /* attention on the AMX tile unit, where asked and the process has it */

#include "simd_avx512.h"
#include "simd_kernels.h"
#endif
