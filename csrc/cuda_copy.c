/* The copy loop of the CUDA path, one for both directions: the stager's
 * device-to-host copies (csrc/cuda_stage.c) and the loader's host-to-device
 * ones (csrc/cuda_load.c).  Per device, on dcpx's own stream: one
 * asynchronous copy per run, one event recorded after the device's last
 * copy, the consumer streams made to wait on it; then a wait for every
 * device's event, which after an error drains whatever was queued, so no
 * copy touches host memory once the wait has returned.  The callers parse
 * and check their pairs, order dcpx's stream after the producer or
 * consumer, and word their own errors; queueing and waiting are separate
 * so that a caller can do other work (read the next part of a load) while
 * the copies run. */
#include "cuda_api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void dcpx_cuda_note(dcpx_cuda_err *e, CUresult rc, const char *call,
                    Py_ssize_t index, int dev)
{
    if (e->rc == CUDA_SUCCESS) {
        e->rc = rc;
        e->call = call;
        e->index = index;
        e->dev = dev;
    }
}

static int cmp_run(const void *a, const void *b)
{
    const dcpx_cuda_run *x = a, *y = b;
    if (x->dev != y->dev)
        return x->dev < y->dev ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

Py_ssize_t dcpx_cuda_runs_sort(dcpx_cuda_run *runs, Py_ssize_t n,
                               int coalesce)
{
    Py_ssize_t m = 0;
    qsort(runs, (size_t)n, sizeof(*runs), cmp_run);
    if (!coalesce)
        return n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (m > 0 && runs[m - 1].dev == runs[i].dev &&
            runs[i].alloc != 0 && runs[m - 1].alloc == runs[i].alloc &&
            runs[m - 1].dptr + runs[m - 1].n == runs[i].dptr &&
            runs[m - 1].host + runs[m - 1].n == runs[i].host)
            runs[m - 1].n += runs[i].n;
        else
            runs[m++] = runs[i];
    }
    return m;
}

CUresult dcpx_cuda_batch_events(PyObject *module, dcpx_cuda_batch *b,
                                const char **call, int *dev)
{
    for (Py_ssize_t i = 0; i < b->nruns; i++) {
        int d = b->runs[i].dev;
        CUresult rc;
        if (b->ev[d] != NULL)
            continue;
        b->devs[d] = dcpx_cuda_device_get(module, d);
        rc = dcpx_cuda_event_create(module, d, &b->ev[d], call);
        if (rc != CUDA_SUCCESS) {
            *dev = d;
            return rc;
        }
    }
    return CUDA_SUCCESS;
}

/* Queue runs [i, j) of one device (its context current) in batched calls
 * of at most DCPX_CUDA_BATCH_MAX copies.  Returns 0; or 1 when the arrays
 * cannot be allocated (nothing queued: the caller copies one by one); or
 * -1 with the failure noted. */
static int queue_batched(dcpx_cuda_batch *b, Py_ssize_t i, Py_ssize_t j,
                         CUstream stream)
{
    size_t cap = (size_t)(j - i) < DCPX_CUDA_BATCH_MAX ? (size_t)(j - i)
                                                       : DCPX_CUDA_BATCH_MAX;
    CUdeviceptr *dsts = malloc(cap * sizeof(*dsts));
    CUdeviceptr *srcs = malloc(cap * sizeof(*srcs));
    size_t *sizes = malloc(cap * sizeof(*sizes));
    int out = 0;
    if (dsts == NULL || srcs == NULL || sizes == NULL) {
        free(dsts);
        free(srcs);
        free(sizes);
        return 1;
    }
    for (Py_ssize_t k = i; k < j && out == 0; k += (Py_ssize_t)cap) {
        size_t m = (size_t)(j - k) < cap ? (size_t)(j - k) : cap;
        Py_ssize_t failed;
        for (size_t q = 0; q < m; q++) {
            const dcpx_cuda_run *r = &b->runs[k + (Py_ssize_t)q];
            CUdeviceptr host = (CUdeviceptr)(uintptr_t)r->host;
            dsts[q] = b->htod ? r->dptr : host;
            srcs[q] = b->htod ? host : r->dptr;
            sizes[q] = r->n;
        }
        CUresult rc = dcpx_cuda_memcpy_batch(dsts, srcs, sizes, m, stream,
                                             &failed);
        if (rc != CUDA_SUCCESS) {
            /* The copy the driver named, else the batch's first (the
             * message says which). */
            const dcpx_cuda_run *r = &b->runs[k + (failed >= 0 ? failed : 0)];
            dcpx_cuda_note(&b->err, rc, dcpx_cuda_batch_call(failed >= 0),
                           r->index, r->dev);
            out = -1;
            break;
        }
        dcpx_cuda_count(b->htod ? DCPX_CUDA_N_BATCH_HTOD
                                : DCPX_CUDA_N_BATCH_DTOH, 1);
        dcpx_cuda_count(b->htod ? DCPX_CUDA_N_BATCHED_HTOD
                                : DCPX_CUDA_N_BATCHED_DTOH, (long)m);
        b->queued[b->runs[k].dev] = 1;
    }
    free(dsts);
    free(srcs);
    free(sizes);
    return out;
}

