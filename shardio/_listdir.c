/* shardio._listdir: one directory of a pack's source, listed and stat'ed in C.
 *
 *   list_dir(dfd, base, stop_field, probe, slow_s, utf8_names=False)
 *       -> None | False | (files, groups, subdirs)
 *
 * The common case of shardio._scan.Walk._list, faster and leaner than scandir plus
 * DirEntry.stat: one directory of 200,000 files is walked in 0.85 s with 111 MB of peak memory
 * against 1.7 s and 284 MB (measured 2026-11-30).
 * `dfd` is a descriptor of the directory, `base` its path with a trailing separator (a str).
 * Entries whose name starts with "." are left out.  Every other entry is stat'ed through
 * fstatat(dfd, name, 0) (links followed, as DirEntry.stat(follow_symlinks=True)).
 *
 * Returns `files` (the number of regular files), `groups`: a list of (stem, fields) sorted by
 * stem, one per stem (the name up to its first dot), `fields` a list of
 * (field, base + name, st_size, st_mtime_ns) sorted by field (the name after its first dot), and
 * `subdirs`: a list of (name, st_dev, st_ino) in directory order.  Exactly what the Python code
 * builds.
 *
 * Returns False when its first `probe` stats took `slow_s` seconds or more on average (0: never
 * timed): a slow store, where the scan fetches stats in threads instead.  A directory with
 * fewer entries is not timed (the scan times its stats again every 4,096 anyway).
 * Returns None, having changed nothing, for a directory it leaves to the Python code, which
 * raises the typed error or applies --on-error: a name that is not ASCII (with `utf8_names`,
 * one that is not valid UTF-8: the caller passes it when the filesystem encoding is UTF-8 with
 * surrogateescape, so that a valid name decodes as Python decodes it, and byte order is code
 * point order), an entry it cannot
 * stat (a broken link, a loop, no permission), one that is neither a regular file nor a
 * directory, a file with no extension, or a file whose field is `stop_field` (the label field,
 * when labels come from folders; None for none).  The listing and the stats run without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    char *name;       /* into the names arena */
    size_t len;
    size_t stem_len;  /* bytes before the first '.'; len when none */
    int is_dir;
    long long size, mtime_ns;
    unsigned long long dev, ino;
} Entry;

typedef struct {
    Entry *e;
    size_t n, cap;
    char *names;
    size_t used, room;
} Listing;

static void
listing_free(Listing *l)
{
    free(l->e);
    free(l->names);
}

/* Append a name; 0 on success, -1 on memory (the arena moves: names are fixed up after). */
static int
listing_add(Listing *l, const char *name, size_t len)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 256;
        Entry *e = realloc(l->e, cap * sizeof(Entry));
        if (e == NULL) {
            return -1;
        }
        l->e = e;
        l->cap = cap;
    }
    if (l->used + len + 1 > l->room) {
        size_t room = l->room ? 2 * l->room : 16384;
        while (room < l->used + len + 1) {
            room *= 2;
        }
        char *names = realloc(l->names, room);
        if (names == NULL) {
            return -1;
        }
        l->names = names;
        l->room = room;
    }
    memcpy(l->names + l->used, name, len + 1);
    Entry *e = &l->e[l->n++];
    memset(e, 0, sizeof(*e));
    e->name = (char *)(uintptr_t)l->used; /* an offset until the arena stops moving */
    e->len = len;
    l->used += len + 1;
    return 0;
}

enum { LIST_OK = 0, LIST_PYTHON = 1, LIST_ERRNO = 2, LIST_SLOW = 3 };

/* 1 when s[0:len] is UTF-8 that Python's strict decoder takes: no overlong form, no surrogate,
 * nothing above U+10FFFF. */
static int
utf8_valid(const unsigned char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t more;
        unsigned cp;
        if (c >= 0xC2 && c <= 0xDF) {
            more = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            more = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            more = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (len - i <= more) {
            return 0;
        }
        for (size_t k = 1; k <= more; k++) {
            unsigned d = s[i + k];
            if ((d & 0xC0) != 0x80) {
                return 0;
            }
            cp = (cp << 6) | (d & 0x3F);
        }
        if ((more == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF)))
                || (more == 3 && (cp < 0x10000 || cp > 0x10FFFF))) {
            return 0;
        }
        i += more + 1;
    }
    return 1;
}

