/* shardio._atomics: atomic loads/stores and futex calls on words inside a Python buffer.
 *
 * The shared-memory ring (shardio/ring.py) keeps its cursors and doorbell words in an mmap shared
 * between processes.  Python has no atomics and no futex, so these few functions provide them:
 *
 *   load_u64(buf, off)                    acquire load
 *   store_u64(buf, off, val)              release store
 *   load_u32(buf, off)                    seq_cst load
 *   store_u32(buf, off, val)              seq_cst store
 *   fetch_add_u32(buf, off, v)            seq_cst fetch-and-add; returns the old value (mod 2**32)
 *   fetch_add_u64(buf, off, v)            seq_cst fetch-and-add on a u64; returns the old value
 *   fence()                               seq_cst thread fence
 *   futex_wait(buf, off, expected, timeout_s=None) -> bool
 *                                         FUTEX_WAIT (shared, not PRIVATE: the word lives in memory
 *                                         mapped by several processes); the GIL is released while
 *                                         asleep.  False on timeout; True when woken, when the word
 *                                         no longer held `expected` (EAGAIN) or on a signal (EINTR,
 *                                         after running Python signal handlers).
 *   futex_wake(buf, off, n=1) -> int      FUTEX_WAKE, returns how many sleepers were woken
 *   buffer_offset(inner, outer) -> int    where inner's first byte lies in outer's buffer (both
 *                                         contiguous); ValueError when it is not inside.  Not an
 *                                         atomic: a fast pointer difference for shardio.sharedbytes
 *   privatize(buf, off, n) -> int         give the pages holding bytes [off, off + n) of `buf` (a
 *                                         shared mapping) private copies, at the same addresses:
 *                                         copy them to fresh anonymous memory, then mremap that
 *                                         over them (MREMAP_FIXED swaps the pages in one step, so
 *                                         a reader sees the old or the new page, with the same
 *                                         bytes).  Returns the bytes swapped (whole pages).  For
 *                                         shardio.ring's Ring.detach; not an atomic either
 *
 * `buf` is any C-contiguous buffer (mmap, memoryview, bytearray); it must be writable except for
 * the loads.  `off` is a byte offset; the word must lie inside the buffer and its address must be
 * aligned to the word size, otherwise ValueError.  The GCC __atomic builtins give the stated
 * orderings on x86-64 and aarch64 alike.  The buffer stays acquired for the duration of each
 * call, so an mmap cannot be closed under a sleeping futex_wait.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Acquire `buf` and return the address of the `width`-byte word at offset `off_obj`.
 * On success the caller must PyBuffer_Release(view). */
static void *
word_addr(PyObject *buf, PyObject *off_obj, Py_ssize_t width, int writable, Py_buffer *view)
{
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (PyObject_GetBuffer(buf, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                                               : PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (off < 0 || off > view->len - width) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd out of range for a %zd-byte word in a buffer of %zd bytes",
                     off, width, view->len);
        PyBuffer_Release(view);
        return NULL;
    }
    char *addr = (char *)view->buf + off;
    if (((uintptr_t)addr) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd is not %zd-byte aligned (atomics need naturally aligned words)",
                     off, width);
        PyBuffer_Release(view);
        return NULL;
    }
    return addr;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t min, Py_ssize_t max)
{
    if (nargs < min || nargs > max) {
        if (min == max) {
            PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, min, nargs);
        }
        else {
            PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name, min,
                         max, nargs);
        }
        return -1;
    }
    return 0;
}

/* An unsigned integer that must fit in `bits` bits (32 or 64). */
static int
as_unsigned(PyObject *obj, int bits, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (bits == 32 && v > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "value %llu does not fit in 32 bits", v);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
load_u64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs("load_u64", nargs, 2, 2) < 0) {
        return NULL;
    }
    uint64_t *p = word_addr(args[0], args[1], 8, 0, &view);
    if (p == NULL) {
        return NULL;
    }
    uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *
store_u64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    if (check_nargs("store_u64", nargs, 3, 3) < 0 || as_unsigned(args[2], 64, &v) < 0) {
        return NULL;
    }
    uint64_t *p = word_addr(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
load_u32(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs("load_u32", nargs, 2, 2) < 0) {
        return NULL;
    }
    uint32_t *p = word_addr(args[0], args[1], 4, 0, &view);
    if (p == NULL) {
        return NULL;
    }
    uint32_t v = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(v);
}

static PyObject *
store_u32(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    if (check_nargs("store_u32", nargs, 3, 3) < 0 || as_unsigned(args[2], 32, &v) < 0) {
        return NULL;
    }
    uint32_t *p = word_addr(args[0], args[1], 4, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    __atomic_store_n(p, (uint32_t)v, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
fetch_add_u32(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    if (check_nargs("fetch_add_u32", nargs, 3, 3) < 0 || as_unsigned(args[2], 32, &v) < 0) {
        return NULL;
    }
    uint32_t *p = word_addr(args[0], args[1], 4, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    uint32_t old = __atomic_fetch_add(p, (uint32_t)v, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(old);
}

static PyObject *
fetch_add_u64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t v;
    if (check_nargs("fetch_add_u64", nargs, 3, 3) < 0 || as_unsigned(args[2], 64, &v) < 0) {
        return NULL;
    }
    uint64_t *p = word_addr(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    uint64_t old = __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(old);
}

static PyObject *
buffer_offset(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer inner, outer;
    if (check_nargs("buffer_offset", nargs, 2, 2) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &inner, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &outer, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&inner);
        return NULL;
    }
    char *a = (char *)inner.buf, *b = (char *)outer.buf;
    Py_ssize_t off = (Py_ssize_t)(a - b);
    int inside = a >= b && off + inner.len <= outer.len;
    PyBuffer_Release(&inner);
    PyBuffer_Release(&outer);
    if (!inside) {
        PyErr_SetString(PyExc_ValueError, "buffer_offset: inner buffer is not inside outer");
        return NULL;
    }
    return PyLong_FromSsize_t(off);
}

static PyObject *
fence(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("fence", nargs, 0, 0) < 0) {
        return NULL;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
futex_wait(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    uint64_t expected;
    struct timespec ts, *tsp = NULL;
    if (check_nargs("futex_wait", nargs, 3, 4) < 0 || as_unsigned(args[2], 32, &expected) < 0) {
        return NULL;
    }
    if (nargs == 4 && args[3] != Py_None) {
        double t = PyFloat_AsDouble(args[3]);
        if (t == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        if (!(t >= 0.0) || isinf(t)) {
            PyErr_Format(PyExc_ValueError,
                         "timeout_s must be a finite number >= 0 or None, got %R", args[3]);
            return NULL;
        }
        if (t > 1e9) {
            t = 1e9; /* ~31 years: effectively forever, and no time_t overflow */
        }
        double whole = floor(t);
        ts.tv_sec = (time_t)whole;
        ts.tv_nsec = (long)((t - whole) * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_nsec = 999999999L;
        }
        tsp = &ts;
    }
    uint32_t *p = word_addr(args[0], args[1], 4, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    long rc;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, p, FUTEX_WAIT, (uint32_t)expected, tsp, NULL, 0);
    if (rc == -1) {
        err = errno;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc == 0 || err == EAGAIN) {
        Py_RETURN_TRUE;
    }
    if (err == ETIMEDOUT) {
        Py_RETURN_FALSE;
    }
    if (err == EINTR) {
        /* Let Ctrl-C and other Python signal handlers run now rather than after the next wake. */
        if (PyErr_CheckSignals() < 0) {
            return NULL;
        }
        Py_RETURN_TRUE;
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *
futex_wake(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    long n = 1;
    if (check_nargs("futex_wake", nargs, 2, 3) < 0) {
        return NULL;
    }
    if (nargs == 3) {
        n = PyLong_AsLong(args[2]);
        if (n == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (n < 1) {
            PyErr_Format(PyExc_ValueError, "n must be >= 1, got %ld", n);
            return NULL;
        }
        if (n > INT_MAX) {
            n = INT_MAX;
        }
    }
    uint32_t *p = word_addr(args[0], args[1], 4, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    long rc = syscall(SYS_futex, p, FUTEX_WAKE, (int)n, NULL, NULL, 0);
    int err = errno;
    PyBuffer_Release(&view);
    if (rc == -1) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
}

static PyObject *
privatize(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (check_nargs("privatize", nargs, 3, 3) < 0) {
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(args[1]);
    if (off == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t base = (uintptr_t)view.buf;
    if (off < 0 || n <= 0 || off > view.len - n || base % page != 0) {
        PyErr_Format(PyExc_ValueError,
                     "privatize: bytes [%zd, %zd) are not inside the page-aligned %zd-byte buffer",
                     off, off + n, view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    uintptr_t p0 = (base + (uintptr_t)off) & ~(page - 1);
    uintptr_t p1 = (base + (uintptr_t)off + (uintptr_t)n + page - 1) & ~(page - 1);
    size_t len = (size_t)(p1 - p0);
    void *fresh = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fresh == MAP_FAILED) {
        PyBuffer_Release(&view);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    memcpy(fresh, (void *)p0, len);
    void *moved = mremap(fresh, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)p0);
    int err = errno;
    PyBuffer_Release(&view);
    if (moved == MAP_FAILED) {
        munmap(fresh, len);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSize_t(len);
}

static PyMethodDef atomics_methods[] = {
    {"load_u64", (PyCFunction)(void (*)(void))load_u64, METH_FASTCALL,
     "load_u64(buf, off) -> int\n\nAcquire load of the aligned u64 at byte offset off."},
    {"store_u64", (PyCFunction)(void (*)(void))store_u64, METH_FASTCALL,
     "store_u64(buf, off, val)\n\nRelease store of the aligned u64 at byte offset off."},
    {"load_u32", (PyCFunction)(void (*)(void))load_u32, METH_FASTCALL,
     "load_u32(buf, off) -> int\n\nSequentially consistent load of the aligned u32 at off."},
    {"store_u32", (PyCFunction)(void (*)(void))store_u32, METH_FASTCALL,
     "store_u32(buf, off, val)\n\nSequentially consistent store of the aligned u32 at off."},
    {"fetch_add_u32", (PyCFunction)(void (*)(void))fetch_add_u32, METH_FASTCALL,
     "fetch_add_u32(buf, off, v) -> int\n\nSequentially consistent add to the u32 at off; returns "
     "the old value."},
    {"fetch_add_u64", (PyCFunction)(void (*)(void))fetch_add_u64, METH_FASTCALL,
     "fetch_add_u64(buf, off, v) -> int\n\nSequentially consistent add to the u64 at off; returns "
     "the old value."},
    {"buffer_offset", (PyCFunction)(void (*)(void))buffer_offset, METH_FASTCALL,
     "buffer_offset(inner, outer) -> int\n\nByte offset of inner's buffer inside outer's."},
    {"fence", (PyCFunction)(void (*)(void))fence, METH_FASTCALL,
     "fence()\n\nSequentially consistent thread fence."},
    {"futex_wait", (PyCFunction)(void (*)(void))futex_wait, METH_FASTCALL,
     "futex_wait(buf, off, expected, timeout_s=None) -> bool\n\nSleep while the u32 at off equals "
     "expected (shared FUTEX_WAIT, GIL released).\nReturns False on timeout, True otherwise "
     "(woken, value changed, or interrupted by a signal)."},
    {"futex_wake", (PyCFunction)(void (*)(void))futex_wake, METH_FASTCALL,
     "futex_wake(buf, off, n=1) -> int\n\nWake up to n sleepers on the u32 at off (shared "
     "FUTEX_WAKE); returns how many were woken."},
    {"privatize", (PyCFunction)(void (*)(void))privatize, METH_FASTCALL,
     "privatize(buf, off, n) -> int\n\nGive the pages holding bytes [off, off + n) of the "
     "shared mapping buf private copies at the same addresses; returns the bytes swapped."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shardio._atomics",
    .m_doc = "Atomic loads/stores and shared futex wait/wake on words inside a Python buffer.",
    .m_size = 0,
    .m_methods = atomics_methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    return PyModuleDef_Init(&atomics_module);
}
