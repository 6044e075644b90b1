/* read_items: read tensor archives straight into destination tensors.
 *
 *   failures = read_items(paths, items, threads=1, verify=True)
 *       paths: [path, ...]
 *       item:  (file_index, offset, length, dest_tensor, storage_type)
 *   -> [(item_index, code, errno, message), ...] for items not read:
 *       code 1 FALLBACK  valid archive in a form we do not read ourselves
 *                        (caller uses torch.load(weights_only=True))
 *            2 CORRUPT   malformed archive, or one that contradicts the
 *                        metadata
 *            3 IO        a read failed (errno), or the file is short
 *            4 CRC       the tensor bytes do not match the recorded CRC-32
 *
 * Per archive: one pread for small archives (whole), or a head window and
 * a tail window for large ones, then the tensor bytes are pread directly
 * into the destination's memory and CRC'd chunk by chunk while cache-hot.
 * Worker threads take items from a shared counter and touch only the plain
 * structs below; the destinations were taken through DLPack beforehand.
 */
#include "dcpx.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WHOLE_MAX ((uint64_t)256 << 10) /* read small archives in one go */
#define WINDOW ((size_t)64 << 10)       /* head/tail windows otherwise */
#define CHUNK ((size_t)4 << 20)

enum { RD_OK = 0, RD_FALLBACK = 1, RD_CORRUPT = 2, RD_IO = 3, RD_CRC = 4 };

typedef struct {
    Py_ssize_t file;
    uint64_t offset, length;
    dcpx_view dest;                  /* owned, released after join */
    char storage_type[48];
    /* result */
    int code;
    int err;
    char msg[160];
} ritem;

typedef struct {
    ritem *items;
    Py_ssize_t n;
    int *fds;
    const char **fwhy;               /* per file: why it is not readable */
    char **paths;
    Py_ssize_t nfiles;
    int verify;
    atomic_long next;
} rjob;

typedef struct {
    unsigned char *buf;              /* WHOLE_MAX or 2 windows */
} scratch;