static double
seconds_since(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/* List and stat `dfd`'s entries into `l` (no GIL needed).  LIST_PYTHON: leave the directory to
 * the Python code; LIST_SLOW: the first `probe` stats averaged `slow_s` or more; LIST_ERRNO: out
 * of memory (errno set). */
static int
list_entries(int dfd, const char *stop, size_t stop_len, size_t probe, double slow_s,
             int utf8_names, Listing *l)
{
    int fd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        return LIST_PYTHON;
    }
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        close(fd);
        return LIST_PYTHON;
    }
    int rc = LIST_OK;
    struct dirent *de;
    errno = 0;
    while ((de = readdir(d)) != NULL) {
        const char *name = de->d_name;
        if (name[0] == '.') {
            continue;
        }
        size_t len = strlen(name);
        for (size_t i = 0; i < len; i++) {
            if ((unsigned char)name[i] >= 0x80) {
                if (!utf8_names || !utf8_valid((const unsigned char *)name, len)) {
                    rc = LIST_PYTHON;
                    goto done;
                }
                break;
            }
        }
        if (listing_add(l, name, len) < 0) {
            rc = LIST_ERRNO;
            goto done;
        }
        errno = 0;
    }
    if (errno != 0) {
        rc = LIST_PYTHON;
        goto done;
    }
    for (size_t i = 0; i < l->n; i++) {
        l->e[i].name = l->names + (uintptr_t)l->e[i].name;
    }
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t i = 0; i < l->n; i++) {
        Entry *e = &l->e[i];
        if (i == probe && probe > 0 && seconds_since(&t0) >= slow_s * (double)probe) {
            rc = LIST_SLOW;
            break;
        }
        struct stat st;
        if (fstatat(dfd, e->name, &st, 0) != 0) {
            rc = LIST_PYTHON;
            break;
        }
        if (S_ISREG(st.st_mode)) {
            const char *dot = memchr(e->name, '.', e->len);
            if (dot == NULL) {
                rc = LIST_PYTHON;
                break;
            }
            e->stem_len = (size_t)(dot - e->name);
            if (stop != NULL && e->len - e->stem_len - 1 == stop_len
                    && memcmp(dot + 1, stop, stop_len) == 0) {
                rc = LIST_PYTHON;
                break;
            }
            e->size = (long long)st.st_size;
            e->mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
        } else if (S_ISDIR(st.st_mode)) {
            e->is_dir = 1;
            e->stem_len = e->len;
            e->dev = (unsigned long long)st.st_dev;
            e->ino = (unsigned long long)st.st_ino;
        } else {
            rc = LIST_PYTHON;
            break;
        }
    }
done:
    closedir(d);
    return rc;
}

/* Files first, by (stem, field): the order of Python's sort of the stems, then of each stem's
 * field names (valid UTF-8: byte order is code point order); then directories, by name. */
static int
by_stem_field(const void *pa, const void *pb)
{
    const Entry *a = pa, *b = pb;
    if (a->is_dir != b->is_dir) {
        return a->is_dir - b->is_dir;
    }
    size_t n = a->stem_len < b->stem_len ? a->stem_len : b->stem_len;
    int c = memcmp(a->name, b->name, n);
    if (c != 0) {
        return c;
    }
    if (a->stem_len != b->stem_len) {
        return a->stem_len < b->stem_len ? -1 : 1;
    }
    /* same stem: by field (after the dot); a directory's stem is its whole name */
    return strcmp(a->name + a->stem_len, b->name + b->stem_len);
}

