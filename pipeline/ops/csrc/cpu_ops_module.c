/* Python bindings of the CPU kernels: `ringllm.pipeline.ops.cpu_kernels`.
 *
 * KERNEL_SETS names every kernel set by index (0: portable C, 1: AVX2 + FMA + F16C,
 * 2: AVX-512, 3: AVX-512 with BF16), SUPPORTED the ones this CPU runs, and cpu_flags() what
 * the CPU reports of the features they need. Every kernel call starts with the set's index
 * and the OpenMP team size, then takes plain ints (data pointers, element strides, sizes)
 * and floats, passed
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
#include <string.h>

#include "cpu_ops.h"
#include "decode_layers.h"


/* The kernel sets by index; pipeline/ops/cpu.py names them by the same order. */
enum { SET_GENERIC, SET_AVX2, SET_AVX512, SET_AVX512BF16, NUM_SETS };
static const char *const SET_NAMES[NUM_SETS] = {"generic", "avx2", "avx512", "avx512bf16"};

#if defined(__x86_64__)
/* What the CPU (and the OS, which must save the wider registers) reports, as libgcc reads
 * it from CPUID and XGETBV: the same answer the kernels' instructions depend on. */
static const char *const CPU_FLAGS[] = {
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512bf16", "avx512fp16", "avx512vnni", "avxvnni", "amx-tile", "amx-bf16",
};
#define NUM_FLAGS (sizeof(CPU_FLAGS) / sizeof(CPU_FLAGS[0]))

static int cpu_has(const char *flag) {
    /* __builtin_cpu_supports wants a literal: one comparison per name */
#define HAS(name) if (!strcmp(flag, name)) return __builtin_cpu_supports(name) != 0
    HAS("avx"); HAS("avx2"); HAS("fma"); HAS("f16c"); HAS("avx512f"); HAS("avx512bw");
    HAS("avx512vl"); HAS("avx512dq"); HAS("avx512bf16"); HAS("avx512fp16"); HAS("avx512vnni");
    HAS("avxvnni"); HAS("amx-tile"); HAS("amx-bf16");
#undef HAS
    return 0;
}

static const cpu_kernels *const SETS[NUM_SETS] = {
    &generic_kernels, &avx2_kernels, &avx512_kernels, &avx512bf16_kernels,
};

static int set_supported(int64_t index) {
    const int avx2 = cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
    const int avx512 = avx2 && cpu_has("avx512f") && cpu_has("avx512bw") &&
                       cpu_has("avx512vl") && cpu_has("avx512dq");
    switch (index) {
    case SET_GENERIC: return 1;
    case SET_AVX2: return avx2;
    case SET_AVX512: return avx512;
    case SET_AVX512BF16: return avx512 && cpu_has("avx512bf16") && cpu_has("avx512vnni");
    default: return 0;
    }
}
#else
/* Other CPUs (aarch64, ...) run the portable set only. */
static const cpu_kernels *const SETS[NUM_SETS] = {&generic_kernels, NULL, NULL, NULL};

static int set_supported(int64_t index) { return index == SET_GENERIC; }
#endif

