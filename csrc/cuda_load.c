/* cuda_copy_from_host: the CUDA load copy.  Host-to-device copies from
 * host buffers (the loader's page-locked bounce buffer, csrc/ has no say in
 * where the bytes were read) into DLPack CUDA tensors, on dcpx's own
 * non-blocking stream per device, ordered both ways against the consumer's
 * stream, with the host waiting without the GIL.
 *
 *   cuda_copy_from_host(pairs, consumer_streams=(), wait=True)
 *     pairs:            [(dst, src, name), ...]: dst a CUDA tensor (or an
 *                       unused DLPack capsule of one), writable, contiguous;
 *                       src a contiguous host tensor of the same byte size
 *     consumer_streams: [(device_id, stream_handle), ...]: the streams that
 *                       will use the tensors (the caller's current streams)
 *     wait:             False: return once the copies are queued, a handle
 *                       ("pending") that cuda_wait(pending) waits for; the
 *                       loader reads the next part of a load meanwhile
 *
 * Per device, with the GIL held: an event recorded on each consumer stream
 * that dcpx's stream waits on (the copies never overwrite bytes a kernel
 * queued before the load still reads), and one event for after the copies.
 * Then without the GIL: one cuMemcpyHtoDAsync per tensor on dcpx's stream,
 * the event recorded after the device's last copy, cuStreamWaitEvent of
 * every consumer stream of that device on it (the consumer's later kernels
 * run after the copies, and the consumer's host thread is not blocked by
 * them), then cuEventSynchronize, so that the host buffers can be reused
 * or freed once the call returns (with wait=False: once cuda_wait has
 * returned; the views of both sides are held until then, and a handle
 * dropped unwaited still waits).  On any error the copies already queued
 * are waited for before the exception (CudaError naming the call, tensor
 * and device; for an asynchronous failure, the device's tensors) is
 * raised; an error found while queueing is raised by the call itself,
 * even with wait=False. */
#include "cuda_api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int dcpx_cuda_after_consumer(PyObject *module, int dev, CUstream stream)
{
    dcpx_cuda_device *d = dcpx_cuda_device_get(module, dev);
    CUcontext saved = NULL;
    CUevent ev = NULL;
    CUresult rc;
    const char *call = "cuCtxSetCurrent";
    if (d == NULL)
        return -1;
    dcpx_cu.cuCtxGetCurrent(&saved);
    if ((rc = dcpx_cu.cuCtxSetCurrent(d->ctx)) == CUDA_SUCCESS) {
        call = "cuEventCreate";
        rc = dcpx_cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
        if (rc == CUDA_SUCCESS) {
            call = "cuEventRecord on the consumer's stream";
            rc = dcpx_cu.cuEventRecord(ev, stream);
            if (rc == CUDA_SUCCESS) {
                call = "cuStreamWaitEvent";
                rc = dcpx_cu.cuStreamWaitEvent(d->stream, ev, 0);
            }
            dcpx_cu.cuEventDestroy_v2(ev);
        }
        dcpx_cu.cuCtxSetCurrent(saved);
    }
    if (rc != CUDA_SUCCESS) {
        char what[128];
        snprintf(what, sizeof(what), "%s on device %d", call, dev);
        dcpx_cuda_raise(module, rc, what);
        return -1;
    }
    return 0;
}

static const char *pair_error(const dcpx_view *dst, const dcpx_view *src)
{
    if (dst->device_type != DCPX_DL_CUDA)
        return "is not on a CUDA device";
    if (!dst->contiguous)
        return "is not contiguous (load into a contiguous tensor)";
    if (dst->device_id < 0 || dst->device_id >= DCPX_CUDA_MAX_DEVICES)
        return "is on a device dcpx cannot address";
    if (src->device_type != DCPX_DL_CPU || !src->contiguous)
        return "has a source that is not contiguous host memory";
    if (src->nbytes != dst->nbytes)
        return "has a source of a different byte size";
    return NULL;
}

/* One load call's copies, from parsing until they are waited for: the
 * views (dst and src of each pair, held so neither memory goes away while
 * a copy may run), the batch, and what the error message needs. */
