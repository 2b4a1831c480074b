// The experts of a mixture-of-experts MLP, after routing: h [T, H], each token's k experts
// and their weights in, out [T, H] = sum over t's k slots of weight * down_e(act(gate_up_e(h[t]))).
// Four kernels, launched in this order by CudaOps.moe_experts:
//
//   moe_group_pairs       experts [T, k] int64 -> the N = T * k (token, slot) pairs sorted
//                         by expert (a counting sort, tokens in order within an expert)
//   moe_gate_up_<dtype>   sorted pair p (token t, expert e) -> act [N, I]:
//                         act(h[t] . Wgu[e, j]) * (h[t] . Wgu[e, I + j])
//   moe_down_<dtype>      y [N, H] = Wd[e] . act[p]
//   moe_combine_<dtype>   out[t] = sum over slots 0..k-1, in slot order, of weight * y[pair]
//
// Layouts (row-major, contiguous, the activation dtype unless said):
//
//   experts        [T, k] int64 (torch.topk's), pair p = t * k + slot
//   w_gate_up      [E, 2I, H]   expert e's gate rows 0..I-1, then its up rows I..2I-1
//   w_down         [E, H, I]
//   offsets        [E + 1] int32: expert e's pairs at sorted positions offsets[e]..offsets[e+1]-1
//   sorted_pairs   [N] int32: the pair at each sorted position; -1 past offsets[E]
//   pair_positions [N] int32: the sorted position of each pair; -1 for an expert id
//                  outside [0, E) (the router never makes one: such a slot adds nothing,
//                  rather than reading out of bounds)
//   act [N, I], y [N, H]: rows in sorted order
//
// Numerics follow TorchOps.moe_experts (the torch loop over the experts): every dot product
// accumulates in float32 and is rounded once to the element type (a `linear` in that dtype);
// act is activation.cu's, rounded where torch rounds (gate and up, act(gate), the product);
// each slot's weight * y is rounded, then added to the token's sum and rounded again, as
// `index_add_` into a tensor of the element type adds. In float32 every rounding is exact.
// No float atomics anywhere: each result has one writer and a fixed summation order.
#include "common.cuh"

namespace ringllm {

// Launch: grid = (1), block = (S threads, any count up to 1024); segment_counts: S * E int32
// of scratch. Thread s owns a contiguous segment of the pairs. It counts its segment per
// expert; the thread of each expert turns those counts into each segment's first slot in
// the expert's run (an exclusive scan over the segments, in segment order); one thread scans
// the totals into offsets; then every thread places its segment's pairs in order. So a pair's
// place depends only on the pairs before it: the order is the stable one, with no atomics.
__device__ void group_pairs(int* __restrict__ counts, int* __restrict__ offsets,
                            int* __restrict__ sorted_pairs, int* __restrict__ pair_positions,
                            int* __restrict__ segment_counts, const long long* __restrict__ experts,
                            int num_pairs, int num_experts) {
  const int num_segments = blockDim.x, segment = threadIdx.x;
  const int per_segment = (num_pairs + num_segments - 1) / num_segments;
  const int begin = min(num_pairs, segment * per_segment);
  const int end = min(num_pairs, begin + per_segment);
  int* mine = segment_counts + (long long)segment * num_experts;
  for (int e = 0; e < num_experts; ++e) mine[e] = 0;
  for (int p = begin; p < end; ++p) {
    const long long e = experts[p];
    if (e >= 0 && e < num_experts) ++mine[e];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int total = 0;
    for (int s = 0; s < num_segments; ++s) {
      const int count = segment_counts[(long long)s * num_experts + e];
      segment_counts[(long long)s * num_experts + e] = total;
      total += count;
    }
    counts[e] = total;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < num_experts; ++e) {
      offsets[e] = run;
      run += counts[e];
    }
    offsets[num_experts] = run;
  }
  __syncthreads();
  for (int p = begin; p < end; ++p) {
    const long long e = experts[p];
    if (e >= 0 && e < num_experts) {
      const int position = offsets[e] + mine[e]++;
      sorted_pairs[position] = p;
      pair_positions[p] = position;
    } else {
      pair_positions[p] = -1;
    }
  }
  for (int q = offsets[num_experts] + threadIdx.x; q < num_pairs; q += blockDim.x) {
    sorted_pairs[q] = -1;
  }
}

