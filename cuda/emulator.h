// CPU emulator for ringllm's CUDA kernels: the CUDA built-ins as plain C++.
//
// emulator.py compiles a kernel source with g++ and this header force-included, so the
// same .cu text that NVRTC compiles for the GPU runs on the CPU in tests.
//
// Execution model (one launch, on one OS thread):
//
//   for each block (in order, or reversed):
//       every thread of the block is a fiber with its own stack (emulator_fiber.h)
//       round: run each runnable fiber (in thread order, or reversed) until it
//              reaches __syncthreads, a warp operation, or returns
//       then release the barrier that every live thread (or warp lane) reached;
//       a barrier that can never be released (some threads exited, others wait;
//       or lanes wait at different kinds of barrier) is reported as a deadlock
//
// A fiber runs uninterrupted between barriers, so a missing __syncthreads makes the
// result depend on thread order: running once forward and once reversed exposes it.
//
// Limits: no grid-wide sync or cooperative groups, no inline PTX, no tensor-core or
// async-copy intrinsics, no warp votes (__ballot_sync...), no texture memory; atomics are trivially atomic (one OS
// thread); static __shared__ arrays are not poisoned between blocks (dynamic shared
// memory is: filled with 0xFF bytes, a NaN for floats, before every block).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "emulator_fiber.h"
#include "emulator_numeric.h"

namespace ringllm_emu {

constexpr unsigned kWarpSize = 32;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kMaxDynamicSharedBytes = 48 * 1024;  // CUDA's default opt-in limit
constexpr unsigned kMaxThreadsPerBlock = 1024;

enum class FiberState { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kExited };

struct Fiber {
  FiberContext context;
  uint3 idx;
  unsigned linear_id;
  FiberState state;
  unsigned warp_mask;    // lanes named by the warp operation this fiber waits at
  unsigned shfl_parity;  // which half of the double-buffered exchange it writes next
};

struct LaunchConfig {  // mirrored by a ctypes.Structure in emulator.py
  uint32_t grid[3];
  uint32_t block[3];
  uint64_t shared_bytes;
  int32_t reverse;
};

using Invoker = void (*)(void* kernel, void** args);

struct Launch {
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  std::vector<Fiber> fibers;
  std::vector<uint64_t> exchange;  // [warp][parity][lane] shuffle values, 8 bytes each
  std::vector<uint8_t> dynamic_shared;
  FiberContext scheduler;
  void* kernel;
  void** args;
  Invoker invoke;
  std::string error;
};

// One launch at a time per compiled module: the state below is what the built-in
// macros read, so launches from two host threads are serialised.
inline std::mutex g_launch_mutex;
inline Launch* g_launch = nullptr;
inline Fiber* g_current = nullptr;

inline unsigned lane_of(const Fiber& f) { return f.linear_id % kWarpSize; }
inline unsigned warp_of(const Fiber& f) { return f.linear_id / kWarpSize; }

// Ends the running fiber's launch with an error: the scheduler never resumes it.
[[noreturn]] inline void fail(const std::string& message) {
  Launch& launch = *g_launch;
  if (launch.error.empty()) launch.error = message;
  fiber_switch(g_current->context, launch.scheduler);
  std::abort();  // unreachable: a failed fiber is never switched back to
}

inline void wait_at(FiberState barrier, unsigned mask) {
  g_current->state = barrier;
  g_current->warp_mask = mask;
  fiber_switch(g_current->context, g_launch->scheduler);
}

inline void fiber_main() {
  Launch& launch = *g_launch;
  try {
    launch.invoke(launch.kernel, launch.args);
  } catch (const std::exception& e) {
    fail(std::string("kernel threw: ") + e.what());
  }
  g_current->state = FiberState::kExited;
  fiber_switch(g_current->context, launch.scheduler);
}

}  // namespace ringllm_emu

#define threadIdx (::ringllm_emu::g_current->idx)
#define blockIdx (::ringllm_emu::g_launch->block_idx)
#define blockDim (::ringllm_emu::g_launch->block_dim)
#define gridDim (::ringllm_emu::g_launch->grid_dim)
#define warpSize 32

