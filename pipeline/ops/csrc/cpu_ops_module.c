/* Python bindings of the CPU kernels: `ringllm.pipeline.ops._cpu_ops`.
 *
 * KERNEL_SETS names the kernel sets this CPU can run, by index (0: portable C, 1: AVX-512,
 * 2: AVX-512 with the BF16 conversions).
 * Every kernel call starts with the set's index and the OpenMP team size, then takes plain ints (data pointers, element strides, sizes) and floats, passed
 * by pipeline/ops/cpu.py, which checks shapes, dtypes and bounds first: nothing here can
 * tell a good pointer from a bad one. METH_FASTCALL keeps a call near a microsecond.
 *
 * The kernels parallelize with OpenMP. This module links libgomp.so.1 and is imported after
 * torch, whose own libgomp.so.1 is then already loaded: the dynamic linker resolves the
 * soname to that copy, so the kernels and torch share one thread pool (two pools would spin
 * against each other on a machine with few cores).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <omp.h>

#include "cpu_ops.h"


static int avx512_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static int avx512bf16_supported(void) {
    return avx512_supported() && __builtin_cpu_supports("avx512bf16");
}

/* The kernel set by index: 0 = generic, 1 = AVX-512, 2 = AVX-512 + BF16 (where the CPU has
 * them). */
static const cpu_kernels *kernel_set(int64_t index, int64_t threads) {
    if (threads < 1 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..4096, got %lld", (long long)threads);
        return NULL;
    }
    if (index == 0) return &generic_kernels;
    if (index == 1 && avx512_supported()) return &avx512_kernels;
    if (index == 2 && avx512bf16_supported()) return &avx512bf16_kernels;
    PyErr_Format(PyExc_ValueError, "no CPU kernel set %lld on this CPU", (long long)index);
    return NULL;
}

/* Reads nints ints then nfloats floats from a fastcall argument vector. */
static int parse(const char *fn, PyObject *const *args, Py_ssize_t nargs, int64_t *ints,
                 Py_ssize_t nints, double *floats, Py_ssize_t nfloats) {
    if (nargs != nints + nfloats) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn,
                     nints + nfloats, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nints; i++) {
        ints[i] = PyLong_AsLongLong(args[i]);
        if (ints[i] == -1 && PyErr_Occurred()) return -1;
    }
    for (Py_ssize_t i = 0; i < nfloats; i++) {
        floats[i] = PyFloat_AsDouble(args[nints + i]);
        if (floats[i] == -1.0 && PyErr_Occurred()) return -1;
    }
    return 0;
}

#define PTR(v) ((void *)(uintptr_t)(v))

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[13];
    double eps;
    if (parse("rms_norm", args, nargs, v, 13, &eps, 1)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const rms_norm_args a = {
        .threads = (int)v[1],
        .out = PTR(v[2]), .x = PTR(v[3]), .x_outer = v[4], .x_inner = v[5],
        .residual_in = PTR(v[6]), .residual_out = PTR(v[7]), .weight = PTR(v[8]),
        .rows = v[9], .inner = v[10], .cols = v[11], .dtype = (int)v[12], .eps = (float)eps,
    };
    k->rms_norm(&a);
    Py_RETURN_NONE;
}

