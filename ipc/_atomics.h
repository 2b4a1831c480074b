/*
 * Helpers shared by the C files of ringllm.ipc (_atomics.c, _ringops.c, _probes.c): resolving (buffer, offset) to
 * an aligned 8-byte word, argument conversion, the futex system call, and the waker half of
 * the sleep handshake (see wait.py).
 */
#ifndef RINGLLM_IPC_ATOMICS_H
#define RINGLLM_IPC_ATOMICS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* One CPU's pause inside a spin loop (x86 PAUSE, Arm YIELD): lets a sibling hardware thread
 * run and tells the core the loop is a spin. */
#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

/* Resolve (buf, offset) to an aligned 8-byte word inside an already exported view. */
static inline uint64_t *word_in(Py_buffer *view, PyObject *offset_obj)
{
    Py_ssize_t offset = PyLong_AsSsize_t(offset_obj);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    if (offset < 0 || offset > view->len - 8) {
        PyErr_Format(PyExc_IndexError,
                     "offset %zd is outside the buffer: need 0 <= offset <= %zd (buffer of %zd bytes)",
                     offset, view->len - 8, view->len);
        return NULL;
    }
    char *addr = (char *)view->buf + offset;
    if (((uintptr_t)addr & 7u) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not 8-byte aligned in memory (address %% 8 = %d)",
                     offset, (int)((uintptr_t)addr & 7u));
        return NULL;
    }
    return (uint64_t *)addr;
}

/* Export `obj` writable and resolve one word; on failure set an exception, hold nothing. */
static inline uint64_t *word_at(PyObject *obj, PyObject *offset_obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_SIMPLE) != 0)
        return NULL;
    uint64_t *word = word_in(view, offset_obj);
    if (word == NULL)
        PyBuffer_Release(view);
    return word;
}

static inline int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", name, expected, nargs);
        return -1;
    }
    return 0;
}

/* Python int (possibly negative) -> uint64 with two's-complement wrap. */
static inline int as_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLongMask(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)value;
    return 0;
}

static inline long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *timeout)
{
    return syscall(SYS_futex, addr, op, val, timeout, NULL, 0);
}

/*
 * The CPU hint (layout.py): a party stores "the CPU it last published from, plus one" (0:
 * not known yet) beside the counter it publishes, and a waiter reads its peer's hint to
 * decide whether spinning can pay (_ringops.c). Stored only when it changed, so a party
 * that stays on one CPU does not write the word again. A hint, not a fact: the peer may
 * have moved since; a stale hint costs one spin or one early sleep, never a lost record.
 */
static inline void record_cpu(uint64_t *hint_word)
{
    int cpu = sched_getcpu();
    uint64_t hint = cpu < 0 ? 0 : (uint64_t)cpu + 1;
    if (__atomic_load_n(hint_word, __ATOMIC_RELAXED) != hint)
        __atomic_store_n(hint_word, hint, __ATOMIC_RELAXED);
}

/* 1 when the hint says the peer last ran on the CPU this thread runs on now. */
static inline int peer_shares_my_cpu(const uint64_t *peer_hint_word)
{
    uint64_t hint = __atomic_load_n(peer_hint_word, __ATOMIC_RELAXED);
    if (hint == 0)
        return 0;
    int cpu = sched_getcpu();
    return cpu >= 0 && (uint64_t)cpu + 1 == hint;
}

/* Release-store `value`, then the waker half of the handshake: fence, and if anyone
 * announced that it sleeps, move the futex word and wake them all. Returns 1 if it woke. */
static inline int publish_and_wake(uint64_t *word, uint64_t value, uint64_t *sleepers,
                                   uint64_t *futex_word)
{
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    /* Dekker handshake with the sleeper: store counter, fence, load "sleeping". The sleeper
     * does store "sleeping", fence, load counter; one of the two sees the other's store. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers, __ATOMIC_ACQUIRE) == 0)
        return 0;
    __atomic_fetch_add(futex_word, 1, __ATOMIC_SEQ_CST);
    futex((uint32_t *)futex_word, FUTEX_WAKE, INT_MAX, NULL);
    return 1;
}

#endif
