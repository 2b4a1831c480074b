// Shared by every kernel source: element-type conversions and warp/block reductions.
//
// The loader pastes this file in place of `#include "common.cuh"`, so NVRTC, nvcc and the
// CPU emulator (emulator.h) all see the same text. Kernels compute in float32 and convert
// at the loads and stores only, rounding to nearest even like torch's `.to(dtype)`.
#ifndef RINGLLM_COMMON_CUH
#define RINGLLM_COMMON_CUH

#ifndef RINGLLM_EMULATOR
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace ringllm {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// float8 e4m3fn, the KV cache's `fp8` (1 sign, 4 exponent bits biased by 7, 3 mantissa
// bits; no infinities, 0x7f / 0xff NaN, largest 448): one byte. Converted with integer and
// float32 arithmetic only, so NVRTC, nvcc and the emulator read the same text (no
// cuda_fp8.h); the CPU kernels' pipeline/ops/csrc/cpu_ops.h does the same steps.
struct fp8_e4m3 {
  unsigned char bits;
};

// (8 + m) * 2^(e - 10) for e > 0 (a float32 of exponent e + 120 and mantissa m << 20),
// m * 2^-9 for e = 0.
__device__ __forceinline__ float to_float(fp8_e4m3 x) {
  const unsigned b = x.bits;
  if ((b & 0x7fu) == 0x7fu) return __int_as_float(0x7fc00000);
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e ? __int_as_float(((e + 120) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return (b & 0x80u) ? -mag : mag;
}

// Round to nearest even, saturating at +-448 (an infinity too, as torch's `.to()` and
// vLLM's cache writes do); NaN -> 0x7f.
template <>
__device__ __forceinline__ fp8_e4m3 from_float<fp8_e4m3>(float x) {
  const unsigned u = __float_as_uint(x);
  const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
  const unsigned a = u & 0x7fffffffu;
  fp8_e4m3 r;
  if (a > 0x7f800000u) {
    r.bits = sign | 0x7fu;
  } else if (a < 0x3c800000u) {  // below 2^-6: m * 2^-9, m = 0..8, ties to even
    const float scaled = __uint_as_float(a) * 512.0f;  // exact
    unsigned m = (unsigned)scaled;
    const float rest = scaled - (float)m;
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    r.bits = sign | (unsigned char)m;
  } else {
    unsigned v = (((a >> 23) - 120u) << 3) | ((a >> 20) & 7u);
    const unsigned rem = a & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (v & 1u))) ++v;
    r.bits = sign | (unsigned char)(v > 0x7eu ? 0x7eu : v);
  }
  return r;
}

// The int8 KV cache (--kv-cache-dtype int8, pipeline/ops/kv_int8.py: the specification):
// `signed char` values q in -127..127, each worth q * scale[block, kv_head], one float32
// scale per (block, KV head) kept right after the cache's values (kv_int8.scales_ptr);
// kernels take the scales as a separate `const float*`. Caches that hold their values
// (T's own, fp8) have no scales: their kernels pass null and read them with a factor of 1.
constexpr int kInt8Max = 127;

__device__ __forceinline__ float to_float(signed char x) { return (float)x; }

template <class C>
constexpr bool kScaledCache = false;
template <>
constexpr bool kScaledCache<signed char> = true;

// What a read of the rows of (block, kv_head) is multiplied by: the int8 cache's scale, or 1.
template <class C>
__device__ __forceinline__ float cache_scale(const float* scales, long long block, int num_kv_heads,
                                             int kv_head) {
  if constexpr (kScaledCache<C>) return scales[block * num_kv_heads + kv_head];
  return 1.0f;
}

// Rounds a float32 value to T and back: the value torch holds after `.to(T)`.
template <class T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// -inf without relying on <cmath>'s INFINITY macro, which NVRTC sources cannot include.
__device__ __forceinline__ float negative_infinity() { return -__int_as_float(0x7f800000); }

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kWarpSize = 32;

// Butterfly reductions: every lane ends with the result of the whole warp.
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarp, x, offset);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, offset));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory; the call ends with a barrier so the
// scratch can be reused at once.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < num_warps ? scratch[lane] : 0.0f;
  x = warp_sum(x);
  __syncthreads();
  return x;
}

}  // namespace ringllm

#endif  // RINGLLM_COMMON_CUH
