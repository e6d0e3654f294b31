/* shardio._tarpack: the hot loop of `shardio pack` for plain members (tar, and HDF5's payload).
 *
 *   fill(samples, start, names, label_field, check, base_pos, base_key, base_row, cap, out,
 *        headers=True, threads=1, delays=None)
 *       -> (stop, slow, length, data, keys, key_offsets, starts, name_ids, offsets, lengths,
 *           checksums)
 *
 * Reads the files of samples[start:stop] (shardio._scan.Sample objects: .key, .files as
 * (field, path, size, mtime_ns) tuples in field order, .label an int or None) and lays out their
 * tar members, `length` bytes, in the writable buffer `out` (data is None) or, when they do not
 * fit there or `out` is None, in a new bytes object `data`: byte for byte what
 * shardio.formats.tar.TarWriter.add writes
 * for them: per field a 512-byte ustar header (mode 0444, uid/gid 0, mtime 0, name
 * "<key>.<field>"), the data, then zero padding to the next 512-byte boundary.  The label, when
 * there is one, is the field `label_field` holding str(label), placed in field-name order.
 *
 * Index rows come back as packed columns ready for array.frombytes: key_offsets ("Q", each
 * sample's key end, counted from base_key), starts ("Q", each sample's first row, counted from
 * base_row), name_ids ("H", from the dict `names`, which gains new field names in order of first
 * use), offsets ("Q", each member's data offset in the shard, counted from base_pos), lengths
 * ("Q") and checksums ("Q", `check` called on a memoryview of each member's data).
 *
 * It stops before a sample it does not handle and returns slow=True there; the caller writes
 * that sample with the Python code, which raises the typed error or applies --on-error, and calls
 * again after it.  Not handled: a key or field name that is not ASCII or makes a member name over
 * 100 bytes (pax headers), a size over the ustar limit, a label that is not an int, a field named
 * like the label, a path that is not valid UTF-8, a file that cannot be opened or read, and a file
 * that grew since the scan.  A file that shrank is written at its new size, as the Python code
 * does.  It also stops (slow=False) once the batch holds `cap` bytes (at least one sample is
 * taken).  The files are read with the GIL released; names are registered only for the samples
 * returned, so the index is the same whichever code wrote a sample.
 *
 * With headers=False the members' data are laid out back to back, with no header and no padding:
 * an HDF5 shard's /payload, byte for byte what shardio.formats.hdf5.Hdf5Writer.add collects.  The
 * tar-only limits (ustar name length and size) then do not apply.
 *
 * With threads > 1 (a slow source: a parallel filesystem's open and read are round trips), the
 * batch's samples are handed out one at a time to that many reader threads (at most
 * MAX_READERS; created and joined inside the call, so none outlives it), each reading its
 * sample's files into the places the scan's sizes give them.  The calling thread then goes
 * through the batch in order and stops at the first sample with a file not read at exactly its
 * scan size (unreadable, grown or shrunk: slow=True there, as above, and the Python code writes
 * it; the serial loop writes a shrunk file itself), then writes the headers and padding.  The
 * bytes are the same as the serial loop's.  `delays` (a float64 buffer, one per sample of
 * `samples`): seconds each sample's reader sleeps before reading it, a simulated slow store's
 * latency (shardio._inject, SHARDIO_SLOW_READS), so the C loop stays on under simulation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 512
#define USTAR_SIZE_LIMIT 8589934592LL /* 8**11 */
#define LABEL_MAX 40
#define MAX_READERS 64 /* reader threads of one fill call, at most */
/* A read returns at most ~2 GiB (Linux: 2 GiB less a page): a short read that long may be that
 * cap rather than the end of the file (shardio._fsutil.BIG_READ). */
#define BIG_READ (1LL << 30)

typedef struct {
    PyObject *path;        /* owned reference (NULL for the label member) */
    const char *cpath;     /* UTF-8 inside `path` */
    Py_ssize_t dir_len;    /* bytes of cpath before its last '/', -1 when none */
    PyObject *field;       /* owned reference */
    const char *fname;
    Py_ssize_t fname_len;
    long long size;        /* the scan's size; the label's length */
    char label[LABEL_MAX]; /* the label member's data */
    long long got;         /* bytes written for this member (phase 2) */
    Py_ssize_t data_off;   /* offset of its data inside the batch (phase 2) */
} Member;