/* The kernel set by index, where this CPU runs it. */
static const cpu_kernels *kernel_set(int64_t index, int64_t threads) {
    if (threads < 1 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..4096, got %lld", (long long)threads);
        return NULL;
    }
    if (index >= 0 && index < NUM_SETS && set_supported(index)) return SETS[index];
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

static PyObject *py_gated_act(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[9];
    if (parse("gated_act", args, nargs, v, 9, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    if (v[8] != ACT_SILU && v[8] != ACT_GELU_TANH) {
        PyErr_Format(PyExc_ValueError, "gated_act: act %lld is not one of ACT_*", (long long)v[8]);
        return NULL;
    }
    const gated_act_args a = {
        .threads = (int)v[1],
        .out = PTR(v[2]), .x = PTR(v[3]), .x_stride = v[4], .rows = v[5], .inter = v[6],
        .dtype = (int)v[7], .act = (int)v[8],
    };
    k->gated_act(&a);
    Py_RETURN_NONE;
}

static PyObject *py_lora(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[19];
    if (parse("lora", args, nargs, v, 19, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    /* parts: v[15..18] their ends (0: no such part); the last end must be n */
    int64_t parts = 0, prev = 0, bad = v[7] < 0 || v[8] < 0 || v[9] < 0 || v[10] < 1 || v[11] < 1;
    for (int i = 15; i < 19 && v[i]; i++, parts++) {
        if (v[i] <= prev) bad = 1;
        prev = v[i];
    }
    if (bad || parts < 1 || prev != v[8] || v[10] != parts * v[11]) {
        PyErr_SetString(PyExc_ValueError,
                        "lora: bad sizes (w must be parts * r, the parts must end at n)");
        return NULL;
    }
    /* shrunk [m, w] floats, then the grouping's 3 m int64 */
    float *shrunk = thread_scratch(v[7] * v[10] + 6 * v[7] + 2);
    if (!shrunk) return PyErr_NoMemory();
    lora_args a = {
        .threads = (int)v[1],
        .y = PTR(v[2]), .x = PTR(v[3]), .a = PTR(v[4]), .b = PTR(v[5]), .slots = PTR(v[6]),
        .m = v[7], .n = v[8], .k = v[9], .w = v[10], .r = v[11], .x_stride = v[12],
        .y_stride = v[13], .dtype = (int)v[14], .shrunk = shrunk, .num_parts = parts,
        .part_end = {v[15], v[16], v[17], v[18]},
    };
    lora_order(&a, (int64_t *)(shrunk + ((v[7] * v[10] + 1) & ~(int64_t)1)));
    k->lora(&a);
    Py_RETURN_NONE;
}

static PyObject *py_cache_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[18];
    if (parse("cache_write", args, nargs, v, 18, NULL, 0)) return NULL;
    const cache_write_args a = {
        .key = PTR(v[0]), .value = PTR(v[1]), .key_tok_stride = v[2], .key_head_stride = v[3],
        .value_tok_stride = v[4], .value_head_stride = v[5], .key_cache = PTR(v[6]),
        .value_cache = PTR(v[7]), .slots = PTR(v[8]), .tokens = v[9], .kv_heads = v[10],
        .head_size = v[11], .block_size = v[12], .num_blocks = v[13], .src_dtype = (int)v[14],
        .cache_dtype = (int)v[15], .key_scales = PTR(v[16]), .value_scales = PTR(v[17]),
    };
    if (a.cache_dtype == DT_I8 && (!a.key_scales || !a.value_scales)) {
        PyErr_SetString(PyExc_ValueError, "cache_write: an int8 cache needs its scales");
        return NULL;
    }
    cache_write(&a);
    Py_RETURN_NONE;
}

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[25];
    double scale;
    if (parse("attention", args, nargs, v, 25, &scale, 1)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const attention_args a = {
        .threads = (int)v[1],
        .out = PTR(v[2]), .query = PTR(v[3]), .q_tok_stride = v[4], .q_head_stride = v[5],
        .out_tok_stride = v[6], .out_head_stride = v[7], .key_cache = PTR(v[8]),
        .value_cache = PTR(v[9]), .block_tables = PTR(v[10]), .bt_stride = v[11],
        .query_start_loc = PTR(v[12]), .seq_lens = PTR(v[13]), .num_reqs = v[14],
        .num_heads = v[15], .num_kv_heads = v[16], .head_size = v[17], .block_size = v[18],
        .dtype = (int)v[19], .cache_dtype = (int)v[20], .window = v[21],
        .key_scales = PTR(v[22]), .value_scales = PTR(v[23]), .tiles = (int)v[24],
        .scale = (float)scale,
    };
    if (a.cache_dtype == DT_I8 && (!a.key_scales || !a.value_scales)) {
        PyErr_SetString(PyExc_ValueError, "attention: an int8 cache needs its scales");
        return NULL;
    }
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

static PyObject *py_exponentials(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[7];
    if (parse("exponentials", args, nargs, v, 7, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const exponential_args a = {
        .threads = (int)v[1], .out = PTR(v[2]), .keys = PTR(v[3]), .rows = v[4], .cols = v[5],
        .row_stride = v[6],
    };
    Py_BEGIN_ALLOW_THREADS
    k->exponentials(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_race(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[10];
    if (parse("race", args, nargs, v, 10, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const race_args a = {
        .threads = (int)v[1], .out = PTR(v[2]), .logits = PTR(v[3]), .inv_temp = PTR(v[4]),
        .keys = PTR(v[5]), .rows = v[6], .cols = v[7], .row_stride = v[8],
        .min_score = PTR(v[9]),
    };
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = k->race(&a);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_top_p(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[9];
    if (parse("top_p", args, nargs, v, 9, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const top_p_args a = {
        .threads = (int)v[1], .out = PTR(v[2]), .logits = PTR(v[3]), .top_p = PTR(v[4]),
        .floor = PTR(v[5]), .rows = v[6], .cols = v[7], .row_stride = v[8],
        .exp_shift = k->exp_shift,
    };
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = top_p_thresholds(&a);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[11];
    if (parse("linear", args, nargs, v, 11, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    const linear_args a = {
        .threads = (int)v[1], .y = PTR(v[2]), .x = PTR(v[3]), .w = PTR(v[4]), .bias = PTR(v[5]),
        .m = v[6], .n = v[7], .k = v[8], .ldx = v[9], .ldy = v[7], .wdtype = (int)v[10],
    };
    Py_BEGIN_ALLOW_THREADS
    k->linear(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[21];
    if (parse("decode_layers", args, nargs, v, 21, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    if (v[17] < 1 || v[18] < 0 || v[18] > v[17] || v[18] > v[3] || (v[18] < v[17] && !v[19])) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: num_reqs, num_decodes and the "
                                          "chunks' query_start_loc do not fit the tokens");
        return NULL;
    }
    const decode_layers_args a = {
        .threads = (int)v[1], .plan = PTR(v[2]), .m = v[3], .x = PTR(v[4]),
        .residual_in = PTR(v[5]), .hidden_out = PTR(v[6]), .residual_out = PTR(v[7]),
        .positions = PTR(v[8]), .slots = PTR(v[9]), .block_tables = PTR(v[10]),
        .bt_stride = v[11], .seq_lens = PTR(v[12]), .workspace = PTR(v[13]),
        .group_bt_stride = v[14], .group_slot_stride = v[15], .lora_slots = PTR(v[16]),
        .num_reqs = v[17], .num_decodes = v[18], .prefill_qsl = PTR(v[19]),
        .profile = PTR(v[20]),
    };
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_layers(k, &a);
    Py_END_ALLOW_THREADS
    if (rc == -1) return PyErr_NoMemory();
    if (rc) return PyErr_Format(PyExc_ValueError, "decode_layers: not a decode plan");
    Py_RETURN_NONE;
}

static PyObject *py_moe_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[7];
    if (parse("moe_forward", args, nargs, v, 7, NULL, 0)) return NULL;
    const cpu_kernels *k = kernel_set(v[0], v[1]);
    if (!k) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = moe_forward(k, PTR(v[2]), PTR(v[3]), v[4], PTR(v[5]), PTR(v[6]), (int)v[1]);
    Py_END_ALLOW_THREADS
    if (rc == -1) return PyErr_NoMemory();
    if (rc) return PyErr_Format(PyExc_ValueError, "moe_forward: not an experts record");
    Py_RETURN_NONE;
}

static PyObject *py_moe_workspace_floats(PyObject *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    int64_t v[2];
    if (parse("moe_workspace_floats", args, nargs, v, 2, NULL, 0)) return NULL;
    return PyLong_FromLongLong((long long)moe_workspace_floats(PTR(v[0]), v[1]));
}

static PyObject *py_decode_workspace_floats(PyObject *self, PyObject *const *args,
                                            Py_ssize_t nargs) {
    int64_t v[2];
    if (parse("decode_workspace_floats", args, nargs, v, 2, NULL, 0)) return NULL;
    return PyLong_FromLongLong(decode_workspace_floats(PTR(v[0]), v[1]));
}

static PyObject *py_pack_linear_weight(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[5];
    if (parse("pack_linear_weight", args, nargs, v, 5, NULL, 0)) return NULL;
    pack_linear_weight(PTR(v[0]), PTR(v[1]), v[2], v[3], v[4]);
    Py_RETURN_NONE;
}

/* Structured outputs: logits [rows, vocab] (float32, rows `row_stride` apart) masked in place
 * by a grammar's bitmask rows (int32 words, bit t % 32 of word t / 32: token t allowed).
 * Portable C: a word that allows nothing (the usual case: a grammar allows few tokens)
 * is a run of 32 stores the compiler vectorizes, one that allows all is skipped. Tokens
 * past the mask's last word are refused. */
static void token_bitmask(int threads, float *logits, int64_t row_stride, const uint32_t *mask,
                          int64_t words, int64_t rows, int64_t vocab) {
    const float refused = -__builtin_inff();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * row_stride;
        const uint32_t *bits = mask + r * words;
        const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
        for (int64_t w = 0; w * 32 < covered; w++) {
            const uint32_t word = bits[w];
            float *at = row + w * 32;
            const int64_t n = covered - w * 32 < 32 ? covered - w * 32 : 32;
            if (word == 0xffffffffu) continue;
            if (word == 0) {
                for (int64_t i = 0; i < n; i++) at[i] = refused;
                continue;
            }
            for (int64_t i = 0; i < n; i++)
                if (!((word >> i) & 1u)) at[i] = refused;
        }
        for (int64_t t = covered; t < vocab; t++) row[t] = refused;
    }
}

static PyObject *py_swap_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[7];
    if (parse("swap_blocks", args, nargs, v, 7, NULL, 0)) return NULL;
    if (v[0] < 1 || v[0] > 4096) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..4096, got %lld", (long long)v[0]);
        return NULL;
    }
    const swap_blocks_args a = {
        .threads = (int)v[0], .src_caches = PTR(v[1]), .dst_caches = PTR(v[2]),
        .mapping = PTR(v[3]), .num_caches = v[4], .num_pairs = v[5], .block_bytes = v[6],
    };
    Py_BEGIN_ALLOW_THREADS
    swap_blocks(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_token_bitmask(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[7];
    if (parse("token_bitmask", args, nargs, v, 7, NULL, 0)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    token_bitmask((int)v[0], PTR(v[1]), v[2], PTR(v[3]), v[4], v[5], v[6]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_cpu_flags(PyObject *self, PyObject *unused) {
    PyObject *flags = PyDict_New();
    if (!flags) return NULL;
#if defined(__x86_64__)
    for (size_t i = 0; i < NUM_FLAGS; i++) {
        if (PyDict_SetItemString(flags, CPU_FLAGS[i], cpu_has(CPU_FLAGS[i]) ? Py_True : Py_False)) {
            Py_DECREF(flags);
            return NULL;
        }
    }
#endif
    return flags;
}

#if defined(__x86_64__)
int attention_tiles_usable(void); /* attention_tiles.h, in the avx512bf16 set */
#endif

static PyObject *py_attention_tiles_usable(PyObject *self, PyObject *unused) {
#if defined(__x86_64__)
    if (set_supported(SET_AVX512BF16) && attention_tiles_usable()) Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(kernel_set, threads, out, x, x_outer, x_inner, residual_in, residual_out, "
     "weight, rows, inner, cols, dtype, eps)"},
    {"rotary", (PyCFunction)(void (*)(void))py_rotary, METH_FASTCALL,
     "rotary(kernel_set, threads, x, tok_stride, head_stride, positions, cos_sin, tokens, "
     "heads, head_size, dtype)"},
    {"lora", (PyCFunction)(void (*)(void))py_lora, METH_FASTCALL,
     "lora(kernel_set, threads, y, x, a, b, slots, m, n, k, w, r, x_stride, y_stride, dtype, "
     "part_end0, part_end1, part_end2, part_end3)"},
    {"gated_act", (PyCFunction)(void (*)(void))py_gated_act, METH_FASTCALL,
     "gated_act(kernel_set, threads, out, x, x_stride, rows, inter, dtype, act)"},
    {"cache_write", (PyCFunction)(void (*)(void))py_cache_write, METH_FASTCALL,
     "cache_write(key, value, key_tok_stride, key_head_stride, value_tok_stride, "
     "value_head_stride, key_cache, value_cache, slots, tokens, kv_heads, head_size, "
     "block_size, num_blocks, src_dtype, cache_dtype, key_scales, value_scales)"},
    {"swap_blocks", (PyCFunction)(void (*)(void))py_swap_blocks, METH_FASTCALL,
     "swap_blocks(threads, src_caches, dst_caches, mapping, num_caches, num_pairs, "
     "block_bytes): whole blocks from one set of caches to another"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL,
     "attention(kernel_set, threads, out, query, q_tok_stride, q_head_stride, out_tok_stride, out_head_stride, "
     "key_cache, value_cache, block_tables, bt_stride, query_start_loc, seq_lens, num_reqs, "
     "num_heads, num_kv_heads, head_size, block_size, dtype, cache_dtype, window, "
     "key_scales, value_scales, tiles, scale)"},
    {"attention_tiles_usable", (PyCFunction)py_attention_tiles_usable, METH_NOARGS,
     "attention_tiles_usable() -> whether attention(tiles=1) runs on the AMX tile unit here "
     "(the CPU has it and the OS gave this process its state)"},
    {"argmax", (PyCFunction)(void (*)(void))py_argmax, METH_FASTCALL,
     "argmax(kernel_set, threads, out, x, rows, cols, row_stride)"},
    {"exponentials", (PyCFunction)(void (*)(void))py_exponentials, METH_FASTCALL,
     "exponentials(kernel_set, threads, out, keys, rows, cols, row_stride): Exp(1) draws, "
     "row r's from the stream of keys[r] (uint64)"},
    {"top_p", (PyCFunction)(void (*)(void))py_top_p, METH_FASTCALL,
     "top_p(kernel_set, threads, out, logits, top_p, floor, rows, cols, row_stride): each "
     "row's top-p "
     "threshold on its logits (floor 0: none)"},
    {"race", (PyCFunction)(void (*)(void))py_race, METH_FASTCALL,
     "race(kernel_set, threads, out, logits, inv_temp, keys, rows, cols, row_stride, "
     "min_score): the exponential race's token of each row, over the draws `exponentials` "
     "would write (min_score 0: no threshold)"},
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "linear(kernel_set, threads, y, x, w_packed, bias, m, n, k, ldx, wdtype): y dense [m, n]"},
    {"moe_forward", (PyCFunction)(void (*)(void))py_moe_forward, METH_FASTCALL,
     "moe_forward(kernel_set, threads, record, x, m, out, workspace): a mixture of experts' "
     "MLP over m rows (decode_layers.h)"},
    {"moe_workspace_floats", (PyCFunction)(void (*)(void))py_moe_workspace_floats,
     METH_FASTCALL, "moe_workspace_floats(record, m)"},
    {"decode_layers", (PyCFunction)(void (*)(void))py_decode_layers, METH_FASTCALL,
     "decode_layers(kernel_set, threads, plan, m, x, residual_in, hidden_out, residual_out, "
     "positions, slots, block_tables, bt_stride, seq_lens, workspace, group_bt_stride, "
     "group_slot_stride, lora_slots, num_reqs, num_decodes, prefill_qsl, profile): a step's "
     "decoder layers (decode_layers.h); profile: 0 or float64 [DECODE_PROFILE_PARTS], each "
     "part's seconds added"},
    {"decode_workspace_floats", (PyCFunction)(void (*)(void))py_decode_workspace_floats,
     METH_FASTCALL, "decode_workspace_floats(plan, m) -> floats of workspace for m tokens"},
    {"pack_linear_weight", (PyCFunction)(void (*)(void))py_pack_linear_weight, METH_FASTCALL,
     "pack_linear_weight(dst, src, n, k, ld): 16-bit W [n, k] into 16-column panels"},
    {"token_bitmask", (PyCFunction)(void (*)(void))py_token_bitmask, METH_FASTCALL,
     "token_bitmask(threads, logits, row_stride, mask, words, rows, vocab): refused -> -inf"},
    {"cpu_flags", py_cpu_flags, METH_NOARGS,
     "cpu_flags() -> {feature: bool}: what the CPU reports (x86-64; empty elsewhere)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cpu_kernels", "CPU kernels of the ops interface.", -1, methods,
};

PyMODINIT_FUNC PyInit_cpu_kernels(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
#endif
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *names = PyTuple_New(NUM_SETS), *supported = PyTuple_New(NUM_SETS);
    if (!names || !supported) goto fail;
    for (int i = 0; i < NUM_SETS; i++) {
        PyTuple_SET_ITEM(names, i, PyUnicode_FromString(SET_NAMES[i]));
        PyObject *yes = set_supported(i) ? Py_True : Py_False;
        Py_INCREF(yes);
        PyTuple_SET_ITEM(supported, i, yes);
        if (!PyTuple_GET_ITEM(names, i)) goto fail;
    }
    if (PyModule_AddObject(m, "KERNEL_SETS", names)) goto fail;
    names = NULL;
    if (PyModule_AddObject(m, "SUPPORTED", supported)) goto fail;
    supported = NULL;
    /* the decode plan's layout (decode_layers.h), which pipeline/models/decode_plan.py
     * checks its own against */
    if (PyModule_AddObject(m, "DECODE_PLAN_LAYOUT",
                           Py_BuildValue("(LLLL)", (long long)DECODE_PLAN_MAGIC,
                                         (long long)DECODE_HEADER_WORDS,
                                         (long long)DECODE_LAYER_WORDS,
                                         (long long)DECODE_MAX_PARTS)))
        goto fail;
    if (PyModule_AddObject(m, "MOE_HEADER_WORDS", PyLong_FromLongLong(MOE_HEADER_WORDS)))
        goto fail;
    if (PyModule_AddIntConstant(m, "DECODE_PROFILE_PARTS", DECODE_PROFILE_PARTS)) goto fail;
    return m;
fail:
    Py_XDECREF(names);
    Py_XDECREF(supported);
    Py_DECREF(m);
    return NULL;
}
