/* DLPack ingestion: a tensor-like object -> dcpx_view.
 *
 * The capsule contract (https://dmlc.github.io/dlpack/latest/python_spec.html):
 *  - ask for a versioned capsule with __dlpack__(max_version=(1, 0)); a
 *    producer that predates it raises TypeError, then use the legacy call;
 *  - accept "dltensor_versioned" (major version 1) or "dltensor";
 *  - once the pointer is taken, rename the capsule to "used_dltensor[...]"
 *    so its destructor does not free the tensor, and call the deleter
 *    exactly once ourselves (dcpx_view_release);
 *  - honour byte_offset, strides == NULL (compact row-major) and the
 *    read-only flag.
 * Modelled on numpy/_core/src/multiarray/dlpack.c.
 */
#include "dcpx.h"

#include <string.h>

#define DCPX_MAX_NDIM 64

static PyObject *call_dlpack(PyObject *obj)
{
    PyObject *meth = NULL, *kw = NULL, *ver = NULL, *empty = NULL, *res = NULL;

    meth = PyObject_GetAttrString(obj, "__dlpack__");
    if (meth == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "dcpx: object of type %.200s has no __dlpack__; "
                     "expected a tensor", Py_TYPE(obj)->tp_name);
        goto done;
    }
    empty = PyTuple_New(0);
    ver = Py_BuildValue("(ii)", 1, 0);
    if (empty == NULL || ver == NULL)
        goto done;
    kw = PyDict_New();
    if (kw == NULL || PyDict_SetItemString(kw, "max_version", ver) < 0)
        goto done;
    res = PyObject_Call(meth, empty, kw);
    if (res == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        /* Producer without max_version support: legacy protocol. */
        PyErr_Clear();
        res = PyObject_CallNoArgs(meth);
    }
done:
    Py_XDECREF(meth);
    Py_XDECREF(kw);
    Py_XDECREF(ver);
    Py_XDECREF(empty);
    return res;
}

static int fill_view(dcpx_view *v, const DLTensor *t, int read_only)
{
    if (t->dtype.lanes != 1 || t->dtype.bits == 0 || t->dtype.bits % 8) {
        PyErr_Format(PyExc_TypeError,
                     "dcpx: unsupported DLPack dtype (code %d, bits %d, "
                     "lanes %d)", t->dtype.code, t->dtype.bits,
                     t->dtype.lanes);
        return -1;
    }
    if (t->ndim < 0 || t->ndim > DCPX_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "dcpx: unsupported ndim %d", t->ndim);
        return -1;
    }
    v->ndim = t->ndim;
    v->shape = t->shape;
    v->strides = t->strides;
    v->itemsize = t->dtype.bits / 8;
    v->dtype_code = t->dtype.code;
    v->device_type = t->device.device_type;
    v->device_id = t->device.device_id;
    v->read_only = read_only;

    uint64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "dcpx: negative dimension");
            return -1;
        }
        if (t->shape[i] && numel > UINT64_MAX / (uint64_t)t->shape[i]) {
            PyErr_SetString(PyExc_OverflowError, "dcpx: tensor too large");
            return -1;
        }
        numel *= (uint64_t)t->shape[i];
    }
    v->numel = numel;
    v->nbytes = numel * v->itemsize;
    if (t->data == NULL && numel > 0) {
        /* A tensor without storage (a wrapper subclass): nothing to read. */
        PyErr_Format(PyExc_ValueError,
                     "dcpx: tensor of %llu elements has no data (NULL data pointer: "
                     "a tensor subclass without storage?)", (unsigned long long)numel);
        return -1;
    }
    v->data = (char *)t->data + t->byte_offset;

    /* Compact row-major?  Dimensions of size 1 may carry any stride. */
    v->contiguous = 1;
    if (t->strides != NULL && numel > 1) {
        int64_t expect = 1;
        for (int i = t->ndim - 1; i >= 0; i--) {
            if (t->shape[i] != 1 && t->strides[i] != expect) {
                v->contiguous = 0;
                break;
            }
            expect *= t->shape[i];
        }
    }
    if (v->contiguous)
        v->strides = NULL;
    return 0;
}

