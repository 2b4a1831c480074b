/* The SIMD kernels (simd_kernels.h) for AVX-512 F/BW/VL/DQ: `avx512_kernels`. Only called
 * when the CPU reports those features (cpu_ops_module.c checks). */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#define KERNELS avx512_kernels
#define KERNELS_NAME "avx512"
#define BF16_DOT 0

#include "simd_avx512.h"
#include "simd_kernels.h"
#endif
