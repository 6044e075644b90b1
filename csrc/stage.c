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

/* stage_plain(values, entries, base, threads=1) -> bool: the stager's
 * copy when a state dict has the layout it staged last time.
 *
 * entries: one (index, type, dtype, shape, requires_grad, offset, nbytes,
 * is_complex) per plain CPU tensor of the layout (staging.py, _Layout):
 * values[index] must still be a contiguous, strided CPU tensor of exactly
 * that type, dtype, shape and requires_grad, without neg (or, complex,
 * conj) bit, with memory.  Each is checked through its own getters (one C
 * call each, no Python frame: ~0.3 us a tensor, most of it in torch) and
 * its data pointer read, holding the GIL (dropped for a moment every 1024
 * entries, so that other threads are not held for the whole check).
 *
 * The copy is pipelined with the checks: worker threads (no GIL, no Python
 * object) copy the runs already checked while the caller's thread checks
 * the next ones, so the per-tensor work hides behind the copy; the caller
 * joins the copy once every entry is checked.  Runs adjacent both in the
 * sources (views of one storage) and in the buffer are one memcpy; runs
 * are handed out in tasks of about GROUP bytes, big ones cut at TASK.
 *
 * Returns False on the first entry that differs (or whose getters raise),
 * after the workers stopped: the bytes copied so far went to the stager's
 * own buffer, which the caller then stages again the general way (which
 * names what is wrong).  values must keep the tensors alive until return. */
#include <pthread.h>

#define GROUP ((uint64_t)1 << 20)

typedef struct {
    const char *src;
    char *dst;
    uint64_t len;
} prun;

typedef struct {
    Py_ssize_t first, count; /* runs [first, first + count) */
    uint64_t from, len;      /* count == 1: the bytes [from, from + len) */
} ptask;

typedef struct {
    prun *runs;
    ptask *tasks;
    Py_ssize_t nruns, ntasks_max;
    /* Under mu: tasks [taken, published) wait for a worker; closed: no
     * more will be published (all checked, or a mismatch: abort). */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    Py_ssize_t published, taken;
    int closed, abort;
} ppipe;

static void run_task(const ppipe *p, const ptask *t)
{
    if (t->count == 1) {
        const prun *r = &p->runs[t->first];
        memcpy(r->dst + t->from, r->src + t->from, t->len);
        return;
    }
    for (Py_ssize_t k = t->first; k < t->first + t->count; k++)
        memcpy(p->runs[k].dst, p->runs[k].src, p->runs[k].len);
}

static void *plain_worker(void *arg)
{
    ppipe *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->taken == p->published && !p->closed)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->abort || p->taken == p->published)
            break;
        const ptask *t = &p->tasks[p->taken++];
        pthread_mutex_unlock(&p->mu);
        run_task(p, t);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* Make runs [first, p->nruns - keep) tasks and hand them to the workers
 * (keep: the last run may still grow by coalescing).  Returns the first
 * run not yet handed out. */
static Py_ssize_t publish(ppipe *p, Py_ssize_t first, Py_ssize_t keep)
{
    Py_ssize_t end = p->nruns - keep, ntasks;
    if (first >= end)
        return first;
    pthread_mutex_lock(&p->mu);
    ntasks = p->published;
    pthread_mutex_unlock(&p->mu);
    /* Only this thread writes tasks at or after `published`. */
    for (Py_ssize_t i = first; i < end;) {
        if (p->runs[i].len >= GROUP) {
            for (uint64_t from = 0; from < p->runs[i].len; from += TASK) {
                ptask *t = &p->tasks[ntasks++];
                t->first = i;
                t->count = 1;
                t->from = from;
                t->len = p->runs[i].len - from < TASK ? p->runs[i].len - from : TASK;
            }
            i++;
            continue;
        }
        ptask *t = &p->tasks[ntasks++];
        t->first = i;
        t->count = 0;
        t->from = 0;
        t->len = 0;
        while (i < end && p->runs[i].len < GROUP && t->len < GROUP) {
            t->len += p->runs[i].len;
            t->count++;
            i++;
        }
        if (t->count == 1)
            t->len = p->runs[t->first].len;
    }
    pthread_mutex_lock(&p->mu);
    p->published = ntasks;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return end;
}

