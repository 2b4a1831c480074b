/*
 * The ring hot path in C: one Python->C crossing per operation instead of five to ten.
 *
 * A round trip through two rings costs four of these operations; in Python each one took
 * 0.5-1.5 us of attribute lookups, numpy slicing and separate atomic calls, which was most of
 * the round trip. Here each is one call that checks its arguments once:
 *
 *   wait_u64(buf, counter_off, sleepers_off, futex_off, peer_cpu_off, known, spin_s,
 *            timeout_s) -> value
 *       Wait for the counter to differ from `known`: spin (acquire loads + cpu pause) for up
 *       to `spin_s` unless the peer's CPU hint says it last ran on this CPU (below), then,
 *       when `timeout_s` > 0, the sleeper half of the handshake and one futex sleep of up
 *       to `timeout_s`. Returns the counter (== known: nothing came). The GIL is released
 *       for the whole wait.
 *   write_slots(buf, slots_off, slot_bytes, capacity, tail_off, sleepers_off, futex_off,
 *               cpu_off, tail, data) -> new tail
 *       Copy `data` (whole records) into the slots of record numbers tail, tail+1, ...
 *       (wrapping), record this CPU in the hint word at `cpu_off`, then publish tail + n:
 *       release store, fence, wake sleepers.
 *   read_slots(buf, slots_off, slot_bytes, capacity, head_off, sleepers_off, futex_off,
 *              cpu_off, head, count) -> bytearray
 *       Copy `count` records out from record number `head` (wrapping), then release their
 *       slots: hint and head + count stored the same way, waking a writer that sleeps for
 *       space.
 *   cores_are_free() -> bool
 *       Whether no more tasks are runnable than there are CPUs (wait.py's Python spin over
 *       several counters asks this; wait_u64 uses the CPU hint instead).
 *
 * The arguments that name places come first and the ones that change per call last, so
 * that an endpoint binds the first ones once (functools.partial).
 *
 * The caller (writer.py / reader.py) owns the ring protocol: it checked that the slots are
 * free (write) or published (read). These functions check only what keeps memory safe:
 * offsets inside the buffer and aligned, the slot array inside the buffer, whole records,
 * at most `capacity` of them.
 */
#include "_atomics.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>

static int64_t monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/*
 * A gate for wait.py's Python spin over several counters (the MPSC consumer, a writer
 * waiting for the slowest reader), where there is no single peer whose CPU could be
 * checked: spin only while /proc/loadavg's count of runnable tasks (which includes the
 * caller) is at most the number of CPUs. The count is re-read at most every
 * GATE_PERIOD_NS, so lasting load closes the gate within 4 ms.
 */
#define GATE_PERIOD_NS 2000000

static int64_t gate_checked_ns = INT64_MIN / 2;
static int gate_open = 1;

static int loadavg_fd = -1;

