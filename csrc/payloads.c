/* scan_plain: the C writer's payloads of a flat state dict's plain CPU
 * tensors, and whether they still match a save plan's signature.
 *
 *   scan_plain(values, expect, direct, dl_dtypes, export, cuda)
 *       -> (payloads, holes, same)
 *
 * values: the flat state dict's values (a list; it keeps them alive).
 * For each value that dcpx/storage/pending.py's _direct_payload would take (an
 * exact torch.Tensor or torch.nn.Parameter, on the CPU, strided, not
 * nested, not quantized, without conj or neg bit, of a dtype in `direct`,
 * {dtype: storage type name}), payloads[i] is what it returns:
 * (export(t), storage type), t detached first if it requires grad or is a
 * Parameter; `export` is torch._C._to_dlpack_versioned.  Each value is
 * looked at through its own getters (one C call each, no Python frame);
 * its device, shape and dtype are read from the export (a DLPack
 * DLManagedTensorVersioned, dcpx.h), which costs no getter: `dl_dtypes`
 * maps dlpack_dtype_key() of a DLPack dtype to the one torch dtype that
 * exports as it (dcpx/storage/pending.py builds it over every torch dtype and
 * leaves out a DLPack dtype two share); one not in it is asked for.  Every other
 * value, and one whose getters or export raise, is left to Python:
 * payloads[i] is None and i is in `holes` (the checked path names what is
 * wrong with it, or raises the export's error).
 *
 * expect: None, or the plan's signature (dcpx/coordination/plan.py, scan): `same` is
 * True when expect is given and every value handled here has expect[i] ==
 * (dtype, shape, requires_grad, pinned) -- pinned asked only when `cuda`,
 * else False -- as _plan.scan would build it.  The holes are the caller's
 * to compare.
 *
 * Called with the GIL held, which it lets go of for a moment every 1024
 * values (as stage_plain does), so other threads are not held for the
 * whole scan.
 */
#include "dcpx.h"

enum { G_NESTED, G_DTYPE, G_GRAD, M_CONJ, M_NEG, M_DETACH, M_PINNED, N_NAMES };
static const char *const names[N_NAMES] = {
    "is_nested", "dtype", "requires_grad", "is_conj", "is_neg", "detach", "is_pinned"};
static PyObject *name_str[N_NAMES];

#define DLPACK_COMPLEX 5 /* kDLComplex */
static PyObject *tensor_type, *parameter_type;

/* Attribute (or, from M_CONJ on, no-argument method) `which` of v: a new
 * reference, or NULL with the error cleared. */
static PyObject *get(PyObject *v, int which)
{
    PyObject *got = which >= M_CONJ
        ? PyObject_VectorcallMethod(name_str[which], &v,
                                    1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)
        : PyObject_GetAttr(v, name_str[which]);
    if (got == NULL)
        PyErr_Clear();
    return got;
}

static int is(PyObject *v, int which, PyObject *want)
{
    PyObject *got = get(v, which);
    int same = got == want;
    Py_XDECREF(got);
    return same;
}

