/* cuda_copy_into: the CUDA staging copy.  Device-to-host copies of DLPack
 * CUDA tensors into the stager's host buffer, on dcpx's own non-blocking
 * stream per device, ordered after the producer's pending work, waited on
 * with the GIL released.
 *
 *   cuda_copy_into(pairs, base, wait_streams=(), wait=True,
 *                  segment_bytes=64 MiB)
 *     pairs:        [(src, byte_offset[, name[, alloc_key]]), ...]
 *                   (name None: none; alloc_key: below)
 *     base:         the contiguous host staging buffer (a CPU tensor)
 *     wait_streams: [(device_id, stream_handle), ...]
 *     wait:         False: segmented (below); returns (gate, pending)
 *
 * The handshake that keeps the copies from reading bytes a pending kernel
 * is still writing, in either of the two forms DLPack allows:
 *  - a tensor object is exported with src.__dlpack__(stream=S), S being
 *    dcpx's stream on the tensor's device: the producer makes S wait for
 *    its own pending work (the DLPack consumer contract);
 *  - for each (device, stream) of wait_streams (the producer's current
 *    streams, when the caller hands in capsules it exported itself), dcpx
 *    records an event on that stream and makes its own stream wait on it.
 * Neither blocks the producer's stream.
 *
 * Then, without the GIL: per device, make the primary context current, one
 * cuMemcpyDtoHAsync per run of adjacent tensors (adjacent on the device
 * and in the buffer, and with the same non-zero alloc_key: one copy), one
 * event recorded after the device's last copy, and cuEventSynchronize on
 * each device's event.  alloc_key names the device allocation the source
 * lies in (for torch, its storage's data_ptr(): one storage is one block
 * of the caching allocator); tensors adjacent in the address space may
 * still be two allocations (two cudaMalloc segments back to back), and a
 * copy spanning both is not one the driver guarantees, so without a key
 * (absent, None or 0) a pair is copied on its own.  Returns once every
 * byte is in `base`.  On any error the copies already queued are waited
 * for before the exception is raised, so nothing writes into the buffer
 * after the call has returned, and the caller sees which tensor and which
 * call failed.  Sources stay referenced (their DLPack views held) until
 * their copies have completed.
 *
 * Segmented (wait=False): the runs, in buffer order, are cut into segments
 * of at least segment_bytes, each with its own events, all queued before
 * the call returns (gate, pending).  cuda_stage_wait(pending) waits for the
 * segments in order without the GIL and publishes each on the staging gate
 * (csrc/gate.c), which the upload's writer threads wait on before reading
 * a staged tensor's bytes; a failure fails the gate after the rest has
 * drained.  The views (sources and buffer) are held until that wait. */
#include "cuda_api.h"
#include "gate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* src as a DLPack capsule, exported with the stream handshake when src is
 * a tensor object on a CUDA device. */
static PyObject *export_cuda(PyObject *module, PyObject *src)
{
    PyObject *devt = NULL, *meth = NULL, *kw = NULL, *empty = NULL;
    PyObject *cap = NULL;
    int type = 0, id = 0;
    dcpx_cuda_device *d;

    if (PyCapsule_CheckExact(src)) {
        Py_INCREF(src);
        return src;
    }
    devt = PyObject_CallMethod(src, "__dlpack_device__", NULL);
    if (devt == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "dcpx: object of type %.200s has no "
                         "__dlpack_device__; expected a CUDA tensor",
                         Py_TYPE(src)->tp_name);
        }
        return NULL;
    }
    if (!PyArg_ParseTuple(devt, "ii;dcpx: __dlpack_device__() must return "
                          "(device_type, device_id)", &type, &id))
        goto done;
    if (type != DCPX_DL_CUDA) {
        PyErr_Format(PyExc_TypeError,
                     "dcpx: expected a CUDA tensor (DLPack device type %d), "
                     "got device type %d", DCPX_DL_CUDA, type);
        goto done;
    }
    if ((d = dcpx_cuda_device_get(module, id)) == NULL)
        goto done;
    meth = PyObject_GetAttrString(src, "__dlpack__");
    empty = PyTuple_New(0);
    kw = Py_BuildValue("{s:K,s:(ii)}", "stream",
                       (unsigned long long)(uintptr_t)d->stream,
                       "max_version", 1, 0);
    if (meth == NULL || empty == NULL || kw == NULL)
        goto done;
    cap = PyObject_Call(meth, empty, kw);
    if (cap == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* A producer without max_version: the legacy call, same stream. */
        PyErr_Clear();
        if (PyDict_DelItemString(kw, "max_version") == 0)
            cap = PyObject_Call(meth, empty, kw);
    }
