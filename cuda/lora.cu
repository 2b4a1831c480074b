// LoRA adapters applied per token (BGMV: every token may take a different adapter, no
// grouping pass), for s = token_slots[t] >= 0:
//     u = a_stack[s] . x[t]  [W = P * R];   y[t, j] += b_stack[s, j] . u[p*R .. p*R + R]
// for j in part p of y's columns (q | k | v of a fused projection: P parts, each with its
// own B; part p ends at column end_p). Two kernels, launched in this order by
// CudaOps.lora_apply:
//
//   lora_shrink_<dtype>   shrunk [T, W] float32 = a_stack[s] . x[t]   (a warp per (t, w))
//   lora_expand_<dtype>   y[t, j] = y[t, j] + b_stack[s, j] . shrunk[t, part] (a thread per (t, j))
//
// Layouts (row-major, the activation dtype unless said):
//
//   x              [T, in]    rows x_row_stride elements apart, the columns contiguous
//   y              [T, out]   rows y_row_stride elements apart (a column slice of a wider
//                             output, e.g. q of a fused qkv, is written in place)
//   a_stack        [S, W, in] contiguous: slot s's down projections, part p's in rows
//                             p*R .. p*R + R, ranks padded with zero rows
//   b_stack        [S, R, out] contiguous: slot s's up projections transposed (scaling
//                             folded in), each output column its part's, ranks padded with
//                             zero rows (threads of consecutive columns read consecutive
//                             values)
//   token_slots    [T] int32: the token's slot; < 0: no adapter, y's row untouched. A slot
//                  >= S is treated the same rather than read out of bounds (the engine never
//                  makes one; refusing it on the host would cost a device sync every call)
//   shrunk         [T, W] float32 scratch; rows of tokens without an adapter are never written
//
// Numerics follow TorchOps.lora_apply: both products accumulate in float32, the shrunk
// row stays float32 (never rounded to the dtype), the delta is added to y's value in float32
// and the sum rounded once to y's dtype. Summation order inside a dot product differs from
// torch's matmul; nothing else does. No atomics: each result has one writer.
#include "common.cuh"

namespace ringllm {

// The slot token t takes, or -1 where it takes none (no adapter, or a slot outside [0, S)).
__device__ __forceinline__ int token_slot(const int* __restrict__ token_slots, long long token,
                                          int num_slots) {
  const int slot = token_slots[token];
  return slot < num_slots ? slot : -1;
}

// Launch: grid = (T, ceil(R / warps per block)), block = (a multiple of 32).
// One warp per (token, rank row r): the lanes stride over `in` (coalesced reads of x's row
// and a's row), a butterfly sum gives each lane the same dot product, lane 0 stores.
template <class T>
__device__ void shrink_rows(float* __restrict__ shrunk, const T* __restrict__ x,
                            const T* __restrict__ a_stack, const int* __restrict__ token_slots,
                            long long x_row_stride, int num_slots, int rank, int in_features) {
  const long long token = blockIdx.x;
  const int lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.y * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int slot = token_slot(token_slots, token, num_slots);
  if (slot < 0 || r >= rank) return;  // whole warps: the shuffles stay full
  const T* x_row = x + token * x_row_stride;
  const T* a_row = a_stack + ((long long)slot * rank + r) * in_features;
  float sum = 0.0f;
  for (int i = lane; i < in_features; i += kWarpSize) {
    sum += to_float(x_row[i]) * to_float(a_row[i]);
  }
  sum = warp_sum(sum);
  if (lane == 0) shrunk[token * rank + r] = sum;
}

// Launch: grid = (T, ceil(out / threads per block)), block = (threads, a multiple of 32).
// One thread per (token, output column j): column j of b's R rows (a warp's threads read
// consecutive values of each row) against the token's shrunk part, which every thread of
// the block reads (a broadcast from L1), in rank order; then one rounding of y + delta.
template <class T>
__device__ void expand_rows(T* __restrict__ y, const float* __restrict__ shrunk,
                            const T* __restrict__ b_stack, const int* __restrict__ token_slots,
                            long long y_row_stride, int num_slots, int width, int rank,
                            int out_features, int end0, int end1, int end2) {
  const long long token = blockIdx.x;
  const int j = blockIdx.y * blockDim.x + threadIdx.x;
  const int slot = token_slot(token_slots, token, num_slots);
  if (slot < 0 || j >= out_features) return;
  const int part = j < end0 ? 0 : j < end1 ? 1 : j < end2 ? 2 : 3;  // ends past out: unused
  const float* shrunk_row = shrunk + token * width + part * rank;
  const T* b_col = b_stack + (long long)slot * rank * out_features + j;
  float delta = 0.0f;
  for (int r = 0; r < rank; ++r) delta += to_float(b_col[(long long)r * out_features]) * shrunk_row[r];
  T* out = y + token * y_row_stride + j;
  *out = from_float<T>(to_float(*out) + delta);
}

}  // namespace ringllm

#define RINGLLM_LORA_KERNELS(suffix, T)                                                          \
  extern "C" __global__ void lora_shrink_##suffix(                                              \
      float* shrunk, const T* x, const T* a_stack, const int* token_slots,                      \
      long long x_row_stride, int num_slots, int rank, int in_features) {                       \
    ringllm::shrink_rows<T>(shrunk, x, a_stack, token_slots, x_row_stride, num_slots, rank,     \
                            in_features);                                                       \
  }                                                                                             \
  extern "C" __global__ void lora_expand_##suffix(                                              \
      T* y, const float* shrunk, const T* b_stack, const int* token_slots,                      \
      long long y_row_stride, int num_slots, int width, int rank, int out_features, int end0,   \
      int end1, int end2) {                                                                     \
    ringllm::expand_rows<T>(y, shrunk, b_stack, token_slots, y_row_stride, num_slots, width,    \
                            rank, out_features, end0, end1, end2);                              \
  }

RINGLLM_LORA_KERNELS(f32, float)
RINGLLM_LORA_KERNELS(f16, __half)
RINGLLM_LORA_KERNELS(bf16, __nv_bfloat16)
