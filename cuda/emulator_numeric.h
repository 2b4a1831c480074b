// CUDA's language keywords, vector and 16-bit float types, math intrinsics and atomics,
// as plain C++ for the CPU emulator (included by emulator.h; see it for the execution
// model). The 16-bit types are storage only: kernels convert them with the intrinsics
// (__half2float, __float2bfloat16, ...), which round to nearest even like the GPU's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define RINGLLM_EMULATOR 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Blocks run one after another, so one static copy per kernel instantiation is exactly
// "shared by the threads of the running block".
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
};

// ---- 16-bit float types: storage only, converted through the intrinsics below ----
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half(float x) {  // round to nearest even, as __float2half does
  _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline __half __float2half_rn(float x) { return __float2half(x); }
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16(float x) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
    return b;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  b.bits = static_cast<uint16_t>(u >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __float2bfloat16(x); }

// ---- math intrinsics ----
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, 4);
  return i;
}
inline float __int_as_float(int i) {
  float x;
  std::memcpy(&x, &i, 4);
  return x;
}
inline unsigned __float_as_uint(float x) { return static_cast<unsigned>(__float_as_int(x)); }
inline float __uint_as_float(unsigned u) { return __int_as_float(static_cast<int>(u)); }

// CUDA's integer min/max device functions (std::min would reject mixed int widths).
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  return b < a ? b : a;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

// ---- atomics: every fiber runs on one OS thread and never yields inside these ----
template <class T, class U>
inline T atomicAdd(T* address, U value) {
  T old = *address;
  *address = old + static_cast<T>(value);
  return old;
}
template <class T, class U>
inline T atomicMax(T* address, U value) {
  T old = *address;
  *address = old < static_cast<T>(value) ? static_cast<T>(value) : old;
  return old;
}
template <class T, class U>
inline T atomicMin(T* address, U value) {
  T old = *address;
  *address = static_cast<T>(value) < old ? static_cast<T>(value) : old;
  return old;
}
template <class T, class U>
inline T atomicExch(T* address, U value) {
  T old = *address;
  *address = static_cast<T>(value);
  return old;
}
template <class T, class U, class V>
inline T atomicCAS(T* address, U compare, V value) {
  T old = *address;
  if (old == static_cast<T>(compare)) *address = static_cast<T>(value);
  return old;
}
