// The gate of a gated MLP: x [T, 2 * I] -> act(x[:, :I]) * x[:, I:]  ([T, I]), act SiLU
// (silu_and_mul_*) or GELU with the tanh approximation (gelu_tanh_and_mul_*, Gemma's GeGLU).
//
// Numerics follow TorchOps: act is computed in float32 and rounded to the element type
// (torch's activation output), then multiplied by `up` and rounded again. GELU(tanh) is
// written as a sigmoid, as the CPU kernels write it: g / 2 * (1 + tanh(u)) = g / (1 + exp(-2u)).
//
// Launch: grid = (num_tokens), block = (up to 1024 threads striding over I).
#include "common.cuh"

namespace ringllm {

template <class T, bool kGelu>
__device__ void gated_act_row(T* __restrict__ out, const T* __restrict__ x, int intermediate_size) {
  const long long row = blockIdx.x;
  const T* gate = x + row * 2 * intermediate_size;
  const T* up = gate + intermediate_size;
  for (int i = threadIdx.x; i < intermediate_size; i += blockDim.x) {
    const float g = to_float(gate[i]);
    // 2u = g (2 sqrt(2 / pi) + 2 sqrt(2 / pi) 0.044715 g^2)
    const float z = kGelu ? g * (1.5957691216057308f + 0.07135481627260025f * g * g) : g;
    const float act = round_to<T>(g / (1.0f + expf(-z)));
    out[row * intermediate_size + i] = from_float<T>(act * to_float(up[i]));
  }
}

}  // namespace ringllm

#define RINGLLM_ACTIVATION_KERNELS(suffix, T)                                                      \
  extern "C" __global__ void silu_and_mul_##suffix(T* out, const T* x, int intermediate_size) {      \
    ringllm::gated_act_row<T, false>(out, x, intermediate_size);                                  \
  }                                                                                               \
  extern "C" __global__ void gelu_tanh_and_mul_##suffix(T* out, const T* x, int intermediate_size) { \
    ringllm::gated_act_row<T, true>(out, x, intermediate_size);                                   \
  }

RINGLLM_ACTIVATION_KERNELS(f32, float)
RINGLLM_ACTIVATION_KERNELS(f16, __half)
RINGLLM_ACTIVATION_KERNELS(bf16, __nv_bfloat16)
