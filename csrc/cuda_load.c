/* cuda_copy_from_host: the CUDA load copy.  Host-to-device copies from
 * host buffers (the loader's page-locked bounce buffer, csrc/ has no say in
 * where the bytes were read) into DLPack CUDA tensors, on dcpx's own
 * non-blocking stream per device, ordered both ways against the consumer's
 * stream, with the host waiting without the GIL.
 *
 *   cuda_copy_from_host(pairs, consumer_streams=())
 *     pairs:            [(dst, src, name), ...]: dst a CUDA tensor (or an
 *                       unused DLPack capsule of one), writable, contiguous;
 *                       src a contiguous host tensor of the same byte size
 *     consumer_streams: [(device_id, stream_handle), ...]: the streams that
 *                       will use the tensors (the caller's current streams)
 *
 * Per device, with the GIL held: an event recorded on each consumer stream
 * that dcpx's stream waits on (the copies never overwrite bytes a kernel
 * queued before the load still reads), and one event for after the copies.
 * Then without the GIL: one cuMemcpyHtoDAsync per tensor on dcpx's stream,
 * the event recorded after the device's last copy, cuStreamWaitEvent of
 * every consumer stream of that device on it (the consumer's later kernels
 * run after the copies, and the consumer's host thread is not blocked by
 * them), then cuEventSynchronize, so that the host buffers can be reused
 * or freed once the call returns.  On any error the copies already queued
 * are waited for before the exception (CudaError naming the call, tensor
 * and device) is raised. */
#include "cuda_api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GIL held.  dcpx's stream on `dev` waits for the work queued so far on
 * the consumer's `stream`. */
static int after_consumer(PyObject *module, int dev, CUstream stream)
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

PyObject *dcpx_cuda_copy_from_host(PyObject *module, PyObject *args,
                                   PyObject *kwds)
{
    static char *kwlist[] = {"pairs", "consumer_streams", NULL};
    PyObject *pairs_obj, *cons_obj = NULL, *pairs = NULL, *cons = NULL;
    PyObject *result = NULL;
    dcpx_view *views = NULL; /* 2 per pair: dst, src */
    dcpx_cuda_run *runs = NULL;
    dcpx_cuda_stream *cs = NULL;
    dcpx_cuda_batch b;
    Py_ssize_t n = 0, nviews = 0, nruns = 0, ncs = 0;

    memset(&b, 0, sizeof(b));
    b.err.index = b.err.dev = -1;
    b.htod = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:cuda_copy_from_host",
                                     kwlist, &pairs_obj, &cons_obj))
        return NULL;
    if (dcpx_cuda_load(module) < 0)
        return NULL;
    pairs = PySequence_Fast(pairs_obj, "dcpx: pairs must be a sequence");
    if (pairs == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(pairs);
    if (cons_obj != NULL && cons_obj != Py_None) {
        cons = PySequence_Fast(cons_obj,
                               "dcpx: consumer_streams must be a sequence");
        if (cons == NULL)
            goto done;
        ncs = PySequence_Fast_GET_SIZE(cons);
    }
    views = PyMem_Calloc(2 * (size_t)n + 1, sizeof(*views));
    runs = PyMem_Calloc((size_t)n + 1, sizeof(*runs));
    cs = PyMem_Calloc((size_t)ncs + 1, sizeof(*cs));
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
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pairs, i), "OOO;dcpx: "
                              "pairs hold (dst, src, name)", &dst, &src,
                              &name))
            goto done;
        if (dcpx_view_from_object(dst, dv, 1) < 0)
            goto done;
        nviews = 2 * i + 1;
        if (dcpx_view_from_object(src, sv, 0) < 0)
            goto done;
        nviews = 2 * i + 2;
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
    b.runs = runs;
    b.nruns = dcpx_cuda_runs_sort(runs, nruns, 0);
    b.cons = cs;
    b.ncons = ncs;
    /* Per device in use: order after its consumers, and create its event. */
    for (Py_ssize_t i = 0; i < b.nruns; i++) {
        int d = runs[i].dev;
        CUresult rc;
        const char *call;
        if (b.ev[d] != NULL)
            continue;
        for (Py_ssize_t j = 0; j < ncs; j++)
            if (cs[j].dev == d && after_consumer(module, d, cs[j].stream) < 0)
                goto done;
        b.devs[d] = dcpx_cuda_device_get(module, d);
        rc = dcpx_cuda_event_create(module, d, &b.ev[d], &call);
        if (rc != CUDA_SUCCESS) {
            char what[128];
            snprintf(what, sizeof(what), "%s on device %d", call, d);
            dcpx_cuda_raise(module, rc, what);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    dcpx_cuda_batch_queue(&b);
    /* Wait for everything queued, even after an error: the host buffers
     * must not be read once we return. */
    dcpx_cuda_batch_wait(&b, "cuEventSynchronize (host-to-device copies)");
    Py_END_ALLOW_THREADS
    if (b.err.rc != CUDA_SUCCESS) {
        dcpx_cuda_batch_raise(module, &b, pairs);
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    dcpx_cuda_batch_destroy(&b);
    for (Py_ssize_t i = 0; i < nviews; i++)
        dcpx_view_release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(runs);
    PyMem_Free(cs);
    Py_XDECREF(pairs);
    Py_XDECREF(cons);
    return result;
}
