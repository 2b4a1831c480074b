// SiLU-and-mul, the gate of a gated MLP: x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]  ([T, I]).
//
// Numerics follow TorchOps.silu_and_mul: silu is computed in float32 and rounded to the
// element type (torch's silu output), then multiplied by `up` and rounded again.
//
// Launch: grid = (num_tokens), block = (up to 1024 threads striding over I).
#include "common.cuh"

namespace ringllm {

template <class T>
__device__ void silu_and_mul_row(T* __restrict__ out, const T* __restrict__ x, int intermediate_size) {
  const long long row = blockIdx.x;
  const T* gate = x + row * 2 * intermediate_size;
  const T* up = gate + intermediate_size;
  for (int i = threadIdx.x; i < intermediate_size; i += blockDim.x) {
    const float g = to_float(gate[i]);
    const float silu = round_to<T>(g / (1.0f + expf(-g)));
    out[row * intermediate_size + i] = from_float<T>(silu * to_float(up[i]));
  }
}

}  // namespace ringllm

#define RINGLLM_ACTIVATION_KERNELS(suffix, T)                                                 \
  extern "C" __global__ void silu_and_mul_##suffix(T* out, const T* x, int intermediate_size) { \
    ringllm::silu_and_mul_row<T>(out, x, intermediate_size);                                 \
  }

RINGLLM_ACTIVATION_KERNELS(f32, float)
RINGLLM_ACTIVATION_KERNELS(f16, __half)
RINGLLM_ACTIVATION_KERNELS(bf16, __nv_bfloat16)
