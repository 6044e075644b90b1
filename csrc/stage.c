/* copy_into: the staging copy.  Copies many source tensors into their
 * staging destinations with several C threads and the GIL released.
 *
 *   copy_into(pairs, threads=1)              pairs: [(src, dst), ...]
 *   copy_into(pairs, threads=1, base=buf)    pairs: [(src, byte_offset), ...]
 *
 * The second form (the stager's) takes the one destination buffer once, so
 * each tensor costs one DLPack export instead of two.
 * Sources may be strided (gathered in row-major order); destinations must
 * be contiguous, writable host memory of the same byte size (the stager's
 * reused, pre-faulted buffers).  The work is cut into tasks of at most
 * TASK bytes so that one huge tensor is still copied by every thread, and
 * threads take tasks from a shared counter.
 */
#include "dcpx.h"

#include <stdatomic.h>
#include <string.h>

#define TASK ((uint64_t)8 << 20) /* multiple of every itemsize */

typedef struct {
    int pair;
    uint64_t from, len;
} ctask;

typedef struct {
    dcpx_view *src, *dst;
    ctask *tasks;
    Py_ssize_t ntasks;
    atomic_long next;
} cjob;

static void *copy_worker(void *arg)
{
    cjob *job = arg;
    for (;;) {
        long i = atomic_fetch_add(&job->next, 1);
        if (i >= job->ntasks)
            break;
        const ctask *t = &job->tasks[i];
        dcpx_view_gather(&job->src[t->pair], t->from, t->len,
                         job->dst[t->pair].data + t->from);
    }
    return NULL;
}

/* A destination given as a byte offset into `base` (the stager's buffer):
 * a borrowed, contiguous view of the bytes [offset, offset + src->nbytes). */
