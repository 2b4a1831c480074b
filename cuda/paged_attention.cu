// Paged-attention decode: one new query token per request against its cached context.
//
// One CTA per (KV head, request, partition). The CTA serves all G = num_heads /
// num_kv_heads query heads that read its KV head, so every key and value is loaded
// once per CTA, not once per query head. Keys are staged a tile at a time in shared
// memory (rows padded to head_size + 1 floats so that threads reading different rows
// hit different banks); each thread scores (query head, token) pairs from it. Values
// are read straight from the cache: thread i owns output element i of [G, head_size],
// so neighbouring threads read neighbouring addresses.
//
// Softmax is online, in float32 (running max m, running sum l per query head):
//
//     m' = max(m, max_t s_t)    p_t = exp(s_t - m')    l' = l * exp(m - m') + sum_t p_t
//     acc' = acc * exp(m - m') + sum_t p_t * v_t          out = acc / l
//
// Sliding window (sliding_window W > 0): the query sits at position seq_len - 1 and sees
// only the last W keys. Both plans start at the window's first key, so the keys before it
// weigh exactly nothing and are never read (an engine may have freed their blocks);
// W = 0 is the whole context:
//
//     attended keys [start, seq_len)    start = W > 0 ? max(0, seq_len - W) : 0
//
// Partitioned variant (long contexts): the attended keys are split into partitions of
// `partition_tokens` across CTAs (grid.z), counted from `start`, so a window needs only
// ceil(W / partition_tokens) of them whatever the context; each writes its partition's
// max m_p, sum l_p and normalised output o_p, and `paged_attention_reduce` combines them:
//
//     M = max_p m_p    w_p = l_p * exp(m_p - M)    out = sum_p w_p * o_p / sum_p w_p
//
// An int8 cache (common.cuh, kv_int8.py) is read with its scales: a key's scale multiplies
// its elements as they are staged (D products per key, shared by the G query heads); a
// value's multiplies the key's softmax weight once the running sum has taken the weight
// (G products per key rather than G * D), so the sum stays unscaled and
// acc = sum_t p_t * vscale_t * q_t is sum_t p_t * v_t.
//
// Dynamic shared memory (floats): q[G * D] | acc[G * D] | keys[tile * (D + 1)]
//                                  | probs[G * tile] | max[G] | sum[G] | rescale[G]
#include "common.cuh"

namespace ringllm {

struct DecodeShape {
  int num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq, tile_tokens;
};

// The first key the decode query (at seq_len - 1) attends to.
__device__ int window_start(int seq_len, int sliding_window) {
  return sliding_window > 0 ? max(0, seq_len - sliding_window) : 0;
}

// Loads keys [first, first + count) of one KV head into shared rows of head_size + 1
// (an int8 cache's times their block's scale).
template <class C>
__device__ void stage_keys(float* keys, const C* __restrict__ key_cache, const float* key_scales,
                           const int* block_table, int kv_head, int first, int count,
                           const DecodeShape& s) {
  for (int i = threadIdx.x; i < count * s.head_size; i += blockDim.x) {
    const int t = i / s.head_size, d = i % s.head_size, pos = first + t;
    const long long block = block_table[pos / s.block_size];
    const long long row = (block * s.num_kv_heads + kv_head) * s.block_size + pos % s.block_size;
    keys[t * (s.head_size + 1) + d] = to_float(key_cache[row * s.head_size + d]) *
                                      cache_scale<C>(key_scales, block, s.num_kv_heads, kv_head);
  }
}

// An int8 cache's value scales folded into the tile's weights probs[g][t], t < count.
__device__ void scale_weights(float* probs, const float* value_scales, const int* block_table,
                              int kv_head, int first, int count, int num_groups, const DecodeShape& s) {
  for (int i = threadIdx.x; i < num_groups * s.tile_tokens; i += blockDim.x) {
    const int t = i % s.tile_tokens;
    if (t >= count) continue;
    const long long block = block_table[(first + t) / s.block_size];
    probs[i] *= value_scales[block * s.num_kv_heads + kv_head];
  }
}

// Folds one tile's scores (probs[g][t], -inf past `count`) into the running max/sum of
// each query head, turning scores into probabilities and leaving each head's rescale.
__device__ void update_softmax(float* probs, float* run_max, float* run_sum, float* rescale,
                               int num_groups, int tile_tokens) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int g = warp; g < num_groups; g += blockDim.x / kWarpSize) {
    float* p = probs + g * tile_tokens;
    float tile_max = negative_infinity();
    for (int t = lane; t < tile_tokens; t += kWarpSize) tile_max = fmaxf(tile_max, p[t]);
    const float old_max = run_max[g];
    const float new_max = fmaxf(old_max, warp_max(tile_max));
    float tile_sum = 0.0f;
    for (int t = lane; t < tile_tokens; t += kWarpSize) {
      p[t] = new_max == negative_infinity() ? 0.0f : expf(p[t] - new_max);
      tile_sum += p[t];
    }
    tile_sum = warp_sum(tile_sum);
    if (lane == 0) {
      const float scale = new_max == negative_infinity() ? 1.0f : expf(old_max - new_max);
      run_sum[g] = run_sum[g] * scale + tile_sum;
      run_max[g] = new_max;
      rescale[g] = scale;
    }
  }
}

