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
 *   Index.get_into(fd, i, buf, view, voff, min_bytes, check, on_read=None) -> dict | tuple | None
 *       the same for a reader with an arena (shardio.sharedbytes): the sample's span
 *       [lo[i], hi[i]) lands whole in ``buf`` (a writable buffer of exactly that many bytes: the
 *       arena's room at offset ``voff`` of its chunk view ``view``) with one pread; a field of at
 *       least ``min_bytes`` bytes is ``view[voff + o : voff + o + length]`` (o: its offset in the
 *       span), a smaller one a new bytes object.  That is ShardReader.get's fast path with
 *       ``ShardDataset(zero_copy=True)``; before it, those reads went through per-field Python.
 *
 *   Index.cut(i, buf, base, view, voff, min_bytes, check) -> dict | tuple | None
 *       sample i cut from shard bytes [base, base + len(buf)) the caller read already (a run of
 *       samples read with one large pread: ShardReader.iter_range), fields as get_into makes
 *       them (``view`` None: every field a new bytes object); ("checksum", row, found) when a
 *       field does not match.  Nothing is read, so no "io" or "short" here.
 *
 *   read_many(readers, slots, local, k, end, buf, view, voff, min_bytes, out) -> (k, used)
 *       get_into for a whole batch of samples from several shards, with no Python code between
 *       them: ``readers`` a tuple of (Index, fd, check, on_read), one per shard; ``slots`` and
 *       ``local`` int64 buffers, sample j being sample local[j] of reader slots[j].  For j
 *       from k to end - 1, each sample's span lands at the next 64-byte aligned offset of
 *       ``buf`` (the arena's free room, at offset ``voff`` of ``view``) and its dict is appended
 *       to the list ``out``.
 *       Stops at the first sample it cannot deliver (no room left in buf, a read error or short
 *       read, a checksum mismatch, a sample that is not plain) and returns (that j, the aligned
 *       bytes of buf used): the caller reads that sample through its general path, which raises
 *       the fault as its typed error or reads the sample with Python.  (end, used) when all
 *       done.
 *       The loader's shuffled batches hit single samples of many shards: this one call per
 *       batch replaces ~3 us of Python per sample (ShardReader.get, the arena's take, the
 *       reader's loop).
 *
 *   field_rows(items, base, start, end, out) -> bool
 *       for the default collate of a column of fields read into a ring message
 *       (shardio._tree._pieces): when every item of the list ``items`` is an array of the exact
 *       type of ``base`` whose ``.base`` is ``base`` (cut from it), 1-d, of 1-byte "B" items,
 *       C-contiguous, and lies inside bytes [start, end) of ``base``'s buffer, writes (0, offset - start, offset - start + length)
 *       per item into ``out`` (a writable buffer of 3 int64 per item) and returns True; else
 *       False (and ``out`` is garbage).  One call instead of a few Python steps per item.
 *
 * The Index methods return None when the sample is not plain, and the caller reads it with the Python
 * code: a compressed field, fields out of offset order or with a gap wider than the scratch
 * buffer (get), a key that is not UTF-8.  A fault comes back as a tuple for the caller to raise
 * as its typed error (so it is counted and fails over like any other): ("io", errno) when the
 * read failed, ("short", bytes_read) when the file ended early, ("checksum", row, found) when a
 * field does not match the index.  get is ShardReader.get's fast path (shardio/formats/base.py):
 * one copy from the page cache instead of two, and no per-field Python code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#define SCRATCH (64 * 1024)
/* A read returns at most ~2 GiB: a span this long goes to the Python read, which reads on past
 * that cap (shardio._fsutil.BIG_READ). */
#define BIG_READ (1LL << 30)
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

typedef struct {
    uint64_t r0, r1; /* field rows */
    uint64_t k0, k1; /* key bytes in key_blob */
    int64_t lo, hi;  /* the sample's span in the shard */
} Span;

/* Sample i's span and rows: 1, or 0 when the index does not hold together for it (the caller
 * returns None), or -1 with IndexError set. */
static int
span_of(IndexObject *self, Py_ssize_t i, Span *sp)
{
    if (i < 0 || i >= self->samples) {
        PyErr_SetString(PyExc_IndexError, "sample index out of range");
        return -1;
    }
    sp->r0 = U64(self, A_START, i);
    sp->r1 = U64(self, A_START, i + 1);
    sp->k0 = U64(self, A_KEYOFF, i);
    sp->k1 = U64(self, A_KEYOFF, i + 1);
    sp->lo = ((const int64_t *)self->views[A_LO].buf)[i];
    sp->hi = ((const int64_t *)self->views[A_HI].buf)[i];
    return !(sp->r1 < sp->r0 || sp->r1 > (uint64_t)self->rows || sp->k1 < sp->k0
             || sp->k1 > (uint64_t)PyBytes_GET_SIZE(self->key_blob) || sp->hi < sp->lo
             || sp->lo < 0);
}

/* check(field) against the index's checksum of `row`: 1 equal, 0 not (*found set), -1 error. */
static int
check_field(IndexObject *self, PyObject *check, PyObject *field, uint64_t row,
            unsigned long long *found)
{
    PyObject *c = PyObject_CallOneArg(check, field);
    if (c == NULL) {
        return -1;
    }
    *found = PyLong_AsUnsignedLongLong(c);
    Py_DECREF(c);
    if (*found == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    return (uint64_t)*found == ((const uint64_t *)self->views[A_CHECKSUM].buf)[row];
}

/* on_read(nbytes) unless None: 0, or -1 with its exception set. */
static int
report_read(PyObject *on_read, ssize_t nbytes)
{
    if (on_read == Py_None) {
        return 0;
    }
    PyObject *n = PyLong_FromSsize_t((Py_ssize_t)nbytes);
    PyObject *r = n == NULL ? NULL : PyObject_CallOneArg(on_read, n);
    Py_XDECREF(n);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* {"__key__": key}, or NULL: with an exception set, or without one for a key that is not
 * UTF-8 (the caller returns None and the Python code reads the sample). */
static PyObject *
new_sample(IndexObject *self, const Span *sp)
{
    PyObject *key = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(self->key_blob) + sp->k0,
                                         (Py_ssize_t)(sp->k1 - sp->k0), NULL);
    if (key == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *sample = PyDict_New();
    if (sample == NULL || PyDict_SetItemString(sample, "__key__", key) < 0) {
        Py_XDECREF(sample);
        sample = NULL;
    }
    Py_DECREF(key);
    return sample;
}

static PyObject *
index_get(IndexObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t i;
    PyObject *check, *on_read = Py_None;
    if (!PyArg_ParseTuple(args, "inO|O", &fd, &i, &check, &on_read)) {
        return NULL;
    }
    Span sp;
    int plain = span_of(self, i, &sp);
    if (plain < 0) {
        return NULL;
    }
    uint64_t r0 = sp.r0, r1 = sp.r1;
    int64_t lo = sp.lo, hi = sp.hi;
    const uint8_t *flags = self->views[A_FLAGS].buf;
    const uint16_t *fname = self->views[A_NAME].buf;
    Py_ssize_t nf = (Py_ssize_t)(r1 - r0);
    if (!plain || nf > MAX_FIELDS) {
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
    if (want >= BIG_READ) { /* over what one read returns: the Python read reads on */
        goto fallback;
    }
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
    for (Py_ssize_t r = 0; check != Py_None && r < nf; r++) {
        unsigned long long found;
        int ok = check_field(self, check, fields[r], r0 + (uint64_t)r, &found);
        if (ok < 0) {
            goto error;
        }
        if (!ok) {
            release_fields(fields, made);
            return Py_BuildValue("(sKK)", "checksum", (unsigned long long)(r0 + r), found);
        }
    }
    if (report_read(on_read, want) < 0) {
        goto error;
    }
    PyObject *sample = new_sample(self, &sp);
    if (sample == NULL) {
        if (PyErr_Occurred()) {
            goto error;
        }
        goto fallback;
    }
    int bad = 0;
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

/* Whether every field of the sample is stored plain (not compressed), known by name and inside
 * [lo, hi): what the one-buffer paths below can cut without the Python code. */
static int
rows_inside(IndexObject *self, const Span *sp, uint64_t lo, uint64_t hi)
{
    const uint8_t *flags = self->views[A_FLAGS].buf;
    const uint16_t *fname = self->views[A_NAME].buf;
    for (uint64_t row = sp->r0; row < sp->r1; row++) {
        uint64_t off = U64(self, A_OFFSET, row), len = U64(self, A_LENGTH, row);
        if (flags[row] != 0 || off < lo || off + len > hi || off + len < off
            || fname[row] >= PyTuple_GET_SIZE(self->names)) {
            return 0;
        }
    }
    return 1;
}

/* The sample whose bytes [lo, ...) are at `data`: its fields checked (`check` unless None), then
 * cut: a field of at least `min_bytes` bytes as view[voff + o : voff + o + length] (o: its
 * offset from lo), a smaller one (or any, when `view` is None) as a new bytes object.  Returns
 * the dict, a ("checksum", row, found) tuple, None (a key that is not UTF-8), or NULL with an
 * exception set; `on_read` is called with `nbytes` once every field checked out. */
static PyObject *
cut_sample(IndexObject *self, const Span *sp, const char *data, uint64_t lo, PyObject *check,
           PyObject *on_read, ssize_t nbytes, PyObject *view, Py_ssize_t voff,
           Py_ssize_t min_bytes)
{
    const uint16_t *fname = self->views[A_NAME].buf;
    for (uint64_t row = sp->r0; check != Py_None && row < sp->r1; row++) {
        PyObject *mv = PyMemoryView_FromMemory((char *)data + (U64(self, A_OFFSET, row) - lo),
                                               (Py_ssize_t)U64(self, A_LENGTH, row), PyBUF_READ);
        if (mv == NULL) {
            return NULL;
        }
        unsigned long long found;
        int ok = check_field(self, check, mv, row, &found);
        Py_DECREF(mv);
        if (ok < 0) {
            return NULL;
        }
        if (!ok) {
            return Py_BuildValue("(sKK)", "checksum", (unsigned long long)row, found);
        }
    }
    if (report_read(on_read, nbytes) < 0) {
        return NULL;
    }
    PyObject *sample = new_sample(self, sp);
    if (sample == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    int bad = 0;
    for (uint64_t row = sp->r0; !bad && row < sp->r1; row++) {
        Py_ssize_t off = (Py_ssize_t)(U64(self, A_OFFSET, row) - lo);
        Py_ssize_t len = (Py_ssize_t)U64(self, A_LENGTH, row);
        PyObject *field;
        if (view != Py_None && len >= min_bytes) { /* a view of the chunk (shardio.sharedbytes) */
            PyObject *a = PyLong_FromSsize_t(voff + off), *b = PyLong_FromSsize_t(voff + off + len);
            PyObject *slice = (a == NULL || b == NULL) ? NULL : PySlice_New(a, b, NULL);
            Py_XDECREF(a);
            Py_XDECREF(b);
            field = slice == NULL ? NULL : PyObject_GetItem(view, slice);
            Py_XDECREF(slice);
        } else {
            field = PyBytes_FromStringAndSize(data + off, len);
        }
        bad = field == NULL
              || PyDict_SetItem(sample, PyTuple_GET_ITEM(self->names, fname[row]), field) < 0;
        Py_XDECREF(field);
    }
    if (bad) {
        Py_DECREF(sample);
        return NULL;
    }
    return sample;
}

static PyObject *
index_get_into(IndexObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t i, voff, min_bytes;
    PyObject *bufobj, *view, *check, *on_read = Py_None;
    if (!PyArg_ParseTuple(args, "inOOnnO|O", &fd, &i, &bufobj, &view, &voff, &min_bytes, &check,
                          &on_read)) {
        return NULL;
    }
    Span sp;
    int plain = span_of(self, i, &sp);
    if (plain <= 0 || !rows_inside(self, &sp, (uint64_t)sp.lo, (uint64_t)sp.hi)) {
        return plain < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (sp.hi - sp.lo >= BIG_READ) { /* over what one read returns: the Python read reads on */
        return Py_NewRef(Py_None);
    }
    Py_buffer pb;
    if (PyObject_GetBuffer(bufobj, &pb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    ssize_t want = (ssize_t)(sp.hi - sp.lo), got = 0;
    if (pb.len != want) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes for a span of %zd", pb.len, want);
        goto done;
    }
    if (want > 0) {
        Py_BEGIN_ALLOW_THREADS
        do {
            got = pread(fd, pb.buf, (size_t)want, (off_t)sp.lo);
        } while (got < 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
        if (got < 0) {
            result = Py_BuildValue("(si)", "io", errno);
            goto done;
        }
        if (got != want) {
            result = Py_BuildValue("(sn)", "short", (Py_ssize_t)got);
            goto done;
        }
    }
    result = cut_sample(self, &sp, pb.buf, (uint64_t)sp.lo, check, on_read, want, view, voff,
                        min_bytes);
done:
    PyBuffer_Release(&pb);
    return result;
}

static PyObject *
index_cut(IndexObject *self, PyObject *args)
{
    Py_ssize_t i, voff, min_bytes;
    long long base;
    PyObject *bufobj, *view, *check;
    if (!PyArg_ParseTuple(args, "nOLOnnO", &i, &bufobj, &base, &view, &voff, &min_bytes,
                          &check)) {
        return NULL;
    }
    Span sp;
    int plain = span_of(self, i, &sp);
    if (plain < 0) {
        return NULL;
    }
    Py_buffer pb;
    if (PyObject_GetBuffer(bufobj, &pb, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    PyObject *result;
    if (!plain || base < 0
        || !rows_inside(self, &sp, (uint64_t)base, (uint64_t)base + (uint64_t)pb.len)) {
        result = Py_NewRef(Py_None);
    } else {
        result = cut_sample(self, &sp, pb.buf, (uint64_t)base, check, Py_None, 0, view, voff,
                            min_bytes);
    }
    PyBuffer_Release(&pb);
    return result;
}

static PyMethodDef index_methods[] = {
    {"get", (PyCFunction)index_get, METH_VARARGS,
     "get(fd, i, check, on_read=None) -> dict | None: sample i read with one preadv (see the "
     "module source)."},
    {"get_into", (PyCFunction)index_get_into, METH_VARARGS,
     "get_into(fd, i, buf, view, voff, min_bytes, check, on_read=None) -> dict | tuple | None: "
     "sample i read with one pread into buf (see the module source)."},
    {"cut", (PyCFunction)index_cut, METH_VARARGS,
     "cut(i, buf, base, view, voff, min_bytes, check) -> dict | tuple | None: sample i cut from "
     "shard bytes [base, base + len(buf)) already read (see the module source)."},
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

/* read_many: see the module comment.  Stops, returning (k, used), at the first sample it does
 * not deliver itself; the caller reads that one through its general path (which raises the
 * typed error of a fault, or reads a sample that is not plain). */
static PyObject *
read_many(PyObject *mod, PyObject *args)
{
    PyObject *readers, *out, *view;
    Py_buffer slots, local, pb;
    Py_ssize_t k, end, voff, min_bytes;
    if (!PyArg_ParseTuple(args, "O!y*y*nnw*OnnO!", &PyTuple_Type, &readers, &slots, &local, &k,
                          &end, &pb, &view, &voff, &min_bytes, &PyList_Type, &out)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = local.len / 8, nreaders = PyTuple_GET_SIZE(readers), used = 0;
    const int64_t *slot = slots.buf, *loc = local.buf;
    if (slots.len != local.len || k < 0 || k > end || end > n) {
        PyErr_SetString(PyExc_ValueError, "read_many: slots and local of different lengths, or "
                        "not 0 <= k <= end <= len(local)");
        goto done;
    }
    for (Py_ssize_t r = 0; r < nreaders; r++) {
        PyObject *t = PyTuple_GET_ITEM(readers, r);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4
            || Py_TYPE(PyTuple_GET_ITEM(t, 0)) != &IndexType
            || !PyLong_Check(PyTuple_GET_ITEM(t, 1))) {
            PyErr_SetString(PyExc_TypeError, "read_many: readers must be (Index, fd, check, "
                            "on_read) tuples");
            goto done;
        }
    }
    char *base = pb.buf;
    for (; k < end; k++) {
        if (slot[k] < 0 || slot[k] >= nreaders) {
            PyErr_SetString(PyExc_IndexError, "read_many: reader slot out of range");
            goto done;
        }
        PyObject *t = PyTuple_GET_ITEM(readers, slot[k]);
        IndexObject *ix = (IndexObject *)PyTuple_GET_ITEM(t, 0);
        int fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
        if (fd == -1 && PyErr_Occurred()) {
            goto done;
        }
        Span sp;
        int plain = span_of(ix, (Py_ssize_t)loc[k], &sp);
        if (plain < 0) {
            PyErr_Clear(); /* the caller's read raises it */
        }
        if (plain <= 0 || sp.hi <= sp.lo || sp.hi - sp.lo >= BIG_READ
            || !rows_inside(ix, &sp, (uint64_t)sp.lo, (uint64_t)sp.hi)) {
            break;
        }
        Py_ssize_t off = (used + 63) & ~(Py_ssize_t)63, want = (Py_ssize_t)(sp.hi - sp.lo);
        if (off > pb.len || want > pb.len - off) {
            break; /* no room left here */
        }
        ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        do {
            got = pread(fd, base + off, (size_t)want, (off_t)sp.lo);
        } while (got < 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
        if (got != want) {
            break; /* an error or a short read: the caller's read meets it again */
        }
        PyObject *sample = cut_sample(ix, &sp, base + off, (uint64_t)sp.lo, PyTuple_GET_ITEM(t, 2),
                                      PyTuple_GET_ITEM(t, 3), want, view, voff + off, min_bytes);
        if (sample == NULL) {
            goto done;
        }
        if (!PyDict_Check(sample)) { /* a checksum mismatch, or a key that is not UTF-8 */
            Py_DECREF(sample);
            break;
        }
        int bad = PyList_Append(out, sample);
        Py_DECREF(sample);
        if (bad < 0) {
            goto done;
        }
        used = off + want;
    }
    result = Py_BuildValue("(nn)", k, (used + 63) & ~(Py_ssize_t)63);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&local);
    PyBuffer_Release(&slots);
    return result;
}

static PyObject *base_name; /* "base", interned */

static PyObject *
field_rows(PyObject *mod, PyObject *args)
{
    PyObject *items, *base, *out_obj;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "O!OnnO", &PyList_Type, &items, &base, &start, &end, &out_obj)) {
        return NULL;
    }
    Py_buffer bb, ob;
    if (PyObject_GetBuffer(base, &bb, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&bb);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    int ok = start >= 0 && start <= end && end <= bb.len && ob.len >= n * 3 * 8;
    const char *lo = (const char *)bb.buf + start, *hi = (const char *)bb.buf + end;
    int64_t *row = (int64_t *)ob.buf;
    for (Py_ssize_t k = 0; ok && k < n; k++) {
        PyObject *x = PyList_GET_ITEM(items, k);
        if (Py_TYPE(x) != Py_TYPE(base)) {
            ok = 0;
            break;
        }
        PyObject *owner = PyObject_GetAttr(x, base_name);
        if (owner == NULL) {
            PyErr_Clear();
        }
        Py_XDECREF(owner);
        if (owner != base) {
            ok = 0;
            break;
        }
        Py_buffer v;
        if (PyObject_GetBuffer(x, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        const char *p = (const char *)v.buf;
        ok = v.ndim == 1 && v.itemsize == 1 && v.format != NULL && strcmp(v.format, "B") == 0
             && p >= lo && p + v.len <= hi;
        if (ok) {
            row[3 * k] = 0;
            row[3 * k + 1] = (int64_t)(p - lo);
            row[3 * k + 2] = (int64_t)(p - lo + v.len);
        }
        PyBuffer_Release(&v);
    }
    PyBuffer_Release(&ob);
    PyBuffer_Release(&bb);
    return PyBool_FromLong(ok);
}

static PyMethodDef module_methods[] = {
    {"read_many", (PyCFunction)read_many, METH_VARARGS,
     "read_many(readers, slots, local, k, end, buf, view, voff, min_bytes, out) -> (k, used): "
     "samples k..end-1 "
     "read one pread each into buf, appended to out (see the module source)."},
    {"field_rows", (PyCFunction)field_rows, METH_VARARGS,
     "field_rows(items, base, start, end, out) -> bool: where a column of fields lies in base "
     "(see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shardio._sampleio",
    "One-preadv sample reads (shardio/_sampleio.c).", -1, module_methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__sampleio(void)
{
    if (PyType_Ready(&IndexType) < 0) {
        return NULL;
    }
    base_name = PyUnicode_InternFromString("base");
    if (base_name == NULL) {
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