done:
    Py_XDECREF(devt);
    Py_XDECREF(meth);
    Py_XDECREF(empty);
    Py_XDECREF(kw);
    return cap;
}

/* GIL held.  Make dcpx's stream on `dev` wait for the work queued so far on
 * the producer's `stream`. */
static int wait_on(PyObject *module, int dev, unsigned long long stream)
{
    dcpx_cuda_device *d = dcpx_cuda_device_get(module, dev);
    CUcontext saved = NULL;
    CUevent ev = NULL;
    CUresult rc;
    const char *call;
    if (d == NULL)
        return -1;
    dcpx_cu.cuCtxGetCurrent(&saved);
    call = "cuCtxSetCurrent";
    if ((rc = dcpx_cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS)
        goto fail;
    call = "cuEventCreate";
    if ((rc = dcpx_cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING)) !=
        CUDA_SUCCESS)
        goto restore;
    call = "cuEventRecord on the producer's stream";
    rc = dcpx_cu.cuEventRecord(ev, (CUstream)(uintptr_t)stream);
    if (rc == CUDA_SUCCESS) {
        call = "cuStreamWaitEvent";
        rc = dcpx_cu.cuStreamWaitEvent(d->stream, ev, 0);
    }
    /* Destroying an event some stream still waits on is allowed: the
     * driver frees it once the wait is done. */
    dcpx_cu.cuEventDestroy_v2(ev);
restore:
    dcpx_cu.cuCtxSetCurrent(saved);
    if (rc == CUDA_SUCCESS)
        return 0;
fail:
    dcpx_cuda_raise(module, rc, call);
    return -1;
}

/* Segmented staging (wait=False): the copies cut, in buffer order, into
 * segments of at least segment_bytes, each a batch with its own events; a
 * staging gate that the wait publishes segment by segment.  Owns what the
 * copies need until they are waited for: the views of the sources and of
 * the buffer, and the pairs (their keys, for the error). */
typedef struct {
    PyObject *module;
    PyObject *pairs;
    dcpx_view base;
    int have_base;
    dcpx_view *views;
    Py_ssize_t nviews;
    dcpx_cuda_run *runs;
    dcpx_cuda_batch *segs;
    uint64_t *ready;   /* per segment: the watermark once it completed */
    Py_ssize_t nseg;
    dcpx_gate *gate;
    int pinned;        /* the buffer is page-locked: batched copies allowed */
    int waited;
} stage_job;

#define STAGE_PENDING "dcpx.cuda_pending_stage"
static const char *const STAGE_SYNC =
    "cuEventSynchronize (device-to-host copies)";

static int cmp_host(const void *a, const void *b)
{
    const dcpx_cuda_run *x = a, *y = b;
    return x->host < y->host ? -1 : (x->host > y->host);
}

/* GIL held.  Everything released (the copies were waited for, or never
 * queued). */
static void stage_job_release(stage_job *j)
{
    for (Py_ssize_t k = 0; k < j->nseg; k++)
        dcpx_cuda_batch_destroy(&j->segs[k]);
    for (Py_ssize_t i = 0; i < j->nviews; i++)
        dcpx_view_release(&j->views[i]);
    j->nviews = 0;
    if (j->have_base)
        dcpx_view_release(&j->base);
    j->have_base = 0;
    PyMem_Free(j->views);
    PyMem_Free(j->runs);
    PyMem_Free(j->segs);
    PyMem_Free(j->ready);
    j->views = NULL;
    j->runs = NULL;
    j->segs = NULL;
    j->ready = NULL;
    j->nseg = 0;
    dcpx_gate_decref(j->gate);
    j->gate = NULL;
    Py_CLEAR(j->pairs);
    Py_CLEAR(j->module);
    j->waited = 1;
}