typedef struct {
    PyObject *key;       /* owned reference */
    const char *ckey;
    Py_ssize_t key_len;
    Py_ssize_t first;    /* its first member */
    Py_ssize_t count;    /* its members */
    Py_ssize_t out_off;  /* where its first header starts in the batch (phase 2) */
} SampleRec;

typedef struct {
    Member *m;
    Py_ssize_t n, cap;
    SampleRec *s;
    Py_ssize_t ns, scap;
} Batch;

static void
batch_free(Batch *b)
{
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Py_XDECREF(b->m[i].path);
        Py_XDECREF(b->m[i].field);
    }
    for (Py_ssize_t i = 0; i < b->ns; i++) {
        Py_XDECREF(b->s[i].key);
    }
    PyMem_Free(b->m);
    PyMem_Free(b->s);
}

static Member *
batch_member(Batch *b)
{
    if (b->n == b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 256;
        Member *m = PyMem_Realloc(b->m, (size_t)cap * sizeof(Member));
        if (m == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        b->m = m;
        b->cap = cap;
    }
    Member *m = &b->m[b->n++];
    memset(m, 0, sizeof(*m));
    return m;
}

static Py_ssize_t
padded(long long n)
{
    return (Py_ssize_t)(((n + BLOCK - 1) / BLOCK) * BLOCK);
}

/* A str whose characters are all ASCII (then PyUnicode_DATA holds its bytes). */
static int
ascii_str(PyObject *s)
{
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) { /* legacy strings (3.11 and older) */
        PyErr_Clear();
        return 0;
    }
#endif
    return PyUnicode_IS_ASCII(s);
}

/* Append a member named <key>.<fname>: a file's (label NULL; the caller sets its path) or the
 * label's (its text).  1: added; 0: the name needs a pax header (the Python code writes it);
 * -1: out of memory. */
static int
push_member(Batch *b, PyObject *field, const char *fname, Py_ssize_t fname_len, long long size,
            const char *label, Py_ssize_t key_len, int headers, long long *added)
{
    if (headers && key_len + 1 + fname_len > 100) {
        return 0;
    }
    Member *m = batch_member(b);
    if (m == NULL) {
        return -1;
    }
    Py_INCREF(field);
    m->field = field;
    m->fname = fname;
    m->fname_len = fname_len;
    m->size = size;
    if (label != NULL) {
        memcpy(m->label, label, (size_t)size);
    }
    *added += headers ? BLOCK + padded(size) : size;
    return 1;
}

/* Add sample `obj`'s members to the batch.  1: added; 0: the sample needs the Python code (the
 * batch is left as it was); -1: a Python error (not a property of the sample). */