// Launch: grid = (N sorted pairs, ceil(I / warps per block)), block = (a multiple of 32).
// One warp per (pair, column j): the lanes stride over H (coalesced reads of the two weight
// rows), a butterfly sum gives each lane the same dot product, lane 0 stores.
template <class T>
__device__ void gate_up_act(T* __restrict__ act, const T* __restrict__ x,
                            const T* __restrict__ w_gate_up, const long long* __restrict__ experts,
                            const int* __restrict__ sorted_pairs, int top_k, int hidden_size,
                            int intermediate_size, int gelu) {
  const long long row = blockIdx.x;
  const int pair = sorted_pairs[row];
  const int lane = threadIdx.x % kWarpSize;
  const int j = blockIdx.y * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (pair < 0 || j >= intermediate_size) return;  // whole warps: the shuffles stay full
  const long long expert = experts[pair];
  const T* x_row = x + (long long)(pair / top_k) * hidden_size;
  const T* gate_row = w_gate_up + (expert * 2 * intermediate_size + j) * hidden_size;
  const T* up_row = gate_row + (long long)intermediate_size * hidden_size;
  float gate = 0.0f, up = 0.0f;
  for (int i = lane; i < hidden_size; i += kWarpSize) {
    const float xi = to_float(x_row[i]);
    gate += xi * to_float(gate_row[i]);
    up += xi * to_float(up_row[i]);
  }
  gate = round_to<T>(warp_sum(gate));
  up = round_to<T>(warp_sum(up));
  // SiLU g * sigmoid(g); GELU(tanh) as activation.cu writes it, g * sigmoid(2u).
  const float z = gelu ? gate * (1.5957691216057308f + 0.07135481627260025f * gate * gate) : gate;
  const float a = round_to<T>(gate / (1.0f + expf(-z)));
  if (lane == 0) act[row * intermediate_size + j] = from_float<T>(a * up);
}

// Launch: grid = (N sorted pairs, ceil(H / warps per block)), block = (a multiple of 32).
// One warp per (pair, output column c), the lanes striding over I.
template <class T>
__device__ void down_rows(T* __restrict__ y, const T* __restrict__ act,
                          const T* __restrict__ w_down, const long long* __restrict__ experts,
                          const int* __restrict__ sorted_pairs, int hidden_size,
                          int intermediate_size) {
  const long long row = blockIdx.x;
  const int pair = sorted_pairs[row];
  const int lane = threadIdx.x % kWarpSize;
  const int c = blockIdx.y * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (pair < 0 || c >= hidden_size) return;
  const T* w_row = w_down + (experts[pair] * hidden_size + c) * intermediate_size;
  const T* act_row = act + row * intermediate_size;
  float sum = 0.0f;
  for (int i = lane; i < intermediate_size; i += kWarpSize) {
    sum += to_float(act_row[i]) * to_float(w_row[i]);
  }
  sum = warp_sum(sum);
  if (lane == 0) y[row * hidden_size + c] = from_float<T>(sum);
}

// Launch: grid = (T), block = (threads striding over H). One thread per (token, column),
// its k slots added in slot order.
template <class T>
__device__ void combine_rows(T* __restrict__ out, const T* __restrict__ y,
                             const T* __restrict__ weights, const int* __restrict__ pair_positions,
                             int top_k, int hidden_size) {
  const long long token = blockIdx.x;
  for (int c = threadIdx.x; c < hidden_size; c += blockDim.x) {
    float sum = 0.0f;
    for (int slot = 0; slot < top_k; ++slot) {
      const long long pair = token * top_k + slot;
      const int position = pair_positions[pair];
      if (position < 0) continue;
      const float y_value = to_float(y[(long long)position * hidden_size + c]);
      const float scaled = round_to<T>(to_float(weights[pair]) * y_value);
      sum = round_to<T>(sum + scaled);
    }
    out[token * hidden_size + c] = from_float<T>(sum);
  }
}

}  // namespace ringllm

extern "C" __global__ void moe_group_pairs(int* counts, int* offsets, int* sorted_pairs,
                                           int* pair_positions, int* segment_counts,
                                           const long long* experts, int num_pairs,
                                           int num_experts) {
  ringllm::group_pairs(counts, offsets, sorted_pairs, pair_positions, segment_counts, experts,
                       num_pairs, num_experts);
}

#define RINGLLM_MOE_KERNELS(suffix, T)                                                           \
  extern "C" __global__ void moe_gate_up_##suffix(                                              \
      T* act, const T* x, const T* w_gate_up, const long long* experts, const int* sorted_pairs, \
      int top_k, int hidden_size, int intermediate_size, int gelu) {                            \
    ringllm::gate_up_act<T>(act, x, w_gate_up, experts, sorted_pairs, top_k, hidden_size,       \
                            intermediate_size, gelu);                                           \
  }                                                                                             \
  extern "C" __global__ void moe_down_##suffix(T* y, const T* act, const T* w_down,             \
                                               const long long* experts, const int* sorted_pairs, \
                                               int hidden_size, int intermediate_size) {        \
    ringllm::down_rows<T>(y, act, w_down, experts, sorted_pairs, hidden_size, intermediate_size); \
  }                                                                                             \
  extern "C" __global__ void moe_combine_##suffix(T* out, const T* y, const T* weights,         \
                                                  const int* pair_positions, int top_k,         \
                                                  int hidden_size) {                            \
    ringllm::combine_rows<T>(out, y, weights, pair_positions, top_k, hidden_size);              \
  }

RINGLLM_MOE_KERNELS(f32, float)
RINGLLM_MOE_KERNELS(f16, __half)
RINGLLM_MOE_KERNELS(bf16, __nv_bfloat16)
