/*
 * ringllm.ipc._atomics: the few hardware primitives the shared-memory rings need and
 * Python does not offer.
 *
 * Every function takes a writable buffer (the segment's memoryview) and a byte offset into
 * it, so Python never handles raw addresses; the offset is checked against the buffer length
 * and for 8-byte alignment (an unaligned 8-byte atomic is not atomic on every CPU and can
 * straddle a cache line).
 *
 *   fence()                                   full barrier (seq_cst)
 *   load_u64(buf, off)                        acquire load
 *   store_u64(buf, off, value)                release store
 *   fetch_add_u64(buf, off, delta)            seq_cst add (delta may be negative), returns old
 *   compare_exchange_u64(buf, off, exp, new)  seq_cst CAS, returns True when it swapped
 *   publish_u64(buf, off, value, sleepers_off, futex_off[, cpu_hint_off])
 *       release store + fence + "wake the futex word if anyone sleeps on it": the writer
 *       half of the sleep handshake in one call, because each Python->C crossing costs
 *       about as much as the whole operation.
 *   futex_wait(buf, off, expected_u32, timeout_s) -> 0 woken, 1 value differed, 2 timeout
 *   futex_wake(buf, off, n) -> number of waiters woken
 *   sched_yield()
 *
 * _ringops.c adds the ring hot path on top (wait_u64, write_slots, read_slots).
 *
 * The futex calls use the shared (not FUTEX_PRIVATE_FLAG) operations: the word lives in a
 * MAP_SHARED mapping and the waiter and the waker are different processes. The futex word
 * is the low 32 bits of an 8-byte slot (x86-64 and aarch64 are little-endian).
 */
#include "_atomics.h"

#include <errno.h>
#include <sched.h>

/* The ring hot path (_ringops.c): wait, copy in + publish, copy out + release. */
extern PyMethodDef ringllm_ringops_methods[];

static PyObject *py_fence(PyObject *self, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *py_sched_yield(PyObject *self, PyObject *unused)
{
    sched_yield();
    Py_RETURN_NONE;
}

static PyObject *py_load_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs("load_u64", nargs, 2) < 0)
        return NULL;
    uint64_t *word = word_at(args[0], args[1], &view);
    if (word == NULL)
        return NULL;
    uint64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *py_store_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t value;
    if (check_nargs("store_u64", nargs, 3) < 0 || as_u64(args[2], &value) < 0)
        return NULL;
    uint64_t *word = word_at(args[0], args[1], &view);
    if (word == NULL)
        return NULL;
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *py_fetch_add_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t delta;
    if (check_nargs("fetch_add_u64", nargs, 3) < 0 || as_u64(args[2], &delta) < 0)
        return NULL;
    uint64_t *word = word_at(args[0], args[1], &view);
    if (word == NULL)
        return NULL;
    uint64_t old = __atomic_fetch_add(word, delta, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(old);
}

static PyObject *py_compare_exchange_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t expected, desired;
    if (check_nargs("compare_exchange_u64", nargs, 4) < 0 || as_u64(args[2], &expected) < 0 ||
        as_u64(args[3], &desired) < 0)
        return NULL;
    uint64_t *word = word_at(args[0], args[1], &view);
    if (word == NULL)
        return NULL;
    int swapped = __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                              __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyBool_FromLong(swapped);
}

static PyObject *py_futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs("futex_wake", nargs, 3) < 0)
        return NULL;
    long n = PyLong_AsLong(args[2]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "futex_wake: n must be >= 1 waiter, got %ld", n);
        return NULL;
    }
    uint64_t *word = word_at(args[0], args[1], &view);
    if (word == NULL)
        return NULL;
    long woken = futex((uint32_t *)word, FUTEX_WAKE, (uint32_t)(n > INT_MAX ? INT_MAX : n), NULL);
    PyBuffer_Release(&view);
    if (woken < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(woken);
}