static int pread_all(int fd, void *p, size_t n, uint64_t off)
{
    char *c = p;
    while (n) {
        ssize_t r = pread(fd, c, n, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0) {
            errno = 0; /* short file: reported as truncation */
            return -1;
        }
        c += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static int fail(ritem *it, int code, int err, const char *msg)
{
    it->code = code;
    it->err = err;
    snprintf(it->msg, sizeof(it->msg), "%s", msg);
    return -1;
}

static int io_fail(ritem *it, const char *what)
{
    if (errno == 0)
        return fail(it, RD_IO, 0, "file is shorter than the metadata says "
                                 "(truncated?)");
    char m[96];
    snprintf(m, sizeof(m), "%s failed", what);
    return fail(it, RD_IO, errno, m);
}

/* A window [wbeg, wbeg + wlen) of the archive is in memory at `w`. */
typedef struct {
    const unsigned char *w;
    uint64_t wbeg, wlen;
} window;

static const unsigned char *in_window(const window *win, uint64_t off,
                                      uint64_t len)
{
    if (off < win->wbeg || off + len > win->wbeg + win->wlen ||
        off + len < off)
        return NULL;
    return win->w + (off - win->wbeg);
}

static int check_record(ritem *it, const dcpx_tensor_record *rec)
{
    const dcpx_view *d = &it->dest;
    if (strcmp(rec->storage_type, it->storage_type) != 0) {
        char m[160];
        snprintf(m, sizeof(m), "archive holds a %s storage, metadata says %s",
                 rec->storage_type, it->storage_type);
        return fail(it, RD_CORRUPT, 0, m);
    }
    if (rec->ndim != d->ndim)
        return fail(it, RD_CORRUPT, 0, "archive tensor rank differs from the "
                                      "metadata");
    /* Unsigned, overflow-checked: a shape like (0, 2**62, 8) is a real
     * (empty) tensor, and strides come from the file (found by fuzzing). */
    uint64_t expect = 1, numel = 1;
    for (int i = rec->ndim - 1; i >= 0; i--) {
        if (rec->shape[i] != d->shape[i])
            return fail(it, RD_CORRUPT, 0, "archive tensor shape differs from "
                                          "the metadata");
        if (rec->shape[i] > 1 && (uint64_t)rec->stride[i] != expect)
            return fail(it, RD_FALLBACK, 0, "non-contiguous saved tensor");
        uint64_t dim = rec->shape[i] > 1 ? (uint64_t)rec->shape[i] : 1;
        if (i > 0 && __builtin_mul_overflow(expect, dim, &expect))
            return fail(it, RD_CORRUPT, 0, "archive tensor shape overflows");
        numel *= (uint64_t)rec->shape[i];
    }
    uint64_t storage_numel = rec->storage_numel;
    if (rec->numel_in_bytes)
        storage_numel /= d->itemsize ? d->itemsize : 1;
    if (rec->storage_offset != 0 || storage_numel != numel)
        return fail(it, RD_FALLBACK, 0, "saved tensor is a view of a larger "
                                       "storage");
    return 0;
}

static int read_one(rjob *job, ritem *it, scratch *s)
{
    int fd = job->fds[it->file];
    const uint64_t L = it->length;
    window head, tail;
    const char *why = "";
    uint64_t cd_off, cd_len, pkl_lho, pkl_len, data_lho, data_len, doff;
    uint32_t pkl_crc, data_crc;
    dcpx_tensor_record rec;
    const unsigned char *p;
    int rc;

    if (L <= WHOLE_MAX) {
        if (pread_all(fd, s->buf, L, it->offset) < 0)
            return io_fail(it, "read");
        head.w = tail.w = s->buf;
        head.wbeg = tail.wbeg = 0;
        head.wlen = tail.wlen = L;
    }
    else {
        head.w = s->buf;
        head.wbeg = 0;
        head.wlen = WINDOW;
        tail.w = s->buf + WINDOW;
        tail.wbeg = L - WINDOW;
        tail.wlen = WINDOW;
        if (pread_all(fd, s->buf, WINDOW, it->offset) < 0 ||
            pread_all(fd, s->buf + WINDOW, WINDOW, it->offset + L - WINDOW) < 0)
            return io_fail(it, "read");
    }
    rc = dcpx_zip_find_cd(tail.w, tail.wlen, L, &cd_off, &cd_len, &why);
    if (rc == DCPX_PARSE_OK && !(p = in_window(&tail, cd_off, cd_len))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "central directory larger than the read window";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_scan_cd(p, cd_len, L, &pkl_lho, &pkl_len, &pkl_crc,
                              &data_lho, &data_len, &data_crc, &why);
    if (rc == DCPX_PARSE_OK && !(p = in_window(&head, pkl_lho, 30))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "data.pkl is not near the start of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p, 30, &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        !(p = in_window(&head, pkl_lho + doff, pkl_len))) {
        rc = pkl_lho + doff + pkl_len > L ? DCPX_PARSE_CORRUPT
                                          : DCPX_PARSE_UNSUPPORTED;
        why = "data.pkl lies outside the archive window";
    }
    if (rc == DCPX_PARSE_OK && job->verify && pkl_crc &&
        dcpx_crc32(0, p, pkl_len) != pkl_crc)
        return fail(it, RD_CRC, 0, "CRC-32 mismatch in data.pkl");
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_pickle_parse_tensor(p, pkl_len, &rec, &why);
    if (rc == DCPX_PARSE_OK && check_record(it, &rec) < 0)
        return -1;
    if (rc == DCPX_PARSE_OK && data_len != it->dest.nbytes) {
        rc = DCPX_PARSE_CORRUPT;
        why = "tensor record size does not match its shape and dtype";
    }
    if (rc == DCPX_PARSE_OK && !(p = in_window(&head, data_lho, 30))) {
        rc = DCPX_PARSE_UNSUPPORTED;
        why = "data/0 is not near the start of the archive";
    }
    if (rc == DCPX_PARSE_OK)
        rc = dcpx_zip_local_data_off(p, 30, &doff, &why);
    if (rc == DCPX_PARSE_OK &&
        (data_lho + doff > L || data_len > L - data_lho - doff)) {
        rc = DCPX_PARSE_CORRUPT;
        why = "tensor data runs past the end of the archive";
    }
    if (rc != DCPX_PARSE_OK)
        return fail(it, rc == DCPX_PARSE_UNSUPPORTED ? RD_FALLBACK : RD_CORRUPT,
                    0, why);

    /* The bytes: from the buffer, or pread straight into the tensor. */
    uint64_t at = data_lho + doff;
    uint32_t crc = 0;
    if (data_len == 0) {
        /* empty tensor: its data pointer may be NULL */
    }
    else if (L <= WHOLE_MAX) {
        memcpy(it->dest.data, s->buf + at, data_len);
        if (job->verify)
            crc = dcpx_crc32(0, it->dest.data, data_len);
    }
    else {
        for (uint64_t done = 0; done < data_len; done += CHUNK) {
            size_t n = data_len - done < CHUNK ? (size_t)(data_len - done) : CHUNK;
            if (pread_all(fd, it->dest.data + done, n, it->offset + at + done) < 0)
                return io_fail(it, "read");
            if (job->verify)
                crc = dcpx_crc32(crc, it->dest.data + done, n);
        }
    }
    /* A zero CRC field means "not recorded" (torch with CRC writing off). */
    if (job->verify && data_crc != 0 && crc != data_crc) {
        char m[160];
        snprintf(m, sizeof(m), "CRC-32 mismatch in tensor data: recorded "
                 "%08x, computed %08x", data_crc, crc);
        return fail(it, RD_CRC, 0, m);
    }
    return 0;
}

static void *rworker(void *arg)
{
    rjob *job = arg;
    scratch s;
    s.buf = malloc(WHOLE_MAX > 2 * WINDOW ? WHOLE_MAX : 2 * WINDOW);
    for (;;) {
        long i = atomic_fetch_add(&job->next, 1);
        if (i >= job->n)
            break;
        ritem *it = &job->items[i];
        if (s.buf == NULL) {
            fail(it, RD_IO, ENOMEM, "out of memory");
            continue;
        }
        if (it->code == RD_OK && job->fds[it->file] < 0) {
            if (job->fwhy[it->file] != NULL)
                fail(it, RD_CORRUPT, 0, job->fwhy[it->file]);
            else
                fail(it, RD_IO, -job->fds[it->file] - 1, "open failed");
            continue;
        }
        if (it->code == RD_OK)
            read_one(job, it, &s);
    }
    free(s.buf);
    return NULL;
}

static void run_threads(rjob *job, int nthreads)
{
    for (Py_ssize_t f = 0; f < job->nfiles; f++) {
        job->fds[f] = dcpx_open_regular(job->paths[f], &job->fwhy[f]);
        if (job->fds[f] < 0)
            job->fds[f] = -errno - 1; /* reported per item */
    }
    dcpx_run_workers(rworker, job, nthreads);
    for (Py_ssize_t f = 0; f < job->nfiles; f++)
        if (job->fds[f] >= 0)
            close(job->fds[f]);
}

static int parse_item(rjob *job, ritem *it, PyObject *obj)
{
    PyObject *dest;
    const char *stype;
    Py_ssize_t slen;
    unsigned long long off, len;

    if (!PyArg_ParseTuple(obj, "nKKOs#;dcpx: read item must be (file, "
                               "offset, length, dest, storage_type)",
                          &it->file, &off, &len, &dest, &stype, &slen))
        return -1;
    if (it->file < 0 || it->file >= job->nfiles) {
        PyErr_SetString(PyExc_IndexError, "dcpx: file index out of range");
        return -1;
    }
    if ((size_t)slen >= sizeof(it->storage_type)) {
        PyErr_SetString(PyExc_ValueError, "dcpx: storage type name too long");
        return -1;
    }
    memcpy(it->storage_type, stype, (size_t)slen + 1);
    it->offset = off;
    it->length = len;
    if (dcpx_view_from_object(dest, &it->dest, 1) < 0)
        return -1;
    if ((it->dest.device_type != DCPX_DL_CPU &&
         it->dest.device_type != DCPX_DL_CUDA_HOST) ||
        !it->dest.contiguous || it->dest.ndim > 16)
        fail(it, RD_FALLBACK, 0, "destination is not contiguous host memory");
    return 0;
}

static void free_job(rjob *job)
{
    for (Py_ssize_t i = 0; i < job->n; i++)
        dcpx_view_release(&job->items[i].dest);
    for (Py_ssize_t i = 0; i < job->nfiles; i++)
        PyMem_RawFree(job->paths ? job->paths[i] : NULL);
    PyMem_RawFree(job->paths);
    PyMem_RawFree(job->fds);
    PyMem_RawFree(job->fwhy);
    PyMem_RawFree(job->items);
}

static int parse_paths(rjob *job, PyObject *paths)
{
    PyObject *fast = PySequence_Fast(paths, "dcpx: paths must be a sequence");
    if (fast == NULL)
        return -1;
    job->nfiles = PySequence_Fast_GET_SIZE(fast);
    job->paths = PyMem_RawCalloc((size_t)job->nfiles + 1, sizeof(char *));
    job->fds = PyMem_RawCalloc((size_t)job->nfiles + 1, sizeof(int));
    job->fwhy = PyMem_RawCalloc((size_t)job->nfiles + 1, sizeof(char *));
    if (job->paths == NULL || job->fds == NULL || job->fwhy == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < job->nfiles; i++) {
        PyObject *b;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &b)) {
            Py_DECREF(fast);
            return -1;
        }
        size_t n = (size_t)PyBytes_GET_SIZE(b) + 1;
        job->paths[i] = PyMem_RawMalloc(n);
        if (job->paths[i] != NULL)
            memcpy(job->paths[i], PyBytes_AS_STRING(b), n);
        Py_DECREF(b);
        if (job->paths[i] == NULL) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

PyObject *dcpx_read_items(PyObject *Py_UNUSED(module), PyObject *args,
                          PyObject *kwds)
{
    static char *kwlist[] = {"paths", "items", "threads", "verify", NULL};
    PyObject *paths, *items, *fast = NULL, *out = NULL;
    int nthreads = 1, verify = 1;
    rjob job;

    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|ip", kwlist, &paths,
                                     &items, &nthreads, &verify))
        return NULL;
    if (nthreads < 1 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    job.verify = verify;
    if (parse_paths(&job, paths) < 0)
        goto done;
    fast = PySequence_Fast(items, "dcpx: items must be a sequence");
    if (fast == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    job.items = PyMem_RawCalloc((size_t)(n ? n : 1), sizeof(ritem));
    if (job.items == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        job.n = i + 1;
        if (parse_item(&job, &job.items[i], PySequence_Fast_GET_ITEM(fast, i)) < 0)
            goto done;
    }
    if (nthreads > n)
        nthreads = n > 0 ? (int)n : 1;
    Py_BEGIN_ALLOW_THREADS
    run_threads(&job, nthreads);
    Py_END_ALLOW_THREADS
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < job.n; i++) {
        ritem *it = &job.items[i];
        if (it->code == RD_OK)
            continue;
        PyObject *t = Py_BuildValue("(niis)", i, it->code, it->err, it->msg);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
done:
    Py_XDECREF(fast);
    free_job(&job);
    return out;
}
