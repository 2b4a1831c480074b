// KV-cache writes: reshape_and_cache (new tokens into their slots), copy_blocks (within one
// cache) and swap_blocks (between two sets of caches: the device tier and the host tier).
//
// Cache layout (pipeline/ops/interface.py), per layer and for keys and values alike:
//
//     cache[num_blocks, num_kv_heads, block_size, head_size]
//
// slot s = block * block_size + offset; token t's head h goes to
// cache[s / block_size, h, s % block_size, :]. Slot -1 marks a token not to be written
// (padding, or a token whose KV is already cached): its CTA returns at once.
//
// Launch: reshape_and_cache: grid = (num_tokens), block = (threads over heads * head_size).
//         reshape_and_cache_*_i8: grid = (num_tokens), block = (a warp per (cache, head)).
//         copy_blocks: grid = (num_pairs, num_caches), block = (threads over one block).
//         swap_blocks: grid = (num_pairs, 2 * num_layers), block = (threads over one block).
//         copy_block_scales: grid = (num_pairs, num_caches), block = (threads over kv_heads).
//
// The int8 cache (pipeline/ops/kv_int8.py) keeps one float32 scale per (block, KV head)
// right after its values; a block's copies move its values (as bytes, copy_blocks_u8 or
// swap_blocks_*) and then its scales (copy_block_scales).
#include "common.cuh"

namespace ringllm {

// C: the cache's element type, T's or fp8_e4m3 (each value rounded to it, common.cuh).
template <class T, class C>
__device__ void reshape_and_cache(const T* __restrict__ key, const T* __restrict__ value,
                                  C* __restrict__ key_cache, C* __restrict__ value_cache,
                                  const long long* __restrict__ slot_mapping,
                                  long long key_token_stride, long long value_token_stride,
                                  int num_kv_heads, int head_size, int block_size) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const long long block = slot / block_size, offset = slot % block_size;
  const T* token_key = key + blockIdx.x * key_token_stride;
  const T* token_value = value + blockIdx.x * value_token_stride;
  for (int item = threadIdx.x; item < num_kv_heads * head_size; item += blockDim.x) {
    const int head = item / head_size, d = item % head_size;
    const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_size + d;
    key_cache[dst] = from_float<C>(to_float(token_key[item]));
    value_cache[dst] = from_float<C>(to_float(token_value[item]));
  }
}

// ---- the int8 cache's write (kv_int8.py's rule, which kv_int8.write_rows defines) ----
//
// A row that raises its block's scale re-rounds the rows before it, so a block's rows must
// go in in token order and no two threads may own one block's scale. NOTE: the design that
// gives both without atomics: the CTA of token t works only if t starts a run, i.e. t has a
// slot and the nearest earlier token with a slot (-1s skipped) is in another cache block or
// there is none; it then writes the run -- t and the following tokens up to the first slot
// in another block, -1s skipped -- in order, one warp per (cache, head), each warp holding
// its (block, head)'s scale in a register and storing it once at the end. The tokens that
// land in one block are consecutive in a batch (a block is written by one sequence, in
// order), so every block is written by exactly one CTA. A decode batch is runs of one
// token; a prefill chunk of B-token blocks is runs of up to B tokens, its blocks in
// parallel. Each lane owns the columns d = lane + 32k of every row it writes or re-rounds,
// so a warp never reads what another lane wrote.

// Whether token t starts a run (above). The backward scan crosses only the -1 slots just
// before t, so over the whole grid each -1 is crossed by one scan back (and by at most one
// run's walk forward): O(num_tokens) work, however the -1s fall.
__device__ bool starts_run(const long long* __restrict__ slot_mapping, int t, int block_size) {
  const long long slot = slot_mapping[t];
  if (slot < 0) return false;
  for (int u = t - 1; u >= 0; --u)
    if (slot_mapping[u] >= 0) return slot_mapping[u] / block_size != slot / block_size;
  return true;
}