static long runnable_tasks(void)
{
    /* One descriptor kept open: pread at offset 0 regenerates the text (0.8 us), where
     * open + read + close cost 3.8 us, a visible bump in a 2.5 us round trip. */
    int fd = __atomic_load_n(&loadavg_fd, __ATOMIC_ACQUIRE);
    if (fd < 0) {
        int opened = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
        if (opened < 0)
            return 0;
        int expected = -1;
        if (__atomic_compare_exchange_n(&loadavg_fd, &expected, opened, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            fd = opened;
        else {
            close(opened); /* another thread was first */
            fd = expected;
        }
    }
    char text[128];
    ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
    if (n <= 0)
        return 0;
    text[n] = '\0';
    /* "0.35 0.73 1.08 2/345 6789": the fourth field is runnable/total. */
    double loads[3];
    long runnable = 0, total = 0;
    if (sscanf(text, "%lf %lf %lf %ld/%ld", &loads[0], &loads[1], &loads[2], &runnable, &total) != 5)
        return 0;
    return runnable;
}

static int gate_busy_readings;

/* 1 while no more tasks are runnable than there are CPUs (benign races: plain ints). One
 * busy reading does not close the gate, two in a row do: a task that is runnable for a
 * moment (a daemon, a shell command) would otherwise stop the spin for a whole period. */
static int cores_are_free(int64_t now_ns)
{
    if (now_ns - __atomic_load_n(&gate_checked_ns, __ATOMIC_RELAXED) < GATE_PERIOD_NS)
        return __atomic_load_n(&gate_open, __ATOMIC_RELAXED);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int busy = runnable_tasks() > (cpus > 0 ? cpus : 1);
    int busy_readings = busy ? __atomic_load_n(&gate_busy_readings, __ATOMIC_RELAXED) + 1 : 0;
    int open_now = busy_readings < 2;
    __atomic_store_n(&gate_busy_readings, busy_readings, __ATOMIC_RELAXED);
    __atomic_store_n(&gate_open, open_now, __ATOMIC_RELAXED);
    __atomic_store_n(&gate_checked_ns, now_ns, __ATOMIC_RELAXED);
    return open_now;
}

/*
 * Two processes in a tight ping-pong that the scheduler stacked on one CPU tend to stay
 * there (each wakes the other beside itself), at the 8.6 us of "one CPU, sleep at once" in
 * the table below, where another CPU could give "different CPUs, spin". After
 * UNSTACK_STREAK waits in a row that found the peer on this CPU, the thread steps off it:
 * its affinity mask without this CPU (the kernel moves it at once), then the mask it had
 * (which does not move it back). At most once per UNSTACK_PERIOD_NS per thread, and never
 * for a thread allowed only one CPU. A waiter that polls a sleeping peer with timeouts also
 * counts its waits, which at worst moves it once per 16 timeouts: harmless. Measured with
 * the ping-pong started on one CPU, two CPU-bound processes beside it: 2 of 3 runs stayed
 * stacked (8.2-8.5 / 12-13 us) without this, 0 of 3 with it (3.0 / 5.7 us).
 */
#define UNSTACK_STREAK 16
#define UNSTACK_PERIOD_NS 100000000

static __thread int same_cpu_streak;
static __thread int64_t unstacked_ns = INT64_MIN / 2;

static void step_off_this_cpu(void)
{
    cpu_set_t allowed, elsewhere;
    int cpu = sched_getcpu();
    if (cpu < 0 || sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
        return;
    elsewhere = allowed;
    CPU_CLR(cpu, &elsewhere);
    if (CPU_COUNT(&elsewhere) == 0)
        return;
    if (sched_setaffinity(0, sizeof(elsewhere), &elsewhere) == 0)
        sched_setaffinity(0, sizeof(allowed), &allowed);
}

/* Called when a wait skips its spin because the peer shares this CPU. */
static void note_stacked_on_peer(void)
{
    if (++same_cpu_streak < UNSTACK_STREAK)
        return;
    same_cpu_streak = 0;
    int64_t now_ns = monotonic_ns();
    if (now_ns - unstacked_ns > UNSTACK_PERIOD_NS) {
        unstacked_ns = now_ns;
        step_off_this_cpu();
    }
}

/*
 * Spin until *word != known or `spin_ns` passed; returns the last value loaded.
 *
 * Spinning pays only while the peer runs on another CPU: then its answer is seen within
 * ~100 ns of its store, with no system call on either side and no wake-up of a halted vCPU
 * (20-50 us on these virtual machines). When the peer is queued on the spinner's own CPU
 * (the scheduler put a woken process beside its waker), the spin holds the very core the
 * answer needs and burns all of `spin_ns` every hop. Which case holds is read from the
 * peer's CPU hint (_atomics.h). Measured on 2 cores with two CPU-bound processes beside a
 * ping-pong (round trip p50 / p99):
 *
 *     peers on different CPUs, spin          2.6 / 4.7 us
 *     peers on different CPUs, sleep at once   27 / 60-2,000 us  (a cross-CPU wake-up each hop)
 *     peers on one CPU, spin                 89-110 / 3,000 us  (each hop spins out)
 *     peers on one CPU, sleep at once         8.6 / 12 us       (a local context switch)
 *
 * An earlier gate on /proc/loadavg ("spin only while a core is free") slept at once
 * whenever the machine was loaded, which is the second row; the hint picks row 1 or 4, and
 * a thread that keeps finding its peer beside it steps to another CPU (above), so row 4
 * does not last.
 */
static uint64_t spin_while_equal(const uint64_t *word, const uint64_t *peer_hint_word,
                                 uint64_t known, int64_t spin_ns)
{
    uint64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (value != known || spin_ns <= 0)
        return value;
    if (peer_shares_my_cpu(peer_hint_word)) {
        note_stacked_on_peer();
        return value;
    }
    same_cpu_streak = 0;
    int64_t deadline_ns = monotonic_ns() + spin_ns;
    for (unsigned i = 1;; i++) {
        CPU_RELAX();
        value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (value != known)
            return value;
        if ((i & 15u) == 0 && monotonic_ns() >= deadline_ns)
            return value;
    }
}

static int seconds_arg(const char *name, const char *what, PyObject *obj, double *out)
{
    double value = PyFloat_AsDouble(obj);
    if (value == -1.0 && PyErr_Occurred())
        return -1;
    if (!(value >= 0.0) || value > 86400.0) {
        /* PyErr_Format has no %g: %R prints the argument as Python does. */
        PyErr_Format(PyExc_ValueError, "%s: %s must be in [0, 86400] s, got %R", name, what, obj);
        return -1;
    }
    *out = value;
    return 0;
}

static PyObject *py_wait_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t known;
    double spin_s, timeout_s;
    if (check_nargs("wait_u64", nargs, 8) < 0 || as_u64(args[5], &known) < 0 ||
        seconds_arg("wait_u64", "spin_s", args[6], &spin_s) < 0 ||
        seconds_arg("wait_u64", "timeout_s", args[7], &timeout_s) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_SIMPLE) != 0)
        return NULL;
    uint64_t *counter = word_in(&view, args[1]);
    uint64_t *sleepers = counter ? word_in(&view, args[2]) : NULL;
    uint64_t *futex_word = sleepers ? word_in(&view, args[3]) : NULL;
    uint64_t *peer_hint_word = futex_word ? word_in(&view, args[4]) : NULL;
    if (peer_hint_word == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t value;
    long rc = 0;
    int err = 0;
    /* The buffer export stays held while the GIL is released, so the mapping cannot be
     * closed underneath this thread. */
    Py_BEGIN_ALLOW_THREADS
    value = spin_while_equal(counter, peer_hint_word, known, (int64_t)(spin_s * 1e9));
    if (value == known && timeout_s > 0.0) {
        /* Sleeper half of the handshake (wait.py): read the futex word, announce, fence,
         * re-check; the waker stores, fences, then looks for sleepers. */
        uint32_t seq = (uint32_t)__atomic_load_n(futex_word, __ATOMIC_ACQUIRE);
        __atomic_fetch_add(sleepers, 1, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        value = __atomic_load_n(counter, __ATOMIC_ACQUIRE);
        if (value == known) {
            struct timespec timeout;
            timeout.tv_sec = (time_t)timeout_s;
            timeout.tv_nsec = (long)((timeout_s - (double)timeout.tv_sec) * 1e9);
            rc = futex((uint32_t *)futex_word, FUTEX_WAIT, seq, &timeout);
            if (rc < 0)
                err = errno;
            value = __atomic_load_n(counter, __ATOMIC_ACQUIRE);
        }
        __atomic_fetch_sub(sleepers, 1, __ATOMIC_SEQ_CST);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc < 0 && err != EAGAIN && err != ETIMEDOUT && err != EINTR) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Let a pending Python signal handler run (KeyboardInterrupt, SIGTERM chain). */
    if (err == EINTR && PyErr_CheckSignals() < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(value);
}

/* The slot array of a ring: `capacity` records of `slot_bytes` from `slots_off`. */
typedef struct {
    char *base;
    Py_ssize_t slot_bytes;
    Py_ssize_t capacity;
} Slots;

static int slots_in(const char *name, Py_buffer *view, PyObject *const *args, Slots *slots)
{
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]);
    Py_ssize_t slot_bytes = PyLong_AsSsize_t(args[1]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return -1;
    if (offset < 0 || slot_bytes < 1 || capacity < 1 || capacity > view->len / slot_bytes ||
        offset > view->len - slot_bytes * capacity) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %zd slots of %zd bytes at offset %zd do not fit the buffer of %zd bytes",
                     name, capacity, slot_bytes, offset, view->len);
        return -1;
    }
    slots->base = (char *)view->buf + offset;
    slots->slot_bytes = slot_bytes;
    slots->capacity = capacity;
    return 0;
}

/* Copy between a contiguous run of `count` records and the ring slots from record `first`. */
static void copy_slots(const Slots *slots, uint64_t first, Py_ssize_t count, char *records,
                       int into_ring)
{
    Py_ssize_t start = (Py_ssize_t)(first % (uint64_t)slots->capacity);
    Py_ssize_t head_count = count < slots->capacity - start ? count : slots->capacity - start;
    Py_ssize_t head_bytes = head_count * slots->slot_bytes;
    Py_ssize_t rest_bytes = (count - head_count) * slots->slot_bytes;
    char *ring_at = slots->base + start * slots->slot_bytes;
    if (into_ring) {
        memcpy(ring_at, records, head_bytes);
        memcpy(slots->base, records + head_bytes, rest_bytes);
    } else {
        memcpy(records, ring_at, head_bytes);
        memcpy(records + head_bytes, slots->base, rest_bytes);
    }
}

/* Resolve the counter, sleepers, futex and CPU hint words of a publish. */
static int wake_words_in(Py_buffer *view, PyObject *const *offsets, uint64_t **words)
{
    words[0] = word_in(view, offsets[0]);
    for (int i = 1; i < 4; i++)
        words[i] = words[i - 1] ? word_in(view, offsets[i]) : NULL;
    return words[3] == NULL ? -1 : 0;
}

/* Record this CPU, then publish `value` and wake sleepers (words from wake_words_in). */
static void publish_from_here(uint64_t **words, uint64_t value)
{
    record_cpu(words[3]);
    publish_and_wake(words[0], value, words[1], words[2]);
}

static PyObject *py_write_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view, data;
    Slots slots;
    uint64_t tail, *words[4];
    if (check_nargs("write_slots", nargs, 10) < 0 || as_u64(args[8], &tail) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_SIMPLE) != 0)
        return NULL;
    if (PyObject_GetBuffer(args[9], &data, PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *result = NULL;
    if (slots_in("write_slots", &view, args + 1, &slots) < 0 ||
        wake_words_in(&view, args + 4, words) < 0)
        goto done;
    if (data.len % slots.slot_bytes != 0 || data.len / slots.slot_bytes > slots.capacity) {
        PyErr_Format(PyExc_ValueError,
                     "write_slots: data of %zd bytes is not 0..%zd whole records of %zd bytes",
                     data.len, slots.capacity, slots.slot_bytes);
        goto done;
    }
    Py_ssize_t count = data.len / slots.slot_bytes;
    copy_slots(&slots, tail, count, (char *)data.buf, 1);
    publish_from_here(words, tail + (uint64_t)count);
    result = PyLong_FromUnsignedLongLong(tail + (uint64_t)count);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *py_read_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Slots slots;
    uint64_t head, *words[4];
    if (check_nargs("read_slots", nargs, 10) < 0 || as_u64(args[8], &head) < 0)
        return NULL;
    Py_ssize_t count = PyLong_AsSsize_t(args[9]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_SIMPLE) != 0)
        return NULL;
    PyObject *result = NULL;
    if (slots_in("read_slots", &view, args + 1, &slots) < 0 ||
        wake_words_in(&view, args + 4, words) < 0)
        goto done;
    if (count < 0 || count > slots.capacity) {
        PyErr_Format(PyExc_ValueError, "read_slots: count must be in [0, %zd] records, got %zd",
                     slots.capacity, count);
        goto done;
    }
    result = PyByteArray_FromStringAndSize(NULL, count * slots.slot_bytes);
    if (result == NULL)
        goto done;
    copy_slots(&slots, head, count, PyByteArray_AS_STRING(result), 0);
    publish_from_here(words, head + (uint64_t)count);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *py_cores_are_free(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(cores_are_free(monotonic_ns()));
}

PyMethodDef ringllm_ringops_methods[] = {
    {"cores_are_free", py_cores_are_free, METH_NOARGS,
     "cores_are_free() -> True when no more tasks are runnable than there are CPUs "
     "(wait.py's Python spin runs only then; re-read at most every 2 ms)."},
    {"wait_u64", (PyCFunction)(void (*)(void))py_wait_u64, METH_FASTCALL,
     "wait_u64(buf, counter_off, sleepers_off, futex_off, peer_cpu_off, known, spin_s, "
     "timeout_s) -> value: spin up to spin_s (unless the peer last ran on this CPU), then "
     "sleep up to timeout_s, until the counter differs from known."},
    {"write_slots", (PyCFunction)(void (*)(void))py_write_slots, METH_FASTCALL,
     "write_slots(buf, slots_off, slot_bytes, capacity, tail_off, sleepers_off, futex_off, "
     "cpu_off, tail, data) -> new tail: copy whole records in (wrapping), then record this "
     "CPU, publish and wake."},
    {"read_slots", (PyCFunction)(void (*)(void))py_read_slots, METH_FASTCALL,
     "read_slots(buf, slots_off, slot_bytes, capacity, head_off, sleepers_off, futex_off, "
     "cpu_off, head, count) -> bytearray: copy records out (wrapping), then record this CPU "
     "and release their slots."},
    {NULL, NULL, 0, NULL},
};