// Attends the query heads of (request, kv_head) over context tokens [first, last);
// leaves acc (unnormalised), run_max and run_sum in shared memory.
// C: the cache's element type (T's, or fp8_e4m3 or int8 under any T), read as float32;
// key_scales / value_scales: an int8 cache's, else null.
template <class T, class C>
__device__ void attend_range(float* smem, const T* __restrict__ query, const C* __restrict__ key_cache,
                             const C* __restrict__ value_cache, const float* __restrict__ key_scales,
                             const float* __restrict__ value_scales, const int* block_table, int request,
                             int kv_head, int first, int last, float scale, const DecodeShape& s) {
  const int G = s.num_heads / s.num_kv_heads, D = s.head_size, tile = s.tile_tokens;
  float* q = smem;
  float* acc = q + G * D;
  float* keys = acc + G * D;
  float* probs = keys + tile * (D + 1);
  float* run_max = probs + G * tile;
  float* run_sum = run_max + G;
  float* rescale = run_sum + G;
  const T* q_heads = query + ((long long)request * s.num_heads + kv_head * G) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    q[i] = to_float(q_heads[i]);
    acc[i] = 0.0f;
  }
  for (int g = threadIdx.x; g < G; g += blockDim.x) {
    run_max[g] = negative_infinity();
    run_sum[g] = 0.0f;
  }
  for (int start = first; start < last; start += tile) {
    const int count = min(tile, last - start);
    stage_keys(keys, key_cache, key_scales, block_table, kv_head, start, count, s);
    __syncthreads();
    for (int i = threadIdx.x; i < G * tile; i += blockDim.x) {
      const int g = i / tile, t = i % tile;
      float dot = 0.0f;
      for (int d = 0; t < count && d < D; ++d) dot += q[g * D + d] * keys[t * (D + 1) + d];
      probs[i] = t < count ? dot * scale : negative_infinity();
    }
    __syncthreads();
    update_softmax(probs, run_max, run_sum, rescale, G, tile);
    __syncthreads();
    if constexpr (kScaledCache<C>) {
      scale_weights(probs, value_scales, block_table, kv_head, start, count, G, s);
      __syncthreads();
    }
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
      const int g = i / D, d = i % D;
      float a = acc[i] * rescale[g];
      for (int t = 0; t < count; ++t) {
        const int pos = start + t;
        const long long block = block_table[pos / s.block_size];
        const long long row = (block * s.num_kv_heads + kv_head) * s.block_size + pos % s.block_size;
        a += probs[g * tile + t] * to_float(value_cache[row * D + d]);
      }
      acc[i] = a;
    }
    __syncthreads();
  }
}

// grid = (num_kv_heads, num_requests, num_partitions); partition_tokens = 0: one
// partition holding every attended key, written straight to `out`.
template <class T, class C>
__device__ void paged_attention_decode(T* __restrict__ out, float* __restrict__ partial_out,
                                       float* __restrict__ partial_max, float* __restrict__ partial_sum,
                                       const T* __restrict__ query, const C* __restrict__ key_cache,
                                       const C* __restrict__ value_cache, const float* __restrict__ key_scales,
                                       const float* __restrict__ value_scales,
                                       const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                                       float scale, int sliding_window, int partition_tokens,
                                       const DecodeShape& s) {
  extern __shared__ float smem[];
  const int kv_head = blockIdx.x, request = blockIdx.y, partition = blockIdx.z;
  const int seq_len = seq_lens[request];
  const int first = window_start(seq_len, sliding_window) + partition * partition_tokens;
  const int last = partition_tokens > 0 ? min(seq_len, first + partition_tokens) : seq_len;
  if (first >= last) return;  // the whole CTA leaves together: no barrier is left waiting
  const int* block_table = block_tables + (long long)request * s.max_blocks_per_seq;
  attend_range(smem, query, key_cache, value_cache, key_scales, value_scales, block_table, request, kv_head,
               first, last, scale, s);
  const int G = s.num_heads / s.num_kv_heads, D = s.head_size;
  const float* acc = smem + G * D;
  const float* run_max = acc + G * D + s.tile_tokens * (D + 1) + G * s.tile_tokens;
  const float* run_sum = run_max + G;
  const int num_partitions = gridDim.z;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    const long long head = (long long)request * s.num_heads + kv_head * G + g;
    const float value = run_sum[g] > 0.0f ? acc[i] / run_sum[g] : 0.0f;
    if (partition_tokens == 0) {
      out[head * D + d] = from_float<T>(value);
      continue;
    }
    partial_out[(head * num_partitions + partition) * D + d] = value;
    if (d == 0) {
      partial_max[head * num_partitions + partition] = run_max[g];
      partial_sum[head * num_partitions + partition] = run_sum[g];
    }
  }
}