// One head of the run from token `first` (its block's rows, in token order) into an int8
// cache and its scales, by one warp. x: the tokens' rows of this cache (keys or values).
template <class T>
__device__ void quantize_run(const T* __restrict__ x, long long token_stride,
                             signed char* __restrict__ cache, float* __restrict__ scales,
                             const long long* __restrict__ slot_mapping, int first, int num_tokens,
                             int head, int num_kv_heads, int head_size, int block_size) {
  const int lane = threadIdx.x % kWarpSize;
  const long long block = slot_mapping[first] / block_size;
  signed char* rows = cache + (block * num_kv_heads + head) * block_size * head_size;
  float* block_scale = scales + block * num_kv_heads + head;
  float scale = *block_scale;  // what rows before the run were written with (if any)
  for (int t = first; t < num_tokens; ++t) {
    const long long slot = slot_mapping[t];
    if (slot < 0) continue;
    if (slot / block_size != block) break;
    const int row = slot % block_size;
    const T* token = x + t * token_stride + (long long)head * head_size;
    float amax = 0.0f;
    for (int d = lane; d < head_size; d += kWarpSize) amax = fmaxf(amax, fabsf(to_float(token[d])));
    const float wanted = warp_max(amax) / (float)kInt8Max;
    if (row == 0) {
      scale = wanted;  // a block's first row starts it afresh
    } else if (wanted > scale) {
      const float ratio = scale / wanted;  // < 1: the re-rounded values stay in -127..127
      for (int r = 0; r < row; ++r)
        for (int d = lane; d < head_size; d += kWarpSize) {
          signed char* q = rows + (long long)r * head_size + d;
          *q = (signed char)rintf((float)*q * ratio);
        }
      scale = wanted;
    }
    for (int d = lane; d < head_size; d += kWarpSize) {
      const float q = scale > 0.0f ? rintf(to_float(token[d]) / scale) : 0.0f;
      rows[(long long)row * head_size + d] =
          (signed char)fminf(fmaxf(q, (float)-kInt8Max), (float)kInt8Max);
    }
  }
  if (lane == 0) *block_scale = scale;
}

// grid = (num_tokens): the CTAs of tokens that start no run leave at once, together.
template <class T>
__device__ void reshape_and_cache_int8(const T* __restrict__ key, const T* __restrict__ value,
                                       signed char* __restrict__ key_cache,
                                       signed char* __restrict__ value_cache,
                                       float* __restrict__ key_scales, float* __restrict__ value_scales,
                                       const long long* __restrict__ slot_mapping,
                                       long long key_token_stride, long long value_token_stride,
                                       int num_kv_heads, int head_size, int block_size) {
  const int first = blockIdx.x, num_tokens = gridDim.x;
  if (!starts_run(slot_mapping, first, block_size)) return;
  const int warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  for (int item = warp; item < 2 * num_kv_heads; item += num_warps) {
    const int head = item % num_kv_heads;
    if (item < num_kv_heads)
      quantize_run(key, key_token_stride, key_cache, key_scales, slot_mapping, first, num_tokens,
                   head, num_kv_heads, head_size, block_size);
    else
      quantize_run(value, value_token_stride, value_cache, value_scales, slot_mapping, first,
                   num_tokens, head, num_kv_heads, head_size, block_size);
  }
}

// ---- block copies ----

// cache_pointers[c] is the address of cache c (every layer's keys, then its values);
// block_mapping[p] = (src, dst). Pairs never share a dst, so CTAs never race.
template <class T>
__device__ void copy_blocks(const long long* __restrict__ cache_pointers,
                            const long long* __restrict__ block_mapping, long long block_elems) {
  T* cache = reinterpret_cast<T*>(cache_pointers[blockIdx.y]);
  const long long src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  for (long long i = threadIdx.x; i < block_elems; i += blockDim.x)
    cache[dst * block_elems + i] = cache[src * block_elems + i];
}

// 16 bytes moved by one load and one store (LDG.128 / STG.128, as CUDA's uint4): the unit
// of swap_blocks where every cache and the block size are 16-byte aligned.
struct alignas(16) Bytes16 {
  unsigned int x, y, z, w;
};

// Block mapping[p] = (src, dst) of cache c = blockIdx.y (layer c / 2's keys, then its
// values), from src_pointers[c] to dst_pointers[c], in units of U (a block is block_units
// of them). Either side may be host memory a pinned tensor's pointer names (unified
// addressing): the loads or stores then cross the bus, which the many CTAs keep busy.
// Destinations are distinct and the two sides never the same memory (checked on the
// host), so CTAs never race.
template <class U>
__device__ void swap_blocks(const long long* __restrict__ src_pointers,
                            const long long* __restrict__ dst_pointers,
                            const long long* __restrict__ block_mapping, long long block_units) {
  const U* src = reinterpret_cast<const U*>(src_pointers[blockIdx.y]) +
                 block_mapping[2 * blockIdx.x] * block_units;
  U* dst = reinterpret_cast<U*>(dst_pointers[blockIdx.y]) +
           block_mapping[2 * blockIdx.x + 1] * block_units;
  for (long long i = threadIdx.x; i < block_units; i += blockDim.x) dst[i] = src[i];
}

// The scales of int8 caches for block_mapping[p] = (src, dst) of cache c = blockIdx.y: the
// float32 [num_blocks, kv_heads] after each cache's values, src_values_bytes past
// src_pointers[c] (dst_values_bytes past dst_pointers[c]). copy_blocks passes one table
// as both sides. Destinations are distinct and never sources, so CTAs never race.
__device__ void copy_block_scales(const long long* __restrict__ src_pointers,
                                  const long long* __restrict__ dst_pointers,
                                  const long long* __restrict__ block_mapping, long long src_values_bytes,
                                  long long dst_values_bytes, int num_kv_heads) {
  const float* src = reinterpret_cast<const float*>(
      reinterpret_cast<const char*>(src_pointers[blockIdx.y]) + src_values_bytes);
  float* dst = reinterpret_cast<float*>(reinterpret_cast<char*>(dst_pointers[blockIdx.y]) + dst_values_bytes);
  const long long src_block = block_mapping[2 * blockIdx.x], dst_block = block_mapping[2 * blockIdx.x + 1];
  for (int h = threadIdx.x; h < num_kv_heads; h += blockDim.x)
    dst[dst_block * num_kv_heads + h] = src[src_block * num_kv_heads + h];
}

}  // namespace ringllm