inline void __syncthreads() {
  ::ringllm_emu::wait_at(::ringllm_emu::FiberState::kAtBlockBarrier, 0);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::ringllm_emu::wait_at(::ringllm_emu::FiberState::kAtWarpBarrier, mask);
}
inline void __threadfence() {}
inline void __threadfence_block() {}

namespace ringllm_emu {

enum class ShuffleKind { kIdx, kUp, kDown, kXor };

// The lane whose value `lane` receives, following the CUDA rules for `width` segments:
// a source outside the caller's segment (or a later segment, for xor) yields the caller's own value.
inline unsigned shuffle_source(ShuffleKind kind, unsigned lane, int operand, int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fail("shuffle width " + std::to_string(width) + " is not a power of two in 1..32");
  unsigned first = lane / width * width;
  int src = static_cast<int>(lane);
  if (kind == ShuffleKind::kIdx) src = static_cast<int>(first) + ((operand % width) + width) % width;
  if (kind == ShuffleKind::kUp) src = static_cast<int>(lane) - operand;
  if (kind == ShuffleKind::kDown) src = static_cast<int>(lane) + operand;
  if (kind == ShuffleKind::kXor) src = static_cast<int>(lane ^ static_cast<unsigned>(operand));
  if (kind == ShuffleKind::kXor && src >= static_cast<int>(first + width)) return lane;
  if (src < static_cast<int>(first) || src >= static_cast<int>(first + width)) return lane;
  return static_cast<unsigned>(src);
}

template <class T>
T shuffle(ShuffleKind kind, unsigned mask, T value, int operand, int width) {
  static_assert(sizeof(T) <= 8, "emulated shuffles move at most 8 bytes");
  Launch& launch = *g_launch;
  Fiber& self = *g_current;
  unsigned lane = lane_of(self);
  if (!(mask & (1u << lane)))
    fail("lane " + std::to_string(lane) + " calls a shuffle whose mask leaves it out");
  size_t base = (warp_of(self) * 2 + self.shfl_parity) * kWarpSize;
  self.shfl_parity ^= 1u;  // double buffer: the next shuffle cannot clobber unread values
  std::memcpy(&launch.exchange[base + lane], &value, sizeof(T));
  wait_at(FiberState::kAtWarpBarrier, mask);
  unsigned src = shuffle_source(kind, lane, operand, width);
  if (!(mask & (1u << src)))
    fail("lane " + std::to_string(lane) + " reads lane " + std::to_string(src) +
         ", which the shuffle mask leaves out");
  T out;
  std::memcpy(&out, &launch.exchange[base + src], sizeof(T));
  return out;
}

}  // namespace ringllm_emu

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return ::ringllm_emu::shuffle(::ringllm_emu::ShuffleKind::kIdx, mask, v, src_lane, width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::ringllm_emu::shuffle(::ringllm_emu::ShuffleKind::kUp, mask, v, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::ringllm_emu::shuffle(::ringllm_emu::ShuffleKind::kDown, mask, v, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::ringllm_emu::shuffle(::ringllm_emu::ShuffleKind::kXor, mask, v, lane_mask, width);
}

namespace ringllm_emu {

inline void* dynamic_shared_memory() { return g_launch->dynamic_shared.data(); }

// ---- scheduler ----

// Releases a warp whose named lanes all wait at a warp operation; false if none can go.
inline bool release_warp_barriers(Launch& launch) {
  bool released = false;
  unsigned num_threads = static_cast<unsigned>(launch.fibers.size());
  for (unsigned first = 0; first < num_threads; first += kWarpSize) {
    unsigned last = std::min(first + kWarpSize, num_threads);
    unsigned mask = 0;
    for (unsigned t = first; t < last; ++t)
      if (launch.fibers[t].state == FiberState::kAtWarpBarrier) mask = launch.fibers[t].warp_mask;
    if (mask == 0) continue;
    const unsigned lanes = last - first;
    if (lanes < kWarpSize && (mask >> lanes) != 0) {
      launch.error = "warp " + std::to_string(first / kWarpSize) + " has " + std::to_string(lanes) +
                     " threads but its warp operation's mask names lanes beyond them "
                     "(the block size is not a multiple of 32)";
      return false;
    }
    bool complete = true;
    for (unsigned t = first; t < last; ++t) {
      const Fiber& f = launch.fibers[t];
      bool named = (mask >> (t - first)) & 1u;
      if (!named) continue;
      if (f.state == FiberState::kExited) {
        launch.error = "deadlock: warp " + std::to_string(first / kWarpSize) +
                       " waits at a warp operation that names lane " + std::to_string(t - first) +
                       ", which has exited";
        return false;
      }
      if (f.state != FiberState::kAtWarpBarrier || f.warp_mask != mask) complete = false;
    }
    if (!complete) continue;
    for (unsigned t = first; t < last; ++t)
      if ((mask >> (t - first)) & 1u) launch.fibers[t].state = FiberState::kRunnable;
    released = true;
  }
  return released;
}

inline std::string describe_deadlock(const Launch& launch) {
  unsigned at_block = 0, at_warp = 0, exited = 0;
  for (const Fiber& f : launch.fibers) {
    at_block += f.state == FiberState::kAtBlockBarrier;
    at_warp += f.state == FiberState::kAtWarpBarrier;
    exited += f.state == FiberState::kExited;
  }
  return "deadlock in block (" + std::to_string(launch.block_idx.x) + "," +
         std::to_string(launch.block_idx.y) + "," + std::to_string(launch.block_idx.z) + "): " +
         std::to_string(at_block) + " threads wait at __syncthreads, " + std::to_string(at_warp) +
         " at a warp operation, " + std::to_string(exited) + " have exited";
}

// After a round in which no fiber is runnable: releases a barrier, or records a deadlock.
inline bool release_barriers(Launch& launch) {
  if (release_warp_barriers(launch)) return true;
  if (!launch.error.empty()) return false;
  unsigned live = 0, at_block = 0;
  for (const Fiber& f : launch.fibers) {
    live += f.state != FiberState::kExited;
    at_block += f.state == FiberState::kAtBlockBarrier;
  }
  if (live == 0) return false;
  if (at_block == launch.fibers.size()) {
    for (Fiber& f : launch.fibers) f.state = FiberState::kRunnable;
    return true;
  }
  launch.error = describe_deadlock(launch);
  return false;
}

inline void run_block(Launch& launch, char* stacks, bool reverse) {
  unsigned n = static_cast<unsigned>(launch.fibers.size());
  const dim3& bd = launch.block_dim;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = launch.fibers[t];
    f.linear_id = t;
    f.idx = uint3{t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)};
    f.state = FiberState::kRunnable;
    f.shfl_parity = 0;
    char* stack = stacks + t * (kStackBytes + getpagesize()) + getpagesize();
    fiber_prepare(f.context, stack, kStackBytes, fiber_main);
  }
  std::memset(launch.dynamic_shared.data(), 0xFF, launch.dynamic_shared.size());
  do {
    for (unsigned k = 0; k < n; ++k) {
      Fiber& f = launch.fibers[reverse ? n - 1 - k : k];
      if (f.state != FiberState::kRunnable) continue;
      g_current = &f;
      fiber_switch(launch.scheduler, f.context);
      if (!launch.error.empty()) return;
    }
  } while (release_barriers(launch));
}

inline std::string check_config(const LaunchConfig& c) {
  for (int i = 0; i < 3; ++i)
    if (c.grid[i] == 0 || c.block[i] == 0) return "grid and block dimensions must all be >= 1";
  uint64_t threads = uint64_t(c.block[0]) * c.block[1] * c.block[2];
  if (threads > kMaxThreadsPerBlock || c.block[2] > 64)
    return "block of " + std::to_string(threads) + " threads exceeds CUDA's limit of 1024 (z <= 64)";
  if (c.shared_bytes > kMaxDynamicSharedBytes)
    return "dynamic shared memory of " + std::to_string(c.shared_bytes) +
           " bytes exceeds CUDA's default limit of 49152 bytes";
  return "";
}

inline int run_grid(void* kernel, Invoker invoke, const LaunchConfig* c, void** args, char* err,
                    size_t err_len) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  Launch launch;
  launch.error = check_config(*c);
  unsigned threads = c->block[0] * c->block[1] * c->block[2];
  size_t page = getpagesize(), slot = kStackBytes + page;
  char* stacks = nullptr;
  if (launch.error.empty()) {
    void* mem = mmap(nullptr, slot * threads, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) launch.error = "could not map fiber stacks";
    stacks = static_cast<char*>(mem);
    for (unsigned t = 0; stacks && t < threads; ++t) mprotect(stacks + t * slot, page, PROT_NONE);
  }
  launch.block_dim = dim3{c->block[0], c->block[1], c->block[2]};
  launch.grid_dim = dim3{c->grid[0], c->grid[1], c->grid[2]};
  launch.fibers.resize(threads);
  launch.exchange.assign((threads + kWarpSize - 1) / kWarpSize * 2 * kWarpSize, 0);
  launch.dynamic_shared.resize(c->shared_bytes + 16);
  launch.kernel = kernel;
  launch.args = args;
  launch.invoke = invoke;
  g_launch = &launch;
  uint64_t num_blocks = uint64_t(c->grid[0]) * c->grid[1] * c->grid[2];
  for (uint64_t k = 0; launch.error.empty() && k < num_blocks; ++k) {
    uint64_t b = c->reverse ? num_blocks - 1 - k : k;
    launch.block_idx = uint3{unsigned(b % c->grid[0]), unsigned(b / c->grid[0] % c->grid[1]),
                             unsigned(b / (uint64_t(c->grid[0]) * c->grid[1]))};
    run_block(launch, stacks, c->reverse != 0);
  }
  if (stacks) munmap(stacks, slot * threads);
  g_launch = nullptr;
  g_current = nullptr;
  std::snprintf(err, err_len, "%s", launch.error.c_str());
  return launch.error.empty() ? 0 : 1;
}

