// Prefill attention: a chunk of new query tokens per request, causal, over the paged KV
// cache that already holds the request's cached prefix and (written first by
// reshape_and_cache) the chunk's own keys and values.
//
// Query token i of request r sits at absolute position
//     pos(i) = seq_len[r] - q_len[r] + i
// and attends to cached positions 0 .. pos(i), or with a sliding window W > 0 to
// max(0, pos(i) - W + 1) .. pos(i) only (W keys, its own included).
//
// One CTA per (query tile, request, query head): `q_tile` query rows are staged in
// shared memory, then the keys and values they can see stream through shared memory
// `k_tile` tokens at a time. Per key tile: scores for all (row, key) pairs, an
// online-softmax update per row (one warp per row, float32 running max and sum, as in
// paged_attention.cu), then acc += p @ v. Only the keys some row of the CTA sees are
// loaded, from its first row's window start to its last row's position; within them a
// row scores the keys outside its own range -inf, which the softmax turns into a weight
// of exactly 0 (the same as the causal mask):
//
//     key positions  0 .. kv_begin - 1 | kv_begin = max(0, pos(row 0) - W + 1) .. pos(last row)
//                    never read        | staged k_tile at a time
//     (no window: kv_begin = 0)
//
// An int8 cache (common.cuh, kv_int8.py) is read with its scales as it is staged: each key
// and value element times its (block, KV head)'s scale, once per CTA and tile, so the
// scores and acc += p @ v below are the same code for every cache type.
//
// Dynamic shared memory (floats):
//   q[q_tile * D] | acc[q_tile * D] | keys[k_tile * (D + 1)] | values[k_tile * D]
//   | scores[q_tile * k_tile] | max[q_tile] | sum[q_tile] | rescale[q_tile]
#include "common.cuh"

namespace ringllm {

struct PrefillShape {
  int num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq, q_tile, k_tile;
};

struct PrefillSmem {
  float *q, *acc, *keys, *values, *scores, *run_max, *run_sum, *rescale;
};

__device__ PrefillSmem carve_prefill_smem(float* smem, const PrefillShape& s) {
  PrefillSmem m;
  m.q = smem;
  m.acc = m.q + s.q_tile * s.head_size;
  m.keys = m.acc + s.q_tile * s.head_size;
  m.values = m.keys + s.k_tile * (s.head_size + 1);
  m.scores = m.values + s.k_tile * s.head_size;
  m.run_max = m.scores + s.q_tile * s.k_tile;
  m.run_sum = m.run_max + s.q_tile;
  m.rescale = m.run_sum + s.q_tile;
  return m;
}

// key_scales / value_scales: an int8 cache's, else null.
template <class C>
__device__ void stage_kv(const PrefillSmem& m, const C* __restrict__ key_cache, const C* __restrict__ value_cache,
                         const float* __restrict__ key_scales, const float* __restrict__ value_scales,
                         const int* block_table, int kv_head, int first, int count, const PrefillShape& s) {
  const int D = s.head_size;
  for (int i = threadIdx.x; i < count * D; i += blockDim.x) {
    const int t = i / D, d = i % D, pos = first + t;
    const long long block = block_table[pos / s.block_size];
    const long long at = ((block * s.num_kv_heads + kv_head) * s.block_size + pos % s.block_size) * D + d;
    const float key_scale = cache_scale<C>(key_scales, block, s.num_kv_heads, kv_head);
    const float value_scale = cache_scale<C>(value_scales, block, s.num_kv_heads, kv_head);
    m.keys[t * (D + 1) + d] = to_float(key_cache[at]) * key_scale;
    m.values[t * D + d] = to_float(value_cache[at]) * value_scale;
  }
}

// One warp per query row: fold the tile's scores into the row's running max / sum.
__device__ void update_rows(const PrefillSmem& m, int k_tile, int q_tile) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int row = warp; row < q_tile; row += blockDim.x / kWarpSize) {
    float* p = m.scores + row * k_tile;
    float tile_max = negative_infinity();
    for (int t = lane; t < k_tile; t += kWarpSize) tile_max = fmaxf(tile_max, p[t]);
    const float old_max = m.run_max[row];
    const float new_max = fmaxf(old_max, warp_max(tile_max));
    const bool empty = new_max == negative_infinity();
    float tile_sum = 0.0f;
    for (int t = lane; t < k_tile; t += kWarpSize) {
      p[t] = empty ? 0.0f : expf(p[t] - new_max);
      tile_sum += p[t];
    }
    tile_sum = warp_sum(tile_sum);
    if (lane == 0) {
      const float scale = empty ? 1.0f : expf(old_max - new_max);
      m.run_sum[row] = m.run_sum[row] * scale + tile_sum;
      m.run_max[row] = new_max;
      m.rescale[row] = scale;
    }
  }
}

