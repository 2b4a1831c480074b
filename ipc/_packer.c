/*
 * Rows of Python values -> the bytes of fixed-layout records, many rows per call.
 *
 * `struct.Struct.pack` packs one record per call, and each call builds an argument tuple
 * of every value (52 for a request with 40 token ids): ~0.5 us a record, which capped a
 * batched ring writer at ~1.9 M records/s. `Packer.pack(rows)` walks the rows itself and
 * writes each value straight into one bytes object:
 *
 *     Packer(itemsize, fields)        fields: ((offset, code, count, name), ...)
 *     packer.pack(rows) -> bytes      len(rows) * itemsize bytes, padding zeroed
 *
 * codes: b B h H i I q Q (integers), f d (floats), s (bytes of at most `count`). A row is a
 * tuple or list with one item per field, in `fields` order; a field with count > 1 (not
 * `s`) takes a sequence of at most `count` numbers, the rest of its elements zeroed.
 * Values are checked as struct checks them (integers in the type's range, no float for an
 * integer field, float32 overflow), and a bad one raises naming the row and the field.
 * Little-endian only (x86-64, aarch64), as the rings are; ipc/packer.py builds the
 * fields from a numpy dtype.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ringllm records are little-endian: this packer copies native values"
#endif

typedef struct {
    Py_ssize_t offset;
    Py_ssize_t count;
    char code;
    int size;
    PyObject *name;
} Field;

typedef struct {
    PyObject_HEAD
    Py_ssize_t itemsize;
    Py_ssize_t num_fields;
    Field *fields;
} Packer;

static int code_size(char code)
{
    switch (code) {
    case 'b': case 'B': case 's': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': case 'f': return 4;
    case 'q': case 'Q': case 'd': return 8;
    default: return 0;
    }
}

static void packer_dealloc(Packer *self)
{
    for (Py_ssize_t i = 0; i < self->num_fields; i++)
        Py_XDECREF(self->fields[i].name);
    PyMem_Free(self->fields);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int packer_init(Packer *self, PyObject *args, PyObject *kwargs)
{
    Py_ssize_t itemsize;
    PyObject *fields_obj;
    static char *keywords[] = {"itemsize", "fields", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nO", keywords, &itemsize, &fields_obj))
        return -1;
    PyObject *fields = PySequence_Fast(fields_obj, "fields must be a sequence");
    if (fields == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fields);
    Field *parsed = PyMem_Calloc(n > 0 ? n : 1, sizeof(Field));
    if (parsed == NULL) {
        Py_DECREF(fields);
        PyErr_NoMemory();
        return -1;
    }
    int ok = itemsize >= 1;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "itemsize must be >= 1 byte, got %zd", itemsize);
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        Field *field = &parsed[i];
        const char *code;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fields, i), "nsnU;fields[i] must be "
                              "(offset, code, count, name)", &field->offset, &code,
                              &field->count, &field->name);
        if (!ok)
            break;
        Py_INCREF(field->name);
        field->code = code[0];
        field->size = strlen(code) == 1 ? code_size(code[0]) : 0;
        if (field->size == 0 || field->count < 1 || field->offset < 0 ||
            field->offset + field->count * field->size > itemsize) {
            PyErr_Format(PyExc_ValueError,
                         "field %R: code %s x %zd at offset %zd does not fit a %zd-byte record "
                         "(codes: b B h H i I q Q f d s)",
                         field->name, code, field->count, field->offset, itemsize);
            ok = 0;
        }
    }
    Py_DECREF(fields);
    for (Py_ssize_t i = 0; i < self->num_fields; i++)
        Py_XDECREF(self->fields[i].name);
    PyMem_Free(self->fields);
    self->fields = parsed;
    self->num_fields = n;
    self->itemsize = itemsize;
    return ok ? 0 : -1;
}

/* Raise `type` naming the row and the field; a pending OverflowError keeps its type. */
static int fail_at(Py_ssize_t row, const Field *field, const char *what, PyObject *type)
{
    if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_OverflowError))
        type = PyExc_OverflowError;
    PyErr_Clear();
    PyErr_Format(type, "row %zd, field %R (%c): %s", row, field->name, field->code, what);
    return -1;
}

