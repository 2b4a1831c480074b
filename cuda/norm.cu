// RMSNorm over the last dim, optionally fused with the residual add that precedes it.
//
// Numerics follow TorchOps.rms_norm: with a residual, h = x + residual is rounded to the
// element type first (that rounded h is also returned as the new residual); the mean of
// squares is taken in float32; norm(h) is rounded to the element type, then multiplied
// by the weight and rounded again (torch multiplies two tensors of the element type).
//
// Launch: grid = (num_tokens), block = (multiple of 32, <= 1024); one CTA per row, each
// thread owning the columns tid, tid + blockDim.x, ... in both passes, so the second
// pass re-reads only what the same thread wrote.
#include "common.cuh"

namespace ringllm {

template <class T>
__device__ void rms_norm_row(T* __restrict__ out, T* __restrict__ residual_out,
                             const T* __restrict__ x, const T* __restrict__ residual,
                             const T* __restrict__ weight, int hidden_size, float eps) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const T* x_row = x + row * hidden_size;
  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    float h = to_float(x_row[i]);
    if (residual != nullptr) {
      h = round_to<T>(h + to_float(residual[row * hidden_size + i]));
      residual_out[row * hidden_size + i] = from_float<T>(h);
    }
    sum_squares += h * h;
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / hidden_size + eps);
  const T* h_row = residual != nullptr ? residual_out + row * hidden_size : x_row;
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    const float normed = round_to<T>(to_float(h_row[i]) * inv_rms);
    out[row * hidden_size + i] = from_float<T>(to_float(weight[i]) * normed);
  }
}

}  // namespace ringllm

#define RINGLLM_NORM_KERNELS(suffix, T)                                                        \
  extern "C" __global__ void rms_norm_##suffix(T* out, const T* x, const T* weight,           \
                                               int hidden_size, float eps) {                  \
    ringllm::rms_norm_row<T>(out, nullptr, x, nullptr, weight, hidden_size, eps);             \
  }                                                                                           \
  extern "C" __global__ void fused_add_rms_norm_##suffix(T* out, T* residual_out, const T* x, \
                                                         const T* residual, const T* weight,  \
                                                         int hidden_size, float eps) {        \
    ringllm::rms_norm_row<T>(out, residual_out, x, residual, weight, hidden_size, eps);       \
  }

RINGLLM_NORM_KERNELS(f32, float)
RINGLLM_NORM_KERNELS(f16, __half)
RINGLLM_NORM_KERNELS(bf16, __nv_bfloat16)