typedef struct {
    PyObject *module;  /* strong: CudaError, at wait */
    PyObject *pairs;   /* the caller's pairs (their keys) */
    dcpx_view *views;  /* 2 per pair: dst, src */
    Py_ssize_t nviews;
    dcpx_cuda_run *runs;
    dcpx_cuda_stream *cs;
    dcpx_cuda_batch b;
    int waited;        /* the batch has been waited for, resources freed */
} load_job;

#define PENDING_NAME "dcpx.cuda_pending_load"
static const char *const SYNC_CALL =
    "cuEventSynchronize (host-to-device copies)";

/* GIL held.  Events destroyed, views released, references dropped (the
 * copies have been waited for, or were never queued). */
static void job_release(load_job *j)
{
    dcpx_cuda_batch_destroy(&j->b);
    for (Py_ssize_t i = 0; i < j->nviews; i++)
        dcpx_view_release(&j->views[i]);
    j->nviews = 0;
    PyMem_Free(j->views);
    PyMem_Free(j->runs);
    PyMem_Free(j->cs);
    j->views = NULL;
    j->runs = NULL;
    j->cs = NULL;
    Py_CLEAR(j->pairs);
    Py_CLEAR(j->module);
    j->waited = 1;
}

/* GIL held.  Wait for the copies (GIL released), then release everything;
 * with `raise`, 0 or -1 with the batch's CudaError set. */
static int job_finish(load_job *j, int raise)
{
    int rc = 0;
    if (j->waited)
        return 0;
    Py_BEGIN_ALLOW_THREADS
    dcpx_cuda_batch_wait(&j->b, SYNC_CALL);
    Py_END_ALLOW_THREADS
    if (j->b.err.rc != CUDA_SUCCESS && raise) {
        dcpx_cuda_batch_raise(j->module, &j->b, j->pairs);
        rc = -1;
    }
    job_release(j);
    return rc;
}

/* A pending load dropped without cuda_wait: its copies are still waited
 * for (the host buffer must not be reused under them); an error is lost,
 * as the caller gave up on the result. */
static void pending_destroy(PyObject *cap)
{
    load_job *j = PyCapsule_GetPointer(cap, PENDING_NAME);
    if (j == NULL) {
        PyErr_Clear();
        return;
    }
    job_finish(j, 0);
    PyMem_Free(j);
}

