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
