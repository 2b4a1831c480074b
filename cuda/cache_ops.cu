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
//         copy_blocks: grid = (num_pairs, num_caches), block = (threads over one block).
//         swap_blocks: grid = (num_pairs, 2 * num_layers), block = (threads over one block).
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

}  // namespace ringllm

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

extern "C" __global__ void copy_blocks_u8(const long long* cache_pointers,
                                          const long long* block_mapping, long long block_elems) {
  ringllm::copy_blocks<unsigned char>(cache_pointers, block_mapping, block_elems);
}

extern "C" __global__ void swap_blocks_u8(const long long* src_pointers,
                                          const long long* dst_pointers,
                                          const long long* block_mapping, long long block_units) {
  ringllm::swap_blocks<unsigned char>(src_pointers, dst_pointers, block_mapping, block_units);
}
