/* Python bindings of the quantized matrix kernels: `ringllm.pipeline.ops.quant_kernels`.
 *
 * KERNEL_SETS names the sets by index (0: portable C, 1: AVX2 + FMA + F16C, 2: AVX-512
 * F/BW/VL/DQ, 3: AVX-512 + VNNI, 4: 3 with bf16 weights on VDPBF16PS (AVX512_BF16), 5: 3 with
 * int8 and bf16 weights on the AMX tile unit),
 * SUPPORTED says which ones this CPU runs, ROWS_PER_PANEL each set's panel height, QTYPES
 * the type names by index (with BLOCK_K and GGUF_BLOCK_BYTES). Calls take plain ints (data
 * pointers, sizes) from pipeline/ops/quant.py, which checks every shape, dtype and size
 * first: nothing here can tell a good pointer from a bad one. METH_FASTCALL keeps a call
 * near a microsecond.
 *
 * OpenMP: like cpu_kernels, this module is imported after torch, so its libgomp.so.1
 * resolves to the copy torch loaded and the kernels share torch's thread pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "quant.h"

enum { SET_GENERIC, SET_AVX2, SET_AVX512, SET_AVX512VNNI, SET_AVX512BF16, SET_AVX512AMX, NUM_SETS };
static const char *const SET_NAMES[NUM_SETS] = {"generic",    "avx2",       "avx512",
                                                "avx512vnni", "avx512bf16", "avx512amx"};

#if defined(__x86_64__)
static const quant_kernels *const SETS[NUM_SETS] = {
    &quant_generic, &quant_avx2, &quant_avx512, &quant_avx512vnni, &quant_avx512bf16, &quant_avx512amx,
};

/* What the CPU (and the OS, which must save the wider registers) reports, as libgcc reads
 * it from CPUID and XGETBV. */
static int set_supported(int64_t index) {
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    switch (index) {
    case SET_GENERIC: return 1;
    case SET_AVX2: return avx2;
    case SET_AVX512: return avx512;
    case SET_AVX512VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
    case SET_AVX512BF16:
        return avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
    case SET_AVX512AMX: return avx512 && __builtin_cpu_supports("avx512vnni") && quant_amx_usable();
    default: return 0;
    }
}
#else
/* Other CPUs (aarch64, ...) run the portable set only. */
static const quant_kernels *const SETS[NUM_SETS] = {&quant_generic, NULL, NULL, NULL, NULL, NULL};

static int set_supported(int64_t index) { return index == SET_GENERIC; }
#endif

static const quant_kernels *kernel_set(int64_t index, int64_t threads, int64_t qtype) {
    if (threads < 1 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..4096, got %lld", (long long)threads);
        return NULL;
    }
    if (qtype < 0 || qtype >= NUM_QT) {
        PyErr_Format(PyExc_ValueError, "no quantized type %lld", (long long)qtype);
        return NULL;
    }
    if (qtype == QT_BF16 && index != SET_AVX512AMX && index != SET_AVX512BF16) {
        PyErr_SetString(PyExc_ValueError,
                        "qtype bf16 (B tiles) is the avx512bf16 and avx512amx sets' only");
        return NULL;
    }
    if (index >= 0 && index < NUM_SETS && set_supported(index)) return SETS[index];
    PyErr_Format(PyExc_ValueError, "no quantized kernel set %lld on this CPU", (long long)index);
    return NULL;
}