static int setup(void)
{
    PyObject *torch, *nn;
    for (int i = 0; i < N_NAMES; i++)
        if (name_str[i] == NULL &&
            (name_str[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return -1;
    if (tensor_type != NULL)
        return 0;
    torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return -1;
    tensor_type = PyObject_GetAttrString(torch, "Tensor");
    nn = PyObject_GetAttrString(torch, "nn");
    Py_DECREF(torch);
    if (nn != NULL) {
        parameter_type = PyObject_GetAttrString(nn, "Parameter");
        Py_DECREF(nn);
    }
    if (tensor_type == NULL || parameter_type == NULL) {
        Py_CLEAR(tensor_type);
        Py_CLEAR(parameter_type);
        return -1;
    }
    return 0;
}

/* The key of a DLPack dtype in scan_plain's `dl_dtypes`: small (a cached
 * int) for the usual codes, -1 for one that has none (lanes, odd bits). */
static long dtype_key(DLDataType t)
{
    if (t.lanes != 1 || t.bits == 0 || t.bits % 8 || t.bits / 8 >= 32)
        return -1;
    return (long)t.code * 32 + t.bits / 8;
}

/* The torch dtype of an exported tensor (borrowed): from `dl_dtypes`, or,
 * for a DLPack dtype not in it, from the tensor's dtype getter (a new
 * reference, dropped at once: one object per dtype, which torch holds for
 * good).  NULL with no exception when neither answers. */
static PyObject *dtype_of(PyObject *v, const DLManagedTensorVersioned *m, PyObject *dl_dtypes)
{
    long key = dtype_key(m->dl_tensor.dtype);
    PyObject *d = NULL;
    if (key >= 0) {
        PyObject *k = PyLong_FromLong(key);
        if (k == NULL) {
            PyErr_Clear();
            return NULL;
        }
        d = PyDict_GetItemWithError(dl_dtypes, k);
        Py_DECREF(k);
        if (d != NULL)
            return d;
        PyErr_Clear();
    }
    d = get(v, G_DTYPE);
    Py_XDECREF(d);
    return d;
}

/* The payload of v, a new reference; NULL with no exception when v is left
 * to Python; NULL with an exception when detach() raised.  *dtype and
 * *grad: borrowed (one object per dtype; Py_True or Py_False), *m: the
 * exported tensor (kept alive by the payload), for the signature. */
static PyObject *payload(PyObject *v, PyObject *direct, PyObject *dl_dtypes,
                         PyObject *export, PyObject **dtype, PyObject **grad,
                         const DLManagedTensorVersioned **m)
{
    PyObject *tp = (PyObject *)Py_TYPE(v), *stype, *d, *g, *t, *cap, *out;
    const DLManagedTensorVersioned *mt;
    if (tp != tensor_type && tp != parameter_type)
        return NULL;
    /* Getters only for what the export does not answer: is_cpu, shape and
     * (through `dl_dtypes`) dtype are read from it; `direct` holds only
     * dtypes of tensors check_saveable took (never a quantized one); a
     * tensor of any layout but strided has no storage, which the export
     * refuses (sparse, mkldnn: tests/test_scan_plain.py). */
    if (!is(v, G_NESTED, Py_False) || !is(v, M_NEG, Py_False))
        return NULL;
    g = get(v, G_GRAD);
    if (g == NULL)
        return NULL;
    Py_DECREF(g); /* Py_True or Py_False */
    if (g == Py_True || tp != tensor_type) {
        t = PyObject_VectorcallMethod(name_str[M_DETACH], &v,
                                      1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (t == NULL)
            return NULL;
    }
    else {
        Py_INCREF(v);
        t = v;
    }
    cap = PyObject_CallOneArg(export, t);
    Py_DECREF(t);
    /* A tensor export refuses (a meta tensor, ...) is Python's to refuse,
     * naming the key; one not on the CPU, or of a dtype never checked, too
     * (the capsule, unused, gives the tensor back when it goes). */
    mt = cap != NULL && PyCapsule_IsValid(cap, "dltensor_versioned")
        ? PyCapsule_GetPointer(cap, "dltensor_versioned") : NULL;
    d = mt != NULL && mt->version.major == 1 &&
        mt->dl_tensor.device.device_type == DCPX_DL_CPU
        ? dtype_of(v, mt, dl_dtypes) : NULL;
    stype = d != NULL ? PyDict_GetItemWithError(direct, d) : NULL;
    Py_XINCREF(stype); /* held: is_conj() below may run Python code (a mode) */
    /* Only a complex tensor can have the conj bit (is_conj() costs as much
     * as an export: it parses its arguments). */
    if (stype != NULL && mt->dl_tensor.dtype.code == DLPACK_COMPLEX &&
        !is(v, M_CONJ, Py_False))
        Py_CLEAR(stype);
    if (stype == NULL) {
        PyErr_Clear();
        Py_XDECREF(cap);
        return NULL;
    }
    out = PyTuple_Pack(2, cap, stype);
    Py_DECREF(stype);
    Py_DECREF(cap);
    *dtype = d;
    *grad = g;
    *m = mt;
    return out;
}

/* dlpack_dtype_key(capsule): dtype_key of an unused DLPack capsule's
 * tensor (not consumed), or -1; for dcpx/storage/pending.py's table of which
 * DLPack dtype is which torch dtype. */
PyObject *dcpx_dlpack_dtype_key(PyObject *Py_UNUSED(module), PyObject *cap)
{
    const DLManagedTensorVersioned *m;
    if (!PyCapsule_IsValid(cap, "dltensor_versioned")) {
        PyErr_SetString(PyExc_TypeError, "dcpx: expected an unused dltensor_versioned capsule");
        return NULL;
    }
    m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m == NULL)
        return NULL;
    return PyLong_FromLong(m->version.major == 1 ? dtype_key(m->dl_tensor.dtype) : -1);
}

/* Whether (dtype, shape, requires_grad, pinned) of v is e; shape from m. */
static int matches(PyObject *v, PyObject *e, PyObject *dtype, PyObject *grad, int cuda,
                   const DLManagedTensorVersioned *m)
{
    PyObject *shape;
    Py_ssize_t nd;
    if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 4 ||
        PyTuple_GET_ITEM(e, 0) != dtype || PyTuple_GET_ITEM(e, 2) != grad)
        return 0;
    if (!cuda) {
        if (PyTuple_GET_ITEM(e, 3) != Py_False)
            return 0;
    }
    else if (!is(v, M_PINNED, PyTuple_GET_ITEM(e, 3)))
        return 0;
    shape = PyTuple_GET_ITEM(e, 1);
    if (!PyTuple_Check(shape))
        return 0;
    nd = PyTuple_GET_SIZE(shape);
    if (nd != m->dl_tensor.ndim)
        return 0;
    for (Py_ssize_t i = 0; i < nd; i++) {
        int overflow = 0;
        long long want = PyLong_Check(PyTuple_GET_ITEM(shape, i))
            ? PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(shape, i), &overflow) : -1;
        if (want == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (overflow || want != m->dl_tensor.shape[i])
            return 0;
    }
    return 1;
}

PyObject *dcpx_scan_plain(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *values, *expect, *direct, *dl_dtypes, *export;
    PyObject *payloads = NULL, *holes = NULL;
    int cuda, same;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O!OO!O!Op:scan_plain", &PyList_Type, &values,
                          &expect, &PyDict_Type, &direct, &PyDict_Type, &dl_dtypes,
                          &export, &cuda))
        return NULL;
    n = PyList_GET_SIZE(values);
    if (expect != Py_None &&
        (!PyList_Check(expect) || PyList_GET_SIZE(expect) != n)) {
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: scan_plain: expect must be None or a list as long as values");
        return NULL;
    }
    if (setup() < 0)
        return NULL;
    same = expect != Py_None;
    payloads = PyList_New(n);
    holes = PyList_New(0);
    if (payloads == NULL || holes == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyList_GET_ITEM(values, i), *dtype = NULL, *grad = NULL, *p;
        const DLManagedTensorVersioned *m = NULL;
        if (i % 1024 == 1023) {
            /* Let other threads run; `values` is the caller's own list. */
            Py_BEGIN_ALLOW_THREADS
            Py_END_ALLOW_THREADS
        }
        p = payload(v, direct, dl_dtypes, export, &dtype, &grad, &m);
        if (p == NULL) {
            PyObject *ix;
            if (PyErr_Occurred())
                goto fail;
            Py_INCREF(Py_None);
            PyList_SET_ITEM(payloads, i, Py_None);
            ix = PyLong_FromSsize_t(i);
            if (ix == NULL || PyList_Append(holes, ix) < 0) {
                Py_XDECREF(ix);
                goto fail;
            }
            Py_DECREF(ix);
            continue;
        }
        PyList_SET_ITEM(payloads, i, p);
        if (same && !matches(v, PyList_GET_ITEM(expect, i), dtype, grad, cuda, m))
            same = 0;
    }
    return Py_BuildValue("(NNO)", payloads, holes, same ? Py_True : Py_False);
fail:
    Py_XDECREF(payloads);
    Py_XDECREF(holes);
    return NULL;
}
