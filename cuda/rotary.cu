// Rotary embedding, GPT-NeoX style: each head's last dim is split in halves (x1, x2) and
//
//     x1' = x1 * cos - x2 * sin          x2' = x2 * cos + x1 * sin
//
// with cos/sin read from the float32 cache row of the token's position
// (cos_sin_cache[p] = [cos | sin], each head_size / 2 wide; llama3 / linear scaling are
// already folded into it by pipeline/ops/rope.py). Computed in float32, rounded once.
//
// query and key are rotated in place and may be views with a token stride (e.g. the
// q and k parts of a fused qkv projection): within a token, heads are contiguous.
//
// Launch: grid = (num_tokens), block = (threads striding over all (head, pair) items).
#include "common.cuh"

namespace ringllm {

template <class T>
__device__ void rotate_heads(T* __restrict__ x, long long token_stride, int num_heads, int head_size,
                             const float* __restrict__ cos, const float* __restrict__ sin) {
  const int half_size = head_size / 2;
  T* token = x + blockIdx.x * token_stride;
  for (int item = threadIdx.x; item < num_heads * half_size; item += blockDim.x) {
    const int head = item / half_size, i = item % half_size;
    T* head_x = token + head * head_size;
    const float x1 = to_float(head_x[i]), x2 = to_float(head_x[i + half_size]);
    head_x[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
    head_x[i + half_size] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

template <class T>
__device__ void rotary_embedding(const long long* __restrict__ positions, T* __restrict__ query,
                                 T* __restrict__ key, const float* __restrict__ cos_sin_cache,
                                 long long query_token_stride, long long key_token_stride,
                                 int num_heads, int num_kv_heads, int head_size) {
  const float* cos = cos_sin_cache + positions[blockIdx.x] * head_size;
  const float* sin = cos + head_size / 2;
  rotate_heads(query, query_token_stride, num_heads, head_size, cos, sin);
  rotate_heads(key, key_token_stride, num_kv_heads, head_size, cos, sin);
}

}  // namespace ringllm

#define RINGLLM_ROTARY_KERNELS(suffix, T)                                                    \
  extern "C" __global__ void rotary_embedding_##suffix(                                      \
      const long long* positions, T* query, T* key, const float* cos_sin_cache,              \
      long long query_token_stride, long long key_token_stride, int num_heads,               \
      int num_kv_heads, int head_size) {                                                     \
    ringllm::rotary_embedding<T>(positions, query, key, cos_sin_cache, query_token_stride,   \
                                 key_token_stride, num_heads, num_kv_heads, head_size);      \
  }

RINGLLM_ROTARY_KERNELS(f32, float)
RINGLLM_ROTARY_KERNELS(f16, __half)
RINGLLM_ROTARY_KERNELS(bf16, __nv_bfloat16)