// grid = (num_heads, num_requests); combines the partitions of one (request, head): those
// the decode CTAs wrote, the ones covering the attended keys.
// Dynamic shared memory: one float weight per partition.
template <class T>
__device__ void paged_attention_reduce(T* __restrict__ out, const float* __restrict__ partial_out,
                                       const float* __restrict__ partial_max,
                                       const float* __restrict__ partial_sum, const int* __restrict__ seq_lens,
                                       int sliding_window, int head_size, int partition_tokens,
                                       int max_partitions) {
  extern __shared__ float smem[];
  const long long head = (long long)blockIdx.y * gridDim.x + blockIdx.x;
  const int seq_len = seq_lens[blockIdx.y];
  const int attended = seq_len - window_start(seq_len, sliding_window);
  const int used = (attended + partition_tokens - 1) / partition_tokens;
  const float* maxes = partial_max + head * max_partitions;
  const float* sums = partial_sum + head * max_partitions;
  float global_max = negative_infinity();
  for (int p = 0; p < used; ++p) global_max = fmaxf(global_max, maxes[p]);
  for (int p = threadIdx.x; p < used; p += blockDim.x) smem[p] = sums[p] * expf(maxes[p] - global_max);
  __syncthreads();
  float total = 0.0f;
  for (int p = 0; p < used; ++p) total += smem[p];
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float value = 0.0f;
    for (int p = 0; p < used; ++p) value += smem[p] * partial_out[(head * max_partitions + p) * head_size + d];
    out[head * head_size + d] = from_float<T>(total > 0.0f ? value / total : 0.0f);
  }
}

}  // namespace ringllm

#define RINGLLM_DECODE_ONLY(suffix, T, C)                                                        \
  extern "C" __global__ void paged_attention_decode_##suffix(                                    \
      T* out, float* partial_out, float* partial_max, float* partial_sum, const T* query,        \
      const C* key_cache, const C* value_cache, const int* block_tables, const int* seq_lens,    \
      float scale, int sliding_window, int num_heads, int num_kv_heads, int head_size,           \
      int block_size, int max_blocks_per_seq, int tile_tokens, int partition_tokens) {           \
    const ringllm::DecodeShape shape{num_heads,  num_kv_heads,       head_size,                  \
                                     block_size, max_blocks_per_seq, tile_tokens};               \
    ringllm::paged_attention_decode<T, C>(out, partial_out, partial_max, partial_sum, query,     \
                                          key_cache, value_cache, nullptr, nullptr, block_tables, \
                                          seq_lens, scale, sliding_window, partition_tokens,     \
                                          shape);                                                \
  }

// an int8 cache: its keys' and values' scales follow the caches
#define RINGLLM_DECODE_INT8(suffix, T)                                                           \
  extern "C" __global__ void paged_attention_decode_##suffix(                                    \
      T* out, float* partial_out, float* partial_max, float* partial_sum, const T* query,        \
      const signed char* key_cache, const signed char* value_cache, const float* key_scales,     \
      const float* value_scales, const int* block_tables, const int* seq_lens, float scale,      \
      int sliding_window, int num_heads, int num_kv_heads, int head_size, int block_size,        \
      int max_blocks_per_seq, int tile_tokens, int partition_tokens) {                           \
    const ringllm::DecodeShape shape{num_heads,  num_kv_heads,       head_size,                  \
                                     block_size, max_blocks_per_seq, tile_tokens};               \
    ringllm::paged_attention_decode<T, signed char>(                                             \
        out, partial_out, partial_max, partial_sum, query, key_cache, value_cache, key_scales,   \
        value_scales, block_tables, seq_lens, scale, sliding_window, partition_tokens, shape);   \
  }

#define RINGLLM_DECODE_KERNELS(suffix, T)                                                        \
  RINGLLM_DECODE_ONLY(suffix, T, T)                                                              \
  extern "C" __global__ void paged_attention_reduce_##suffix(                                    \
      T* out, const float* partial_out, const float* partial_max, const float* partial_sum,      \
      const int* seq_lens, int sliding_window, int head_size, int partition_tokens,              \
      int max_partitions) {                                                                      \
    ringllm::paged_attention_reduce<T>(out, partial_out, partial_max, partial_sum, seq_lens,     \
                                       sliding_window, head_size, partition_tokens,              \
                                       max_partitions);                                          \
  }

RINGLLM_DECODE_KERNELS(f32, float)
RINGLLM_DECODE_KERNELS(f16, __half)
RINGLLM_DECODE_KERNELS(bf16, __nv_bfloat16)
// an fp8 cache under each activation type (the partitions' reduce is the type's own)
RINGLLM_DECODE_ONLY(f32_fp8, float, ringllm::fp8_e4m3)
RINGLLM_DECODE_ONLY(f16_fp8, __half, ringllm::fp8_e4m3)
RINGLLM_DECODE_ONLY(bf16_fp8, __nv_bfloat16, ringllm::fp8_e4m3)
// an int8 cache under each activation type (the reduce is the type's own, too)
RINGLLM_DECODE_INT8(f32_i8, float)
RINGLLM_DECODE_INT8(f16_i8, __half)
RINGLLM_DECODE_INT8(bf16_i8, __nv_bfloat16)
