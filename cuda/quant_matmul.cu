// GGUF block-quantized weights on the GPU: a dequantize-and-dot GEMV for decode and a
// dequantize kernel (whole matrix or a tile) for prefill's dense GEMM.
//
// The weights stay in GGUF's native block bytes: an [n, k] weight is n rows of
// k / block_elems blocks, row r starting at `w + r * w_row_stride` bytes (a row shard is a
// slice of rows; a block-aligned column shard is the same rows with a wider stride).
//
// Every block is decoded in *chunks* of 8 weights, two runs of 4 that share their bytes:
//
//   elements [lo, lo + 4) and [lo + gap, lo + gap + 4) of the block
//
//   type   block elems  bytes  chunks/block  gap  chunk c: lo              layout (bytes)
//   Q4_0       32         18        4         16   4c                    d | qs[16]
//   Q4_1       32         20        4         16   4c                    d | m | qs[16]
//   Q5_0       32         22        4         16   4c                    d | qh[4] | qs[16]
//   Q5_1       32         24        4         16   4c                    d | m | qh[4] | qs[16]
//   Q8_0       32         34        4         16   4c                    d | qs[32] (int8)
//   Q4_K      256        144       32         32   64(c/8) + 4(c%8)      d | dmin | sc[12] | qs[128]
//   Q5_K      256        176       32         32   64(c/8) + 4(c%8)      d | dmin | sc[12] | qh[32] | qs[128]
//   Q6_K      256        210       32         64   128(c/16) + 32(c/8%2) ql[128] | qh[64] | sc[16] | d
//                                                    + 4(c%8)
//
// (the low nibble of a byte feeds the `lo` run, the high nibble the `lo + gap` run; d, m,
// dmin are float16). Numerics: a weight is computed exactly as gguf.quants.dequantize
// computes it in float32 -- every product rounded on its own (`mul_rn`: nvcc would fuse
// `d * q - m` into one FMA and lose bit-exactness) -- so `dequantize_*` in float32 is
// bit-exact and the 16-bit outputs are that value rounded once. The GEMV dots those same
// weights with the activations in float32 (fmaf) and rounds the sum once to T.
//
// Launch:
//   quant_gemv_<type>_<T>(out, out_row_stride, x, w, w_row_stride, m, n, k)
//     grid = ceil(n / warps per block), block = 32 * warps per block; one warp per
//     output row, lanes striding over the row's chunks, m <= kMaxGemvRows rows of x
//     (x contiguous [m, k]); out[r * out_row_stride + row].
//   dequantize_<type>_<T>(out, out_row_stride, w, w_row_stride, n, k)
//     one thread per chunk: grid = ceil(n * chunks per row / block), any block size.
#include "common.cuh"