static PyObject *py_futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t expected;
    if (check_nargs("futex_wait", nargs, 4) < 0 || as_u64(args[2], &expected) < 0)
        return NULL;
    double timeout_s = PyFloat_AsDouble(args[3]);
    if (timeout_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(timeout_s >= 0.0) || timeout_s > 86400.0) {
        /* PyErr_Format has no %g: %R prints the argument as Python does. */
        PyErr_Format(PyExc_ValueError, "futex_wait: timeout_s must be in [0, 86400] s, got %R",
                     args[3]);
        return NULL;
    }
    uint64_t *word = word_at(args[0], args[1], &view);
    if (word == NULL)
        return NULL;
    struct timespec timeout;
    timeout.tv_sec = (time_t)timeout_s;
    timeout.tv_nsec = (long)((timeout_s - (double)timeout.tv_sec) * 1e9);
    long rc;
    int err = 0;
    /* The buffer export stays held while the GIL is released, so the mapping cannot be
     * closed underneath the sleeping thread. */
    Py_BEGIN_ALLOW_THREADS
    rc = futex((uint32_t *)word, FUTEX_WAIT, (uint32_t)expected, &timeout);
    if (rc < 0)
        err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc == 0)
        return PyLong_FromLong(0);
    if (err == EAGAIN)
        return PyLong_FromLong(1);
    if (err == ETIMEDOUT)
        return PyLong_FromLong(2);
    if (err == EINTR) {
        /* Let a pending Python signal handler run (KeyboardInterrupt, SIGTERM chain). */
        if (PyErr_CheckSignals() < 0)
            return NULL;
        return PyLong_FromLong(0);
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *py_publish_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_Format(PyExc_TypeError, "publish_u64() takes 5 or 6 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer view;
    uint64_t value;
    if (as_u64(args[2], &value) < 0 ||
        PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_SIMPLE) != 0)
        return NULL;
    uint64_t *word = word_in(&view, args[1]);
    uint64_t *sleepers = word ? word_in(&view, args[3]) : NULL;
    uint64_t *futex_word = sleepers ? word_in(&view, args[4]) : NULL;
    uint64_t *hint_word = futex_word && nargs == 6 ? word_in(&view, args[5]) : NULL;
    if (futex_word == NULL || (nargs == 6 && hint_word == NULL)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (hint_word != NULL)
        record_cpu(hint_word);
    int woke = publish_and_wake(word, value, sleepers, futex_word);
    PyBuffer_Release(&view);
    return PyBool_FromLong(woke);
}

static PyMethodDef methods[] = {
    {"fence", py_fence, METH_NOARGS, "Full memory barrier (seq_cst)."},
    {"sched_yield", py_sched_yield, METH_NOARGS, "Give the CPU to another runnable thread."},
    {"load_u64", (PyCFunction)(void (*)(void))py_load_u64, METH_FASTCALL,
     "load_u64(buf, offset) -> int: acquire load of an aligned 8-byte word."},
    {"store_u64", (PyCFunction)(void (*)(void))py_store_u64, METH_FASTCALL,
     "store_u64(buf, offset, value): release store of an aligned 8-byte word."},
    {"fetch_add_u64", (PyCFunction)(void (*)(void))py_fetch_add_u64, METH_FASTCALL,
     "fetch_add_u64(buf, offset, delta) -> old value (delta may be negative; wraps mod 2**64)."},
    {"compare_exchange_u64", (PyCFunction)(void (*)(void))py_compare_exchange_u64, METH_FASTCALL,
     "compare_exchange_u64(buf, offset, expected, desired) -> True when the word was swapped."},
    {"publish_u64", (PyCFunction)(void (*)(void))py_publish_u64, METH_FASTCALL,
     "publish_u64(buf, offset, value, sleepers_offset, futex_offset[, cpu_hint_offset]) -> "
     "True when it woke sleepers: record this CPU in the hint word (if given), release store, "
     "fence, and a futex wake if the sleepers count is non-zero."},
    {"futex_wait", (PyCFunction)(void (*)(void))py_futex_wait, METH_FASTCALL,
     "futex_wait(buf, offset, expected_u32, timeout_s) -> 0 woken, 1 value differed, 2 timed out."},
    {"futex_wake", (PyCFunction)(void (*)(void))py_futex_wake, METH_FASTCALL,
     "futex_wake(buf, offset, n) -> number of waiters woken (shared futex, across processes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_atomics",
    "Atomics, fences and futexes on shared-memory buffers for ringllm.ipc.", -1, methods,
};

PyMODINIT_FUNC PyInit__atomics(void)
{
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddFunctions(mod, ringllm_ringops_methods) != 0)
        Py_CLEAR(mod);
    return mod;
}