/* The low `size` bytes of `x` at `at` (little-endian), as fixed-size stores. */
static inline void store_low_bytes(char *at, uint64_t x, int size)
{
    uint8_t v8 = (uint8_t)x;
    uint16_t v16 = (uint16_t)x;
    uint32_t v32 = (uint32_t)x;
    switch (size) {
    case 1: memcpy(at, &v8, 1); break;
    case 2: memcpy(at, &v16, 2); break;
    case 4: memcpy(at, &v32, 4); break;
    default: memcpy(at, &x, 8); break;
    }
}

/* The range of a signed-storable integer code ('Q' is handled on its own). */
static long long int_low(char code)
{
    switch (code) {
    case 'b': return INT8_MIN;
    case 'h': return INT16_MIN;
    case 'i': return INT32_MIN;
    case 'q': return INT64_MIN;
    default: return 0; /* B H I */
    }
}

static long long int_high(char code)
{
    switch (code) {
    case 'b': return INT8_MAX;
    case 'B': return UINT8_MAX;
    case 'h': return INT16_MAX;
    case 'H': return UINT16_MAX;
    case 'i': return INT32_MAX;
    case 'I': return UINT32_MAX;
    default: return INT64_MAX; /* q */
    }
}

static int put_int(char *at, const Field *field, PyObject *value, Py_ssize_t row)
{
    if (!PyLong_Check(value)) {
        if (PyFloat_Check(value) || !PyIndex_Check(value))
            return fail_at(row, field, "needs an integer", PyExc_TypeError);
        value = PyNumber_Index(value); /* numpy integers */
        if (value == NULL)
            return fail_at(row, field, "needs an integer", PyExc_TypeError);
    } else {
        Py_INCREF(value);
    }
    int ok = 1;
    if (field->code == 'Q') {
        unsigned long long x = PyLong_AsUnsignedLongLong(value);
        ok = !(x == (unsigned long long)-1 && PyErr_Occurred());
        if (ok)
            memcpy(at, &x, 8);
    } else {
        long long x = PyLong_AsLongLong(value);
        ok = !(x == -1 && PyErr_Occurred());
        ok = ok && x >= int_low(field->code) && x <= int_high(field->code);
        if (ok)
            store_low_bytes(at, (uint64_t)x, field->size);
    }
    Py_DECREF(value);
    return ok ? 0 : fail_at(row, field, "integer out of the field's range", PyExc_OverflowError);
}

static int put_float(char *at, const Field *field, PyObject *value, Py_ssize_t row)
{
    double x = PyFloat_AsDouble(value); /* float, int, or anything with __float__ */
    if (x == -1.0 && PyErr_Occurred())
        return fail_at(row, field, "needs a number", PyExc_TypeError);
    if (field->code == 'd') {
        memcpy(at, &x, 8);
        return 0;
    }
    float narrow = (float)x;
    if (isfinite(x) && !isfinite(narrow)) {
        return fail_at(row, field, "too large for float32", PyExc_OverflowError);
    }
    memcpy(at, &narrow, 4);
    return 0;
}

static int put_scalar(char *at, const Field *field, PyObject *value, Py_ssize_t row)
{
    return field->code == 'f' || field->code == 'd' ? put_float(at, field, value, row)
                                                    : put_int(at, field, value, row);
}