// ---- argument unpacking and signatures ----

template <class... A, size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A>
void invoke(void* kernel, void** args) {
  call_with(reinterpret_cast<void (*)(A...)>(kernel), args, std::index_sequence_for<A...>{});
}

}  // namespace ringllm_emu

namespace ringllm {
struct fp8_e4m3;  // common.cuh: the fp8 KV cache's byte, named in kernel signatures
}

namespace ringllm_emu {

template <class T>
std::string type_name() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) {
    return type_name<std::remove_cv_t<std::remove_pointer_t<U>>>() + "*";
  } else if constexpr (std::is_void_v<U>) {
    return "void";
  } else if constexpr (std::is_same_v<U, float>) {
    return "float32";
  } else if constexpr (std::is_same_v<U, double>) {
    return "float64";
  } else if constexpr (std::is_same_v<U, __half>) {
    return "float16";
  } else if constexpr (std::is_same_v<U, __nv_bfloat16>) {
    return "bfloat16";
  } else if constexpr (std::is_same_v<U, ringllm::fp8_e4m3>) {
    return "float8_e4m3fn";
  } else if constexpr (std::is_integral_v<U>) {
    return std::string(std::is_signed_v<U> ? "int" : "uint") + std::to_string(8 * sizeof(U));
  } else {
    static_assert(sizeof(U) == 0, "unsupported kernel parameter type");
    return "";
  }
}

template <class... A>
int launch_kernel(void (*kernel)(A...), const LaunchConfig* c, void** args, char* err, size_t len) {
  return run_grid(reinterpret_cast<void*>(kernel), &invoke<A...>, c, args, err, len);
}

template <class... A>
const char* signature(void (*)(A...)) {
  static const std::string text = [] {
    std::string s;
    ((s += type_name<A>() + ","), ...);
    return s;
  }();
  return text.c_str();
}

}  // namespace ringllm_emu

// emulator.py appends one of these per `extern "C" __global__` kernel of the source.
#define RINGLLM_EMU_EXPORT(name)                                                              \
  extern "C" int ringllm_emu_launch__##name(const ::ringllm_emu::LaunchConfig* c, void** a,   \
                                            char* e, size_t n) {                              \
    return ::ringllm_emu::launch_kernel(&name, c, a, e, n);                                   \
  }                                                                                           \
  extern "C" const char* ringllm_emu_signature__##name() { return ::ringllm_emu::signature(&name); }