/* GIL held.  Wait for the segments in order (GIL released), publishing
 * each one's watermark on the gate; after a failure drain the rest and
 * fail the gate.  With `raise`: 0, or -1 with the CudaError set. */
static int stage_job_finish(stage_job *j, int raise)
{
    Py_ssize_t failed = -1;
    int rc = 0;
    if (j->waited)
        return 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < j->nseg; k++) {
        dcpx_cuda_batch_wait(&j->segs[k], STAGE_SYNC);
        if (failed < 0 && j->segs[k].err.rc != CUDA_SUCCESS)
            failed = k;
        if (failed < 0)
            dcpx_gate_publish(j->gate, j->ready[k]);
    }
    if (failed >= 0)
        dcpx_gate_fail(j->gate);
    else
        dcpx_gate_publish(j->gate, (uint64_t)j->base.nbytes);
    Py_END_ALLOW_THREADS
    if (failed >= 0 && raise) {
        dcpx_cuda_batch_raise(j->module, &j->segs[failed], j->pairs);
        rc = -1;
    }
    stage_job_release(j);
    return rc;
}

static void stage_pending_free(PyObject *cap)
{
    stage_job *j = PyCapsule_GetPointer(cap, STAGE_PENDING);
    if (j == NULL) {
        PyErr_Clear();
        return;
    }
    stage_job_finish(j, 0);
    PyMem_Free(j);
}

/* GIL held.  Takes j (heap, filled but for its segments): cut its runs
 * (nruns of them, unsorted) into segments, create their events and queue
 * them all.  Returns (gate, pending), pending owning j; or NULL with an
 * exception, j freed after draining whatever was queued. */