static PyObject *py_rotary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[11];
    if (parse("rotary", args, nargs, v, 11, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const rotary_args a = {
        .threads = (int)v[1],
        .x = PTR(v[2]), .tok_stride = v[3], .head_stride = v[4], .positions = PTR(v[5]),
        .cos_sin = PTR(v[6]), .tokens = v[7], .heads = v[8], .head_size = v[9],
        .dtype = (int)v[10],
    };
    k->rotary(&a);
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[8];
    if (parse("silu_mul", args, nargs, v, 8, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const silu_mul_args a = {
        .threads = (int)v[1],
        .out = PTR(v[2]), .x = PTR(v[3]), .x_stride = v[4], .rows = v[5], .inter = v[6],
        .dtype = (int)v[7],
    };
    k->silu_mul(&a);
    Py_RETURN_NONE;
}

static PyObject *py_cache_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[15];
    if (parse("cache_write", args, nargs, v, 15, NULL, 0)) return NULL;
    const cache_write_args a = {
        .key = PTR(v[0]), .value = PTR(v[1]), .key_tok_stride = v[2], .key_head_stride = v[3],
        .value_tok_stride = v[4], .value_head_stride = v[5], .key_cache = PTR(v[6]),
        .value_cache = PTR(v[7]), .slots = PTR(v[8]), .tokens = v[9], .kv_heads = v[10],
        .head_size = v[11], .block_size = v[12], .num_blocks = v[13], .elem_size = (int)v[14],
    };
    cache_write(&a);
    Py_RETURN_NONE;
}

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[20];
    double scale;
    if (parse("attention", args, nargs, v, 20, &scale, 1)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const attention_args a = {
        .threads = (int)v[1],
        .out = PTR(v[2]), .query = PTR(v[3]), .q_tok_stride = v[4], .q_head_stride = v[5],
        .out_tok_stride = v[6], .out_head_stride = v[7], .key_cache = PTR(v[8]),
        .value_cache = PTR(v[9]), .block_tables = PTR(v[10]), .bt_stride = v[11],
        .query_start_loc = PTR(v[12]), .seq_lens = PTR(v[13]), .num_reqs = v[14],
        .num_heads = v[15], .num_kv_heads = v[16], .head_size = v[17], .block_size = v[18],
        .dtype = (int)v[19], .scale = (float)scale,
    };
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = k->attention(&a);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_argmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[7];
    if (parse("argmax", args, nargs, v, 7, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const argmax_args a = {
        .threads = (int)v[1], .out = PTR(v[2]), .x = PTR(v[3]), .rows = v[4], .cols = v[5],
        .row_stride = v[6],
    };
    Py_BEGIN_ALLOW_THREADS
    k->argmax(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(kernel_set, threads, out, x, x_outer, x_inner, residual_in, residual_out, "
     "weight, rows, inner, cols, dtype, eps)"},
    {"rotary", (PyCFunction)(void (*)(void))py_rotary, METH_FASTCALL,
     "rotary(kernel_set, threads, x, tok_stride, head_stride, positions, cos_sin, tokens, "
     "heads, head_size, dtype)"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(kernel_set, threads, out, x, x_stride, rows, inter, dtype)"},
    {"cache_write", (PyCFunction)(void (*)(void))py_cache_write, METH_FASTCALL,
     "cache_write(key, value, key_tok_stride, key_head_stride, value_tok_stride, "
     "value_head_stride, key_cache, value_cache, slots, tokens, kv_heads, head_size, "
     "block_size, num_blocks, elem_size)"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL,
     "attention(kernel_set, threads, out, query, q_tok_stride, q_head_stride, out_tok_stride, out_head_stride, "
     "key_cache, value_cache, block_tables, bt_stride, query_start_loc, seq_lens, num_reqs, "
     "num_heads, num_kv_heads, head_size, block_size, dtype, scale)"},
    {"argmax", (PyCFunction)(void (*)(void))py_argmax, METH_FASTCALL,
     "argmax(kernel_set, threads, out, x, rows, cols, row_stride)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_ops", "CPU kernels of the ops interface.", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_ops(void) {
    __builtin_cpu_init();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *sets = avx512bf16_supported() ? Py_BuildValue("(sss)", "generic", "avx512", "avx512bf16")
                     : avx512_supported()   ? Py_BuildValue("(ss)", "generic", "avx512")
                                            : Py_BuildValue("(s)", "generic");
    if (!sets || PyModule_AddObject(m, "KERNEL_SETS", sets)) {
        Py_XDECREF(sets);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
