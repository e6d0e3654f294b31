/* shardio._sampleio: read one sample of a shard with a single preadv, each field straight into
 * its own bytes object.
 *
 *   Index(key_blob, key_offsets, sample_start, f_name, f_flags, f_offset, f_length, f_checksum,
 *         lo, hi, names)
 *       holds a shard index (shardio.formats.base.ShardIndex's arrays, C-contiguous, native
 *       byte order; lo/hi its spans()) and its field names (a tuple of str).
 *   Index.get(fd, i, check, on_read=None) -> dict | tuple | None
 *       sample i as {"__key__": key, field: bytes, ...} (fields in row order), read from file
 *       descriptor fd with one preadv of the sample's span [lo[i], hi[i]): each field's bytes
 *       land in a new bytes object, the headers and padding between fields in a scratch buffer
 *       (the GIL is released during the read).  `check`, when not None, is called on each field
 *       (the shard's per-sample checksum function) and must return the index's value;
 *       `on_read`, when not None, is called with the bytes read once they all checked out.
 *
 * It returns None when the sample is not plain, and the caller reads it with the Python code: a
 * compressed field, fields out of offset order or with a gap wider than the scratch buffer, a
 * key that is not UTF-8.  A fault comes back as a tuple for the caller to raise as its typed
 * error (so it is counted and fails over like any other): ("io", errno) when preadv failed,
 * ("short", bytes_read) when the file ended early, ("checksum", row, found) when a field does
 * not match the index.  That is ShardReader.get's fast path (shardio/formats/base.py): one copy
 * from the page cache instead of two, and no per-field Python code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define SCRATCH (64 * 1024)
#define MAX_FIELDS 64

enum { A_KEYOFF, A_START, A_NAME, A_FLAGS, A_OFFSET, A_LENGTH, A_CHECKSUM, A_LO, A_HI, N_ARRAYS };

static const Py_ssize_t itemsizes[N_ARRAYS] = {8, 8, 2, 1, 8, 8, 8, 8, 8};
static const char *array_names[N_ARRAYS] = {
    "key_offsets", "sample_start", "f_name", "f_flags", "f_offset", "f_length", "f_checksum",
    "lo", "hi",
};

typedef struct {
    PyObject_HEAD
    PyObject *key_blob; /* bytes */
    PyObject *names;    /* tuple of str */
    Py_buffer views[N_ARRAYS];
    int have[N_ARRAYS];
    Py_ssize_t samples; /* len(key_offsets) - 1 */
    Py_ssize_t rows;    /* len(f_name) */
} IndexObject;

static void
index_dealloc(IndexObject *self)
{
    for (int k = 0; k < N_ARRAYS; k++) {
        if (self->have[k]) {
            PyBuffer_Release(&self->views[k]);
        }
    }
    Py_XDECREF(self->key_blob);
    Py_XDECREF(self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
index_init(IndexObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *blob, *names, *arrays[N_ARRAYS];
    if (!PyArg_ParseTuple(args, "O!OOOOOOOOOO!", &PyBytes_Type, &blob, &arrays[A_KEYOFF],
                          &arrays[A_START], &arrays[A_NAME], &arrays[A_FLAGS], &arrays[A_OFFSET],
                          &arrays[A_LENGTH], &arrays[A_CHECKSUM], &arrays[A_LO], &arrays[A_HI],
                          &PyTuple_Type, &names)) {
        return -1;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(names); k++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(names, k))) {
            PyErr_SetString(PyExc_TypeError, "field names must be str");
            return -1;
        }
    }
    for (int k = 0; k < N_ARRAYS; k++) { /* __init__ called again: let go of the old arrays */
        if (self->have[k]) {
            PyBuffer_Release(&self->views[k]);
            self->have[k] = 0;
        }
    }
    for (int k = 0; k < N_ARRAYS; k++) {
        if (PyObject_GetBuffer(arrays[k], &self->views[k], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            return -1;
        }
        self->have[k] = 1;
        if (self->views[k].itemsize != itemsizes[k]) {
            PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", array_names[k],
                         self->views[k].itemsize, itemsizes[k]);
            return -1;
        }
    }
    self->samples = self->views[A_KEYOFF].len / 8 - 1;
    self->rows = self->views[A_NAME].len / 2;
    if (self->samples < 0 || self->views[A_START].len / 8 != self->samples + 1
        || self->views[A_LO].len / 8 != self->samples || self->views[A_HI].len / 8 != self->samples
        || self->views[A_FLAGS].len != self->rows || self->views[A_OFFSET].len / 8 != self->rows
        || self->views[A_LENGTH].len / 8 != self->rows
        || self->views[A_CHECKSUM].len / 8 != self->rows) {
        PyErr_SetString(PyExc_ValueError, "index arrays of inconsistent lengths");
        return -1;
    }
    Py_INCREF(blob);
    Py_XSETREF(self->key_blob, blob);
    Py_INCREF(names);
    Py_XSETREF(self->names, names);
    return 0;
}

static void
release_fields(PyObject **fields, Py_ssize_t made)
{
    for (Py_ssize_t r = 0; r < made; r++) {
        Py_DECREF(fields[r]);
    }
}

#define U64(self, a, i) (((const uint64_t *)(self)->views[a].buf)[i])