static int parse(const char *fn, PyObject *const *args, Py_ssize_t nargs, int64_t *ints,
                 Py_ssize_t nints) {
    if (nargs != nints) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, nints, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nints; i++) {
        ints[i] = PyLong_AsLongLong(args[i]);
        if (ints[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

#define PTR(v) ((void *)(uintptr_t)(v))

static PyObject *py_packed_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[4];
    if (parse("packed_bytes", args, nargs, v, 4)) return NULL;
    if (v[0] < 0 || v[0] >= NUM_QT || v[3] < 1) {
        PyErr_SetString(PyExc_ValueError, "packed_bytes: bad type or panel height");
        return NULL;
    }
    return PyLong_FromLongLong(packed_bytes((int)v[0], v[1], v[2], (int)v[3]));
}

static PyObject *py_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[8];
    if (parse("pack", args, nargs, v, 8)) return NULL;
    const quant_kernels *ks = kernel_set(v[0], v[1], v[2]);
    if (!ks) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ks->pack((int)v[2], PTR(v[3]), PTR(v[4]), PTR(v[5]), v[6], v[7], (int)v[1]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[7];
    if (parse("dequantize", args, nargs, v, 7)) return NULL;
    const quant_kernels *ks = kernel_set(v[0], v[1], v[2]);
    if (!ks) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ks->dequantize((int)v[2], PTR(v[3]), PTR(v[4]), v[5], v[6], (int)v[1]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_qlinear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[13] = {0}; /* the 13th, y's type, may be left out: float32 */
    if (parse("qlinear", args, nargs, v, nargs == 13 ? 13 : 12)) return NULL;
    const quant_kernels *ks = kernel_set(v[0], v[1], v[2]);
    if (!ks) return NULL;
    if (v[12] != XT_F32 && v[12] != XT_BF16) {
        PyErr_Format(PyExc_ValueError, "qlinear: no output type %lld", (long long)v[12]);
        return NULL;
    }
    const qlinear_args a = {
        .threads = (int)v[1], .qtype = (int)v[2], .y = PTR(v[3]), .x = PTR(v[4]),
        .xtype = (int)v[5], .ldx = v[6], .w = PTR(v[7]), .bias = PTR(v[8]), .m = v[9],
        .n = v[10], .k = v[11], .ytype = (int)v[12],
    };
    if (a.ytype != XT_F32 && ks != SETS[SET_AVX512AMX] && ks != SETS[SET_AVX512BF16]) {
        PyErr_SetString(PyExc_ValueError,
                        "qlinear: bfloat16 output is the avx512bf16 and AMX sets' only");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ks->qlinear(&a);
    Py_END_ALLOW_THREADS
    if (rc == -2) {
        PyErr_SetString(PyExc_ValueError,
                        "qlinear: bfloat16 output only for bf16 weights, or (AMX set) int8 "
                        "ones from AMX_MIN_ROWS rows");
        return NULL;
    }
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The address of a set's qlinear, for the decode plan (cpu_kernels.decode_layers calls it
 * from C; pipeline/models/decode_plan.py writes it into the plan). */
static PyObject *py_qlinear_address(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[1];
    if (parse("qlinear_address", args, nargs, v, 1)) return NULL;
    const quant_kernels *ks = kernel_set(v[0], 1, 0);
    if (!ks) return NULL;
    return PyLong_FromLongLong((long long)(uintptr_t)ks->qlinear);
}

static PyMethodDef methods[] = {
    {"packed_bytes", (PyCFunction)(void (*)(void))py_packed_bytes, METH_FASTCALL,
     "packed_bytes(qtype, n, k, rows_per_panel) -> bytes of the packed matrix"},
    {"pack", (PyCFunction)(void (*)(void))py_pack, METH_FASTCALL,
     "pack(kernel_set, threads, qtype, dst, src, row_scales, n, k): GGUF blocks (or i8 rows)"
     " into the set's layout"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL,
     "dequantize(kernel_set, threads, qtype, out, packed, n, k): float32 [n, k]"},
    {"qlinear", (PyCFunction)(void (*)(void))py_qlinear, METH_FASTCALL,
     "qlinear(kernel_set, threads, qtype, y, x, xtype, ldx, packed, bias, m, n, k): "
     "y dense [m, n]"},
    {"qlinear_address", (PyCFunction)(void (*)(void))py_qlinear_address, METH_FASTCALL,
     "qlinear_address(kernel_set) -> the C address of the set's qlinear"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "quant_kernels", "Quantized matrix kernels.", -1, methods,
};

static PyObject *str_tuple(const char *const *names, int count) {
    PyObject *t = PyTuple_New(count);
    for (int i = 0; t && i < count; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);
        if (!s) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

PyMODINIT_FUNC PyInit_quant_kernels(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
#endif
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    const char *qnames[NUM_QT];
    for (int i = 0; i < NUM_QT; i++) qnames[i] = QTYPES[i].name;
    PyObject *objs[6] = {
        str_tuple(SET_NAMES, NUM_SETS), PyTuple_New(NUM_SETS), PyTuple_New(NUM_SETS),
        str_tuple(qnames, NUM_QT), PyTuple_New(NUM_QT), PyTuple_New(NUM_QT),
    };
    static const char *const attrs[6] = {"KERNEL_SETS", "SUPPORTED", "ROWS_PER_PANEL",
                                         "QTYPES", "BLOCK_K", "GGUF_BLOCK_BYTES"};
    for (int i = 0; i < 6; i++)
        if (!objs[i]) goto fail;
    for (int i = 0; i < NUM_SETS; i++) {
        PyObject *yes = set_supported(i) ? Py_True : Py_False;
        Py_INCREF(yes);
        PyTuple_SET_ITEM(objs[1], i, yes);
        PyTuple_SET_ITEM(objs[2], i, PyLong_FromLong(SETS[i] ? SETS[i]->rows_per_panel : 0));
    }
    for (int i = 0; i < NUM_QT; i++) {
        PyTuple_SET_ITEM(objs[4], i, PyLong_FromLong(QTYPES[i].block_k));
        PyTuple_SET_ITEM(objs[5], i, PyLong_FromLong(QTYPES[i].gguf_block_bytes));
    }
    for (int i = 0; i < 6; i++) {
        if (PyModule_AddObject(m, attrs[i], objs[i])) goto fail;
        objs[i] = NULL;
    }
    if (PyModule_AddIntConstant(m, "AMX_MIN_ROWS", AMX_MIN_ROWS)) goto fail;
    return m;
fail:
    for (int i = 0; i < 6; i++) Py_XDECREF(objs[i]);
    Py_DECREF(m);
    return NULL;
}