static int offset_view(const dcpx_view *base, PyObject *off,
                       const dcpx_view *src, dcpx_view *dst)
{
    unsigned long long o = PyLong_AsUnsignedLongLong(off);
    if (o == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (o > base->nbytes || src->nbytes > base->nbytes - o) {
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: staging offset outside the buffer");
        return -1;
    }
    memset(dst, 0, sizeof(*dst));
    dst->data = base->data + o;
    dst->itemsize = src->itemsize;
    dst->numel = src->numel;
    dst->nbytes = src->nbytes;
    dst->device_type = base->device_type;
    dst->contiguous = 1;
    return 0; /* owns nothing: release is a no-op */
}

static int take_pair(PyObject *pair, const dcpx_view *base, dcpx_view *src,
                     dcpx_view *dst)
{
    PyObject *s, *d;
    if (!PyTuple_Check(pair)) {
        PyErr_Format(PyExc_TypeError, "dcpx: pair must be a (src, dst) tuple, "
                     "not %.200s", Py_TYPE(pair)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(pair, "OO;dcpx: pair must be (src, dst)", &s, &d))
        return -1;
    if (dcpx_view_from_object(s, src, 0) < 0)
        return -1;
    if (base != NULL ? offset_view(base, d, src, dst) < 0
                     : dcpx_view_from_object(d, dst, 1) < 0)
        return -1;
    if ((src->device_type != DCPX_DL_CPU &&
         src->device_type != DCPX_DL_CUDA_HOST) ||
        (dst->device_type != DCPX_DL_CPU &&
         dst->device_type != DCPX_DL_CUDA_HOST)) {
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: copy_into needs host-accessible tensors");
        return -1;
    }
    if (!dst->contiguous || src->nbytes != dst->nbytes ||
        src->itemsize != dst->itemsize) {
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: staging destination must be contiguous and "
                        "match the source's size and itemsize");
        return -1;
    }
    return 0;
}

PyObject *dcpx_copy_into(PyObject *Py_UNUSED(module), PyObject *args,
                         PyObject *kwds)
{
    static char *kwlist[] = {"pairs", "threads", "base", NULL};
    PyObject *pairs, *fast = NULL, *out = NULL, *base_obj = Py_None;
    int nthreads = 1;
    Py_ssize_t n = 0;
    cjob job;
    dcpx_view base, *basep = NULL;

    memset(&job, 0, sizeof(job));
    memset(&base, 0, sizeof(base));
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|iO", kwlist, &pairs,
                                     &nthreads, &base_obj))
        return NULL;
    if (nthreads < 1 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    if (base_obj != Py_None) {
        if (dcpx_view_from_object(base_obj, &base, 1) < 0)
            return NULL;
        basep = &base;
        if (!base.contiguous || (base.device_type != DCPX_DL_CPU &&
                                 base.device_type != DCPX_DL_CUDA_HOST)) {
            dcpx_view_release(&base);
            PyErr_SetString(PyExc_ValueError,
                            "dcpx: base must be contiguous host memory");
            return NULL;
        }
    }
    fast = PySequence_Fast(pairs, "dcpx: pairs must be a sequence");
    if (fast == NULL) {
        dcpx_view_release(&base);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(fast);
    job.src = PyMem_RawCalloc((size_t)n + 1, sizeof(dcpx_view));
    job.dst = PyMem_RawCalloc((size_t)n + 1, sizeof(dcpx_view));
    if (job.src == NULL || job.dst == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t ntasks = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (take_pair(PySequence_Fast_GET_ITEM(fast, i), basep, &job.src[i],
                      &job.dst[i]) < 0)
            goto done;
        ntasks += (Py_ssize_t)((job.src[i].nbytes + TASK - 1) / TASK);
    }
    job.tasks = PyMem_RawMalloc(((size_t)ntasks + 1) * sizeof(ctask));
    if (job.tasks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        for (uint64_t from = 0; from < job.src[i].nbytes; from += TASK) {
            ctask *t = &job.tasks[job.ntasks++];
            t->pair = (int)i;
            t->from = from;
            t->len = job.src[i].nbytes - from < TASK ? job.src[i].nbytes - from
                                                     : TASK;
        }
    if (nthreads > job.ntasks)
        nthreads = job.ntasks > 0 ? (int)job.ntasks : 1;
    Py_BEGIN_ALLOW_THREADS
    dcpx_run_workers(copy_worker, &job, nthreads);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    out = Py_None;
done:
    for (Py_ssize_t i = 0; job.src && i < n; i++)
        dcpx_view_release(&job.src[i]);
    for (Py_ssize_t i = 0; job.dst && i < n; i++)
        dcpx_view_release(&job.dst[i]);
    PyMem_RawFree(job.src);
    PyMem_RawFree(job.dst);
    PyMem_RawFree(job.tasks);
    Py_DECREF(fast);
    dcpx_view_release(&base);
    return out;
}

/* prefault(tensor, threads=1): fault in every page of a freshly mapped
 * staging buffer with the GIL released, so that allocating a stager's
 * buffer never stalls Python threads and later staging copies take no page
 * faults.  Asks for transparent huge pages first (fewer faults; ignored
 * where unsupported), then MADV_POPULATE_WRITE (Linux >= 5.14), and falls
 * back to touching one byte per page on several threads. */
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef struct {
    char *base;
    size_t len, page;
    atomic_long next;
    long nblocks;
} pjob;

#define PBLOCK ((size_t)64 << 20)

static void *prefault_worker(void *arg)
{
    pjob *j = arg;
    for (;;) {
        long b = atomic_fetch_add(&j->next, 1);
        if (b >= j->nblocks)
            break;
        size_t from = (size_t)b * PBLOCK;
        size_t to = from + PBLOCK < j->len ? from + PBLOCK : j->len;
        if (madvise(j->base + from, to - from, MADV_POPULATE_WRITE) == 0)
            continue;
        for (size_t o = from; o < to; o += j->page)
            ((volatile char *)j->base)[o] = 0; /* new mappings read as zero */
    }
    return NULL;
}

PyObject *dcpx_prefault(PyObject *Py_UNUSED(module), PyObject *args,
                        PyObject *kwds)
{
    static char *kwlist[] = {"tensor", "threads", NULL};
    PyObject *obj;
    int nthreads = 1;
    dcpx_view v;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|i", kwlist, &obj,
                                     &nthreads))
        return NULL;
    if (nthreads < 1 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    if (dcpx_view_from_object(obj, &v, 1) < 0)
        return NULL;
    if (v.device_type != DCPX_DL_CPU || !v.contiguous) {
        dcpx_view_release(&v);
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: prefault needs a contiguous CPU tensor");
        return NULL;
    }
    pjob j;
    j.page = (size_t)sysconf(_SC_PAGESIZE);
    /* madvise needs page-aligned ranges: round inward to whole pages. */
    uintptr_t start = ((uintptr_t)v.data + j.page - 1) & ~(uintptr_t)(j.page - 1);
    uintptr_t end = ((uintptr_t)v.data + v.nbytes) & ~(uintptr_t)(j.page - 1);
    j.base = (char *)start;
    j.len = end > start ? end - start : 0;
    j.nblocks = (long)((j.len + PBLOCK - 1) / PBLOCK);
    atomic_init(&j.next, 0);
    Py_BEGIN_ALLOW_THREADS
    if (j.len) {
        madvise(j.base, j.len, MADV_HUGEPAGE); /* best effort */
        dcpx_run_workers(prefault_worker, &j,
                         nthreads < j.nblocks ? nthreads : (int)j.nblocks);
    }
    Py_END_ALLOW_THREADS
    dcpx_view_release(&v);
    Py_RETURN_NONE;
}
