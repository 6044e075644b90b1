/* cuda_load_pipeline: checkpoint archives read into CUDA tensors through a
 * ring of page-locked slots, the reads and the host-to-device copies
 * overlapped.
 *
 *   failures, stats = cuda_load_pipeline(paths, items, ring,
 *                                        consumer_streams=(), threads=4,
 *                                        verify=True, slot_bytes=4 MiB)
 *     item: (file, offset, length, storage_type, shape, itemsize, dst, lo,
 *            key, alloc_key)
 *       the archive at [offset, offset + length) of paths[file] holds a
 *       saved chunk of `shape` (`itemsize` bytes an element) of storage
 *       type `storage_type` ("" for raw bytes, as read_items); its tensor
 *       bytes [lo, lo + dst's byte size) go into dst, a contiguous CUDA
 *       tensor (or an unused DLPack capsule of one); key names it in
 *       errors; alloc_key names dst's device allocation (0: unknown)
 *     ring: the contiguous host buffer the slots are cut from, page-locked
 *       with cuda_host_register (pageable works, the copies then wait)
 *     consumer_streams: [(device_id, stream), ...] as cuda_copy_from_host
 *   -> failures as read_items ([(item, code, errno, message), ...]: 1 the
 *      record is left to torch.load, 2 corrupt, 3 I/O, 4 CRC), and a dict
 *      saying what ran (units, copies, batched calls, slot reuses, ...).
 *
 * With the GIL: every item and its destination checked (ValueError naming
 * the key), the devices' streams made to wait for the consumers' pending
 * work, the events created.  Then without it:
 *  1. archives longer than a slot have their head and tail windows read
 *     and parsed (where their tensor bytes lie, the recorded CRC) by the
 *     worker threads;
 *  2. the work is cut into units in file order: a *run* (small archives of
 *     one file lying next to each other, at most a slot in all: one pread)
 *     or a *piece* (a slot's worth of a long archive's tensor bytes).  Each
 *     worker thread takes the next unit, takes a free slot (else the one
 *     whose copies were queued first, once its event says they are done),
 *     reads into it, computes the CRC on the bytes
 *     just read (a piece's CRC is combined with the others' afterwards:
 *     one pass over the bytes), swaps the byte order if the archive asks,
 *     and queues the slot's copies on dcpx's stream of each device they go
 *     to (per device one batched call where the driver has
 *     cuMemcpyBatchAsync and the ring is page-locked; else one
 *     cuMemcpyHtoDAsync per run of copies adjacent on both sides within one
 *     allocation) and the slot's event for the device after them;
 *  3. items whose destinations overlap another's (tied weights) are read
 *     afterwards by the calling thread alone, one after another in
 *     torch's order (the files as they first appear, then the items'), so
 *     that the last one wins; never batched (a batch has no order);
 *  4. per device an event after every copy that the consumer streams wait
 *     on, and the host waits for it (the ring is reused by the next load).
 * A CUDA failure stops the workers at their next unit; every stream is
 * drained before CudaError (naming the call, the key and the device; for a
 * failed wait, the keys of the slot or device it covered) is raised, so no
 * copy reads the ring once the call has returned.  A read failure (I/O,
 * corrupt record, CRC) is the item's own and the others go on, as in
 * read_items; a long archive's pieces may be on the device by the time its
 * CRC is known to fail, so a failed load leaves its destinations undefined,
 * as a failed CPU load does.  Worker threads touch plain structs only. */
#include "cuda_api.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PIPE_GAP ((uint64_t)4 << 10)    /* largest gap read through in a run */
#define PIPE_RUN_ITEMS 1024             /* archives in one run */
#define PIPE_SUB ((size_t)1 << 20)      /* a piece is read and CRC'd by this */
#define PIPE_MAX_THREADS 64

enum { U_RUN, U_PIECE };
enum { S_FREE, S_FILL, S_FLIGHT, S_RECLAIM };
enum { ST_UNITS, ST_HTOD, ST_BATCH, ST_BATCHED,
       ST_MERGED, ST_REUSES, ST_READ, ST_N };

typedef struct {
    dcpx_ritem r;            /* r.dest: the saved chunk's description */
    int64_t shape[16];
    int dev;                 /* index into the job's devices (< 64) */
    CUdeviceptr dptr;
    uint64_t lo, n;          /* tensor bytes [lo, lo + n) go to dptr */
    unsigned long long alloc;
    int large;               /* longer than a slot: read in pieces */
    int serial;              /* its destination overlaps another's */
    dcpx_archive_loc loc;    /* large: where its tensor bytes lie */
    Py_ssize_t piece0;       /* large: its first piece's CRC */
    uint64_t npieces;
    atomic_int failed;       /* large: a piece failed (failure in r) */
} pitem;

typedef struct {
    int kind;
    Py_ssize_t a, b;         /* run: order[a .. b); piece: item a, piece b */
} unit;

typedef struct {
    unsigned char *p;
    int state;
    uint64_t devs;           /* devices (bits) with copies in flight */
    uint64_t seq;            /* when they were queued */
    Py_ssize_t unit;         /* whose copies they are (errors) */
    const unit *u;
} slot;

typedef struct {
    pitem *items;
    Py_ssize_t n;
    Py_ssize_t *order;       /* parallel items by (file, offset), then the
                              * serial ones in torch's order */
    Py_ssize_t norder, nserial;
    unit *units, *sunits;    /* the parallel pass's, the serial pass's */
    Py_ssize_t nunits, nsunits;
    atomic_long next;
    Py_ssize_t *large;
    Py_ssize_t nlarge;
    atomic_long next_large;
    uint32_t *piece_crc;
    char **paths;
    int *fds;
    const char **fwhy;
    Py_ssize_t nfiles;
    slot *slots;
    int nslots;
    size_t slot_bytes;
    CUevent *ev;             /* nslots * ndevs: slot s, device d */
    int ndevs;
    int dev_id[DCPX_CUDA_MAX_DEVICES];
    dcpx_cuda_device *devs[DCPX_CUDA_MAX_DEVICES];
    CUevent done[DCPX_CUDA_MAX_DEVICES];
    const dcpx_cuda_stream *cons;
    Py_ssize_t ncons;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t seq;
    atomic_int cancel;
    int verify, batch, pinned, nthreads;
    dcpx_cuda_err err;       /* the first CUDA failure (under mu) */
    const unit *err_unit;    /* the slot's unit whose wait failed */
    atomic_long st[ST_N];
} pjob;

/* A worker's own: the device whose context it made current, and the
 * arrays of one slot's copies. */