// C: the cache's element type (T's, or fp8_e4m3 or int8 under any T), staged as float32.
template <class T, class C>
__device__ void paged_attention_prefill(T* __restrict__ out, const T* __restrict__ query,
                                        const C* __restrict__ key_cache, const C* __restrict__ value_cache,
                                        const float* __restrict__ key_scales,
                                        const float* __restrict__ value_scales,
                                        const int* __restrict__ block_tables,
                                        const int* __restrict__ query_start_loc,
                                        const int* __restrict__ seq_lens, float scale, int sliding_window,
                                        const PrefillShape& s) {
  extern __shared__ float smem[];
  const int request = blockIdx.y, head = blockIdx.z, D = s.head_size;
  const int q_start = query_start_loc[request], q_len = query_start_loc[request + 1] - q_start;
  const int first_row = blockIdx.x * s.q_tile;
  if (first_row >= q_len) return;  // the whole CTA leaves together
  const int rows = min(s.q_tile, q_len - first_row);
  const int first_pos = seq_lens[request] - q_len + first_row;  // position of row 0
  const int kv_begin = sliding_window > 0 ? max(0, first_pos - sliding_window + 1) : 0;
  const int kv_end = first_pos + rows;  // keys the last row sees
  const int kv_head = head / (s.num_heads / s.num_kv_heads);
  const int* block_table = block_tables + (long long)request * s.max_blocks_per_seq;
  const PrefillSmem m = carve_prefill_smem(smem, s);
  for (int i = threadIdx.x; i < s.q_tile * D; i += blockDim.x) {
    const int row = i / D;
    const long long token = q_start + first_row + row;
    m.q[i] = row < rows ? to_float(query[(token * s.num_heads + head) * D + i % D]) : 0.0f;
    m.acc[i] = 0.0f;
  }
  for (int row = threadIdx.x; row < s.q_tile; row += blockDim.x) {
    m.run_max[row] = negative_infinity();
    m.run_sum[row] = 0.0f;
  }
  for (int start = kv_begin; start < kv_end; start += s.k_tile) {
    const int count = min(s.k_tile, kv_end - start);
    stage_kv(m, key_cache, value_cache, key_scales, value_scales, block_table, kv_head, start, count, s);
    __syncthreads();
    for (int i = threadIdx.x; i < s.q_tile * s.k_tile; i += blockDim.x) {
      const int row = i / s.k_tile, t = i % s.k_tile, key = start + t, pos = first_pos + row;
      const bool in_window = sliding_window == 0 || key > pos - sliding_window;
      const bool visible = row < rows && t < count && key <= pos && in_window;
      float dot = 0.0f;
      for (int d = 0; visible && d < D; ++d) dot += m.q[row * D + d] * m.keys[t * (D + 1) + d];
      m.scores[i] = visible ? dot * scale : negative_infinity();
    }
    __syncthreads();
    update_rows(m, s.k_tile, s.q_tile);
    __syncthreads();
    for (int i = threadIdx.x; i < s.q_tile * D; i += blockDim.x) {
      const int row = i / D, d = i % D;
      float a = m.acc[i] * m.rescale[row];
      for (int t = 0; t < count; ++t) a += m.scores[row * s.k_tile + t] * m.values[t * D + d];
      m.acc[i] = a;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int row = i / D;
    const long long token = q_start + first_row + row;
    const float sum = m.run_sum[row];
    out[(token * s.num_heads + head) * D + i % D] = from_float<T>(sum > 0.0f ? m.acc[i] / sum : 0.0f);
  }
}

}  // namespace ringllm

#define RINGLLM_PREFILL_KERNELS(suffix, T, C)                                                       \
  extern "C" __global__ void paged_attention_prefill_##suffix(                                      \
      T* out, const T* query, const C* key_cache, const C* value_cache, const int* block_tables,     \
      const int* query_start_loc, const int* seq_lens, float scale, int sliding_window,             \
      int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,       \
      int q_tile, int k_tile) {                                                                     \
    const ringllm::PrefillShape shape{num_heads,          num_kv_heads, head_size, block_size,      \
                                      max_blocks_per_seq, q_tile,       k_tile};                    \
    ringllm::paged_attention_prefill<T, C>(out, query, key_cache, value_cache, nullptr, nullptr,    \
                                           block_tables, query_start_loc, seq_lens, scale,          \
                                           sliding_window, shape);                                  \
  }

// an int8 cache: its keys' and values' scales follow the caches
#define RINGLLM_PREFILL_INT8(suffix, T)                                                             \
  extern "C" __global__ void paged_attention_prefill_##suffix(                                      \
      T* out, const T* query, const signed char* key_cache, const signed char* value_cache,         \
      const float* key_scales, const float* value_scales, const int* block_tables,                  \
      const int* query_start_loc, const int* seq_lens, float scale, int sliding_window,             \
      int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,       \
      int q_tile, int k_tile) {                                                                     \
    const ringllm::PrefillShape shape{num_heads,          num_kv_heads, head_size, block_size,      \
                                      max_blocks_per_seq, q_tile,       k_tile};                    \
    ringllm::paged_attention_prefill<T, signed char>(out, query, key_cache, value_cache,            \
                                                     key_scales, value_scales, block_tables,        \
                                                     query_start_loc, seq_lens, scale,              \
                                                     sliding_window, shape);                        \
  }

RINGLLM_PREFILL_KERNELS(f32, float, float)
RINGLLM_PREFILL_KERNELS(f16, __half, __half)
RINGLLM_PREFILL_KERNELS(bf16, __nv_bfloat16, __nv_bfloat16)
RINGLLM_PREFILL_KERNELS(f32_fp8, float, ringllm::fp8_e4m3)
RINGLLM_PREFILL_KERNELS(f16_fp8, __half, ringllm::fp8_e4m3)
RINGLLM_PREFILL_KERNELS(bf16_fp8, __nv_bfloat16, ringllm::fp8_e4m3)
RINGLLM_PREFILL_INT8(f32_i8, float)
RINGLLM_PREFILL_INT8(f16_i8, __half)
RINGLLM_PREFILL_INT8(bf16_i8, __nv_bfloat16)
