/*
 * What a ring round trip is made of on this machine, measured below the rings:
 * `ringllm bench ipc` prints these beside its own figures, so a machine where the rings are
 * slow tells which part is slow.
 *
 *   cacheline_round_trips(cpu_a, cpu_b, count) -> list of ns
 *       Two threads pinned to cpu_a and cpu_b bounce one cache line (a release store, the
 *       other side spinning on acquire loads with a CPU pause): the floor of any round trip
 *       between those CPUs, with no futex, no Python and no copy. Two such hops per round.
 *   spin_gaps(seconds, pause) -> (iterations, gaps_over_5us, max_gap_ns)
 *       One thread spins for `seconds` reading the clock each iteration, with a CPU pause
 *       per iteration (pause=1) or plain loads (pause=0), and counts the iterations that
 *       took longer than 5 us: time the thread lost to something else (an interrupt, the
 *       host descheduling the vCPU, or, for pause=1 only, a hypervisor that exits on pause
 *       loops: KVM's pause-loop exiting / AMD's pause filter). More gaps with pause=1 than
 *       with pause=0 means the spin itself costs exits.
 *
 * Both release the GIL. Linux only (sched_setaffinity); a CPU that is not allowed is an
 * OSError naming it.
 */
#define _GNU_SOURCE
#include "_atomics.h" /* Python.h, CPU_RELAX */

#include <errno.h>
#include <pthread.h>
#include <string.h>

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int pin_to(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof(set), &set);
}

typedef struct {
    _Alignas(64) uint64_t ball; /* odd: the echo's turn; even: the caller's */
    _Alignas(64) int cpu;
    int64_t count;
    int pinned; /* 1 ok, -1 failed */
} bounce;

static void *echo_thread(void *arg)
{
    bounce *b = arg;
    const int ok = pin_to(b->cpu) == 0;
    __atomic_store_n(&b->pinned, ok ? 1 : -1, __ATOMIC_RELEASE);
    if (!ok)
        return NULL;
    for (int64_t i = 0; i < b->count; i++) {
        uint64_t want = 2 * (uint64_t)i + 1;
        while (__atomic_load_n(&b->ball, __ATOMIC_ACQUIRE) != want)
            CPU_RELAX();
        __atomic_store_n(&b->ball, want + 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

static PyObject *py_cacheline_round_trips(PyObject *self, PyObject *args)
{
    int cpu_a, cpu_b;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "iin", &cpu_a, &cpu_b, &count))
        return NULL;
    if (cpu_a == cpu_b) {
        PyErr_Format(PyExc_ValueError, "cpu_a and cpu_b must differ (both %d)", cpu_a);
        return NULL;
    }
    if (count < 1 || count > 10000000) {
        PyErr_Format(PyExc_ValueError, "count must be 1..10,000,000, got %zd", count);
        return NULL;
    }
    int64_t *samples = PyMem_RawMalloc(sizeof(int64_t) * (size_t)count);
    if (!samples)
        return PyErr_NoMemory();
    static bounce b; /* one probe at a time: the GIL is taken back before the next */
    b.ball = 0;
    b.cpu = cpu_b;
    b.count = count;
    b.pinned = 0;
    cpu_set_t saved;
    int failed_cpu = -1, err = 0;
    Py_BEGIN_ALLOW_THREADS
    sched_getaffinity(0, sizeof(saved), &saved);
    pthread_t echo;
    if (pin_to(cpu_a) != 0) {
        failed_cpu = cpu_a;
        err = errno;
    } else if ((err = pthread_create(&echo, NULL, echo_thread, &b)) != 0) {
        failed_cpu = cpu_b;
    } else {
        while (__atomic_load_n(&b.pinned, __ATOMIC_ACQUIRE) == 0)
            CPU_RELAX();
        if (b.pinned < 0) { /* the echo could not pin, and has returned */
            failed_cpu = cpu_b;
            err = EINVAL;
        }
        for (int64_t i = 0; failed_cpu < 0 && i < count; i++) {
            uint64_t serve = 2 * (uint64_t)i;
            int64_t t0 = now_ns();
            __atomic_store_n(&b.ball, serve + 1, __ATOMIC_RELEASE);
            while (__atomic_load_n(&b.ball, __ATOMIC_ACQUIRE) != serve + 2)
                CPU_RELAX();
            samples[i] = now_ns() - t0;
        }
        pthread_join(echo, NULL);
    }
    sched_setaffinity(0, sizeof(saved), &saved);
    Py_END_ALLOW_THREADS
    if (failed_cpu >= 0) {
        PyMem_RawFree(samples);
        errno = err;
        return PyErr_Format(PyExc_OSError, "cannot run a thread on CPU %d: %s", failed_cpu,
                            strerror(err));
    }
    PyObject *out = PyList_New(count);
    for (Py_ssize_t i = 0; out && i < count; i++) {
        PyObject *v = PyLong_FromLongLong(samples[i]);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    PyMem_RawFree(samples);
    return out;
}

static PyObject *py_spin_gaps(PyObject *self, PyObject *args)
{
    double seconds;
    int pause;
    if (!PyArg_ParseTuple(args, "dp", &seconds, &pause))
        return NULL;
    if (!(seconds > 0.0 && seconds <= 60.0)) {
        PyErr_Format(PyExc_ValueError, "seconds must be in (0, 60], got %R", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    long long iterations = 0, gaps = 0;
    int64_t max_gap = 0;
    Py_BEGIN_ALLOW_THREADS
    volatile uint64_t word = 0;
    int64_t prev = now_ns(), end = prev + (int64_t)(seconds * 1e9);
    while (prev < end) {
        if (pause)
            CPU_RELAX();
        else
            for (int i = 0; i < 4; i++)
                (void)word;
        int64_t t = now_ns(), gap = t - prev;
        if (gap > max_gap)
            max_gap = gap;
        if (gap > 5000)
            gaps++;
        prev = t;
        iterations++;
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LLL)", iterations, gaps, (long long)max_gap);
}

static PyMethodDef methods[] = {
    {"cacheline_round_trips", py_cacheline_round_trips, METH_VARARGS,
     "cacheline_round_trips(cpu_a, cpu_b, count) -> [ns]: one cache line bounced between two "
     "pinned threads"},
    {"spin_gaps", py_spin_gaps, METH_VARARGS,
     "spin_gaps(seconds, pause) -> (iterations, gaps_over_5us, max_gap_ns)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "probes", "Machine probes under the rings (bench ipc).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_probes(void) { return PyModule_Create(&module); }