typedef struct {
    int cur;
    int oom;
    CUdeviceptr *dsts, *srcs;
    size_t *sizes;
    Py_ssize_t *idx;
    unsigned long long *alloc;
    unsigned char **from;    /* a run's items: their bytes in the slot */
} wstate;

static void stat_add(pjob *j, int k, long n)
{
    atomic_fetch_add_explicit(&j->st[k], n, memory_order_relaxed);
}

/* Record the first CUDA failure and stop the workers. */
static void cuda_fail(pjob *j, CUresult rc, const char *call, Py_ssize_t item,
                      int dev, const unit *u)
{
    pthread_mutex_lock(&j->mu);
    if (j->err.rc == CUDA_SUCCESS)
        j->err_unit = u;
    dcpx_cuda_note(&j->err, rc, call, item, j->dev_id[dev]);
    atomic_store(&j->cancel, 1);
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* ---------------------------------------------------------------- slots */

/* A slot to fill: a free one, else the one whose copies were queued first,
 * once its event says they are done (waited for in the event's device's
 * context, made w's current).  NULL once the load is cancelled. */
static slot *slot_acquire(pjob *j, wstate *w)
{
    pthread_mutex_lock(&j->mu);
    for (;;) {
        slot *best = NULL;
        if (atomic_load(&j->cancel))
            break;
        for (int i = 0; i < j->nslots && best == NULL; i++)
            if (j->slots[i].state == S_FREE)
                best = &j->slots[i];
        if (best != NULL) {
            best->state = S_FILL;
            best->devs = 0;
            pthread_mutex_unlock(&j->mu);
            return best;
        }
        for (int i = 0; i < j->nslots; i++)
            if (j->slots[i].state == S_FLIGHT &&
                (best == NULL || j->slots[i].seq < best->seq))
                best = &j->slots[i];
        if (best == NULL) {
            /* every slot is being filled or reclaimed by another thread */
            pthread_cond_wait(&j->cv, &j->mu);
            continue;
        }
        best->state = S_RECLAIM;
        pthread_mutex_unlock(&j->mu);
        CUresult rc = CUDA_SUCCESS;
        int d;
        for (d = 0; d < j->ndevs && rc == CUDA_SUCCESS; d++) {
            if (!(best->devs >> d & 1))
                continue;
            if (w->cur != d) {
                rc = dcpx_cu.cuCtxSetCurrent(j->devs[d]->ctx);
                w->cur = rc == CUDA_SUCCESS ? d : -1;
            }
            if (rc == CUDA_SUCCESS)
                rc = dcpx_cu.cuEventSynchronize(
                    j->ev[(best - j->slots) * j->ndevs + d]);
        }
        stat_add(j, ST_REUSES, 1);
        if (rc != CUDA_SUCCESS) {
            cuda_fail(j, rc, "cuEventSynchronize (host-to-device copies)", -1,
                      d - 1, best->u);
            pthread_mutex_lock(&j->mu);
            best->state = S_FREE;
            break;
        }
        pthread_mutex_lock(&j->mu);
        best->state = S_FILL;
        best->devs = 0;
        pthread_mutex_unlock(&j->mu);
        return best;
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

static void slot_release(pjob *j, slot *s, int in_flight, const unit *u)
{
    pthread_mutex_lock(&j->mu);
    if (in_flight) {
        s->state = S_FLIGHT;
        s->seq = ++j->seq;
        s->u = u;
    }
    else {
        s->state = S_FREE;
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* ----------------------------------------------------------- the copies */

/* Queue copies of a slot (w's arrays, m of them, all for device `dev`) and
 * the slot's event for that device after them.  1 queued, 0 nothing to
 * queue, -1 a CUDA failure (recorded). */
static int issue(pjob *j, wstate *w, slot *s, int dev, size_t m)
{
    dcpx_cuda_device *d = j->devs[dev];
    CUresult rc;
    if (m == 0)
        return 0;
    if (w->cur != dev) {
        if ((rc = dcpx_cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS) {
            cuda_fail(j, rc, "cuCtxSetCurrent", w->idx[0], dev, NULL);
            return -1;
        }
        w->cur = dev;
    }
    if (j->batch && m > 1 && dcpx_cuda_batch_api() != NULL) {
        Py_ssize_t failed;
        rc = dcpx_cuda_memcpy_batch(w->dsts, w->srcs, w->sizes, m, d->stream,
                                    &failed);
        if (rc != CUDA_SUCCESS) {
            cuda_fail(j, rc, dcpx_cuda_batch_call(failed >= 0),
                      w->idx[failed >= 0 ? failed : 0], dev, NULL);
            return -1;
        }
        stat_add(j, ST_BATCH, 1);
        stat_add(j, ST_BATCHED, (long)m);
        dcpx_cuda_count(DCPX_CUDA_N_BATCH_HTOD, 1);
        dcpx_cuda_count(DCPX_CUDA_N_BATCHED_HTOD, (long)m);
    }
    else {
        /* Copies adjacent on both sides, into one allocation: one call. */
        size_t k = 0;
        for (size_t q = 1; q < m; q++) {
            if (w->alloc[q] != 0 && w->alloc[q] == w->alloc[k] &&
                w->dsts[k] + w->sizes[k] == w->dsts[q] &&
                w->srcs[k] + w->sizes[k] == w->srcs[q]) {
                w->sizes[k] += w->sizes[q];
                continue;
            }
            k++;
            w->dsts[k] = w->dsts[q];
            w->srcs[k] = w->srcs[q];
            w->sizes[k] = w->sizes[q];
            w->idx[k] = w->idx[q];
            w->alloc[k] = w->alloc[q];
        }
        stat_add(j, ST_MERGED, (long)(m - (k + 1)));
        for (size_t q = 0; q <= k; q++) {
            rc = dcpx_cu.cuMemcpyHtoDAsync_v2(
                w->dsts[q], (const void *)(uintptr_t)w->srcs[q], w->sizes[q],
                d->stream);
            if (rc != CUDA_SUCCESS) {
                cuda_fail(j, rc, "cuMemcpyHtoDAsync", w->idx[q], dev, NULL);
                return -1;
            }
            stat_add(j, ST_HTOD, 1);
            dcpx_cuda_count(DCPX_CUDA_N_HTOD, 1);
        }
    }
    rc = dcpx_cu.cuEventRecord(j->ev[(s - j->slots) * j->ndevs + dev],
                               d->stream);
    if (rc != CUDA_SUCCESS) {
        cuda_fail(j, rc, "cuEventRecord", w->idx[0], dev, NULL);
        return -1;
    }
    s->devs |= (uint64_t)1 << dev;
    return 1;
}

static void add_copy(wstate *w, size_t *m, const pitem *it, Py_ssize_t i,
                     CUdeviceptr dst, const unsigned char *src, size_t n)
{
    w->dsts[*m] = dst;
    w->srcs[*m] = (CUdeviceptr)(uintptr_t)src;
    w->sizes[*m] = n;
    w->idx[*m] = i;
    w->alloc[*m] = it->alloc;
    (*m)++;
}

/* ------------------------------------------------------------ the units */

static int file_usable(pjob *j, pitem *it)
{
    int fd = j->fds[it->r.file];
    if (fd >= 0)
        return 1;
    if (j->fwhy[it->r.file] != NULL)
        dcpx_ritem_fail(&it->r, DCPX_RD_CORRUPT, 0, j->fwhy[it->r.file]);
    else
        dcpx_ritem_fail(&it->r, DCPX_RD_IO, -fd - 1, "open failed");
    return 0;
}

/* A run: small archives order[a .. b) of one file, read with one pread
 * (each alone if that comes back short, so that each reports its own
 * error), parsed, CRC-checked and byte-swapped in the slot, and their
 * tensor bytes copied to the device from there. */
static int fill_run(pjob *j, wstate *w, const unit *u, slot *s)
{
    pitem *first = &j->items[j->order[u->a]];
    uint64_t beg = first->r.offset, end = beg, done = 0;
    size_t m = 0;
    int fd, any = 0;

    if (!file_usable(j, first)) {
        for (Py_ssize_t k = u->a + 1; k < u->b; k++)
            file_usable(j, &j->items[j->order[k]]);
        return 0;
    }
    fd = j->fds[first->r.file];
    for (Py_ssize_t k = u->a; k < u->b; k++) {
        const pitem *it = &j->items[j->order[k]];
        if (it->r.offset + it->r.length > end)
            end = it->r.offset + it->r.length;
    }
    if (dcpx_pread_all(fd, s->p, end - beg, beg) < 0) {
        for (Py_ssize_t k = u->a; k < u->b; k++) {
            pitem *it = &j->items[j->order[k]];
            if (dcpx_pread_all(fd, s->p + (it->r.offset - beg), it->r.length,
                               it->r.offset) < 0)
                dcpx_ritem_io_fail(&it->r, "read");
        }
    }
    stat_add(j, ST_READ, (long)(end - beg));
    for (Py_ssize_t k = u->a; k < u->b; k++) {
        Py_ssize_t i = j->order[k];
        pitem *it = &j->items[i];
        unsigned char *mem = s->p + (it->r.offset - beg);
        dcpx_archive_loc loc = {0, it->r.length, 0, 0, 1};
        w->from[k - u->a] = NULL;
        if (it->r.code != DCPX_RD_OK)
            continue;
        if (it->r.storage_type[0] == '\0') {
            if (it->r.length != it->r.dest.nbytes) {
                dcpx_ritem_fail(&it->r, DCPX_RD_CORRUPT, 0, "raw tensor extent "
                                "does not match its shape and dtype");
                continue;
            }
        }
        else if (dcpx_archive_locate(fd, j->verify, &it->r, NULL, mem,
                                     &loc) < 0)
            continue;
        if (j->verify && loc.len &&
            dcpx_archive_check_crc(&it->r, loc.crc,
                                   dcpx_crc32(0, mem + loc.at, loc.len)) < 0)
            continue;
        if (loc.swap && loc.len)
            dcpx_byteswap(mem + loc.at, loc.len, loc.swap);
        if (it->n > 0)
            w->from[k - u->a] = mem + loc.at + it->lo;
    }
    /* The copies, device by device (in the order the devices first come),
     * each device's in one go. */
    for (Py_ssize_t k = u->a; k < u->b; k++) {
        int dev = j->items[j->order[k]].dev, q;
        if (w->from[k - u->a] == NULL || (done >> dev & 1))
            continue;
        done |= (uint64_t)1 << dev;
        m = 0;
        for (Py_ssize_t x = k; x < u->b; x++) {
            const pitem *it = &j->items[j->order[x]];
            if (w->from[x - u->a] != NULL && it->dev == dev)
                add_copy(w, &m, it, j->order[x], it->dptr, w->from[x - u->a],
                         it->n);
        }
        if ((q = issue(j, w, s, dev, m)) < 0)
            return -1;
        any |= q;
    }
    return any;
}

static void piece_io_fail(pitem *it)
{
    int expect = 0;
    int err = errno;
    if (atomic_compare_exchange_strong(&it->failed, &expect, 1)) {
        errno = err;
        dcpx_ritem_io_fail(&it->r, "read");
    }
}

/* A piece: bytes [k * slot, (k + 1) * slot) of a long archive's tensor
 * bytes, read and CRC'd a PIPE_SUB at a time (cache-hot), its CRC kept for
 * the combination, and the part of it inside [lo, lo + n) copied. */
static int fill_piece(pjob *j, wstate *w, const unit *u, slot *s)
{
    pitem *it = &j->items[u->a];
    const uint64_t S = j->slot_bytes, start = (uint64_t)u->b * S;
    const uint64_t n = it->loc.len - start < S ? it->loc.len - start : S;
    const uint64_t off = it->r.offset + it->loc.at + start;
    int fd = j->fds[it->r.file];
    uint32_t crc = 0;
    size_t m = 0;

    for (uint64_t done = 0; done < n; done += PIPE_SUB) {
        size_t c = n - done < PIPE_SUB ? (size_t)(n - done) : PIPE_SUB;
        if (atomic_load(&it->failed))
            return 0;
        if (dcpx_pread_all(fd, s->p + done, c, off + done) < 0) {
            piece_io_fail(it);
            return 0;
        }
        if (j->verify)
            crc = dcpx_crc32(crc, s->p + done, c);
    }
    stat_add(j, ST_READ, (long)n);
    j->piece_crc[it->piece0 + u->b] = crc;
    if (it->loc.swap)
        dcpx_byteswap(s->p, n, it->loc.swap);
    uint64_t a = start > it->lo ? start : it->lo;
    uint64_t b = start + n < it->lo + it->n ? start + n : it->lo + it->n;
    if (a < b)
        add_copy(w, &m, it, u->a, it->dptr + (a - it->lo), s->p + (a - start),
                 (size_t)(b - a));
    return issue(j, w, s, it->dev, m);
}

static void run_unit(pjob *j, wstate *w, const unit *u)
{
    slot *s;
    int q;
    if (u->kind == U_PIECE && atomic_load(&j->items[u->a].failed))
        return;
    if (w->oom) {
        int expect = 0;
        for (Py_ssize_t k = u->a; u->kind == U_RUN && k < u->b; k++)
            dcpx_ritem_fail(&j->items[j->order[k]].r, DCPX_RD_IO, ENOMEM,
                            "out of memory");
        if (u->kind == U_PIECE &&
            atomic_compare_exchange_strong(&j->items[u->a].failed, &expect, 1))
            dcpx_ritem_fail(&j->items[u->a].r, DCPX_RD_IO, ENOMEM,
                            "out of memory");
        return;
    }
    if ((s = slot_acquire(j, w)) == NULL)
        return;
    stat_add(j, ST_UNITS, 1);
    q = u->kind == U_RUN ? fill_run(j, w, u, s) : fill_piece(j, w, u, s);
    slot_release(j, s, q == 1, u);
}

static void wstate_init(wstate *w)
{
    memset(w, 0, sizeof(*w));
    w->cur = -1;
    w->dsts = malloc(PIPE_RUN_ITEMS * sizeof(*w->dsts));
    w->srcs = malloc(PIPE_RUN_ITEMS * sizeof(*w->srcs));
    w->sizes = malloc(PIPE_RUN_ITEMS * sizeof(*w->sizes));
    w->idx = malloc(PIPE_RUN_ITEMS * sizeof(*w->idx));
    w->alloc = malloc(PIPE_RUN_ITEMS * sizeof(*w->alloc));
    w->from = malloc(PIPE_RUN_ITEMS * sizeof(*w->from));
    w->oom = !w->dsts || !w->srcs || !w->sizes || !w->idx || !w->alloc ||
             !w->from;
}

static void wstate_free(wstate *w)
{
    free(w->dsts);
    free(w->srcs);
    free(w->sizes);
    free(w->idx);
    free(w->alloc);
    free(w->from);
}

static void *pworker(void *arg)
{
    pjob *j = arg;
    wstate w;
    CUcontext saved = NULL;
    wstate_init(&w);
    dcpx_cu.cuCtxGetCurrent(&saved);
    for (;;) {
        long u;
        if (atomic_load(&j->cancel))
            break;
        u = atomic_fetch_add(&j->next, 1);
        if (u >= j->nunits)
            break;
        run_unit(j, &w, &j->units[u]);
    }
    dcpx_cu.cuCtxSetCurrent(saved);
    wstate_free(&w);
    return NULL;
}

/* Phase 1: where a long archive's tensor bytes lie. */
static void *locate_worker(void *arg)
{
    pjob *j = arg;
    unsigned char *scratch = malloc(2 * DCPX_READ_WINDOW);
    for (;;) {
        long x = atomic_fetch_add(&j->next_large, 1);
        if (x >= j->nlarge)
            break;
        pitem *it = &j->items[j->large[x]];
        if (!file_usable(j, it))
            continue;
        if (it->r.storage_type[0] == '\0') {
            it->loc.at = 0;
            it->loc.len = it->r.length;
            if (it->r.length != it->r.dest.nbytes)
                dcpx_ritem_fail(&it->r, DCPX_RD_CORRUPT, 0, "raw tensor extent "
                                "does not match its shape and dtype");
        }
        else if (scratch == NULL)
            dcpx_ritem_fail(&it->r, DCPX_RD_IO, ENOMEM, "out of memory");
        else
            dcpx_archive_locate(j->fds[it->r.file], j->verify, &it->r, scratch,
                                NULL, &it->loc);
    }
    free(scratch);
    return NULL;
}

/* ------------------------------------------------------ planning, no GIL */

typedef struct {
    Py_ssize_t file;
    uint64_t offset;
    Py_ssize_t index;
} okey;

static int okey_cmp(const void *pa, const void *pb)
{
    const okey *x = pa, *y = pb;
    if (x->file != y->file)
        return x->file < y->file ? -1 : 1;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

typedef struct {
    int dev;
    CUdeviceptr beg, end;
    Py_ssize_t index;
} span;

static int span_cmp(const void *pa, const void *pb)
{
    const span *x = pa, *y = pb;
    if (x->dev != y->dev)
        return x->dev < y->dev ? -1 : 1;
    if (x->beg != y->beg)
        return x->beg < y->beg ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

/* Mark the items whose destination bytes overlap another's (serial), and
 * put them at the end of j->order in torch's order: the files in the
 * order they first appear among the items, then the items' own.  -1
 * without memory. */
static int find_serial(pjob *j)
{
    span *sp = malloc(sizeof(span) * (size_t)(j->n ? j->n : 1));
    Py_ssize_t *rank = malloc(sizeof(Py_ssize_t) * (size_t)(j->nfiles + 1));
    Py_ssize_t ns = 0, m = 0;
    if (sp == NULL || rank == NULL) {
        free(sp);
        free(rank);
        return -1;
    }
    for (Py_ssize_t i = 0; i < j->n; i++) {
        const pitem *it = &j->items[i];
        if (it->n == 0)
            continue;
        sp[ns].dev = j->dev_id[it->dev];
        sp[ns].beg = it->dptr;
        sp[ns].end = it->dptr + it->n;
        sp[ns].index = i;
        ns++;
    }
    qsort(sp, (size_t)ns, sizeof(span), span_cmp);
    /* clusters of overlapping spans, in address order per device */
    CUdeviceptr end = 0;
    Py_ssize_t first = 0;
    for (Py_ssize_t k = 0; k <= ns; k++) {
        if (k < ns && k > first && sp[k].dev == sp[first].dev &&
            sp[k].beg < end) {
            if (sp[k].end > end)
                end = sp[k].end;
            continue;
        }
        if (k - first > 1)
            for (Py_ssize_t q = first; q < k; q++)
                j->items[sp[q].index].serial = 1;
        if (k < ns) {
            first = k;
            end = sp[k].end;
        }
    }
    for (Py_ssize_t f = 0; f < j->nfiles; f++)
        rank[f] = -1;
    for (Py_ssize_t i = 0, r = 0; i < j->n; i++)
        if (rank[j->items[i].r.file] < 0)
            rank[j->items[i].r.file] = r++;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (!j->items[i].serial)
            continue;
        sp[m].dev = 0;
        sp[m].beg = (CUdeviceptr)rank[j->items[i].r.file];
        sp[m].index = i;
        m++;
    }
    qsort(sp, (size_t)m, sizeof(span), span_cmp);
    j->nserial = m;
    for (Py_ssize_t q = 0; q < m; q++)
        j->order[j->n - m + q] = sp[q].index;
    free(sp);
    free(rank);
    return 0;
}

/* j->order's parallel part, sorted by (file, offset).  -1 without memory. */
static int sort_parallel(pjob *j)
{
    okey *keys = malloc(sizeof(okey) * (size_t)(j->n ? j->n : 1));
    Py_ssize_t m = 0;
    if (keys == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        if (j->items[i].serial)
            continue;
        keys[m].file = j->items[i].r.file;
        keys[m].offset = j->items[i].r.offset;
        keys[m].index = i;
        m++;
    }
    qsort(keys, (size_t)m, sizeof(okey), okey_cmp);
    for (Py_ssize_t q = 0; q < m; q++)
        j->order[q] = keys[q].index;
    j->norder = m;
    free(keys);
    return 0;
}

/* Cut order[from .. to) into units (runs of small archives, a long
 * archive's pieces) into *out; each serial item alone (serial).  Returns
 * the count, or -1 without memory. */
static Py_ssize_t make_units(pjob *j, Py_ssize_t from, Py_ssize_t to,
                             int serial, unit **out)
{
    Py_ssize_t cap = 0, nu = 0;
    const uint64_t S = j->slot_bytes;
    for (Py_ssize_t k = from; k < to; k++) {
        const pitem *it = &j->items[j->order[k]];
        cap += it->large ? (Py_ssize_t)it->npieces : 1;
    }
    unit *u = malloc(sizeof(unit) * (size_t)(cap ? cap : 1));
    if (u == NULL)
        return -1;
    uint64_t beg = 0, end = 0;
    for (Py_ssize_t k = from; k < to; k++) {
        Py_ssize_t i = j->order[k];
        const pitem *it = &j->items[i];
        if (it->large) {
            if (it->r.code != DCPX_RD_OK)
                continue;
            for (uint64_t p = 0; p < it->npieces; p++) {
                /* unverified: a piece outside [lo, lo + n) is not read */
                if (!j->verify && ((p + 1) * S <= it->lo ||
                                   p * S >= it->lo + it->n))
                    continue;
                u[nu++] = (unit){U_PIECE, i, (Py_ssize_t)p};
            }
            continue;
        }
        uint64_t e = it->r.offset + it->r.length;
        const unit *last = nu ? &u[nu - 1] : NULL;
        const pitem *prev = last && last->kind == U_RUN
                                ? &j->items[j->order[last->b - 1]] : NULL;
        int join = !serial && prev != NULL && last->b == k &&
                   prev->r.file == it->r.file &&
                   last->b - last->a < PIPE_RUN_ITEMS &&
                   /* not over the previous archive: each archive's bytes
                    * are checked and swapped in place, once */
                   it->r.offset >= end && it->r.offset <= end + PIPE_GAP &&
                   (e > end ? e : end) - beg <= S;
        if (join) {
            u[nu - 1].b = k + 1;
            if (e > end)
                end = e;
        }
        else {
            u[nu++] = (unit){U_RUN, k, k + 1};
            beg = it->r.offset;
            end = e;
        }
    }
    *out = u;
    return nu;
}

/* Phase 1 and the units: -1 without memory. */
static int plan(pjob *j)
{
    Py_ssize_t npieces = 0;
    if (find_serial(j) < 0 || sort_parallel(j) < 0)
        return -1;
    j->large = malloc(sizeof(Py_ssize_t) * (size_t)(j->n ? j->n : 1));
    if (j->large == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < j->n; i++)
        if (j->items[i].large)
            j->large[j->nlarge++] = i;
    if (j->nlarge > 0)
        dcpx_run_workers(locate_worker, j, j->nthreads < j->nlarge
                                               ? j->nthreads : (int)j->nlarge);
    for (Py_ssize_t x = 0; x < j->nlarge; x++) {
        pitem *it = &j->items[j->large[x]];
        if (it->r.code != DCPX_RD_OK)
            continue;
        it->piece0 = npieces;
        it->npieces = (it->loc.len + j->slot_bytes - 1) / j->slot_bytes;
        npieces += (Py_ssize_t)it->npieces;
    }
    j->piece_crc = malloc(sizeof(uint32_t) * (size_t)(npieces ? npieces : 1));
    if (j->piece_crc == NULL)
        return -1;
    j->nunits = make_units(j, 0, j->norder, 0, &j->units);
    if (j->nunits < 0)
        return -1;
    j->nsunits = make_units(j, j->norder, j->n, 1, &j->sunits);
    return j->nsunits < 0 ? -1 : 0;
}

/* After both passes: a long archive's CRC from its pieces'. */
static void check_pieces(pjob *j)
{
    for (Py_ssize_t x = 0; x < j->nlarge; x++) {
        pitem *it = &j->items[j->large[x]];
        uint32_t crc = 0;
        if (it->r.code != DCPX_RD_OK || it->loc.crc == 0 || it->npieces == 0)
            continue;
        for (uint64_t p = 0; p < it->npieces; p++) {
            uint64_t len = it->loc.len - p * j->slot_bytes;
            if (len > j->slot_bytes)
                len = j->slot_bytes;
            crc = p ? dcpx_crc32_combine(crc, j->piece_crc[it->piece0 + p], len)
                    : j->piece_crc[it->piece0];
        }
        dcpx_archive_check_crc(&it->r, it->loc.crc, crc);
    }
}

/* Per device: the event after every copy, the consumers made to wait on
 * it, and the host's wait; after a failure, every stream drained. */
static void finish(pjob *j)
{
    CUcontext saved = NULL;
    dcpx_cu.cuCtxGetCurrent(&saved);
    for (int d = 0; d < j->ndevs && !atomic_load(&j->cancel); d++) {
        dcpx_cuda_device *dv = j->devs[d];
        CUresult rc = dcpx_cu.cuCtxSetCurrent(dv->ctx);
        const char *call = "cuCtxSetCurrent";
        if (rc == CUDA_SUCCESS) {
            call = "cuEventRecord";
            rc = dcpx_cu.cuEventRecord(j->done[d], dv->stream);
        }
        for (Py_ssize_t c = 0; rc == CUDA_SUCCESS && c < j->ncons; c++) {
            if (j->cons[c].dev != j->dev_id[d])
                continue;
            call = "cuStreamWaitEvent on the consumer's stream";
            rc = dcpx_cu.cuStreamWaitEvent(j->cons[c].stream, j->done[d], 0);
        }
        if (rc == CUDA_SUCCESS) {
            call = "cuEventSynchronize (host-to-device copies)";
            rc = dcpx_cu.cuEventSynchronize(j->done[d]);
        }
        if (rc != CUDA_SUCCESS)
            cuda_fail(j, rc, call, -1, d, NULL);
    }
    if (atomic_load(&j->cancel)) {
        for (int d = 0; d < j->ndevs; d++) {
            if (dcpx_cu.cuCtxSetCurrent(j->devs[d]->ctx) == CUDA_SUCCESS)
                dcpx_cu.cuStreamSynchronize(j->devs[d]->stream);
        }
    }
    dcpx_cu.cuCtxSetCurrent(saved);
}

/* Everything without the GIL: open, plan, both passes, finish, close. */
static void run(pjob *j, int *nomem)
{
    for (Py_ssize_t f = 0; f < j->nfiles; f++) {
        j->fds[f] = dcpx_open_regular(j->paths[f], &j->fwhy[f]);
        if (j->fds[f] < 0)
            j->fds[f] = -errno - 1; /* reported per item */
    }
    if (plan(j) < 0) {
        *nomem = 1;
    }
    else {
        int t = j->nthreads < j->nunits ? j->nthreads : (int)j->nunits;
        if (j->nunits > 0)
            dcpx_run_workers(pworker, j, t > 0 ? t : 1);
        if (j->nsunits > 0 && !atomic_load(&j->cancel)) {
            /* the serial items: this thread alone, in order */
            wstate w;
            CUcontext saved = NULL;
            wstate_init(&w);
            dcpx_cu.cuCtxGetCurrent(&saved);
            for (Py_ssize_t k = 0; k < j->nsunits && !atomic_load(&j->cancel);
                 k++)
                run_unit(j, &w, &j->sunits[k]);
            dcpx_cu.cuCtxSetCurrent(saved);
            wstate_free(&w);
        }
        finish(j);
        if (j->verify && !atomic_load(&j->cancel))
            check_pieces(j);
    }
    for (Py_ssize_t f = 0; f < j->nfiles; f++)
        if (j->fds[f] >= 0)
            close(j->fds[f]);
}

/* --------------------------------------------------- the call, with GIL */

typedef struct {
    PyObject *items;         /* the caller's items (their keys) */
    dcpx_cuda_stream *cons;  /* the consumer streams (owned) */
    dcpx_view *views;        /* destinations, held until the end */
    Py_ssize_t nviews;
    dcpx_view ring;
    int have_ring;
    pjob j;
    int mutex;               /* j.mu and j.cv initialised */
} call_state;

static void call_free(call_state *c)
{
    pjob *j = &c->j;
    CUcontext saved = NULL;
    if (j->ev != NULL || j->ndevs > 0)
        dcpx_cu.cuCtxGetCurrent(&saved);
    for (int d = 0; d < j->ndevs; d++) {
        dcpx_cu.cuCtxSetCurrent(j->devs[d]->ctx);
        for (int s = 0; j->ev != NULL && s < j->nslots; s++)
            if (j->ev[s * j->ndevs + d] != NULL)
                dcpx_cu.cuEventDestroy_v2(j->ev[s * j->ndevs + d]);
        if (j->done[d] != NULL)
            dcpx_cu.cuEventDestroy_v2(j->done[d]);
    }
    if (j->ev != NULL || j->ndevs > 0)
        dcpx_cu.cuCtxSetCurrent(saved);
    for (Py_ssize_t i = 0; i < c->nviews; i++)
        dcpx_view_release(&c->views[i]);
    if (c->have_ring)
        dcpx_view_release(&c->ring);
    for (Py_ssize_t f = 0; j->paths != NULL && f < j->nfiles; f++)
        PyMem_RawFree(j->paths[f]);
    PyMem_RawFree(j->paths);
    PyMem_RawFree(j->fds);
    PyMem_RawFree(j->fwhy);
    PyMem_RawFree(c->views);
    PyMem_RawFree(c->cons);
    PyMem_RawFree(j->items);
    PyMem_RawFree(j->order);
    PyMem_RawFree(j->slots);
    PyMem_RawFree(j->ev);
    free(j->units);
    free(j->sunits);
    free(j->large);
    free(j->piece_crc);
    if (c->mutex) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
    }
    Py_CLEAR(c->items);
}

static int parse_paths(pjob *j, PyObject *paths)
{
    PyObject *fast = PySequence_Fast(paths, "dcpx: paths must be a sequence");
    if (fast == NULL)
        return -1;
    j->nfiles = PySequence_Fast_GET_SIZE(fast);
    j->paths = PyMem_RawCalloc((size_t)j->nfiles + 1, sizeof(char *));
    j->fds = PyMem_RawCalloc((size_t)j->nfiles + 1, sizeof(int));
    j->fwhy = PyMem_RawCalloc((size_t)j->nfiles + 1, sizeof(char *));
    if (j->paths == NULL || j->fds == NULL || j->fwhy == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < j->nfiles; i++) {
        PyObject *b;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &b)) {
            Py_DECREF(fast);
            return -1;
        }
        size_t n = (size_t)PyBytes_GET_SIZE(b) + 1;
        j->paths[i] = PyMem_RawMalloc(n);
        if (j->paths[i] != NULL)
            memcpy(j->paths[i], PyBytes_AS_STRING(b), n);
        Py_DECREF(b);
        if (j->paths[i] == NULL) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* The index of device `id` among the job's devices, added on first use. */
static int job_device(PyObject *module, pjob *j, int id)
{
    for (int d = 0; d < j->ndevs; d++)
        if (j->dev_id[d] == id)
            return d;
    dcpx_cuda_device *dv = dcpx_cuda_device_get(module, id);
    if (dv == NULL)
        return -1;
    j->dev_id[j->ndevs] = id;
    j->devs[j->ndevs] = dv;
    return j->ndevs++;
}

static int item_error(PyObject *key, const char *why)
{
    PyErr_Format(PyExc_ValueError, "dcpx: tensor %R %s", key, why);
    return -1;
}

/* Item i of the caller's list into j->items[i] and c->views[i]. */
static int parse_item(PyObject *module, call_state *c, Py_ssize_t i)
{
    pjob *j = &c->j;
    pitem *it = &j->items[i];
    PyObject *shape, *dst, *key, *akey = NULL, *fast;
    const char *stype;
    Py_ssize_t slen;
    unsigned long long off, len, lo, alloc = 0;
    unsigned int itemsize;
    uint64_t numel = 1;
    dcpx_view *v = &c->views[i];

    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(c->items, i),
                          "nKKs#OIOKO|O;dcpx: pipeline items are (file, "
                          "offset, length, storage_type, shape, itemsize, dst, "
                          "lo, key[, alloc_key])",
                          &it->r.file, &off, &len, &stype, &slen, &shape,
                          &itemsize, &dst, &lo, &key, &akey))
        return -1;
    if (it->r.file < 0 || it->r.file >= j->nfiles) {
        PyErr_SetString(PyExc_IndexError, "dcpx: file index out of range");
        return -1;
    }
    if ((size_t)slen >= sizeof(it->r.storage_type))
        return item_error(key, "has a storage type name too long");
    memcpy(it->r.storage_type, stype, (size_t)slen + 1);
    it->r.offset = off;
    it->r.length = len;
    if (akey != NULL && akey != Py_None) {
        alloc = PyLong_AsUnsignedLongLong(akey);
        if (alloc == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
    }
    it->alloc = alloc;
    fast = PySequence_Fast(shape, "dcpx: shape must be a sequence");
    if (fast == NULL)
        return -1;
    it->r.dest.ndim = (int)PySequence_Fast_GET_SIZE(fast);
    for (int d = 0; d < it->r.dest.ndim && d < 16; d++) {
        long long s = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, d));
        if (s < 0 || __builtin_mul_overflow(numel, (uint64_t)s, &numel)) {
            Py_DECREF(fast);
            return PyErr_Occurred() ? -1 : item_error(key, "has a bad shape");
        }
        it->shape[d] = s;
    }
    Py_DECREF(fast);
    if (it->r.dest.ndim > 16 || itemsize == 0 ||
        __builtin_mul_overflow(numel, (uint64_t)itemsize, &it->r.dest.nbytes))
        return item_error(key, "has a bad shape");
    it->r.dest.shape = it->shape;
    it->r.dest.itemsize = itemsize;
    it->r.dest.numel = numel;
    it->r.dest.contiguous = 1;
    it->r.dest.device_type = DCPX_DL_CPU;
    if (dcpx_view_from_object(dst, v, 1) < 0)
        return -1;
    c->nviews = i + 1;
    if (v->device_type != DCPX_DL_CUDA)
        return item_error(key, "is not on a CUDA device");
    if (!v->contiguous)
        return item_error(key, "is not contiguous (load into a contiguous "
                               "tensor)");
    if (v->device_id < 0 || v->device_id >= DCPX_CUDA_MAX_DEVICES)
        return item_error(key, "is on a device dcpx cannot address");
    if (lo > it->r.dest.nbytes || v->nbytes > it->r.dest.nbytes - lo)
        return item_error(key, "takes bytes past the end of the saved chunk");
    if ((it->dev = job_device(module, j, v->device_id)) < 0)
        return -1;
    it->dptr = (CUdeviceptr)(uintptr_t)v->data;
    it->lo = lo;
    it->n = v->nbytes;
    it->large = len > j->slot_bytes;
    return 0;
}

/* GIL held.  The key of item i, as text. */
static void key_text(call_state *c, Py_ssize_t i, char *out, size_t n)
{
    PyObject *t = PySequence_Fast_GET_ITEM(c->items, i);
    PyObject *s = PyTuple_Check(t) && PyTuple_GET_SIZE(t) > 8
                      ? PyObject_Str(PyTuple_GET_ITEM(t, 8)) : NULL;
    const char *u = s != NULL ? PyUnicode_AsUTF8(s) : NULL;
    if (u != NULL)
        snprintf(out, n, "'%s'", u);
    else
        snprintf(out, n, "#%zd", i);
    PyErr_Clear();
    Py_XDECREF(s);
}

/* GIL held.  CudaError for the job's failure: the item's key, else the
 * keys of the unit (a slot's copies) or of the device whose wait failed. */
static void raise_cuda(PyObject *module, call_state *c)
{
    pjob *j = &c->j;
    const dcpx_cuda_err *e = &j->err;
    char what[512], k[160];
    int len;
    if (e->index >= 0) {
        key_text(c, e->index, k, sizeof(k));
        snprintf(what, sizeof(what), "%s for tensor %s on device %d", e->call,
                 k, e->dev);
        dcpx_cuda_raise(module, e->rc, what);
        return;
    }
    len = snprintf(what, sizeof(what), "%s on device %d", e->call, e->dev);
    Py_ssize_t named = 0, total = 0;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        const unit *u = j->err_unit;
        int in;
        if (u == NULL)
            in = j->dev_id[j->items[i].dev] == e->dev && j->items[i].n > 0;
        else if (u->kind == U_PIECE)
            in = i == u->a;
        else {
            in = 0;
            for (Py_ssize_t q = u->a; q < u->b && !in; q++)
                in = j->order[q] == i;
        }
        if (!in)
            continue;
        total++;
        if (named == 4 || len < 0 || (size_t)len >= sizeof(what) - 200)
            continue;
        key_text(c, i, k, 48);
        len += snprintf(what + len, sizeof(what) - (size_t)len, "%s%s",
                        named ? ", " : " (tensors ", k);
        named++;
    }
    if (named > 0 && len > 0 && (size_t)len < sizeof(what) - 32)
        snprintf(what + len, sizeof(what) - (size_t)len,
                 total > named ? " and %zd more)" : ")", total - named);
    dcpx_cuda_raise(module, e->rc, what);
}

static PyObject *stats_dict(pjob *j)
{
    long runs = 0, pieces = 0;
    for (Py_ssize_t u = 0; u < j->nunits; u++)
        j->units[u].kind == U_RUN ? runs++ : pieces++;
    for (Py_ssize_t u = 0; u < j->nsunits; u++)
        j->sunits[u].kind == U_RUN ? runs++ : pieces++;
    return Py_BuildValue(
        "{s:i,s:i,s:n,s:i,s:l,s:l,s:l,s:n,s:l,s:l,s:l,s:l,s:l,s:l,s:z,s:O}",
        "threads", j->nthreads, "slots", j->nslots,
        "slot_bytes", (Py_ssize_t)j->slot_bytes, "devices", j->ndevs,
        "units", atomic_load(&j->st[ST_UNITS]), "runs", runs,
        "pieces", pieces, "serial", j->nserial,
        "htod_calls", atomic_load(&j->st[ST_HTOD]),
        "batch_calls", atomic_load(&j->st[ST_BATCH]),
        "batched_copies", atomic_load(&j->st[ST_BATCHED]),
        "merged", atomic_load(&j->st[ST_MERGED]),
        "slot_reuses", atomic_load(&j->st[ST_REUSES]),
        "bytes_read", atomic_load(&j->st[ST_READ]),
        "batch_api", j->batch ? dcpx_cuda_batch_api() : NULL,
        "pinned", j->pinned ? Py_True : Py_False);
}

/* The ring cut into slots, the threads and whether copies may be batched
 * (the ring page-locked, the driver's batched call there). */
static int set_up_ring(call_state *c, PyObject *ring, size_t slot_bytes,
                       int threads)
{
    pjob *j = &c->j;
    if (dcpx_view_from_object(ring, &c->ring, 1) < 0)
        return -1;
    c->have_ring = 1;
    if (c->ring.device_type != DCPX_DL_CPU || !c->ring.contiguous ||
        c->ring.nbytes / slot_bytes < 2) {
        PyErr_SetString(PyExc_ValueError, "dcpx: the ring must be a contiguous "
                        "host buffer of at least two slots");
        return -1;
    }
    j->slot_bytes = slot_bytes;
    j->nslots = (int)(c->ring.nbytes / slot_bytes < 4096
                          ? c->ring.nbytes / slot_bytes : 4096);
    j->nthreads = threads < j->nslots - 1 ? threads : j->nslots - 1;
    j->pinned = dcpx_cuda_registry_contains(c->ring.data,
                                            (size_t)c->ring.nbytes);
    j->batch = j->pinned && dcpx_cuda_batch_api() != NULL;
    j->slots = PyMem_RawCalloc((size_t)j->nslots, sizeof(slot));
    if (j->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int s = 0; s < j->nslots; s++)
        j->slots[s].p = (unsigned char *)c->ring.data + (size_t)s * slot_bytes;
    return 0;
}

static int parse_items(PyObject *module, call_state *c, PyObject *items)
{
    pjob *j = &c->j;
    c->items = PySequence_Fast(items, "dcpx: items must be a sequence");
    if (c->items == NULL)
        return -1;
    j->n = PySequence_Fast_GET_SIZE(c->items);
    j->items = PyMem_RawCalloc((size_t)j->n + 1, sizeof(pitem));
    j->order = PyMem_RawCalloc((size_t)j->n + 1, sizeof(Py_ssize_t));
    c->views = PyMem_RawCalloc((size_t)j->n + 1, sizeof(dcpx_view));
    if (!j->items || !j->order || !c->views) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < j->n; i++)
        if (parse_item(module, c, i) < 0)
            return -1;
    return 0;
}

/* The consumer streams (c->cons, owned), dcpx's stream of each device in
 * use made to wait for their pending work, and the devices' events. */
static int set_up_devices(PyObject *module, call_state *c, PyObject *cons_obj)
{
    pjob *j = &c->j;
    PyObject *cons = NULL;
    Py_ssize_t ncs = 0;
    int rc = -1;
    if (cons_obj != NULL && cons_obj != Py_None) {
        cons = PySequence_Fast(cons_obj,
                               "dcpx: consumer_streams must be a sequence");
        if (cons == NULL)
            return -1;
        ncs = PySequence_Fast_GET_SIZE(cons);
    }
    c->cons = PyMem_RawCalloc((size_t)ncs + 1, sizeof(*c->cons));
    j->ev = PyMem_RawCalloc((size_t)j->nslots * (size_t)(j->ndevs + 1),
                            sizeof(CUevent));
    if (c->cons == NULL || j->ev == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ncs; i++) {
        unsigned long long s;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(cons, i), "iK;dcpx: "
                              "consumer_streams holds (device, stream) pairs",
                              &c->cons[i].dev, &s))
            goto done;
        if (dcpx_cuda_device_get(module, c->cons[i].dev) == NULL)
            goto done;
        c->cons[i].stream = (CUstream)(uintptr_t)s;
    }
    j->cons = c->cons;
    j->ncons = ncs;
    for (int d = 0; d < j->ndevs; d++) {
        const char *call;
        char what[128];
        CUresult r;
        for (Py_ssize_t k = 0; k < ncs; k++)
            if (c->cons[k].dev == j->dev_id[d] &&
                dcpx_cuda_after_consumer(module, j->dev_id[d],
                                         c->cons[k].stream) < 0)
                goto done;
        r = dcpx_cuda_event_create(module, j->dev_id[d], &j->done[d], &call);
        for (int s = 0; s < j->nslots && r == CUDA_SUCCESS; s++)
            r = dcpx_cuda_event_create(module, j->dev_id[d],
                                       &j->ev[s * j->ndevs + d], &call);
        if (r != CUDA_SUCCESS) {
            snprintf(what, sizeof(what), "%s on device %d", call,
                     j->dev_id[d]);
            dcpx_cuda_raise(module, r, what);
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(cons);
    return rc;
}

/* (failures, stats) of a load that ran. */
static PyObject *results(call_state *c)
{
    pjob *j = &c->j;
    PyObject *failures = PyList_New(0), *stats = NULL, *out = NULL;
    for (Py_ssize_t i = 0; failures != NULL && i < j->n; i++) {
        const dcpx_ritem *r = &j->items[i].r;
        PyObject *t;
        if (r->code == DCPX_RD_OK)
            continue;
        t = Py_BuildValue("(niis)", i, r->code, r->err, r->msg);
        if (t == NULL || PyList_Append(failures, t) < 0)
            Py_CLEAR(failures);
        Py_XDECREF(t);
    }
    if (failures != NULL && (stats = stats_dict(j)) != NULL)
        out = PyTuple_Pack(2, failures, stats);
    Py_XDECREF(failures);
    Py_XDECREF(stats);
    return out;
}

PyObject *dcpx_cuda_load_pipeline(PyObject *module, PyObject *args,
                                  PyObject *kwds)
{
    static char *kwlist[] = {"paths", "items", "ring", "consumer_streams",
                             "threads", "verify", "slot_bytes", NULL};
    PyObject *paths, *items, *ring, *cons = NULL, *out = NULL;
    unsigned long long slot_bytes = 4ULL << 20;
    int threads = 4, verify = 1, nomem = 0;
    call_state c;
    pjob *j = &c.j;

    memset(&c, 0, sizeof(c));
    j->err.index = j->err.dev = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|OipK:cuda_load_pipeline",
                                     kwlist, &paths, &items, &ring, &cons,
                                     &threads, &verify, &slot_bytes))
        return NULL;
    if (threads < 1 || threads > PIPE_MAX_THREADS) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    if (slot_bytes < 4096 || slot_bytes % 64 != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: slot_bytes must be a multiple of 64, >= 4096");
        return NULL;
    }
    if (dcpx_cuda_load(module) < 0)
        return NULL;
    if (pthread_mutex_init(&j->mu, NULL) != 0 ||
        pthread_cond_init(&j->cv, NULL) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "dcpx: pthread init failed");
        return NULL;
    }
    c.mutex = 1;
    j->verify = verify;
    if (parse_paths(j, paths) < 0 ||
        set_up_ring(&c, ring, (size_t)slot_bytes, threads) < 0 ||
        parse_items(module, &c, items) < 0 ||
        set_up_devices(module, &c, cons) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    run(j, &nomem);
    Py_END_ALLOW_THREADS
    if (j->err.rc != CUDA_SUCCESS)
        raise_cuda(module, &c);
    else if (nomem)
        PyErr_NoMemory();
    else
        out = results(&c);
done:
    call_free(&c);
    return out;
}
