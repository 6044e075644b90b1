/* WriteJob: write DCP data files from C threads with the GIL released.
 *
 *   job = WriteJob(files, sync_files, threads)
 *       files: [(path, [item, ...]), ...]
 *       item:  bytes                      a raw "bytes item"
 *            | (tensor, storage_type)     a tensor, written as a
 *                                         torch.save archive
 *            | (tensor, "")               a tensor's bytes alone, no archive
 *                                         and no alignment gap before them
 *                                         (the tensor data of a safetensors
 *                                         file, dcpx/formats/safetensors.py)
 *            | (tensor, storage_type, gate)  the same, its bytes read only
 *                                         once the staging gate says they
 *                                         are final (csrc/gate.h)
 *            | (offset, nbytes, storage_type, shape[, gate])
 *                                         a contiguous tensor of `shape`
 *                                         stored at bytes [offset, offset +
 *                                         nbytes) of `base` (a staging
 *                                         buffer, taken once through DLPack
 *                                         by WriteJob(..., base=buffer)):
 *                                         no DLPack per tensor
 *   job.layout()  -> [[(offset, length), ...] per file]   (known at once)
 *   job.start()   starts the threads;  job.wait() joins them (GIL released)
 *   job.cancel()  asks the threads to stop at the next chunk
 *
 * DCPX_WRITER_NICE=N (1..19, read at job.start()): each writer thread lowers
 * its own scheduling priority to nice N if it runs at less (Linux:
 * setpriority on the thread's id), so that a training loop's threads win the
 * cores an upload competes for (issue 30: the step slowdown during an
 * upload; bench_gpu.py compares).
 *
 * Construction runs with the GIL: tensors are taken through DLPack, every
 * archive's head and tail length is measured and the whole layout is fixed,
 * so the caller can build DCP metadata while the data is still being
 * written.  Worker threads then see only the plain structs below, and build
 * each archive's head and tail where they write it (nothing per tensor is
 * allocated: a save of 100,000 tensors held ~1.3 KB of archive per tensor
 * in memory until its end before).
 *
 * The CRC recorded for a tensor must be of exactly the bytes written, even
 * if another thread changes the tensor meanwhile (training goes on during a
 * synchronous save; torch.save gives torn values then, but a checkpoint
 * that loads).  So tensor bytes are never written from tensor memory: they
 * are read once, by a fused copy + CRC (dcpx_crc32_copy) into a small
 * cache-resident buffer of the file's own, and written from there.  Small
 * records are packed into that arena, with their heads, tails and
 * alignment gaps (a run of them is one contiguous piece of the arena), and
 * written with pwritev (batched);
 * large tensors stream through it in BOUNCE-sized pieces, their head (with
 * the CRC) written last.  Non-contiguous tensors are gathered chunk by chunk
 * and CRC'd from the gathered copy.
 */
#include "dcpx.h"
#include "gate.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define CHUNK ((size_t)4 << 20)        /* streaming unit for large tensors */
#define SMALL ((uint64_t)1 << 20)      /* tensors up to this go via pwritev */
#define BATCH_BYTES ((size_t)16 << 20)
#define BATCH_IOV 1020                 /* < IOV_MAX (1024) */
#define BOUNCE ((size_t)256 << 10)     /* large tensors: copy+CRC+pwrite unit */
#define ARENA ((size_t)2 << 20)        /* >= SMALL and >= BOUNCE */

#define STYPE_MAX 32                   /* longest storage type name + 1 */

typedef struct {
    int is_tensor;
    int raw;               /* storage type "": the bytes alone, packed */
    /* bytes item: borrowed from a bytes object held in WriteJob.keep */
    const char *bytes;
    uint64_t bytes_len;
    /* tensor item: its archive's head and tail are built by the writer
     * thread where they are written (zipwrite.c); only their lengths are
     * fixed here, for the layout */
    dcpx_view view;        /* owned: released after join */
    dcpx_gate *gate;       /* owned reference, or NULL: wait for it before
                              reading the tensor's bytes */
    char stype[STYPE_MAX]; /* storage type name, for the archive's pickle */
    int64_t dims[4];       /* a base item's shape when ndim <= 4 ... */
    int64_t *big_dims;     /* ... else here (owned, PyMem_Raw) */
    uint64_t serial;       /* the archive's serialization id */
    uint32_t head_len, tail_len;
    /* layout */
    uint64_t offset;       /* archive start in the file */
    uint64_t length;
} witem;