static PyObject *
index_get(IndexObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t i;
    PyObject *check, *on_read = Py_None;
    if (!PyArg_ParseTuple(args, "inO|O", &fd, &i, &check, &on_read)) {
        return NULL;
    }
    if (i < 0 || i >= self->samples) {
        PyErr_SetString(PyExc_IndexError, "sample index out of range");
        return NULL;
    }
    uint64_t r0 = U64(self, A_START, i), r1 = U64(self, A_START, i + 1);
    uint64_t k0 = U64(self, A_KEYOFF, i), k1 = U64(self, A_KEYOFF, i + 1);
    int64_t lo = ((const int64_t *)self->views[A_LO].buf)[i];
    int64_t hi = ((const int64_t *)self->views[A_HI].buf)[i];
    const uint8_t *flags = self->views[A_FLAGS].buf;
    const uint16_t *fname = self->views[A_NAME].buf;
    Py_ssize_t nf = (Py_ssize_t)(r1 - r0);
    if (r1 < r0 || r1 > (uint64_t)self->rows || nf > MAX_FIELDS || k1 < k0
        || k1 > (uint64_t)PyBytes_GET_SIZE(self->key_blob) || hi < lo) {
        Py_RETURN_NONE;
    }
    PyObject *fields[MAX_FIELDS];
    struct iovec iov[2 * MAX_FIELDS + 1];
    static char scratch[SCRATCH]; /* written, never read: shared by every call and thread */
    int niov = 0;
    uint64_t cursor = (uint64_t)lo;
    Py_ssize_t made = 0;
    for (Py_ssize_t r = 0; r < nf; r++) {
        uint64_t row = r0 + (uint64_t)r;
        uint64_t off = U64(self, A_OFFSET, row), len = U64(self, A_LENGTH, row);
        if (flags[row] != 0 || off < cursor || off - cursor > SCRATCH
            || off + len > (uint64_t)hi || fname[row] >= PyTuple_GET_SIZE(self->names)
            || len > (uint64_t)PY_SSIZE_T_MAX) {
            goto fallback;
        }
        if (off > cursor) {
            iov[niov].iov_base = scratch;
            iov[niov].iov_len = (size_t)(off - cursor);
            niov++;
        }
        fields[made] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
        if (fields[made] == NULL) {
            goto error;
        }
        iov[niov].iov_base = PyBytes_AS_STRING(fields[made]);
        iov[niov].iov_len = (size_t)len;
        niov++;
        made++;
        cursor = off + len;
    }
    if ((uint64_t)hi > cursor) { /* cannot happen with spans(): hi is the last field's end */
        goto fallback;
    }
    ssize_t want = (ssize_t)(cursor - (uint64_t)lo), got = 0;
    if (want > 0) {
        Py_BEGIN_ALLOW_THREADS
        do {
            got = preadv(fd, iov, niov, (off_t)lo);
        } while (got < 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
        if (got < 0) {
            int err = errno;
            release_fields(fields, made);
            return Py_BuildValue("(si)", "io", err);
        }
        if (got != want) {
            release_fields(fields, made);
            return Py_BuildValue("(sn)", "short", (Py_ssize_t)got);
        }
    }
    if (check != Py_None) {
        const uint64_t *sums = self->views[A_CHECKSUM].buf;
        for (Py_ssize_t r = 0; r < nf; r++) {
            PyObject *c = PyObject_CallOneArg(check, fields[r]);
            if (c == NULL) {
                goto error;
            }
            unsigned long long v = PyLong_AsUnsignedLongLong(c);
            Py_DECREF(c);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                goto error;
            }
            if ((uint64_t)v != sums[r0 + (uint64_t)r]) {
                release_fields(fields, made);
                return Py_BuildValue("(sKK)", "checksum", (unsigned long long)(r0 + r), v);
            }
        }
    }
    if (on_read != Py_None) {
        PyObject *n = PyLong_FromSsize_t((Py_ssize_t)want);
        PyObject *r = n == NULL ? NULL : PyObject_CallOneArg(on_read, n);
        Py_XDECREF(n);
        if (r == NULL) {
            goto error;
        }
        Py_DECREF(r);
    }
    PyObject *sample = PyDict_New();
    if (sample == NULL) {
        goto error;
    }
    PyObject *key = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(self->key_blob) + k0,
                                         (Py_ssize_t)(k1 - k0), NULL);
    if (key == NULL) {
        Py_DECREF(sample);
        PyErr_Clear();
        goto fallback;
    }
    int bad = PyDict_SetItemString(sample, "__key__", key) < 0;
    Py_DECREF(key);
    for (Py_ssize_t r = 0; !bad && r < nf; r++) {
        PyObject *name = PyTuple_GET_ITEM(self->names, fname[r0 + (uint64_t)r]);
        bad = PyDict_SetItem(sample, name, fields[r]) < 0;
    }
    release_fields(fields, made);
    if (bad) {
        Py_DECREF(sample);
        return NULL;
    }
    return sample;
fallback:
    release_fields(fields, made);
    Py_RETURN_NONE;
error:
    release_fields(fields, made);
    return NULL;
}

static PyMethodDef index_methods[] = {
    {"get", (PyCFunction)index_get, METH_VARARGS,
     "get(fd, i, check, on_read=None) -> dict | None: sample i read with one preadv (see the "
     "module source)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shardio._sampleio.Index",
    .tp_basicsize = sizeof(IndexObject),
    .tp_dealloc = (destructor)index_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A shard index held for one-preadv sample reads (shardio/_sampleio.c).",
    .tp_methods = index_methods,
    .tp_init = (initproc)index_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shardio._sampleio",
    "One-preadv sample reads (shardio/_sampleio.c).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__sampleio(void)
{
    if (PyType_Ready(&IndexType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
