/* The SIMD kernels (simd_kernels.h) for AVX2 with FMA and F16C: `avx2_kernels`, the set of
 * x86-64 CPUs without AVX-512 (AMD Zen 1-3, Intel Haswell and later client parts). Only
 * called when the CPU reports all three (cpu_ops_module.c checks). */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#define KERNELS avx2_kernels
#define KERNELS_NAME "avx2"
#define BF16_DOT 0

#include "simd_avx2.h"
#include "simd_kernels.h"
#endif