typedef struct {
    char *path;            /* owned (PyMem_RawMalloc) */
    witem *items;          /* owned */
    Py_ssize_t n;
    /* result, written by the one worker that owns this file */
    int err;               /* errno, 0 if none */
    const char *what;      /* failed operation */
} wfile;

typedef struct {
    PyObject_HEAD
    wfile *files;
    Py_ssize_t nfiles;
    PyObject *keep;        /* list: bytes objects items borrow from */
    dcpx_view base;        /* base items' buffer (owned), if has_base */
    int has_base;
    int sync;
    int nthreads;
    int nice;              /* DCPX_WRITER_NICE at start(), 0: unchanged */
    pthread_t *tids;
    int started;           /* threads launched (count) */
    int joined;
    atomic_int next_file;
    atomic_int cancel;
    atomic_int running;
    atomic_ullong written; /* bytes written so far, for progress */
} WriteJob;

static const char zeros[DCPX_ALIGN];

/* ---- worker side: no Python API below this line until the type ---- */

typedef struct {
    char arena[ARENA];     /* what the batch writes (archives, copies CRC'd as
                              copied, alignment gaps): a mirror of the file
                              from `pos`, offsets equal modulo DCPX_ALIGN */
    int fd;
    uint64_t pos;          /* file offset where the batch starts */
    struct iovec iov[BATCH_IOV + 4];
    int niov;
    size_t bytes;
    size_t arena_used;     /* bytes of `arena` the batch's iovecs point into */
    int sync;              /* sync_files: write behind each flushed batch */
    uint64_t wb_waited;    /* file bytes before this are on the device */
} batch_t;