namespace ringllm {

constexpr int kMaxGemvRows = 8;
constexpr int kChunkElems = 8;

#ifdef RINGLLM_EMULATOR
__device__ __forceinline__ float mul_rn(float a, float b) { return a * b; }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
#endif

// float16 bits -> float32, exactly (subnormals, inf and NaN included); byte loads,
// because blocks of 18, 22 or 210 bytes leave their scales unaligned.
__device__ __forceinline__ float half_at(const unsigned char* p) {
  const unsigned bits = p[0] | (unsigned(p[1]) << 8);
  const unsigned sign = (bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  if (exponent == 0) return __uint_as_float(sign | __float_as_uint(float(mantissa) * 0x1p-24f));
  if (exponent == 31) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

__device__ __forceinline__ unsigned u32_at(const unsigned char* p) {
  return p[0] | (unsigned(p[1]) << 8) | (unsigned(p[2]) << 16) | (unsigned(p[3]) << 24);
}

// ---- the 32-element types: chunk c holds bytes qs[4c, 4c + 4) ----

struct Q4_0 {
  static constexpr int kBlockElems = 32, kBlockBytes = 18, kChunks = 4, kGap = 16;
  static __device__ int lo_elem(int c) { return 4 * c; }
  static __device__ void decode(const unsigned char* b, int c, float* w) {
    const float d = half_at(b);
    for (int i = 0; i < 4; ++i) {
      const int q = b[2 + 4 * c + i];
      w[i] = mul_rn(d, float((q & 15) - 8));
      w[4 + i] = mul_rn(d, float((q >> 4) - 8));
    }
  }
};

struct Q4_1 {
  static constexpr int kBlockElems = 32, kBlockBytes = 20, kChunks = 4, kGap = 16;
  static __device__ int lo_elem(int c) { return 4 * c; }
  static __device__ void decode(const unsigned char* b, int c, float* w) {
    const float d = half_at(b), m = half_at(b + 2);
    for (int i = 0; i < 4; ++i) {
      const int q = b[4 + 4 * c + i];
      w[i] = mul_rn(d, float(q & 15)) + m;
      w[4 + i] = mul_rn(d, float(q >> 4)) + m;
    }
  }
};

// Q5: bit e of the little-endian qh word is the fifth bit of element e.
struct Q5_0 {
  static constexpr int kBlockElems = 32, kBlockBytes = 22, kChunks = 4, kGap = 16;
  static __device__ int lo_elem(int c) { return 4 * c; }
  static __device__ void decode(const unsigned char* b, int c, float* w) {
    const float d = half_at(b);
    const unsigned qh = u32_at(b + 2);
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * c + i, q = b[6 + e];
      w[i] = mul_rn(d, float(int((q & 15) | (((qh >> e) & 1u) << 4)) - 16));
      w[4 + i] = mul_rn(d, float(int((q >> 4) | (((qh >> (e + 16)) & 1u) << 4)) - 16));
    }
  }
};

struct Q5_1 {
  static constexpr int kBlockElems = 32, kBlockBytes = 24, kChunks = 4, kGap = 16;
  static __device__ int lo_elem(int c) { return 4 * c; }
  static __device__ void decode(const unsigned char* b, int c, float* w) {
    const float d = half_at(b), m = half_at(b + 2);
    const unsigned qh = u32_at(b + 4);
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * c + i, q = b[8 + e];
      w[i] = mul_rn(d, float((q & 15) | (((qh >> e) & 1u) << 4))) + m;
      w[4 + i] = mul_rn(d, float((q >> 4) | (((qh >> (e + 16)) & 1u) << 4))) + m;
    }
  }
};

struct Q8_0 {
  static constexpr int kBlockElems = 32, kBlockBytes = 34, kChunks = 4, kGap = 16;
  static __device__ int lo_elem(int c) { return 4 * c; }
  static __device__ void decode(const unsigned char* b, int c, float* w) {
    const float d = half_at(b);
    for (int i = 0; i < 4; ++i) {
      w[i] = mul_rn(float(static_cast<signed char>(b[2 + 4 * c + i])), d);
      w[4 + i] = mul_rn(float(static_cast<signed char>(b[18 + 4 * c + i])), d);
    }
  }
};

// ---- the 256-element K types: 8 sub-blocks of 32, each with its own 6-bit scale ----

// Sub-block j's 6-bit scale and min from the 12 packed bytes (as get_scale_min_k4).
__device__ __forceinline__ void k4_scale_min(const unsigned char* s, int j, float* scale, float* min) {
  if (j < 4) {
    *scale = float(s[j] & 63);
    *min = float(s[j + 4] & 63);
  } else {
    *scale = float((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    *min = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Q4_K / Q5_K chunk c: sub-blocks 2p (low nibbles) and 2p + 1 (high) with p = c / 8,
// bytes qs[32p + l0, + 4) with l0 = 4 (c % 8).
template <bool kFifthBit>
__device__ __forceinline__ void decode_k4(const unsigned char* b, int c, float* w) {
  const int p = c / 8, l0 = 4 * (c % 8);
  const float d = half_at(b), dmin = half_at(b + 2);
  float scale_lo, min_lo, scale_hi, min_hi;
  k4_scale_min(b + 4, 2 * p, &scale_lo, &min_lo);
  k4_scale_min(b + 4, 2 * p + 1, &scale_hi, &min_hi);
  const float d_lo = mul_rn(d, scale_lo), m_lo = mul_rn(dmin, min_lo);
  const float d_hi = mul_rn(d, scale_hi), m_hi = mul_rn(dmin, min_hi);
  const unsigned char* qs = b + (kFifthBit ? 48 : 16) + 32 * p + l0;
  for (int i = 0; i < 4; ++i) {
    int lo = qs[i] & 15, hi = qs[i] >> 4;
    if (kFifthBit) {  // Q5_K: bit j of qh[l] is the fifth bit of sub-block j's element l
      const int qh = b[16 + l0 + i];
      lo |= ((qh >> (2 * p)) & 1) << 4;
      hi |= ((qh >> (2 * p + 1)) & 1) << 4;
    }
    w[i] = mul_rn(d_lo, float(lo)) - m_lo;
    w[4 + i] = mul_rn(d_hi, float(hi)) - m_hi;
  }
}

struct Q4_K {
  static constexpr int kBlockElems = 256, kBlockBytes = 144, kChunks = 32, kGap = 32;
  static __device__ int lo_elem(int c) { return 64 * (c / 8) + 4 * (c % 8); }
  static __device__ void decode(const unsigned char* b, int c, float* w) { decode_k4<false>(b, c, w); }
};

struct Q5_K {
  static constexpr int kBlockElems = 256, kBlockBytes = 176, kChunks = 32, kGap = 32;
  static __device__ int lo_elem(int c) { return 64 * (c / 8) + 4 * (c % 8); }
  static __device__ void decode(const unsigned char* b, int c, float* w) { decode_k4<true>(b, c, w); }
};

// Q6_K: two halves of 128; in half h, element r = 32 s + l (s = 0..3) takes the low
// (s < 2) or high nibble of ql[64h + 32 (s % 2) + l] and bits 2s, 2s+1 of qh[32h + l];
// 16 int8 scales, one per 16 elements. Chunk c: h = c / 16, s = c / 8 % 2 (and s + 2).
struct Q6_K {
  static constexpr int kBlockElems = 256, kBlockBytes = 210, kChunks = 32, kGap = 64;
  static __device__ int lo_elem(int c) { return 128 * (c / 16) + 32 * (c / 8 % 2) + 4 * (c % 8); }
  static __device__ void decode(const unsigned char* b, int c, float* w) {
    const int h = c / 16, s = c / 8 % 2, l0 = 4 * (c % 8);
    const float d = half_at(b + 208);
    const signed char* scales = reinterpret_cast<const signed char*>(b + 192);
    const float d_lo = mul_rn(d, float(scales[8 * h + 2 * s + l0 / 16]));
    const float d_hi = mul_rn(d, float(scales[8 * h + 4 + 2 * s + l0 / 16]));
    const unsigned char* ql = b + 64 * h + 32 * s + l0;
    const unsigned char* qh = b + 128 + 32 * h + l0;
    for (int i = 0; i < 4; ++i) {
      const int lo = (ql[i] & 15) | (((qh[i] >> (2 * s)) & 3) << 4);
      const int hi = (ql[i] >> 4) | (((qh[i] >> (2 * s + 4)) & 3) << 4);
      w[i] = mul_rn(d_lo, float(lo - 32));
      w[4 + i] = mul_rn(d_hi, float(hi - 32));
    }
  }
};

// ---- kernels ----

template <class Q, class T>
__device__ void quant_gemv(T* __restrict__ out, long long out_row_stride, const T* __restrict__ x,
                           const unsigned char* __restrict__ w, long long w_row_stride, int m, int n,
                           int k) {
  const int lane = threadIdx.x % kWarpSize;
  const int row = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (row >= n) return;  // the whole warp leaves together: its shuffles stay complete
  const unsigned char* w_row = w + row * w_row_stride;
  const int num_chunks = k / Q::kBlockElems * Q::kChunks;
  float acc[kMaxGemvRows];
#pragma unroll
  for (int r = 0; r < kMaxGemvRows; ++r) acc[r] = 0.0f;
  for (int c = lane; c < num_chunks; c += kWarpSize) {
    const int block = c / Q::kChunks, chunk = c % Q::kChunks;
    float weights[kChunkElems];
    Q::decode(w_row + block * Q::kBlockBytes, chunk, weights);
    const int lo = block * Q::kBlockElems + Q::lo_elem(chunk), hi = lo + Q::kGap;
#pragma unroll
    for (int r = 0; r < kMaxGemvRows; ++r) {
      if (r >= m) break;
      const T* x_row = x + static_cast<long long>(r) * k;
      float sum = acc[r];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sum = fmaf(weights[i], to_float(x_row[lo + i]), sum);
        sum = fmaf(weights[4 + i], to_float(x_row[hi + i]), sum);
      }
      acc[r] = sum;
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxGemvRows; ++r) {
    if (r >= m) break;
    const float total = warp_sum(acc[r]);
    if (lane == 0) out[r * out_row_stride + row] = from_float<T>(total);
  }
}

template <class Q, class T>
__device__ void dequantize_chunks(T* __restrict__ out, long long out_row_stride,
                                  const unsigned char* __restrict__ w, long long w_row_stride, int n,
                                  int k) {
  const long long chunks_per_row = static_cast<long long>(k / Q::kBlockElems) * Q::kChunks;
  const long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n * chunks_per_row) return;
  const long long row = c / chunks_per_row;
  const int in_row = static_cast<int>(c % chunks_per_row);
  const int block = in_row / Q::kChunks, chunk = in_row % Q::kChunks;
  float weights[kChunkElems];
  Q::decode(w + row * w_row_stride + block * Q::kBlockBytes, chunk, weights);
  T* lo = out + row * out_row_stride + block * Q::kBlockElems + Q::lo_elem(chunk);
  for (int i = 0; i < 4; ++i) {
    lo[i] = from_float<T>(weights[i]);
    lo[Q::kGap + i] = from_float<T>(weights[4 + i]);
  }
}

}  // namespace ringllm

#define RINGLLM_QUANT_KERNELS(qname, Q, suffix, T)                                                \
  extern "C" __global__ void quant_gemv_##qname##_##suffix(                                       \
      T* out, long long out_row_stride, const T* x, const unsigned char* w, long long w_row_stride, \
      int m, int n, int k) {                                                                       \
    ringllm::quant_gemv<ringllm::Q, T>(out, out_row_stride, x, w, w_row_stride, m, n, k);          \
  }                                                                                                \
  extern "C" __global__ void dequantize_##qname##_##suffix(                                       \
      T* out, long long out_row_stride, const unsigned char* w, long long w_row_stride, int n,     \
      int k) {                                                                                     \
    ringllm::dequantize_chunks<ringllm::Q, T>(out, out_row_stride, w, w_row_stride, n, k);         \
  }

#define RINGLLM_QUANT_TYPE(qname, Q)                   \
  RINGLLM_QUANT_KERNELS(qname, Q, f32, float)          \
  RINGLLM_QUANT_KERNELS(qname, Q, f16, __half)         \
  RINGLLM_QUANT_KERNELS(qname, Q, bf16, __nv_bfloat16)

RINGLLM_QUANT_TYPE(q4_0, Q4_0)
RINGLLM_QUANT_TYPE(q4_1, Q4_1)
RINGLLM_QUANT_TYPE(q5_0, Q5_0)
RINGLLM_QUANT_TYPE(q5_1, Q5_1)
RINGLLM_QUANT_TYPE(q8_0, Q8_0)
RINGLLM_QUANT_TYPE(q4_k, Q4_K)
RINGLLM_QUANT_TYPE(q5_k, Q5_K)
RINGLLM_QUANT_TYPE(q6_k, Q6_K)