static int
take_sample(Batch *b, PyObject *obj, PyObject *label_field, int headers, long long *bytes)
{
    Py_ssize_t mark = b->n;
    int rc = 0;
    PyObject *key = NULL, *files = NULL, *label = NULL;
    const char *lf;
    Py_ssize_t lf_len;

    key = PyObject_GetAttrString(obj, "key");
    if (key == NULL) {
        return -1;
    }
    files = PyObject_GetAttrString(obj, "files");
    if (files == NULL) {
        rc = -1;
        goto done;
    }
    label = PyObject_GetAttrString(obj, "label");
    if (label == NULL) {
        rc = -1;
        goto done;
    }
    if (!PyUnicode_Check(key) || !ascii_str(key) || !PyList_Check(files)) {
        goto done;
    }
    Py_ssize_t key_len = PyUnicode_GET_LENGTH(key);
    const char *ckey = (const char *)PyUnicode_DATA(key);
    lf = PyUnicode_AsUTF8AndSize(label_field, &lf_len);
    if (lf == NULL) {
        rc = -1;
        goto done;
    }
    int with_label = label != Py_None;
    char label_text[LABEL_MAX];
    Py_ssize_t label_len = 0;
    if (with_label) {
        if (!PyLong_CheckExact(label)) {
            goto done;
        }
        long long v = PyLong_AsLongLong(label);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto done;
        }
        label_len = snprintf(label_text, sizeof(label_text), "%lld", v);
    }
    Py_ssize_t nfiles = PyList_GET_SIZE(files);
    long long added = 0;
    int sorts = with_label; /* the Python code sorts the fields only when it adds a label */
    PyObject *prev = NULL;
    for (Py_ssize_t i = 0; i <= nfiles; i++) {
        PyObject *field = NULL, *path = NULL;
        const char *fname = NULL;
        Py_ssize_t fname_len = 0;
        long long size = 0;
        if (i < nfiles) {
            PyObject *t = PyList_GET_ITEM(files, i);
            if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 3) {
                goto undo;
            }
            field = PyTuple_GET_ITEM(t, 0);
            path = PyTuple_GET_ITEM(t, 1);
            PyObject *size_obj = PyTuple_GET_ITEM(t, 2);
            if (!PyUnicode_Check(field) || !ascii_str(field) || !PyUnicode_Check(path)
                || !PyLong_Check(size_obj)) {
                goto undo;
            }
            fname = (const char *)PyUnicode_DATA(field);
            fname_len = PyUnicode_GET_LENGTH(field);
            size = PyLong_AsLongLong(size_obj);
            if (size == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                goto undo;
            }
            if (size < 0 || (headers && size >= USTAR_SIZE_LIMIT)) {
                goto undo;
            }
            if (sorts) {
                if (prev != NULL && PyUnicode_Compare(prev, field) >= 0) {
                    goto undo; /* not in field order: the Python code sorts it */
                }
                prev = field;
            }
            if (with_label) {
                int c = PyUnicode_Compare(field, label_field);
                if (c == 0) {
                    goto undo; /* a file field named like the label: the Python code decides */
                }
                if (c > 0) { /* the label goes first, in field-name order */
                    int r = push_member(b, label_field, lf, lf_len, label_len, label_text, key_len,
                                        headers, &added);
                    if (r <= 0) {
                        rc = r;
                        goto undo;
                    }
                    with_label = 0;
                }
            }
        }
        else if (with_label) {
            int r = push_member(b, label_field, lf, lf_len, label_len, label_text, key_len,
                                headers, &added);
            if (r <= 0) {
                rc = r;
                goto undo;
            }
            break;
        }
        else {
            break;
        }
        int r = push_member(b, field, fname, fname_len, size, NULL, key_len, headers, &added);
        if (r <= 0) {
            rc = r;
            goto undo;
        }
        Member *m = &b->m[b->n - 1];
        Py_ssize_t plen;
        const char *cpath = PyUnicode_AsUTF8AndSize(path, &plen);
        if (cpath == NULL || (Py_ssize_t)strlen(cpath) != plen) {
            PyErr_Clear(); /* surrogates or NUL: the Python code reports it */
            goto undo;
        }
        Py_INCREF(path);
        m->path = path;
        m->cpath = cpath;
        const char *slash = strrchr(cpath, '/');
        m->dir_len = slash == NULL ? -1 : (Py_ssize_t)(slash - cpath);
    }
    if (b->ns == b->scap) {
        Py_ssize_t cap = b->scap ? b->scap * 2 : 128;
        SampleRec *s = PyMem_Realloc(b->s, (size_t)cap * sizeof(SampleRec));
        if (s == NULL) {
            PyErr_NoMemory();
            rc = -1;
            goto undo;
        }
        b->s = s;
        b->scap = cap;
    }
    SampleRec *rec = &b->s[b->ns++];
    Py_INCREF(key);
    rec->key = key;
    rec->ckey = ckey;
    rec->key_len = key_len;
    rec->first = mark;
    rec->count = b->n - mark;
    rec->out_off = 0;
    *bytes += added;
    rc = 1;
    goto done;
undo:
    for (Py_ssize_t i = mark; i < b->n; i++) {
        Py_XDECREF(b->m[i].path);
        Py_XDECREF(b->m[i].field);
    }
    b->n = mark;
done:
    Py_DECREF(key);
    Py_XDECREF(files);
    Py_XDECREF(label);
    return rc;
}

static void
octal(char *dst, int width, unsigned long long v)
{
    /* width-1 octal digits, zero-filled, then NUL (Python's b"%0*o\0") */
    dst[width - 1] = '\0';
    for (int i = width - 2; i >= 0; i--) {
        dst[i] = (char)('0' + (v & 7));
        v >>= 3;
    }
}