void dcpx_cuda_batch_queue(dcpx_cuda_batch *b)
{
    const char *copy_call = b->htod ? "cuMemcpyHtoDAsync"
                                    : "cuMemcpyDtoHAsync";
    CUcontext saved = NULL;
    dcpx_cuda_err *err = &b->err;
    CUresult rc;
    Py_ssize_t batched_to = 0; /* runs below it were queued in batches */

    dcpx_cu.cuCtxGetCurrent(&saved);
    for (Py_ssize_t i = 0; i < b->nruns && err->rc == CUDA_SUCCESS; i++) {
        const dcpx_cuda_run *r = &b->runs[i];
        dcpx_cuda_device *d = b->devs[r->dev];
        if (i == 0 || b->runs[i - 1].dev != r->dev) {
            Py_ssize_t j = i + 1;
            if ((rc = dcpx_cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS) {
                dcpx_cuda_note(err, rc, "cuCtxSetCurrent", r->index, r->dev);
                break;
            }
            /* The device's runs in batched calls, where the driver has
             * them and the host memory is page-locked. */
            while (j < b->nruns && b->runs[j].dev == r->dev)
                j++;
            if (b->pinned && j - i > 1 && dcpx_cuda_batch_api() != NULL) {
                int q = queue_batched(b, i, j, d->stream);
                if (q < 0)
                    break;
                if (q == 0)
                    batched_to = j;
            }
        }
        if (i >= batched_to) {
            if (b->htod)
                rc = dcpx_cu.cuMemcpyHtoDAsync_v2(r->dptr, r->host, r->n,
                                                  d->stream);
            else
                rc = dcpx_cu.cuMemcpyDtoHAsync_v2(r->host, r->dptr, r->n,
                                                  d->stream);
            if (rc != CUDA_SUCCESS) {
                dcpx_cuda_note(err, rc, copy_call, r->index, r->dev);
                break;
            }
            dcpx_cuda_count(b->htod ? DCPX_CUDA_N_HTOD : DCPX_CUDA_N_DTOH, 1);
            b->queued[r->dev] = 1;
        }
        if (i + 1 < b->nruns && b->runs[i + 1].dev == r->dev)
            continue;
        /* The device's last copy: its event, which the device's consumer
         * streams wait on. */
        if ((rc = dcpx_cu.cuEventRecord(b->ev[r->dev], d->stream)) !=
            CUDA_SUCCESS) {
            dcpx_cuda_note(err, rc, "cuEventRecord", r->index, r->dev);
            break;
        }
        b->queued[r->dev] = 2;
        for (Py_ssize_t j = 0; j < b->ncons; j++) {
            if (b->cons[j].dev != r->dev)
                continue;
            rc = dcpx_cu.cuStreamWaitEvent(b->cons[j].stream, b->ev[r->dev],
                                           0);
            if (rc != CUDA_SUCCESS) {
                dcpx_cuda_note(err, rc, "cuStreamWaitEvent on the "
                               "consumer's stream", r->index, r->dev);
                break;
            }
        }
    }
    dcpx_cu.cuCtxSetCurrent(saved);
}

void dcpx_cuda_batch_wait(dcpx_cuda_batch *b, const char *sync_call)
{
    CUcontext saved = NULL;
    dcpx_cu.cuCtxGetCurrent(&saved);
    for (int d = 0; d < DCPX_CUDA_MAX_DEVICES; d++) {
        CUresult rc;
        if (b->queued[d] == 0)
            continue;
        rc = dcpx_cu.cuCtxSetCurrent(b->devs[d]->ctx);
        if (b->queued[d] == 2 && rc == CUDA_SUCCESS) {
            rc = dcpx_cu.cuEventSynchronize(b->ev[d]);
            if (rc != CUDA_SUCCESS) {
                dcpx_cuda_note(&b->err, rc, sync_call, -1, d);
                /* The wait failed, not necessarily the copies: make sure
                 * none is still running before we return. */
                dcpx_cu.cuStreamSynchronize(b->devs[d]->stream);
            }
        }
        else {
            /* Queued copies without their event: drain the stream. */
            dcpx_cu.cuStreamSynchronize(b->devs[d]->stream);
        }
        b->queued[d] = 0;
    }
    dcpx_cu.cuCtxSetCurrent(saved);
}

void dcpx_cuda_batch_raise(PyObject *module, const dcpx_cuda_batch *b,
                           PyObject *pairs)
{
    const dcpx_cuda_err *err = &b->err;
    char what[320];
    if (err->index >= 0) {
        PyObject *item = PySequence_Fast_GET_ITEM(pairs, err->index);
        PyObject *name = NULL;
        const char *s = NULL;
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) > 2 &&
            PyTuple_GET_ITEM(item, 2) != Py_None)
            name = PyObject_Str(PyTuple_GET_ITEM(item, 2));
        if (name != NULL && PyUnicode_Check(name))
            s = PyUnicode_AsUTF8(name);
        if (s != NULL)
            snprintf(what, sizeof(what), "%s for tensor '%.200s' on device "
                     "%d", err->call, s, err->dev);
        else
            snprintf(what, sizeof(what), "%s for tensor #%zd on device %d",
                     err->call, err->index, err->dev);
        PyErr_Clear();
        Py_XDECREF(name);
    }
    else {
        /* A failed wait (an asynchronous error): any of the device's copies
         * may be the one; name the tensors they were for. */
        int len = snprintf(what, sizeof(what), "%s on device %d",
                           err->call, err->dev);
        Py_ssize_t named = 0, total = 0;
        for (Py_ssize_t i = 0; i < b->nruns; i++) {
            PyObject *item, *name = NULL;
            const char *s = NULL;
            if (b->runs[i].dev != err->dev)
                continue;
            total++;
            item = PySequence_Fast_GET_ITEM(pairs, b->runs[i].index);
            if (named == 4 || len < 0 || (size_t)len >= sizeof(what) - 64)
                continue;
            if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) > 2 &&
                PyTuple_GET_ITEM(item, 2) != Py_None)
                name = PyObject_Str(PyTuple_GET_ITEM(item, 2));
            if (name != NULL && PyUnicode_Check(name))
                s = PyUnicode_AsUTF8(name);
            if (s != NULL)
                len += snprintf(what + len, sizeof(what) - (size_t)len,
                                "%s'%.40s'", named ? ", " : " (tensors ", s);
            else
                len += snprintf(what + len, sizeof(what) - (size_t)len,
                                "%s#%zd", named ? ", " : " (tensors ",
                                b->runs[i].index);
            named++;
            PyErr_Clear();
            Py_XDECREF(name);
        }
        if (named > 0 && len > 0 && (size_t)len < sizeof(what) - 32) {
            if (total > named)
                snprintf(what + len, sizeof(what) - (size_t)len,
                         " and %zd more)", total - named);
            else
                snprintf(what + len, sizeof(what) - (size_t)len, ")");
        }
    }
    dcpx_cuda_raise(module, err->rc, what);
}

void dcpx_cuda_batch_destroy(dcpx_cuda_batch *b)
{
    for (int d = 0; d < DCPX_CUDA_MAX_DEVICES; d++) {
        if (b->ev[d] != NULL) {
            CUcontext saved = NULL;
            dcpx_cu.cuCtxGetCurrent(&saved);
            dcpx_cu.cuCtxSetCurrent(b->devs[d]->ctx);
            dcpx_cu.cuEventDestroy_v2(b->ev[d]);
            dcpx_cu.cuCtxSetCurrent(saved);
            b->ev[d] = NULL;
        }
    }
}