static void close_pipe(ppipe *p, int abort)
{
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    p->abort = abort;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

enum { A_DTYPE, A_GRAD, A_CPU, A_SHAPE, M_CONTIG, M_CONJ, M_NEG, M_PTR,
       N_NAMES };
static const char *const plain_names[N_NAMES] = {
    "dtype", "requires_grad", "is_cpu", "shape", "is_contiguous", "is_conj",
    "is_neg", "data_ptr"};
static PyObject *plain_str[N_NAMES];

/* The getters of the (at most PLAIN_TYPES) exact types the entries name,
 * found once by the attribute lookup's own rule (_PyType_Lookup: the
 * type's MRO): a getset descriptor is called through its C getter, a
 * method descriptor through vectorcall, anything else through the
 * generic attribute lookup.  Either way it is torch's own getter of that
 * type, which handles __torch_function__ itself; what is skipped per
 * tensor is only the name lookup (a getset descriptor is a data
 * descriptor, so an instance attribute never shadows it; the methods are
 * torch's, not whatever an instance __dict__ may hold).  Saves ~40 % of
 * the check (benchmarks/README.md, "Staging and upload per tensor"). */
#define PLAIN_TYPES 4
typedef struct {
    PyTypeObject *type;             /* strong reference */
    PyObject *descr[N_NAMES];       /* strong references, or NULL */
} plain_type;
static plain_type plain_types[PLAIN_TYPES];

static const plain_type *plain_type_of(PyTypeObject *tp)
{
    for (int i = 0; i < PLAIN_TYPES; i++) {
        if (plain_types[i].type == tp)
            return &plain_types[i];
        if (plain_types[i].type == NULL) {
            plain_type *pt = &plain_types[i];
            for (int w = 0; w < N_NAMES; w++) {
                PyObject *d = _PyType_Lookup(tp, plain_str[w]); /* borrowed */
                if (d != NULL && (Py_IS_TYPE(d, &PyGetSetDescr_Type) ||
                                  Py_IS_TYPE(d, &PyMethodDescr_Type))) {
                    Py_INCREF(d);
                    pt->descr[w] = d;
                }
            }
            Py_INCREF(tp);
            pt->type = tp;
            return pt;
        }
    }
    return NULL; /* more types than slots: the generic lookup */
}

/* Attribute (or, from M_CONTIG on, no-argument method) `which` of v, an
 * instance of exactly pt's type (pt may be NULL): a new reference, or NULL
 * with the error cleared. */
static PyObject *plain_call(PyObject *v, const plain_type *pt, int which)
{
    PyObject *d = pt != NULL ? pt->descr[which] : NULL, *got;
    if (d != NULL && which < M_CONTIG && Py_IS_TYPE(d, &PyGetSetDescr_Type) &&
        ((PyGetSetDescrObject *)d)->d_getset->get != NULL) {
        PyGetSetDef *g = ((PyGetSetDescrObject *)d)->d_getset;
        got = g->get(v, g->closure);
    }
    else if (d != NULL && which >= M_CONTIG && Py_IS_TYPE(d, &PyMethodDescr_Type)) {
        got = PyObject_Vectorcall(d, &v, 1, NULL);
    }
    else {
        got = which >= M_CONTIG
            ? PyObject_VectorcallMethod(plain_str[which], &v,
                                        1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)
            : PyObject_GetAttr(v, plain_str[which]);
    }
    if (got == NULL)
        PyErr_Clear();
    return got;
}

static int is_attr(PyObject *v, const plain_type *pt, int which, PyObject *want)
{
    PyObject *got = plain_call(v, pt, which);
    int same = got == want;
    Py_XDECREF(got);
    return same;
}

/* 1 and *ptr set when v is the plain tensor entry e describes, else 0.
 * No layout or is_nested getter: a sparse or mkldnn tensor has no
 * data_ptr() or is not contiguous, a strided nested one has no shape
 * (tests/test_staging_reuse.py holds torch to it). */
static int plain_match(PyObject *v, PyObject *e, char **ptr)
{
    if ((PyObject *)Py_TYPE(v) != PyTuple_GET_ITEM(e, 1))
        return 0;
    const plain_type *pt = plain_type_of(Py_TYPE(v));
    if (!is_attr(v, pt, A_DTYPE, PyTuple_GET_ITEM(e, 2)) ||
        !is_attr(v, pt, A_GRAD, PyTuple_GET_ITEM(e, 4)) ||
        !is_attr(v, pt, A_CPU, Py_True) || !is_attr(v, pt, M_CONTIG, Py_True) ||
        !is_attr(v, pt, M_NEG, Py_False) ||
        (PyTuple_GET_ITEM(e, 7) == Py_True && !is_attr(v, pt, M_CONJ, Py_False)))
        return 0;
    PyObject *shape = plain_call(v, pt, A_SHAPE);
    if (shape == NULL)
        return 0;
    int eq = PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(e, 3), Py_EQ);
    Py_DECREF(shape);
    if (eq != 1) {
        PyErr_Clear();
        return 0;
    }
    PyObject *p = plain_call(v, pt, M_PTR);
    if (p == NULL)
        return 0;
    *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

PyObject *dcpx_stage_plain(PyObject *Py_UNUSED(module), PyObject *args,
                           PyObject *kwds)
{
    static char *kwlist[] = {"values", "entries", "base", "threads", NULL};
    PyObject *values, *entries, *base_obj, *out = NULL;
    int nthreads = 1, started = 0, match = 1;
    pthread_t tids[64];
    dcpx_view base;
    ppipe p;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O|i", kwlist,
                                     &PyList_Type, &values, &PyTuple_Type,
                                     &entries, &base_obj, &nthreads))
        return NULL;
    if (nthreads < 1 || nthreads > 64) {
        PyErr_SetString(PyExc_ValueError, "dcpx: threads must be in 1..64");
        return NULL;
    }
    for (int i = 0; i < N_NAMES; i++)
        if (plain_str[i] == NULL &&
            (plain_str[i] = PyUnicode_InternFromString(plain_names[i])) == NULL)
            return NULL;
    if (dcpx_view_from_object(base_obj, &base, 1) < 0)
        return NULL;
    if (!base.contiguous || (base.device_type != DCPX_DL_CPU &&
                             base.device_type != DCPX_DL_CUDA_HOST)) {
        dcpx_view_release(&base);
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: base must be contiguous host memory");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(entries), nvalues = PyList_GET_SIZE(values);
    memset(&p, 0, sizeof(p));
    /* Entries are disjoint ranges of base: at most one task per run plus
     * one per TASK bytes of base. */
    p.ntasks_max = n + (Py_ssize_t)(base.nbytes / TASK) + 2;
    p.runs = PyMem_RawMalloc(((size_t)n + 1) * sizeof(prun));
    p.tasks = PyMem_RawMalloc((size_t)p.ntasks_max * sizeof(ptask));
    if (p.runs == NULL || p.tasks == NULL) {
        PyMem_RawFree(p.runs);
        PyMem_RawFree(p.tasks);
        dcpx_view_release(&base);
        return PyErr_NoMemory();
    }
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    int nworkers = nthreads > 1 ? nthreads - 1 : 1;
    if (n > 0)
        for (int i = 0; i < nworkers && i < 64; i++) {
            if (pthread_create(&tids[started], NULL, plain_worker, &p) != 0)
                break; /* fewer workers: the caller copies the rest */
            started++;
        }

    Py_ssize_t handed = 0;
    uint64_t pending = 0, total = 0; /* bytes checked, not yet handed out */
    for (Py_ssize_t i = 0; i < n && match; i++) {
        PyObject *e = PyTuple_GET_ITEM(entries, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 8) {
            PyErr_SetString(PyExc_TypeError, "dcpx: stage_plain entries must be "
                            "(index, type, dtype, shape, requires_grad, offset, "
                            "nbytes, is_complex)");
            goto fail;
        }
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 0));
        unsigned long long off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 5));
        unsigned long long len = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(e, 6));
        if (PyErr_Occurred())
            goto fail;
        if (index < 0 || index >= nvalues || off > base.nbytes ||
            len > base.nbytes - off || total + len > base.nbytes) {
            PyErr_SetString(PyExc_ValueError,
                            "dcpx: stage_plain entry outside the values or the buffer");
            goto fail;
        }
        if (i % 1024 == 1023) {
            /* Let other threads run (the caller of an asynchronous
             * stage() is waiting to return): C code holding the GIL is
             * never asked to switch.  values keeps the tensors alive. */
            Py_BEGIN_ALLOW_THREADS
            Py_END_ALLOW_THREADS
        }
        char *src = NULL;
        if (!plain_match(PyList_GET_ITEM(values, index), e, &src) ||
            (src == NULL && len > 0)) { /* bytes to copy but no memory */
            match = 0;
            break;
        }
        if (len == 0)
            continue;
        total += len;
        char *dst = base.data + off;
        prun *last = p.nruns ? &p.runs[p.nruns - 1] : NULL;
        if (last != NULL && p.nruns > handed && last->src + last->len == src &&
            last->dst + last->len == dst) {
            last->len += len; /* adjacent in the source and in the buffer */
        }
        else {
            p.runs[p.nruns].src = src;
            p.runs[p.nruns].dst = dst;
            p.runs[p.nruns].len = len;
            p.nruns++;
        }
        pending += len;
        if (pending >= 4 * GROUP) {
            handed = publish(&p, handed, 1);
            pending = p.nruns > handed ? p.runs[p.nruns - 1].len : 0;
        }
    }
    if (match)
        handed = publish(&p, handed, 0);
    close_pipe(&p, !match);
    Py_BEGIN_ALLOW_THREADS
    if (match)
        plain_worker(&p); /* the caller copies too, then waits */
    for (int i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    Py_END_ALLOW_THREADS
    out = match ? Py_True : Py_False;
    Py_INCREF(out);
    goto done;
fail:
    close_pipe(&p, 1);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    Py_END_ALLOW_THREADS
done:
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    PyMem_RawFree(p.runs);
    PyMem_RawFree(p.tasks);
    dcpx_view_release(&base);
    return out;
}