static void
write_header(char *h, const char *key, Py_ssize_t key_len, const char *fname,
             Py_ssize_t fname_len, long long size)
{
    memset(h, 0, BLOCK);
    memcpy(h, key, (size_t)key_len);
    h[key_len] = '.';
    memcpy(h + key_len + 1, fname, (size_t)fname_len);
    octal(h + 100, 8, 0444);
    octal(h + 108, 8, 0);
    octal(h + 116, 8, 0);
    octal(h + 124, 12, (unsigned long long)size);
    octal(h + 136, 12, 0);
    memset(h + 148, ' ', 8);
    h[156] = '0';
    memcpy(h + 257, "ustar\0" "00", 8);
    unsigned int sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        sum += (unsigned char)h[i];
    }
    octal(h + 148, 7, sum); /* six digits and a NUL; h[155] stays ' ' */
}

/* Read `m`'s file: up to m->size bytes into dst, then one more into *spare (dst + m->size in the
 * serial loop, whose buffer has that room; a byte of the reader thread's own in the threaded
 * one, where the byte after dst is the next member's).  Returns the bytes read, or -1 when the
 * file cannot be read in full here (the Python code retries it). */
static long long
read_member(Member *m, char *dst, char *spare, int *dfd, char *cur_dir, Py_ssize_t *cur_len)
{
    const char *name = m->cpath;
    int at = AT_FDCWD;
    if (m->dir_len > 0 && m->dir_len < PATH_MAX) {
        if (*cur_len != m->dir_len || memcmp(cur_dir, m->cpath, (size_t)m->dir_len) != 0) {
            if (*dfd >= 0) {
                close(*dfd);
            }
            memcpy(cur_dir, m->cpath, (size_t)m->dir_len);
            cur_dir[m->dir_len] = '\0';
            *cur_len = m->dir_len;
            *dfd = open(cur_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        }
        if (*dfd >= 0) {
            at = *dfd;
            name = m->cpath + m->dir_len + 1;
        }
    }
    /* O_NONBLOCK: a file the scan saw as regular may since have been replaced by a FIFO,
     * whose open would wait for a writer for ever (no effect on a regular file). */
    int fd = openat(at, name, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        return -1;
    }
    /* One read, as the Python code does: a short read of a regular file is its end (unless it
     * is the kernel's cap on one read: BIG_READ), and m->size + 1 bytes mean it grew since the
     * scan. */
    long long total = 0;
    for (;;) {
        struct iovec iov[2];
        int cnt = 0;
        if (spare == dst + m->size) { /* one buffer: a plain read's cost */
            iov[cnt++] = (struct iovec){dst + total, (size_t)(m->size + 1 - total)};
        }
        else {
            if (total < m->size) {
                iov[cnt++] = (struct iovec){dst + total, (size_t)(m->size - total)};
            }
            iov[cnt++] = (struct iovec){spare, 1};
        }
        ssize_t got;
        do {
            got = readv(fd, iov, cnt);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            total = -1;
            break;
        }
        total += got;
        if (got < BIG_READ || total > m->size) {
            break;
        }
    }
    if (total >= 0 && total < m->size) { /* shrunk, or no longer a regular file (a FIFO
                                            * without a writer reads as empty): Python tells */
        struct stat st;
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            total = -1;
        }
    }
    close(fd);
    return total < 0 || total > m->size ? -1 : total;
}

