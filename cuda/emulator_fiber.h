// Fiber context switching for the CPU emulator (included by emulator.h).
//
// Two implementations of one tiny API: prepare a fiber on its stack, switch between two
// contexts. The portable one is ucontext (makecontext / swapcontext). On x86-64 a
// hand-written switch is used instead, because glibc's swapcontext makes a
// rt_sigprocmask system call on every switch and the emulator switches at every
// barrier and shuffle of every thread: the attention tests spend most of their time
// there otherwise. Define RINGLLM_EMU_UCONTEXT to force the portable path.
//
// x86-64 switch: push the callee-saved registers (rbp rbx r12-r15) and the SSE/x87
// control words on the current stack, store rsp, load the other rsp, pop, ret.
// A fresh fiber's stack is laid out as if it had been switched away from just before
// entering `entry`:
//
//   top (16-aligned) -8: 0 (entry's return address: entry never returns)
//                    -16: entry
//                    -24 .. -64: rbp rbx r12 r13 r14 r15 (zero)
//                    -72: mxcsr 0x1f80 | x87 control word 0x037f      <- saved rsp
#pragma once

#include <ucontext.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ringllm_emu {

#if defined(__x86_64__) && !defined(RINGLLM_EMU_UCONTEXT)

struct FiberContext {
  void* sp;
};

__attribute__((naked, noinline)) static void switch_stacks(void** /*save_sp*/, void* /*load_sp*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

inline void fiber_prepare(FiberContext& context, char* stack, size_t stack_bytes, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + stack_bytes) & ~uintptr_t(15);
  uint64_t* slot = reinterpret_cast<uint64_t*>(top);
  slot[-1] = 0;
  slot[-2] = reinterpret_cast<uint64_t>(entry);
  for (int i = 3; i <= 8; ++i) slot[-i] = 0;
  const uint32_t control[2] = {0x1f80u, 0x037fu};
  std::memcpy(&slot[-9], control, sizeof(control));
  context.sp = &slot[-9];
}

inline void fiber_switch(FiberContext& from, FiberContext& to) { switch_stacks(&from.sp, to.sp); }

#else

struct FiberContext {
  ucontext_t context;
};

inline void fiber_prepare(FiberContext& c, char* stack, size_t stack_bytes, void (*entry)()) {
  getcontext(&c.context);
  c.context.uc_stack.ss_sp = stack;
  c.context.uc_stack.ss_size = stack_bytes;
  c.context.uc_link = nullptr;
  makecontext(&c.context, entry, 0);
}

inline void fiber_switch(FiberContext& from, FiberContext& to) { swapcontext(&from.context, &to.context); }

#endif

}  // namespace ringllm_emu
