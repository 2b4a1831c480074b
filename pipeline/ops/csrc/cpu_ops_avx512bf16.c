/* The AVX-512 kernels again, for CPUs that also have AVX512_BF16 (see cpu_ops_avx512.c). */
#define RINGLLM_AVX512_BF16 1
#include "cpu_ops_avx512.c"