extern "C" __global__ void copy_block_scales(const long long* src_pointers,
                                             const long long* dst_pointers,
                                             const long long* block_mapping, long long src_values_bytes,
                                             long long dst_values_bytes, int num_kv_heads) {
  ringllm::copy_block_scales(src_pointers, dst_pointers, block_mapping, src_values_bytes,
                             dst_values_bytes, num_kv_heads);
}

extern "C" __global__ void swap_blocks_b16(const long long* src_pointers,
                                           const long long* dst_pointers,
                                           const long long* block_mapping, long long block_units) {
  ringllm::swap_blocks<ringllm::Bytes16>(src_pointers, dst_pointers, block_mapping, block_units);
}

#define RINGLLM_CACHE_WRITE(suffix, T, C)                                                    \
  extern "C" __global__ void reshape_and_cache_##suffix(                                     \
      const T* key, const T* value, C* key_cache, C* value_cache,                           \
      const long long* slot_mapping, long long key_token_stride,                            \
      long long value_token_stride, int num_kv_heads, int head_size, int block_size) {       \
    ringllm::reshape_and_cache<T, C>(key, value, key_cache, value_cache, slot_mapping,       \
                                     key_token_stride, value_token_stride, num_kv_heads,     \
                                     head_size, block_size);                                 \
  }

#define RINGLLM_CACHE_KERNELS(suffix, T)                                                     \
  RINGLLM_CACHE_WRITE(suffix, T, T)                                                          \
  extern "C" __global__ void copy_blocks_##suffix(                                           \
      const long long* cache_pointers, const long long* block_mapping, long long block_elems) { \
    ringllm::copy_blocks<T>(cache_pointers, block_mapping, block_elems);                     \
  }                                                                                          \
  extern "C" __global__ void swap_blocks_##suffix(const long long* src_pointers,             \
                                                  const long long* dst_pointers,             \
                                                  const long long* block_mapping,            \
                                                  long long block_units) {                   \
    ringllm::swap_blocks<T>(src_pointers, dst_pointers, block_mapping, block_units);         \
  }

RINGLLM_CACHE_KERNELS(f32, float)
RINGLLM_CACHE_KERNELS(f16, __half)
RINGLLM_CACHE_KERNELS(bf16, __nv_bfloat16)
// fp8 caches: the writes from each activation type; block copies move bytes
RINGLLM_CACHE_WRITE(f32_fp8, float, ringllm::fp8_e4m3)
RINGLLM_CACHE_WRITE(f16_fp8, __half, ringllm::fp8_e4m3)
RINGLLM_CACHE_WRITE(bf16_fp8, __nv_bfloat16, ringllm::fp8_e4m3)

// int8 caches: the writes from each activation type, taking both caches' scales; block
// copies move bytes (copy_blocks_u8, swap_blocks_*), then the scales (copy_block_scales)
#define RINGLLM_CACHE_WRITE_INT8(suffix, T)                                                  \
  extern "C" __global__ void reshape_and_cache_##suffix(                                     \
      const T* key, const T* value, signed char* key_cache, signed char* value_cache,       \
      float* key_scales, float* value_scales, const long long* slot_mapping,                \
      long long key_token_stride, long long value_token_stride, int num_kv_heads,           \
      int head_size, int block_size) {                                                       \
    ringllm::reshape_and_cache_int8<T>(key, value, key_cache, value_cache, key_scales,       \
                                       value_scales, slot_mapping, key_token_stride,         \
                                       value_token_stride, num_kv_heads, head_size,          \
                                       block_size);                                          \
  }

RINGLLM_CACHE_WRITE_INT8(f32_i8, float)
RINGLLM_CACHE_WRITE_INT8(f16_i8, __half)
RINGLLM_CACHE_WRITE_INT8(bf16_i8, __nv_bfloat16)

extern "C" __global__ void copy_blocks_u8(const long long* cache_pointers,
                                          const long long* block_mapping, long long block_elems) {
  ringllm::copy_blocks<unsigned char>(cache_pointers, block_mapping, block_elems);
}

extern "C" __global__ void swap_blocks_u8(const long long* src_pointers,
                                          const long long* dst_pointers,
                                          const long long* block_mapping, long long block_units) {
  ringllm::swap_blocks<unsigned char>(src_pointers, dst_pointers, block_mapping, block_units);
}