static PyObject *
build(Listing *l, PyObject *base)
{
    PyObject *groups = PyList_New(0), *subdirs = PyList_New(0), *fields = NULL;
    PyObject *stem = NULL;
    Py_ssize_t files = 0;
    if (groups == NULL || subdirs == NULL) {
        goto error;
    }
    for (size_t i = 0; i < l->n; i++) {
        Entry *e = &l->e[i];
        if (e->is_dir) {
            PyObject *t = Py_BuildValue("(s#KK)", e->name, (Py_ssize_t)e->len, e->dev, e->ino);
            if (t == NULL || PyList_Append(subdirs, t) < 0) {
                Py_XDECREF(t);
                goto error;
            }
            Py_DECREF(t);
            continue;
        }
        files++;
        int first = i == 0 || l->e[i - 1].is_dir || l->e[i - 1].stem_len != e->stem_len
                    || memcmp(l->e[i - 1].name, e->name, e->stem_len) != 0;
        if (first) {
            Py_CLEAR(stem);
            Py_CLEAR(fields);
            stem = PyUnicode_FromStringAndSize(e->name, (Py_ssize_t)e->stem_len);
            fields = PyList_New(0);
            if (stem == NULL || fields == NULL) {
                goto error;
            }
            PyObject *g = PyTuple_Pack(2, stem, fields);
            if (g == NULL || PyList_Append(groups, g) < 0) {
                Py_XDECREF(g);
                goto error;
            }
            Py_DECREF(g);
        }
        PyObject *name = PyUnicode_FromStringAndSize(e->name, (Py_ssize_t)e->len);
        if (name == NULL) {
            goto error;
        }
        PyObject *path = PyUnicode_Concat(base, name);
        Py_DECREF(name);
        if (path == NULL) {
            goto error;
        }
        PyObject *t = Py_BuildValue("(s#NLL)", e->name + e->stem_len + 1,
                                    (Py_ssize_t)(e->len - e->stem_len - 1), path, e->size,
                                    e->mtime_ns);
        if (t == NULL || PyList_Append(fields, t) < 0) {
            Py_XDECREF(t);
            goto error;
        }
        Py_DECREF(t);
    }
    Py_XDECREF(stem);
    Py_XDECREF(fields);
    return Py_BuildValue("(nNN)", files, groups, subdirs);
error:
    Py_XDECREF(stem);
    Py_XDECREF(fields);
    Py_XDECREF(groups);
    Py_XDECREF(subdirs);
    return NULL;
}

static PyObject *
listdir_list_dir(PyObject *self, PyObject *args)
{
    int dfd;
    PyObject *base, *stop_obj;
    Py_ssize_t probe;
    double slow_s;
    int utf8_names = 0;
    if (!PyArg_ParseTuple(args, "iUOnd|p", &dfd, &base, &stop_obj, &probe, &slow_s,
                          &utf8_names)) {
        return NULL;
    }
    if (probe < 0) {
        PyErr_SetString(PyExc_ValueError, "probe must be >= 0");
        return NULL;
    }
    const char *stop = NULL;
    Py_ssize_t stop_len = 0;
    if (stop_obj != Py_None) {
        if (!PyUnicode_Check(stop_obj)) {
            PyErr_SetString(PyExc_TypeError, "stop_field must be a str or None");
            return NULL;
        }
        stop = PyUnicode_AsUTF8AndSize(stop_obj, &stop_len);
        if (stop == NULL) {
            return NULL;
        }
    }
    Listing l = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = list_entries(dfd, stop, (size_t)stop_len, (size_t)probe, slow_s, utf8_names, &l);
    if (rc == LIST_OK && l.n > 1) {
        qsort(l.e, l.n, sizeof(Entry), by_stem_field);
    }
    Py_END_ALLOW_THREADS
    PyObject *out;
    if (rc == LIST_ERRNO) {
        out = PyErr_NoMemory();
    } else if (rc == LIST_PYTHON) {
        out = Py_NewRef(Py_None);
    } else if (rc == LIST_SLOW) {
        out = Py_NewRef(Py_False);
    } else {
        out = build(&l, base);
    }
    listing_free(&l);
    return out;
}

static PyMethodDef methods[] = {
    {"list_dir", listdir_list_dir, METH_VARARGS,
     "List and stat one directory of a pack's source (see the module's source header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shardio._listdir",
    "A pack source's directory, listed and stat'ed in C (shardio/_listdir.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__listdir(void)
{
    return PyModule_Create(&module);
}