PyObject *dcpx_cuda_copy_from_host(PyObject *module, PyObject *args,
                                   PyObject *kwds)
{
    static char *kwlist[] = {"pairs", "consumer_streams", "wait", NULL};
    PyObject *pairs_obj, *cons_obj = NULL, *cons = NULL;
    PyObject *result = NULL;
    int wait = 1;
    load_job *j;
    dcpx_cuda_run *runs;
    dcpx_cuda_stream *cs;
    dcpx_view *views;
    Py_ssize_t n = 0, nruns = 0, ncs = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Op:cuda_copy_from_host",
                                     kwlist, &pairs_obj, &cons_obj, &wait))
        return NULL;
    if (dcpx_cuda_load(module) < 0)
        return NULL;
    j = PyMem_Calloc(1, sizeof(*j));
    if (j == NULL)
        return PyErr_NoMemory();
    j->b.err.index = j->b.err.dev = -1;
    j->b.htod = 1;
    Py_INCREF(module);
    j->module = module;
    j->pairs = PySequence_Fast(pairs_obj, "dcpx: pairs must be a sequence");
    if (j->pairs == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(j->pairs);
    if (cons_obj != NULL && cons_obj != Py_None) {
        cons = PySequence_Fast(cons_obj,
                               "dcpx: consumer_streams must be a sequence");
        if (cons == NULL)
            goto done;
        ncs = PySequence_Fast_GET_SIZE(cons);
    }
    views = j->views = PyMem_Calloc(2 * (size_t)n + 1, sizeof(*views));
    runs = j->runs = PyMem_Calloc((size_t)n + 1, sizeof(*runs));
    cs = j->cs = PyMem_Calloc((size_t)ncs + 1, sizeof(*cs));
    if (views == NULL || runs == NULL || cs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ncs; i++) {
        unsigned long long s;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(cons, i), "iK;dcpx: "
                              "consumer_streams holds (device, stream) "
                              "pairs", &cs[i].dev, &s))
            goto done;
        if (dcpx_cuda_device_get(module, cs[i].dev) == NULL)
            goto done;
        cs[i].stream = (CUstream)(uintptr_t)s;
    }
    /* Every pair checked before anything is queued. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dst, *src, *name;
        dcpx_view *dv = &views[2 * i], *sv = &views[2 * i + 1];
        const char *why;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(j->pairs, i), "OOO;"
                              "dcpx: pairs hold (dst, src, name)", &dst,
                              &src, &name))
            goto done;
        if (dcpx_view_from_object(dst, dv, 1) < 0)
            goto done;
        j->nviews = 2 * i + 1;
        if (dcpx_view_from_object(src, sv, 0) < 0)
            goto done;
        j->nviews = 2 * i + 2;
        if ((why = pair_error(dv, sv)) != NULL) {
            PyErr_Format(PyExc_ValueError, "dcpx: tensor %R %s", name, why);
            goto done;
        }
        if (dcpx_cuda_device_get(module, dv->device_id) == NULL)
            goto done;
        if (dv->nbytes == 0)
            continue;
        runs[nruns].dev = dv->device_id;
        runs[nruns].dptr = (CUdeviceptr)(uintptr_t)dv->data;
        runs[nruns].host = sv->data;
        runs[nruns].n = (size_t)dv->nbytes;
        runs[nruns].index = i;
        nruns++;
    }
    /* Batched copies only from page-locked memory (the driver's rules for
     * pageable sources differ). */
    j->b.pinned = 1;
    for (Py_ssize_t i = 0; i < nruns && j->b.pinned; i++)
        j->b.pinned = dcpx_cuda_registry_contains(runs[i].host, runs[i].n);
    j->b.runs = runs;
    j->b.nruns = dcpx_cuda_runs_sort(runs, nruns, 0);
    j->b.cons = cs;
    j->b.ncons = ncs;
    /* Per device in use: order after its consumers, and create its event. */
    for (Py_ssize_t i = 0; i < j->b.nruns; i++) {
        int d = runs[i].dev;
        CUresult rc;
        const char *call;
        if (j->b.ev[d] != NULL)
            continue;
        for (Py_ssize_t k = 0; k < ncs; k++)
            if (cs[k].dev == d &&
                dcpx_cuda_after_consumer(module, d, cs[k].stream) < 0)
                goto done;
        j->b.devs[d] = dcpx_cuda_device_get(module, d);
        rc = dcpx_cuda_event_create(module, d, &j->b.ev[d], &call);
        if (rc != CUDA_SUCCESS) {
            char what[128];
            snprintf(what, sizeof(what), "%s on device %d", call, d);
            dcpx_cuda_raise(module, rc, what);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    dcpx_cuda_batch_queue(&j->b);
    Py_END_ALLOW_THREADS
    if (!wait && j->b.err.rc == CUDA_SUCCESS) {
        /* Queued: the caller waits with cuda_wait (or drops the handle,
         * which waits too). */
        result = PyCapsule_New(j, PENDING_NAME, pending_destroy);
        if (result != NULL)
            j = NULL;
        goto done;
    }
    /* Wait for everything queued, even after an error: the host buffers
     * must not be read once we return. */
    if (job_finish(j, 1) == 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    if (j != NULL) {
        /* Failed before anything was queued, or finished: nothing in
         * flight (job_finish waits for a batch that was queued). */
        if (!j->waited)
            job_finish(j, 0);
        PyMem_Free(j);
    }
    Py_XDECREF(cons);
    return result;
}

/* cuda_wait(pending): wait for the copies of a cuda_copy_from_host(...,
 * wait=False) call, raising its CudaError (naming call, key and device)
 * if one failed.  Afterwards the host sources may be reused; a second
 * call returns at once. */
PyObject *dcpx_cuda_wait(PyObject *module, PyObject *cap)
{
    load_job *j;
    (void)module;
    j = PyCapsule_GetPointer(cap, PENDING_NAME);
    if (j == NULL)
        return NULL;
    if (job_finish(j, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
}