int dcpx_view_from_object(PyObject *obj, dcpx_view *out, int need_writable)
{
    PyObject *cap = NULL;
    int rc = -1;

    memset(out, 0, sizeof(*out));
    /* A capsule made by the caller (torch._C._to_dlpack_versioned, ~10x
     * cheaper than torch's Python __dlpack__), or an object to export. */
    if (PyCapsule_CheckExact(obj)) {
        Py_INCREF(obj);
        cap = obj;
    }
    else {
        cap = call_dlpack(obj);
    }
    if (cap == NULL)
        goto done;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        DLManagedTensorVersioned *m =
            PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (m == NULL)
            goto done;
        if (m->version.major != 1) {
            /* Not renamed: the capsule's destructor still owns it. */
            PyErr_Format(PyExc_BufferError,
                         "dcpx: unsupported DLPack version %u.%u",
                         m->version.major, m->version.minor);
            goto done;
        }
        if (fill_view(out, &m->dl_tensor,
                      (m->flags & DCPX_DLPACK_FLAG_READ_ONLY) != 0) < 0)
            goto done;
        if (PyCapsule_SetName(cap, "used_dltensor_versioned") < 0)
            goto done;
        out->managed_v = m;
    }
    else if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m == NULL)
            goto done;
        if (fill_view(out, &m->dl_tensor, 0) < 0)
            goto done;
        if (PyCapsule_SetName(cap, "used_dltensor") < 0)
            goto done;
        out->managed = m;
    }
    else {
        PyErr_SetString(PyExc_TypeError,
                        "dcpx: expected a tensor or an unused DLPack capsule");
        goto done;
    }
    if (need_writable && out->read_only) {
        dcpx_view_release(out);
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: destination tensor is read-only");
        goto done;
    }
    rc = 0;
done:
    Py_XDECREF(cap);
    return rc;
}

void dcpx_view_release(dcpx_view *v)
{
    /* Deleters may take the GIL themselves; callers must not hold a lock a
     * GIL holder could wait on. */
    if (v->managed_v != NULL && v->managed_v->deleter != NULL)
        v->managed_v->deleter(v->managed_v);
    if (v->managed != NULL && v->managed->deleter != NULL)
        v->managed->deleter(v->managed);
    v->managed_v = NULL;
    v->managed = NULL;
    v->shape = NULL;
    v->strides = NULL;
    v->data = NULL;
}

/* Copy elements [e, e + count) of the row-major image of a strided view. */
void dcpx_view_gather(const dcpx_view *v, uint64_t from, uint64_t len,
                      char *dst)
{
    const uint32_t isz = v->itemsize;
    int64_t idx[DCPX_MAX_NDIM];
    uint64_t e = from / isz, count = len / isz;
    const int nd = v->ndim;

    if (v->strides == NULL) {
        memcpy(dst, v->data + from, len);
        return;
    }
    for (int i = nd - 1; i >= 0; i--) {
        idx[i] = (int64_t)(e % (uint64_t)v->shape[i]);
        e /= (uint64_t)v->shape[i];
    }
    const int64_t inner = v->shape[nd - 1];
    const int64_t istride = v->strides[nd - 1] * (int64_t)isz;
    while (count) {
        int64_t off = 0;
        for (int i = 0; i < nd - 1; i++)
            off += idx[i] * v->strides[i];
        const char *src = v->data + (off + idx[nd - 1] * v->strides[nd - 1]) *
                                        (int64_t)isz;
        uint64_t run = (uint64_t)(inner - idx[nd - 1]);
        if (run > count)
            run = count;
        if (istride == (int64_t)isz) {
            memcpy(dst, src, run * isz);
        }
        else {
            switch (isz) {
            case 1:
                for (uint64_t k = 0; k < run; k++)
                    dst[k] = src[k * istride];
                break;
            case 2:
                for (uint64_t k = 0; k < run; k++)
                    memcpy(dst + 2 * k, src + k * istride, 2);
                break;
            case 4:
                for (uint64_t k = 0; k < run; k++)
                    memcpy(dst + 4 * k, src + k * istride, 4);
                break;
            case 8:
                for (uint64_t k = 0; k < run; k++)
                    memcpy(dst + 8 * k, src + k * istride, 8);
                break;
            default:
                for (uint64_t k = 0; k < run; k++)
                    memcpy(dst + isz * k, src + k * istride, isz);
            }
        }
        dst += run * isz;
        count -= run;
        /* Advance the multi-index by `run` elements: the inner dim wraps. */
        idx[nd - 1] += (int64_t)run;
        for (int i = nd - 1; i > 0 && idx[i] >= v->shape[i]; i--) {
            idx[i] = 0;
            idx[i - 1]++;
        }
    }
}