static int put_field(char *record, const Field *field, PyObject *value, Py_ssize_t row)
{
    char *at = record + field->offset;
    if (field->code == 's') {
        char *data;
        Py_ssize_t length;
        if (!PyBytes_Check(value) || PyBytes_AsStringAndSize(value, &data, &length) < 0)
            return fail_at(row, field, "needs bytes", PyExc_TypeError);
        if (length > field->count) {
            PyErr_Format(PyExc_ValueError, "row %zd, field %R: %zd bytes, the field holds %zd",
                         row, field->name, length, field->count);
            return -1;
        }
        memcpy(at, data, length);
        return 0;
    }
    if (field->count == 1)
        return put_scalar(at, field, value, row);
    PyObject *items = PySequence_Fast(value, "");
    if (items == NULL)
        return fail_at(row, field, "needs a sequence of numbers", PyExc_TypeError);
    Py_ssize_t length = PySequence_Fast_GET_SIZE(items);
    if (length > field->count) {
        Py_DECREF(items);
        PyErr_Format(PyExc_ValueError, "row %zd, field %R: %zd values, the field holds %zd",
                     row, field->name, length, field->count);
        return -1;
    }
    PyObject **item = PySequence_Fast_ITEMS(items);
    for (Py_ssize_t i = 0; i < length; i++) {
        if (put_scalar(at + i * field->size, field, item[i], row) < 0) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    return 0;
}

static PyObject *packer_pack(Packer *self, PyObject *rows_obj)
{
    PyObject *rows = PySequence_Fast(rows_obj, "pack() takes a sequence of rows");
    if (rows == NULL)
        return NULL;
    Py_ssize_t num_rows = PySequence_Fast_GET_SIZE(rows);
    PyObject *out = PyBytes_FromStringAndSize(NULL, num_rows * self->itemsize);
    if (out == NULL) {
        Py_DECREF(rows);
        return NULL;
    }
    char *base = PyBytes_AS_STRING(out);
    memset(base, 0, num_rows * self->itemsize);
    for (Py_ssize_t r = 0; r < num_rows; r++) {
        PyObject *row = PySequence_Fast(PySequence_Fast_GET_ITEM(rows, r), "");
        if (row == NULL) {
            PyErr_Format(PyExc_TypeError, "row %zd is not a tuple or list", r);
            goto fail;
        }
        if (PySequence_Fast_GET_SIZE(row) != self->num_fields) {
            PyErr_Format(PyExc_ValueError, "row %zd has %zd values, the record has %zd fields",
                         r, PySequence_Fast_GET_SIZE(row), self->num_fields);
            Py_DECREF(row);
            goto fail;
        }
        PyObject **values = PySequence_Fast_ITEMS(row);
        char *record = base + r * self->itemsize;
        for (Py_ssize_t f = 0; f < self->num_fields; f++) {
            if (put_field(record, &self->fields[f], values[f], r) < 0) {
                Py_DECREF(row);
                goto fail;
            }
        }
        Py_DECREF(row);
    }
    Py_DECREF(rows);
    return out;
fail:
    Py_DECREF(rows);
    Py_DECREF(out);
    return NULL;
}

static PyObject *packer_itemsize(Packer *self, void *closure)
{
    return PyLong_FromSsize_t(self->itemsize);
}

static PyMethodDef packer_methods[] = {
    {"pack", (PyCFunction)packer_pack, METH_O,
     "pack(rows) -> bytes: one record per row (a tuple or list with a value per field)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef packer_getset[] = {
    {"itemsize", (getter)packer_itemsize, NULL, "bytes per record", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PackerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ringllm.ipc._packer.Packer",
    .tp_basicsize = sizeof(Packer),
    .tp_dealloc = (destructor)packer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Packer(itemsize, fields): packs rows of values into fixed-layout records.",
    .tp_methods = packer_methods,
    .tp_getset = packer_getset,
    .tp_init = (initproc)packer_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_packer", "Rows of Python values -> fixed-layout record bytes.", -1,
    NULL,
};

PyMODINIT_FUNC PyInit__packer(void)
{
    if (PyType_Ready(&PackerType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&PackerType);
    if (PyModule_AddObject(mod, "Packer", (PyObject *)&PackerType) < 0) {
        Py_DECREF(&PackerType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