/* Sleep `seconds` (a simulated slow store's delay: shardio._inject). */
static void
sleep_for(double seconds)
{
    if (!(seconds > 0)) {
        return;
    }
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

/* The threaded phase 2: samples handed out one at a time to `threads` readers. */
typedef struct {
    Batch *b;
    char *buf;
    const double *delays; /* per sample of the batch, or NULL */
    Py_ssize_t next;      /* the next sample to hand out (atomic) */
} Pool;

/* Read the members of the pool's samples into their places, until none is left.  A member's
 * `got` is its size, or -1 when its file could not be read in full at the scan's size (failed,
 * shrank or grew: the Python code reads that sample). */
static void *
pool_reader(void *arg)
{
    Pool *p = arg;
    int dfd = -1;
    char cur_dir[PATH_MAX];
    Py_ssize_t cur_len = -1;
    for (;;) {
        Py_ssize_t k = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (k >= p->b->ns) {
            break;
        }
        SampleRec *rec = &p->b->s[k];
        if (p->delays != NULL) {
            sleep_for(p->delays[k]);
        }
        for (Py_ssize_t j = rec->first; j < rec->first + rec->count; j++) {
            Member *m = &p->b->m[j];
            char *dst = p->buf + m->data_off;
            if (m->path == NULL) {
                memcpy(dst, m->label, (size_t)m->size);
                m->got = m->size;
                continue;
            }
            char spare; /* (the byte after dst is the next member's, another thread's) */
            long long got = read_member(m, dst, &spare, &dfd, cur_dir, &cur_len);
            m->got = got == m->size ? m->size : -1;
        }
    }
    if (dfd >= 0) {
        close(dfd);
    }
    return NULL;
}

/* Phase 2 with `threads` readers: the members' places come from the scan's sizes.  Returns the
 * bytes laid out for the first *done_samples samples, which the serial pass then checks (a
 * member not read at its size stops the batch there) and completes (headers, padding). */
static Py_ssize_t
read_threaded(Batch *b, char *buf, int headers, int threads, const double *delays,
              Py_ssize_t *done_samples, int *slow)
{
    Py_ssize_t off = 0, head = headers ? BLOCK : 0;
    for (Py_ssize_t k = 0; k < b->ns; k++) {
        SampleRec *rec = &b->s[k];
        rec->out_off = off;
        for (Py_ssize_t j = rec->first; j < rec->first + rec->count; j++) {
            Member *m = &b->m[j];
            m->data_off = off + head;
            off += headers ? BLOCK + padded(m->size) : (Py_ssize_t)m->size;
        }
    }
    Pool pool = {b, buf, delays, 0};
    if (threads > b->ns) {
        threads = (int)b->ns;
    }
    pthread_t tids[MAX_READERS];
    int started = 0;
    for (; started < threads - 1 && started < MAX_READERS; started++) {
        if (pthread_create(&tids[started], NULL, pool_reader, &pool) != 0) {
            break; /* fewer threads: this one reads the rest */
        }
    }
    pool_reader(&pool);
    for (int t = 0; t < started; t++) {
        pthread_join(tids[t], NULL);
    }
    off = 0;
    for (Py_ssize_t k = 0; k < b->ns; k++) {
        SampleRec *rec = &b->s[k];
        Py_ssize_t j = rec->first;
        for (; j < rec->first + rec->count && b->m[j].got >= 0; j++) {
        }
        if (j < rec->first + rec->count) {
            *done_samples = k;
            *slow = 1;
            return rec->out_off;
        }
        for (j = rec->first; j < rec->first + rec->count; j++) {
            Member *m = &b->m[j];
            if (headers) {
                write_header(buf + m->data_off - BLOCK, rec->ckey, rec->key_len, m->fname,
                             m->fname_len, m->got);
                memset(buf + m->data_off + m->got, 0, (size_t)(padded(m->got) - m->got));
            }
        }
        off = b->m[rec->first + rec->count - 1].data_off + (Py_ssize_t)(
            headers ? padded(b->m[rec->first + rec->count - 1].got)
                    : b->m[rec->first + rec->count - 1].got);
    }
    *done_samples = b->ns;
    return off;
}

static PyObject *
tarpack_fill(PyObject *self, PyObject *args)
{
    PyObject *samples, *names, *label_field, *check, *out;
    Py_ssize_t start;
    long long base_pos, base_key, base_row, cap;
    int headers = 1, threads = 1;
    PyObject *delays_obj = Py_None;
    if (!PyArg_ParseTuple(args, "O!nO!UOLLLLO|piO", &PyList_Type, &samples, &start, &PyDict_Type,
                          &names, &label_field, &check, &base_pos, &base_key, &base_row, &cap,
                          &out, &headers, &threads, &delays_obj)) {
        return NULL;
    }
    Py_ssize_t total = PyList_GET_SIZE(samples);
    if (start < 0 || start > total) {
        PyErr_SetString(PyExc_ValueError, "start out of range");
        return NULL;
    }
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "threads must be >= 1");
        return NULL;
    }
    if (threads > MAX_READERS) {
        threads = MAX_READERS; /* (--scan-threads has no upper bound) */
    }
    Py_buffer delays_view = {0};
    const double *delays = NULL;
    if (delays_obj != Py_None) {
        if (PyObject_GetBuffer(delays_obj, &delays_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            return NULL;
        }
        if (delays_view.itemsize != 8 || delays_view.format == NULL
            || strcmp(delays_view.format, "d") != 0 || delays_view.len / 8 != total) {
            PyBuffer_Release(&delays_view);
            PyErr_SetString(PyExc_ValueError, "delays must be a buffer of one float64 (\"d\") "
                            "per sample");
            return NULL;
        }
        delays = (const double *)delays_view.buf + start;
    }
    Batch b = {0};
    Py_buffer view = {0};
    int have_view = 0;
    PyObject *data = NULL, *result = NULL;
    long long bytes = 0;
    int slow = 0;
    Py_ssize_t i = start;
    /* Phase 1 (GIL held): collect the members of the samples that fit in `cap`. */
    for (; i < total; i++) {
        if (b.ns > 0 && bytes >= cap) {
            break;
        }
        int r = take_sample(&b, PyList_GET_ITEM(samples, i), label_field, headers, &bytes);
        if (r < 0) {
            goto error;
        }
        if (r == 0) {
            slow = 1;
            break;
        }
    }
    char *buf;
    if (out != Py_None) {
        if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto error;
        }
        have_view = 1;
        if (view.len < (Py_ssize_t)bytes + 1) { /* a sample larger than `out`: a bytes of its own */
            PyBuffer_Release(&view);
            have_view = 0;
        }
    }
    if (have_view) {
        buf = view.buf;
    }
    else {
        data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bytes + 1);
        if (data == NULL) {
            goto error;
        }
        buf = PyBytes_AS_STRING(data);
    }
    Py_ssize_t off = 0, done_samples = b.ns;
    Py_ssize_t head = headers ? BLOCK : 0;
    /* Phase 2 (GIL released): read the files and lay out the members. */
    Py_BEGIN_ALLOW_THREADS
    int dfd = -1;
    char cur_dir[PATH_MAX];
    Py_ssize_t cur_len = -1;
    if (threads > 1 && b.ns > 1) {
        off = read_threaded(&b, buf, headers, threads, delays, &done_samples, &slow);
    }
    for (Py_ssize_t k = 0; !(threads > 1 && b.ns > 1) && k < b.ns; k++) {
        SampleRec *rec = &b.s[k];
        rec->out_off = off;
        int failed = 0;
        if (delays != NULL) {
            sleep_for(delays[k]);
        }
        for (Py_ssize_t j = rec->first; j < rec->first + rec->count; j++) {
            Member *m = &b.m[j];
            char *dst = buf + off + head;
            long long got;
            if (m->path == NULL) {
                memcpy(dst, m->label, (size_t)m->size);
                got = m->size;
            }
            else {
                got = read_member(m, dst, dst + m->size, &dfd, cur_dir, &cur_len);
                if (got < 0) {
                    failed = 1;
                    break;
                }
            }
            m->got = got;
            m->data_off = off + head;
            if (!headers) { /* packed back to back; the next member's read may overwrite the
                             * extra byte this one's read had room for */
                off += (Py_ssize_t)got;
                continue;
            }
            write_header(buf + off, rec->ckey, rec->key_len, m->fname, m->fname_len, got);
            Py_ssize_t p = padded(got);
            memset(dst + got, 0, (size_t)(p - got));
            off += BLOCK + p;
        }
        if (failed) {
            off = rec->out_off;
            done_samples = k;
            slow = 1;
            break;
        }
    }
    if (dfd >= 0) {
        close(dfd);
    }
    Py_END_ALLOW_THREADS
    Py_ssize_t written = done_samples; /* b.ns stays: batch_free releases every key taken */
    if (data != NULL) {
        if (_PyBytes_Resize(&data, off) < 0) {
            goto error;
        }
        buf = PyBytes_AS_STRING(data);
    }
    else {
        data = Py_None;
        Py_INCREF(data);
    }
    /* Phase 3 (GIL held): index columns and checksums of the samples written. */
    Py_ssize_t rows = written ? b.s[written - 1].first + b.s[written - 1].count : 0;
    Py_ssize_t key_bytes = 0;
    for (Py_ssize_t k = 0; k < written; k++) {
        key_bytes += b.s[k].key_len;
    }
    PyObject *keys = PyBytes_FromStringAndSize(NULL, key_bytes);
    PyObject *key_offsets = PyBytes_FromStringAndSize(NULL, written * 8);
    PyObject *starts = PyBytes_FromStringAndSize(NULL, written * 8);
    PyObject *name_ids = PyBytes_FromStringAndSize(NULL, rows * 2);
    PyObject *offsets = PyBytes_FromStringAndSize(NULL, rows * 8);
    PyObject *lengths = PyBytes_FromStringAndSize(NULL, rows * 8);
    PyObject *checksums = PyBytes_FromStringAndSize(NULL, rows * 8);
    if (!keys || !key_offsets || !starts || !name_ids || !offsets || !lengths || !checksums) {
        goto columns_error;
    }
    char *kp = PyBytes_AS_STRING(keys);
    uint64_t *ko = (uint64_t *)PyBytes_AS_STRING(key_offsets);
    uint64_t *st = (uint64_t *)PyBytes_AS_STRING(starts);
    uint16_t *ni = (uint16_t *)PyBytes_AS_STRING(name_ids);
    uint64_t *of = (uint64_t *)PyBytes_AS_STRING(offsets);
    uint64_t *ln = (uint64_t *)PyBytes_AS_STRING(lengths);
    uint64_t *ck = (uint64_t *)PyBytes_AS_STRING(checksums);
    uint64_t kpos = (uint64_t)base_key;
    for (Py_ssize_t k = 0; k < written; k++) {
        SampleRec *rec = &b.s[k];
        memcpy(kp, rec->ckey, (size_t)rec->key_len);
        kp += rec->key_len;
        kpos += (uint64_t)rec->key_len;
        ko[k] = kpos;
        st[k] = (uint64_t)base_row + (uint64_t)rec->first;
        for (Py_ssize_t j = rec->first; j < rec->first + rec->count; j++) {
            Member *m = &b.m[j];
            PyObject *id = PyDict_GetItemWithError(names, m->field);
            long v;
            if (id == NULL) {
                if (PyErr_Occurred()) {
                    goto columns_error;
                }
                v = (long)PyDict_GET_SIZE(names);
                PyObject *nv = PyLong_FromLong(v);
                if (nv == NULL || PyDict_SetItem(names, m->field, nv) < 0) {
                    Py_XDECREF(nv);
                    goto columns_error;
                }
                Py_DECREF(nv);
            }
            else {
                v = PyLong_AsLong(id);
                if (v == -1 && PyErr_Occurred()) {
                    goto columns_error;
                }
            }
            if (v < 0 || v > 0xFFFF) {
                PyErr_SetString(PyExc_OverflowError, "more than 65536 field names in one shard");
                goto columns_error;
            }
            ni[j] = (uint16_t)v;
            of[j] = (uint64_t)base_pos + (uint64_t)m->data_off;
            ln[j] = (uint64_t)m->got;
            PyObject *view = PyMemoryView_FromMemory(buf + m->data_off, (Py_ssize_t)m->got,
                                                     PyBUF_READ);
            if (view == NULL) {
                goto columns_error;
            }
            PyObject *c = PyObject_CallOneArg(check, view);
            Py_DECREF(view);
            if (c == NULL) {
                goto columns_error;
            }
            unsigned long long cv = PyLong_AsUnsignedLongLong(c);
            Py_DECREF(c);
            if (cv == (unsigned long long)-1 && PyErr_Occurred()) {
                goto columns_error;
            }
            ck[j] = (uint64_t)cv;
        }
    }
    result = Py_BuildValue("(nNnNNNNNNNN)", start + written, PyBool_FromLong(slow), off, data,
                           keys, key_offsets, starts, name_ids, offsets, lengths, checksums);
    data = NULL;
    if (have_view) {
        PyBuffer_Release(&view);
    }
    if (delays != NULL) {
        PyBuffer_Release(&delays_view);
    }
    batch_free(&b);
    return result;
columns_error:
    Py_XDECREF(keys);
    Py_XDECREF(key_offsets);
    Py_XDECREF(starts);
    Py_XDECREF(name_ids);
    Py_XDECREF(offsets);
    Py_XDECREF(lengths);
    Py_XDECREF(checksums);
error:
    Py_XDECREF(data);
    if (have_view) {
        PyBuffer_Release(&view);
    }
    if (delays != NULL) {
        PyBuffer_Release(&delays_view);
    }
    batch_free(&b);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fill", tarpack_fill, METH_VARARGS,
     "Read and lay out the tar members of a run of samples (see the module's source header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shardio._tarpack",
    "The hot loop of a tar pack in C (shardio/_tarpack.c).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__tarpack(void)
{
    return PyModule_Create(&module);
}
