/* The SIMD kernels (simd_kernels.h) for AVX-512 with AVX512_BF16: `avx512bf16_kernels`.
 * float32 -> bfloat16 rounding is one instruction, and bfloat16 q.k products run straight
 * from the cache (VDPBF16PS). Only called when the CPU reports AVX512_BF16. */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#define RINGLLM_AVX512_BF16 1
#define KERNELS avx512bf16_kernels
#define KERNELS_NAME "avx512bf16"
#define BF16_DOT 1

#include "simd_avx512.h"
#include "simd_kernels.h"
#endif