static PyObject *stage_job_start(stage_job *j, Py_ssize_t nruns,
                                 unsigned long long segment_bytes)
{
    PyObject *gate = NULL, *pending = NULL, *out = NULL;
    Py_ssize_t k = 0, start = 0, failed = -1;
    size_t acc = 0;

    qsort(j->runs, (size_t)nruns, sizeof(*j->runs), cmp_host);
    j->segs = PyMem_Calloc((size_t)nruns + 1, sizeof(*j->segs));
    j->ready = PyMem_Calloc((size_t)nruns + 1, sizeof(*j->ready));
    j->gate = dcpx_gate_new(j->base.data, (uint64_t)j->base.nbytes);
    if (j->segs == NULL || j->ready == NULL || j->gate == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < nruns; i++) {
        dcpx_cuda_batch *b;
        acc += j->runs[i].n;
        if (acc < segment_bytes && i + 1 < nruns)
            continue;
        /* Runs [start, i] are segment k: once they are on the host, every
         * staged byte below the next segment's first run is final. */
        b = &j->segs[k];
        b->err.index = b->err.dev = -1;
        b->runs = j->runs + start;
        j->ready[k] = i + 1 < nruns
                          ? (uint64_t)(j->runs[i + 1].host - j->base.data)
                          : (uint64_t)j->base.nbytes;
        b->nruns = dcpx_cuda_runs_sort(b->runs, i + 1 - start, 1);
        b->pinned = j->pinned;
        k++;
        start = i + 1;
        acc = 0;
    }
    j->nseg = k;
    for (k = 0; k < j->nseg; k++) {
        const char *call;
        int dev;
        CUresult rc = dcpx_cuda_batch_events(j->module, &j->segs[k], &call,
                                             &dev);
        if (rc != CUDA_SUCCESS) {
            dcpx_cuda_raise(j->module, rc, call);
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < j->nseg && failed < 0; k++) {
        dcpx_cuda_batch_queue(&j->segs[k]);
        if (j->segs[k].err.rc != CUDA_SUCCESS)
            failed = k;
    }
    Py_END_ALLOW_THREADS
    if (failed >= 0) {
        /* Raised by the call itself, once what was queued has drained. */
        stage_job_finish(j, 1);
        PyMem_Free(j);
        return NULL;
    }
    gate = dcpx_gate_capsule(j->gate);
    if (gate == NULL)
        goto fail;
    pending = PyCapsule_New(j, STAGE_PENDING, stage_pending_free);
    if (pending == NULL) {
        Py_DECREF(gate);
        goto fail;
    }
    /* From here the capsule owns j (dropping it waits for the copies). */
    out = PyTuple_Pack(2, gate, pending);
    Py_DECREF(gate);
    Py_DECREF(pending);
    return out;
fail:
    stage_job_finish(j, 0);
    PyMem_Free(j);
    return NULL;
}

PyObject *dcpx_cuda_copy_into(PyObject *module, PyObject *args,
                              PyObject *kwds)
{
    static char *kwlist[] = {"pairs", "base", "wait_streams", "wait",
                             "segment_bytes", NULL};
    PyObject *pairs_obj, *base_obj, *waits_obj = NULL;
    PyObject *pairs = NULL, *waits = NULL, *result = NULL;
    dcpx_view base, *views = NULL;
    dcpx_cuda_run *runs = NULL;
    dcpx_cuda_batch b;
    int have_base = 0, wait = 1;
    unsigned long long segment_bytes = 64ULL << 20;
    Py_ssize_t n = 0, nviews = 0, nruns = 0;

    memset(&b, 0, sizeof(b));
    b.err.index = b.err.dev = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OpK:cuda_copy_into",
                                     kwlist, &pairs_obj, &base_obj,
                                     &waits_obj, &wait, &segment_bytes))
        return NULL;
    if (dcpx_cuda_load(module) < 0)
        return NULL;
    pairs = PySequence_Fast(pairs_obj, "dcpx: pairs must be a sequence");
    if (pairs == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(pairs);
    if (dcpx_view_from_object(base_obj, &base, 1) < 0)
        goto done;
    have_base = 1;
    if (base.device_type != DCPX_DL_CPU || !base.contiguous) {
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: the staging buffer must be a contiguous "
                        "host tensor");
        goto done;
    }
    /* The producers' streams first: the copies below queue after them. */
    if (waits_obj != NULL && waits_obj != Py_None) {
        waits = PySequence_Fast(waits_obj,
                                "dcpx: wait_streams must be a sequence");
        if (waits == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(waits); i++) {
            int dev;
            unsigned long long s;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(waits, i), "iK;"
                                  "dcpx: wait_streams holds (device, "
                                  "stream) pairs", &dev, &s))
                goto done;
            if (wait_on(module, dev, s) < 0)
                goto done;
        }
    }
    views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*views));
    runs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*runs));
    if (views == NULL || runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(pairs, i), *src, *off;
        PyObject *name = NULL, *key = NULL, *cap;
        unsigned long long o, alloc = 0;
        dcpx_view *v = &views[i];
        if (!PyArg_ParseTuple(item, "OO|OO;dcpx: pairs hold (src, "
                              "byte_offset[, name[, alloc_key]])", &src,
                              &off, &name, &key))
            goto done;
        if (name == Py_None)
            name = NULL;
        if (key != NULL && key != Py_None) {
            alloc = PyLong_Check(key) ? PyLong_AsUnsignedLongLong(key)
                                      : (unsigned long long)-1;
            if (alloc == (unsigned long long)-1) {
                PyErr_Clear();
                if (name != NULL)
                    PyErr_Format(PyExc_ValueError, "dcpx: tensor %R: "
                                 "alloc_key must be an int in [0, 2**64 - 1)"
                                 " or None, got %R", name, key);
                else
                    PyErr_Format(PyExc_ValueError, "dcpx: tensor #%zd: "
                                 "alloc_key must be an int in [0, 2**64 - 1)"
                                 " or None, got %R", i, key);
                goto done;
            }
        }
        cap = export_cuda(module, src);
        if (cap == NULL)
            goto done;
        int rc = dcpx_view_from_object(cap, v, 0);
        Py_DECREF(cap);
        if (rc < 0)
            goto done;
        nviews = i + 1;
        const char *why = NULL;
        o = PyLong_AsUnsignedLongLong(off);
        if (o == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        if (v->device_type != DCPX_DL_CUDA)
            why = "is not on a CUDA device";
        else if (!v->contiguous)
            why = "is not contiguous (make it contiguous on the device "
                  "first)";
        else if (o > base.nbytes || v->nbytes > base.nbytes - o)
            why = "does not fit the staging buffer at its offset";
        else if (v->device_id < 0 || v->device_id >= DCPX_CUDA_MAX_DEVICES)
            why = "is on a device dcpx cannot address";
        if (why != NULL) {
            if (name != NULL)
                PyErr_Format(PyExc_ValueError, "dcpx: tensor %R %s", name,
                             why);
            else
                PyErr_Format(PyExc_ValueError, "dcpx: tensor #%zd %s", i,
                             why);
            goto done;
        }
        /* A capsule's device was not seen by export_cuda: set it up. */
        if (dcpx_cuda_device_get(module, v->device_id) == NULL)
            goto done;
        if (v->nbytes == 0)
            continue;
        runs[nruns].dev = v->device_id;
        runs[nruns].dptr = (CUdeviceptr)(uintptr_t)v->data;
        runs[nruns].host = base.data + o;
        runs[nruns].n = (size_t)v->nbytes;
        runs[nruns].index = i;
        runs[nruns].alloc = alloc;
        nruns++;
    }
    if (!wait) {
        /* Segmented: the job takes the views, runs, buffer and pairs. */
        stage_job *j = PyMem_Calloc(1, sizeof(*j));
        if (j == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_INCREF(module);
        j->module = module;
        j->pairs = pairs;
        j->base = base;
        j->have_base = 1;
        j->views = views;
        j->nviews = nviews;
        j->runs = runs;
        j->pinned = dcpx_cuda_registry_contains(base.data,
                                                (size_t)base.nbytes);
        pairs = NULL;
        have_base = 0;
        views = NULL;
        nviews = 0;
        runs = NULL;
        result = stage_job_start(j, nruns, segment_bytes);
        goto done;
    }
    /* By device, in the caller's order; then coalesce runs adjacent both
     * on the device and in the buffer, of one allocation. */
    b.runs = runs;
    b.nruns = dcpx_cuda_runs_sort(runs, nruns, 1);
    b.pinned = dcpx_cuda_registry_contains(base.data, (size_t)base.nbytes);
    /* One event per device in use, created here (they need the device's
     * context current, and creating them cannot fail half-way through the
     * copies). */
    {
        const char *call;
        int dev;
        CUresult rc = dcpx_cuda_batch_events(module, &b, &call, &dev);
        if (rc != CUDA_SUCCESS) {
            dcpx_cuda_raise(module, rc, call);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    dcpx_cuda_batch_queue(&b);
    /* Wait for everything queued, even after an error: the buffer must
     * not be written once we return. */
    dcpx_cuda_batch_wait(&b, "cuEventSynchronize (device-to-host copies)");
    Py_END_ALLOW_THREADS
    if (b.err.rc != CUDA_SUCCESS) {
        dcpx_cuda_batch_raise(module, &b, pairs);
        goto done;
    }
    Py_INCREF(Py_None); /* Py_NewRef is 3.10+ */
    result = Py_None;
done:
    dcpx_cuda_batch_destroy(&b);
    for (Py_ssize_t i = 0; i < nviews; i++)
        dcpx_view_release(&views[i]);
    if (have_base)
        dcpx_view_release(&base);
    PyMem_Free(views);
    PyMem_Free(runs);
    Py_XDECREF(pairs);
    Py_XDECREF(waits);
    return result;
}

/* cuda_stage_wait(pending): wait, without the GIL, for the segments of a
 * cuda_copy_into(..., wait=False) call, publishing each on its gate as it
 * completes; raise its CudaError (naming call, key and device) if a copy
 * failed, after draining the rest and failing the gate.  Idempotent. */
PyObject *dcpx_cuda_stage_wait(PyObject *module, PyObject *cap)
{
    stage_job *j;
    (void)module;
    j = PyCapsule_GetPointer(cap, STAGE_PENDING);
    if (j == NULL)
        return NULL;
    if (stage_job_finish(j, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}