static int pwrite_all(int fd, const char *p, size_t n, uint64_t off)
{
    while (n) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

#define WB_WINDOW ((uint64_t)32 << 20)

/* With sync_files, start the device write of each flushed batch at once
 * (SYNC_FILE_RANGE_WRITE does not wait) and wait for what lies more than
 * WB_WINDOW bytes back, so the device works while the next batches are
 * copied and CRC'd, dirty memory stays bounded, and the final fsync finds
 * little left to do.  Errors here are not final: fsync reports any. */
static void batch_write_behind(batch_t *b, uint64_t start, uint64_t end)
{
#ifdef SYNC_FILE_RANGE_WRITE
    if (!b->sync || end <= start)
        return;
    sync_file_range(b->fd, (off_t)start, (off_t)(end - start), SYNC_FILE_RANGE_WRITE);
    if (end - b->wb_waited > 2 * WB_WINDOW) {
        uint64_t upto = end - WB_WINDOW;
        sync_file_range(b->fd, (off_t)b->wb_waited, (off_t)(upto - b->wb_waited),
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                            SYNC_FILE_RANGE_WAIT_AFTER);
        b->wb_waited = upto;
    }
#else
    (void)b;
    (void)start;
    (void)end;
#endif
}

static int batch_flush(batch_t *b)
{
    struct iovec *iov = b->iov;
    int n = b->niov;
    uint64_t off = b->pos;
    int rc = 0;

    while (n > 0) {
        ssize_t w = pwritev(b->fd, iov, n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            rc = -1;
            break;
        }
        if (w == 0) {
            errno = EIO;
            rc = -1;
            break;
        }
        off += (uint64_t)w;
        while (n > 0 && (size_t)w >= iov->iov_len) { /* short write */
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    if (rc == 0)
        batch_write_behind(b, b->pos, off);
    b->pos = off;
    b->arena_used = (size_t)(off % DCPX_ALIGN);
    b->niov = 0;
    b->bytes = 0;
    return rc;
}

static void batch_add(batch_t *b, const void *p, size_t n)
{
    if (n == 0)
        return;
    b->iov[b->niov].iov_base = (void *)p;
    b->iov[b->niov].iov_len = n;
    b->niov++;
    b->bytes += n;
}

/* `n` bytes of the arena, next in the file: flushes the batch first when
 * they do not fit (n <= ARENA - DCPX_ALIGN always fits then).  Extends the
 * last iovec when it ends where they start, so a run of archives and gaps
 * is one iovec; otherwise skips to the arena offset with the file offset's
 * alignment.  NULL with errno set if the flush failed. */
static char *batch_reserve(batch_t *b, size_t n)
{
    uint64_t at = b->pos + b->bytes;   /* file offset of the new bytes */
    struct iovec *last = b->niov ? &b->iov[b->niov - 1] : NULL;
    size_t start = b->arena_used;
    int extend = last != NULL &&
                 (char *)last->iov_base + last->iov_len == b->arena + start;

    if (!extend)
        start += (size_t)((at - start) % DCPX_ALIGN);
    if (start + n > ARENA) {
        if (batch_flush(b) < 0)
            return NULL;
        return batch_reserve(b, n);
    }
    if (extend) {
        last->iov_len += n;
        b->bytes += n;
    }
    else {
        batch_add(b, b->arena + start, n);
    }
    b->arena_used = start + n;
    return b->arena + start;
}

/* Build `it`'s archive at `mem` (cap bytes), the tail `tail_skip` bytes
 * after the head; checks that it has the lengths the layout gave it. */
static int build_archive(const witem *it, dcpx_archive *a, char *mem, size_t cap,
                         size_t tail_skip)
{
    if (dcpx_archive_build(a, mem, cap, tail_skip, it->stype, it->view.shape,
                           it->view.ndim, it->view.numel, it->view.nbytes,
                           it->serial) < 0)
        return -1;
    if (a->head_len != it->head_len || a->tail_len != it->tail_len) {
        errno = EPROTO; /* cannot happen: same inputs as when measured */
        return -1;
    }
    return 0;
}

/* With sync_files, start the disk write of each chunk as soon as it is in
 * the page cache (SYNC_FILE_RANGE_WRITE does not wait), and wait for the
 * one WB_LAG chunks back, so the disk works while we CRC and copy the next
 * chunks, dirty memory stays bounded, and the final fsync finds little left
 * to do.  Errors here are not final: fsync reports any write-back error. */
#define WB_LAG 8

static void write_behind(int fd, uint64_t off, size_t n)
{
#ifdef SYNC_FILE_RANGE_WRITE
    sync_file_range(fd, (off_t)off, (off_t)n, SYNC_FILE_RANGE_WRITE);
    if (off >= (uint64_t)WB_LAG * n)
        sync_file_range(fd, (off_t)(off - (uint64_t)WB_LAG * n), (off_t)n,
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                            SYNC_FILE_RANGE_WAIT_AFTER);
#else
    (void)fd;
    (void)off;
    (void)n;
#endif
}

/* Stream one large tensor: data first (CRC per chunk), then its head.  A
 * contiguous tensor goes through the (flushed, so free) arena BOUNCE bytes
 * at a time: copied and CRC'd in one read, written from the copy. */
static int write_large(WriteJob *job, batch_t *b, witem *it)
{
    const dcpx_view *v = &it->view;
    uint64_t data_off = it->offset + it->head_len;
    dcpx_archive a;
    size_t chunk = CHUNK - CHUNK % v->itemsize;
    char *bounce = NULL;
    uint32_t crc = 0;

    if (batch_flush(b) < 0)
        return -1;
    if (!v->contiguous && (bounce = malloc(chunk)) == NULL)
        return -1;
    for (uint64_t done = 0; done < v->nbytes; done += chunk) {
        size_t n = (size_t)(v->nbytes - done < chunk ? v->nbytes - done : chunk);
        const char *src = v->data + done;
        if (atomic_load_explicit(&job->cancel, memory_order_relaxed)) {
            free(bounce);
            errno = ECANCELED;
            return -1;
        }
        if (bounce) {
            dcpx_view_gather(v, done, n, bounce);
            crc = dcpx_crc32(crc, bounce, n);
            if (pwrite_all(b->fd, bounce, n, data_off + done) < 0) {
                free(bounce);
                return -1;
            }
        }
        for (size_t at = 0; !bounce && at < n; at += BOUNCE) {
            size_t m = n - at < BOUNCE ? n - at : BOUNCE;
            crc = dcpx_crc32_copy(crc, b->arena, src + at, m);
            if (pwrite_all(b->fd, b->arena, m, data_off + done + at) < 0)
                return -1;
        }
        if (job->sync)
            write_behind(b->fd, data_off + done, n);
        atomic_fetch_add_explicit(&job->written, n, memory_order_relaxed);
    }
    free(bounce);
    if (it->raw) {
        b->pos = data_off + v->nbytes;
        b->arena_used = (size_t)(b->pos % DCPX_ALIGN);
        return 0;
    }
    /* The head, written last (it holds the CRC), and the tail, which
     * continues the (empty) batch, are built in the arena's last
     * DCPX_ARCHIVE_MAX bytes, clear of what the batch reserves next. */
    char *scratch = b->arena + ARENA - DCPX_ARCHIVE_MAX;
    if (build_archive(it, &a, scratch, DCPX_ARCHIVE_MAX, 0) < 0)
        return -1;
    dcpx_archive_patch_crc(&a, crc);
    if (pwrite_all(b->fd, a.head, a.head_len, it->offset) < 0)
        return -1;
    b->pos = data_off + v->nbytes;
    b->arena_used = 0;
    char *tail = batch_reserve(b, a.tail_len);
    if (tail == NULL)
        return -1;
    memcpy(tail, a.tail, a.tail_len);
    return 0;
}

/* A small tensor: alignment gap, head, bytes and tail go into the arena in
 * one piece, the bytes copied (gathered) and CRC'd in the same pass; the
 * batch writes them from there. */
static int write_small(batch_t *b, witem *it, size_t gap)
{
    const dcpx_view *v = &it->view;
    size_t n = gap + it->head_len + (size_t)v->nbytes + it->tail_len;
    char *p = batch_reserve(b, n);
    dcpx_archive a;
    uint32_t crc;

    if (p == NULL)
        return -1;
    memset(p, 0, gap);
    p += gap;
    if (it->raw) {
        if (v->nbytes == 0)
            return 0; /* an empty tensor: its data pointer may be NULL */
        if (v->contiguous)
            memcpy(p, v->data, (size_t)v->nbytes);
        else
            dcpx_view_gather(v, 0, v->nbytes, p);
        return 0;
    }
    if (build_archive(it, &a, p, n - gap, (size_t)v->nbytes) < 0)
        return -1;
    char *dst = p + it->head_len;
    if (v->contiguous) {
        crc = dcpx_crc32_copy(0, dst, v->data, (size_t)v->nbytes);
    }
    else {
        dcpx_view_gather(v, 0, v->nbytes, dst);
        crc = dcpx_crc32(0, dst, (size_t)v->nbytes);
    }
    dcpx_archive_patch_crc(&a, crc);
    return 0;
}

static int write_file(WriteJob *job, wfile *f)
{
    batch_t *b = NULL;
    int rc = -1;

    /* aligned: the arena mirrors the file modulo DCPX_ALIGN, so tensor
     * bytes are copied to DCPX_ALIGN-aligned addresses */
    if (posix_memalign((void **)&b, DCPX_ALIGN, sizeof(batch_t)) != 0) {
        f->err = ENOMEM;
        f->what = "allocate";
        return -1;
    }
    b->niov = 0;
    b->arena_used = 0;
    b->pos = 0;
    b->bytes = 0;
    b->sync = job->sync;
    b->wb_waited = 0;
    b->fd = dcpx_create_fresh(f->path); /* never through a link or FIFO */
    if (b->fd < 0) {
        f->what = "open";
        goto out;
    }
    f->what = "write";
    for (Py_ssize_t i = 0; i < f->n; i++) {
        witem *it = &f->items[i];
        uint64_t end = b->pos + b->bytes;
        if (atomic_load_explicit(&job->cancel, memory_order_relaxed)) {
            errno = ECANCELED;
            goto out;
        }
        size_t gap = (size_t)(it->offset - end); /* alignment */
        if (it->gate != NULL &&
            dcpx_gate_wait(it->gate, it->view.data,
                           (size_t)it->view.nbytes) < 0) {
            /* Its device-to-host copy failed: the save fails (the
             * staging's own error says why; not ECANCELED, which
             * WriteJob.wait reports only after another failure). */
            errno = EIO;
            f->what = "wait for the staging copies (a device-to-host copy "
                      "failed)";
            goto out;
        }
        if (!it->is_tensor || it->view.nbytes > SMALL)
            batch_add(b, zeros, gap);
        if (!it->is_tensor) {
            batch_add(b, it->bytes, it->bytes_len);
        }
        else if (it->view.nbytes > SMALL) {
            if (write_large(job, b, it) < 0)
                goto out;
        }
        else if (write_small(b, it, gap) < 0) {
            goto out;
        }
        if ((b->niov >= BATCH_IOV || b->bytes >= BATCH_BYTES) &&
            batch_flush(b) < 0)
            goto out;
    }
    if (batch_flush(b) < 0)
        goto out;
    if (job->sync) {
        f->what = "fsync";
        if (fsync(b->fd) < 0)
            goto out;
    }
    rc = 0;
out:
    if (rc < 0)
        f->err = errno ? errno : EIO;
    if (b->fd >= 0 && close(b->fd) < 0 && rc == 0) {
        f->err = errno;
        f->what = "close";
        rc = -1;
    }
    free(b);
    return rc;
}

static void *worker(void *arg)
{
    WriteJob *job = arg;
#ifdef __linux__
    /* Linux keeps a nice value per thread: this thread only, and only ever
     * lower in priority (a process already at a higher nice keeps it).
     * Raising the value needs no privilege; a failure changes nothing. */
    if (job->nice > 0) {
        id_t tid = (id_t)syscall(SYS_gettid);
        int cur;
        errno = 0;
        cur = getpriority(PRIO_PROCESS, tid);
        if (errno == 0 && job->nice > cur)
            (void)setpriority(PRIO_PROCESS, tid, job->nice);
    }
#endif
    for (;;) {
        int i = atomic_fetch_add(&job->next_file, 1);
        if (i >= job->nfiles)
            break;
        if (write_file(job, &job->files[i]) < 0)
            atomic_store(&job->cancel, 1); /* one failure fails the save */
    }
    atomic_fetch_sub(&job->running, 1);
    return NULL;
}

/* ---- Python type ---- */

/* Items measured so far in this WriteJob's constructor: a later tensor of
 * the same storage type, shape and size has an archive of the same lengths
 * (state dicts repeat a few shapes many times), so it is not built again. */
#define NTEMPLATES 8
typedef struct {
    const witem *item[NTEMPLATES];
    int next;
} templates;

static const witem *find_template(const templates *tp, const witem *it)
{
    for (int i = 0; i < NTEMPLATES; i++) {
        const witem *t = tp->item[i];
        if (t != NULL && t->view.ndim == it->view.ndim &&
            t->view.nbytes == it->view.nbytes &&
            (it->view.ndim == 0 ||
             memcmp(t->view.shape, it->view.shape,
                    (size_t)it->view.ndim * sizeof(int64_t)) == 0) &&
            strcmp(t->stype, it->stype) == 0)
            return t;
    }
    return NULL;
}

/* The head and tail lengths of `it`'s archive: the writer thread builds it
 * where it writes it; here it is only measured (or its lengths taken from
 * an item of the same kind) to fix the layout. */
static int measure_archive(witem *it, templates *tp)
{
    const witem *t = find_template(tp, it);
    if (t != NULL) {
        it->head_len = t->head_len;
        it->tail_len = t->tail_len;
        return 0;
    }
    dcpx_archive a;
    if (dcpx_archive_build(&a, NULL, 0, 0, it->stype,
                           it->view.shape, it->view.ndim, it->view.numel,
                           it->view.nbytes, it->serial) < 0) {
        PyErr_SetString(PyExc_ValueError, "dcpx: tensor archive header too large");
        return -1;
    }
    it->head_len = (uint32_t)a.head_len;
    it->tail_len = (uint32_t)a.tail_len;
    tp->item[tp->next] = it;
    tp->next = (tp->next + 1) % NTEMPLATES;
    return 0;
}

/* A base item's view: the contiguous bytes [off, off + len) of the job's
 * base buffer, of `shape` (a tuple of ints); borrowed (release is a no-op:
 * the caller keeps the buffer alive and unchanged until the job is done). */
static int base_view(WriteJob *self, witem *it, unsigned long long off,
                     unsigned long long len, PyObject *shape)
{
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    dcpx_view *v = &it->view;
    uint64_t numel = 1;
    int64_t *dims = it->dims;

    if (!self->has_base) {
        PyErr_SetString(PyExc_ValueError, "dcpx: a base item needs WriteJob(..., base=)");
        return -1;
    }
    if (off > self->base.nbytes || len > self->base.nbytes - off) {
        PyErr_Format(PyExc_ValueError, "dcpx: base item [%llu, +%llu) outside the "
                     "buffer of %llu bytes", off, len,
                     (unsigned long long)self->base.nbytes);
        return -1;
    }
    if (nd > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: unsupported ndim");
        return -1;
    }
    if (nd > 4) {
        dims = it->big_dims = PyMem_RawMalloc((size_t)nd * sizeof(int64_t));
        if (dims == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (d == -1 && PyErr_Occurred())
            return -1;
        if (d < 0) {
            PyErr_SetString(PyExc_ValueError, "dcpx: negative dimension");
            return -1;
        }
        dims[i] = d;
        if (numel != 0 && d != 0 && (uint64_t)d > UINT64_MAX / numel) {
            PyErr_SetString(PyExc_ValueError, "dcpx: shape too large");
            return -1;
        }
        numel *= (uint64_t)d;
    }
    uint64_t isz = numel ? len / numel : 1;
    if (numel == 0 ? len != 0
                   : (len % numel != 0 || isz == 0 || isz > 16 || (isz & (isz - 1)))) {
        PyErr_Format(PyExc_ValueError, "dcpx: base item of %llu bytes does not "
                     "hold %llu elements", len, (unsigned long long)numel);
        return -1;
    }
    memset(v, 0, sizeof(*v));
    v->data = self->base.data + off;
    v->ndim = (int)nd;
    v->shape = dims;
    v->itemsize = (uint32_t)isz;
    v->numel = numel;
    v->nbytes = len;
    v->device_type = self->base.device_type;
    v->device_id = self->base.device_id;
    v->contiguous = 1;
    return 0;
}

static int add_item(WriteJob *self, witem *it, PyObject *obj, uint64_t serial,
                    templates *tp)
{
    if (PyBytes_Check(obj)) {
        it->bytes = PyBytes_AS_STRING(obj);
        it->bytes_len = (uint64_t)PyBytes_GET_SIZE(obj);
        it->length = it->bytes_len;
        return PyList_Append(self->keep, obj);
    }
    PyObject *tensor = NULL, *gate = NULL, *shape = NULL;
    unsigned long long boff = 0, blen = 0;
    const char *stype;
    if (!PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "dcpx: item must be bytes or (tensor, storage_type), "
                     "not %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyTuple_GET_SIZE(obj) >= 4 && PyLong_Check(PyTuple_GET_ITEM(obj, 0))) {
        if (!PyArg_ParseTuple(obj, "KKsO!|O;dcpx: a base item must be (offset, "
                                   "nbytes, storage_type, shape[, gate])",
                              &boff, &blen, &stype, &PyTuple_Type, &shape, &gate))
            return -1;
    }
    else if (!PyArg_ParseTuple(obj, "Os|O;dcpx: item must be bytes or (tensor, "
                                    "storage_type[, gate])", &tensor, &stype,
                               &gate)) {
        return -1;
    }
    if (strlen(stype) >= STYPE_MAX) {
        PyErr_Format(PyExc_ValueError, "dcpx: storage type name too long: %.100s",
                     stype);
        return -1;
    }
    strcpy(it->stype, stype);
    it->serial = serial;
    if (gate != NULL && gate != Py_None) {
        if ((it->gate = dcpx_gate_from(gate)) == NULL)
            return -1;
        dcpx_gate_incref(it->gate);
    }
    if (shape != NULL ? base_view(self, it, boff, blen, shape) < 0
                      : dcpx_view_from_object(tensor, &it->view, 0) < 0)
        return -1;
    it->is_tensor = 1;
    if (it->view.device_type != DCPX_DL_CPU &&
        it->view.device_type != DCPX_DL_CUDA_HOST) {
        PyErr_Format(PyExc_ValueError,
                     "dcpx: tensor memory is not host-accessible (DLPack "
                     "device %d); stage it to CPU first",
                     it->view.device_type);
        return -1;
    }
    it->raw = it->stype[0] == '\0';
    if (!it->raw && measure_archive(it, tp) < 0)
        return -1;
    it->length = it->head_len + it->view.nbytes + it->tail_len;
    return 0;
}

static int add_file(WriteJob *self, wfile *f, PyObject *spec, uint64_t *serial,
                    templates *tp)
{
    PyObject *path, *items, *fast;
    uint64_t off = 0;

    if (!PyArg_ParseTuple(spec, "O&O;dcpx: file must be (path, items)",
                          PyUnicode_FSConverter, &path, &items))
        return -1;
    f->path = PyMem_RawMalloc((size_t)PyBytes_GET_SIZE(path) + 1);
    if (f->path == NULL) {
        Py_DECREF(path);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(f->path, PyBytes_AS_STRING(path), (size_t)PyBytes_GET_SIZE(path) + 1);
    Py_DECREF(path);
    fast = PySequence_Fast(items, "dcpx: items must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    f->items = PyMem_RawCalloc((size_t)(n ? n : 1), sizeof(witem));
    if (f->items == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        witem *it = &f->items[i];
        f->n = i + 1; /* so that dealloc releases what was taken */
        if (add_item(self, it, PySequence_Fast_GET_ITEM(fast, i),
                     (*serial)++, tp) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        if (!it->raw)
            off = (off + DCPX_ALIGN - 1) / DCPX_ALIGN * DCPX_ALIGN;
        it->offset = off;
        off += it->length;
    }
    Py_DECREF(fast);
    return 0;
}

static void release_items(WriteJob *self)
{
    for (Py_ssize_t i = 0; i < self->nfiles; i++) {
        wfile *f = &self->files[i];
        for (Py_ssize_t j = 0; j < f->n; j++) {
            dcpx_view_release(&f->items[j].view);
            PyMem_RawFree(f->items[j].big_dims);
            f->items[j].big_dims = NULL;
            dcpx_gate_decref(f->items[j].gate);
            f->items[j].gate = NULL;
        }
        PyMem_RawFree(f->items);
        PyMem_RawFree(f->path);
    }
    PyMem_RawFree(self->files);
    self->files = NULL;
    self->nfiles = 0;
    if (self->has_base) {
        dcpx_view_release(&self->base);
        self->has_base = 0;
    }
}

static void join_threads(WriteJob *self)
{
    if (self->joined || !self->started)
        return;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < self->started; i++)
        pthread_join(self->tids[i], NULL);
    Py_END_ALLOW_THREADS
    self->joined = 1;
}

static int WriteJob_init(WriteJob *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"files", "sync_files", "threads", "serial", "base", NULL};
    PyObject *files, *fast = NULL, *base = Py_None;
    int sync = 1, nthreads = 1;
    unsigned long long serial_arg = 0;
    uint64_t serial;

    if (self->files != NULL || self->keep != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dcpx: WriteJob is initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|piKO", kwlist, &files,
                                     &sync, &nthreads, &serial_arg, &base))
        return -1;
    serial = serial_arg;
    if (nthreads < 1 || nthreads > 256) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..256");
        return -1;
    }
    self->sync = sync;
    if (base != Py_None) {
        if (dcpx_view_from_object(base, &self->base, 0) < 0)
            return -1;
        self->has_base = 1;
        if (!self->base.contiguous || (self->base.device_type != DCPX_DL_CPU &&
                                       self->base.device_type != DCPX_DL_CUDA_HOST)) {
            PyErr_SetString(PyExc_ValueError,
                            "dcpx: base must be contiguous host memory");
            release_items(self);
            return -1;
        }
    }
    self->keep = PyList_New(0);
    fast = PySequence_Fast(files, "dcpx: files must be a sequence");
    if (self->keep == NULL || fast == NULL)
        goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    self->files = PyMem_RawCalloc((size_t)(n ? n : 1), sizeof(wfile));
    if (self->files == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    templates tp;
    memset(&tp, 0, sizeof(tp));
    for (Py_ssize_t i = 0; i < n; i++) {
        self->nfiles = i + 1;
        if (add_file(self, &self->files[i], PySequence_Fast_GET_ITEM(fast, i),
                     &serial, &tp) < 0)
            goto fail;
    }
    self->nthreads = nthreads < n ? nthreads : (int)(n ? n : 1);
    Py_DECREF(fast);
    return 0;
fail:
    Py_XDECREF(fast);
    release_items(self);
    return -1;
}

static PyObject *WriteJob_layout(WriteJob *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(self->nfiles);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->nfiles; i++) {
        wfile *f = &self->files[i];
        PyObject *l = PyList_New(f->n);
        if (l == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, l);
        for (Py_ssize_t j = 0; j < f->n; j++) {
            PyObject *t = Py_BuildValue("(KK)", f->items[j].offset,
                                        f->items[j].length);
            if (t == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(l, j, t);
        }
    }
    return out;
}

static PyObject *WriteJob_start(WriteJob *self, PyObject *Py_UNUSED(ignored))
{
    if (self->files == NULL || self->started) {
        PyErr_SetString(PyExc_RuntimeError,
                        "dcpx: WriteJob already started or not initialised");
        return NULL;
    }
    self->tids = PyMem_RawCalloc((size_t)self->nthreads, sizeof(pthread_t));
    if (self->tids == NULL)
        return PyErr_NoMemory();
    {
        const char *e = getenv("DCPX_WRITER_NICE");
        int n = e != NULL ? atoi(e) : 0;
        self->nice = n < 0 ? 0 : n > 19 ? 19 : n;
    }
    atomic_store(&self->running, self->nthreads);
    for (int i = 0; i < self->nthreads; i++) {
        int err = pthread_create(&self->tids[i], NULL, worker, self);
        if (err != 0) {
            /* Roll back: stop the ones already running. */
            atomic_fetch_sub(&self->running, self->nthreads - i);
            atomic_store(&self->cancel, 1);
            join_threads(self);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        self->started = i + 1;
    }
    Py_RETURN_NONE;
}

static PyObject *WriteJob_wait(WriteJob *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->started) {
        PyErr_SetString(PyExc_RuntimeError, "dcpx: WriteJob not started");
        return NULL;
    }
    join_threads(self);
    /* Report the first real failure; ECANCELED only follows another one. */
    wfile *bad = NULL;
    for (Py_ssize_t i = 0; i < self->nfiles; i++) {
        wfile *f = &self->files[i];
        if (f->err && (bad == NULL || bad->err == ECANCELED))
            bad = f;
    }
    if (bad != NULL) {
        dcpx_set_oserror(bad->err, bad->what, bad->path);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *WriteJob_cancel(WriteJob *self, PyObject *Py_UNUSED(ignored))
{
    atomic_store(&self->cancel, 1);
    Py_RETURN_NONE;
}

static PyObject *WriteJob_release(WriteJob *self, PyObject *Py_UNUSED(ignored))
{
    /* Give tensor memory back to its producers as soon as the data is out. */
    if (self->started && !self->joined) {
        PyErr_SetString(PyExc_RuntimeError, "dcpx: WriteJob still running");
        return NULL;
    }
    release_items(self);
    Py_CLEAR(self->keep);
    Py_RETURN_NONE;
}

static PyObject *WriteJob_get_done(WriteJob *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->started && atomic_load(&self->running) == 0);
}

static PyObject *WriteJob_get_written(WriteJob *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->written));
}

static int WriteJob_traverse(WriteJob *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->keep);
    return 0;
}

static int WriteJob_clear(WriteJob *self)
{
    /* `keep` holds only bytes objects, which cannot form cycles; clearing
     * it while threads run would free memory they read, so never do. */
    if (!self->started || self->joined)
        Py_CLEAR(self->keep);
    return 0;
}

static void WriteJob_dealloc(WriteJob *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->started && !self->joined) {
        atomic_store(&self->cancel, 1);
        join_threads(self);
    }
    release_items(self);
    Py_CLEAR(self->keep);
    PyMem_RawFree(self->tids);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(layout_doc, "layout($self, /)\n--\n\n"
             "[[(offset, length), ...] per file]: where each item lands.");
PyDoc_STRVAR(start_doc, "start($self, /)\n--\n\nStart the writer threads.");
PyDoc_STRVAR(wait_doc, "wait($self, /)\n--\n\n"
             "Join the writer threads with the GIL released; raise OSError "
             "naming the file on failure.");
PyDoc_STRVAR(cancel_doc, "cancel($self, /)\n--\n\n"
             "Ask the writer threads to stop at the next chunk.");
PyDoc_STRVAR(release_doc, "release($self, /)\n--\n\n"
             "Drop the references to the source tensors (after wait()).");

static PyMethodDef WriteJob_methods[] = {
    {"layout", (PyCFunction)WriteJob_layout, METH_NOARGS, layout_doc},
    {"start", (PyCFunction)WriteJob_start, METH_NOARGS, start_doc},
    {"wait", (PyCFunction)WriteJob_wait, METH_NOARGS, wait_doc},
    {"cancel", (PyCFunction)WriteJob_cancel, METH_NOARGS, cancel_doc},
    {"release", (PyCFunction)WriteJob_release, METH_NOARGS, release_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef WriteJob_getset[] = {
    {"done", (getter)WriteJob_get_done, NULL, "all threads have finished", NULL},
    {"bytes_written", (getter)WriteJob_get_written, NULL,
     "tensor bytes written so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(WriteJob_doc,
             "WriteJob(files, sync_files=True, threads=1, serial=0, base=None)\n--\n\n"
             "Write DCP data files from C threads without the GIL.");

static PyType_Slot WriteJob_slots[] = {
    {Py_tp_doc, (void *)WriteJob_doc},
    {Py_tp_init, WriteJob_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, WriteJob_dealloc},
    {Py_tp_traverse, WriteJob_traverse},
    {Py_tp_clear, WriteJob_clear},
    {Py_tp_methods, WriteJob_methods},
    {Py_tp_getset, WriteJob_getset},
    {0, NULL},
};

/* Py_TPFLAGS_IMMUTABLETYPE is new in Python 3.10.  On 3.9 the type is left
 * mutable (its attributes could be reassigned from Python), which nothing in
 * dcpx relies on; everything else the extension uses exists in 3.9. */
#ifdef Py_TPFLAGS_IMMUTABLETYPE
#define WRITEJOB_TPFLAGS_IMMUTABLE Py_TPFLAGS_IMMUTABLETYPE
#else
#define WRITEJOB_TPFLAGS_IMMUTABLE 0
#endif

PyType_Spec dcpx_writejob_spec = {
    .name = "dcpx._C.WriteJob",
    .basicsize = sizeof(WriteJob),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             WRITEJOB_TPFLAGS_IMMUTABLE,
    .slots = WriteJob_slots,
};
