/* The CUDA driver, loaded at run time: dlopen("libcuda.so.1") on first use
 * (DCPX_LIBCUDA overrides the path: the tests load a stand-in), entry
 * points resolved by dlsym under their versioned names, CUresult codes
 * turned into dcpx._C.CudaError, per-device primary context and stream,
 * the registry of page-locked host ranges, and fork safety.
 *
 * Everything here that changes state runs with the GIL held, which
 * serialises it.  The table `dcpx_cu` and a device's context and stream
 * are written once, before any GIL-free code can use them, and only read
 * afterwards (until dcpx_cuda_release_all, which callers run when no
 * staging is in flight: stager close has waited, interpreter exit). */
#include "cuda_api.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

dcpx_cuda_api dcpx_cu;

static int g_loaded;      /* driver loaded, version checked, cuInit done */
static int g_forked;      /* this process forked after g_loaded */
static int g_ndevices;
static int g_atfork;
static dcpx_cuda_device g_dev[DCPX_CUDA_MAX_DEVICES];

typedef struct {
    void *p;
    size_t n;
} reg_range;
static reg_range *g_reg;
static size_t g_nreg, g_capreg;

int dcpx_cuda_forked(void) { return g_forked; }

/* The child of a fork shares no CUDA state with its parent: the parent's
 * contexts, streams and registrations are not the child's to use or free
 * (the driver itself refuses them there).  Forget them without a call. */
static void after_fork_child(void)
{
    if (g_loaded)
        g_forked = 1;
    g_loaded = 0;
    memset(g_dev, 0, sizeof(g_dev));
    g_nreg = 0;
}

static PyObject *cuda_error_type(PyObject *module)
{
    dcpx_state *st = PyModule_GetState(module);
    return st->CudaError;
}

static void raise_msg(PyObject *module, int code, const char *msg)
{
    PyObject *exc = PyObject_CallFunction(cuda_error_type(module), "s", msg);
    if (exc == NULL)
        return;
    PyObject *c = PyLong_FromLong(code);
    if (c == NULL || PyObject_SetAttrString(exc, "code", c) < 0) {
        Py_XDECREF(c);
        Py_DECREF(exc);
        return;
    }
    Py_DECREF(c);
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

void dcpx_cuda_raise(PyObject *module, CUresult rc, const char *what)
{
    const char *name = NULL, *desc = NULL;
    char msg[512];
    if (dcpx_cu.cuGetErrorName == NULL ||
        dcpx_cu.cuGetErrorName(rc, &name) != CUDA_SUCCESS || name == NULL)
        name = "unknown CUresult";
    if (dcpx_cu.cuGetErrorString == NULL ||
        dcpx_cu.cuGetErrorString(rc, &desc) != CUDA_SUCCESS || desc == NULL)
        desc = "no description";
    snprintf(msg, sizeof(msg), "dcpx: %s failed: %s (%d: %s)", what, name,
             (int)rc, desc);
    raise_msg(module, (int)rc, msg);
}

int dcpx_cuda_load(PyObject *module)
{
    static void *lib;
    char msg[768];
    const char *path;
    int version = 0;
    CUresult rc;

    if (g_loaded)
        return 0;
    if (g_forked) {
        raise_msg(module, CUDA_ERROR_NOT_INITIALIZED,
                  "dcpx: CUDA was set up in the parent process before "
                  "fork(); a forked child cannot use it (start the child "
                  "with the 'spawn' method)");
        return -1;
    }
    path = getenv("DCPX_LIBCUDA");
    if (path == NULL || path[0] == '\0')
        path = "libcuda.so.1";
    if (lib == NULL) {
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL) {
            const char *why = dlerror();
            snprintf(msg, sizeof(msg),
                     "dcpx: cannot load the CUDA driver %s: %s", path,
                     why ? why : "unknown error");
            raise_msg(module, CUDA_ERROR_NOT_INITIALIZED, msg);
            return -1;
        }
    }
#define DCPX_CUDA_RESOLVE(name)                                          \
    *(void **)&dcpx_cu.name = dlsym(lib, #name);                         \
    if (dcpx_cu.name == NULL) {                                          \
        snprintf(msg, sizeof(msg),                                       \
                 "dcpx: the CUDA driver %s has no " #name ": it is "     \
                 "older than dcpx needs (CUDA 11.0 or newer)", path);    \
        memset(&dcpx_cu, 0, sizeof(dcpx_cu));                            \
        raise_msg(module, CUDA_ERROR_NOT_INITIALIZED, msg);              \
        return -1;                                                       \
    }
    DCPX_CUDA_FN(DCPX_CUDA_RESOLVE)
#undef DCPX_CUDA_RESOLVE
    rc = dcpx_cu.cuDriverGetVersion(&version);
    if (rc != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuDriverGetVersion");
        return -1;
    }
    if (version < DCPX_CUDA_MIN_DRIVER) {
        snprintf(msg, sizeof(msg),
                 "dcpx: the CUDA driver is version %d.%d (%d); dcpx needs "
                 "%d.%d or newer", version / 1000, (version % 1000) / 10,
                 version, DCPX_CUDA_MIN_DRIVER / 1000,
                 (DCPX_CUDA_MIN_DRIVER % 1000) / 10);
        raise_msg(module, CUDA_ERROR_NOT_INITIALIZED, msg);
        return -1;
    }
    rc = dcpx_cu.cuInit(0);
    if (rc != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuInit");
        return -1;
    }
    rc = dcpx_cu.cuDeviceGetCount(&g_ndevices);
    if (rc != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuDeviceGetCount");
        return -1;
    }
    if (!g_atfork) {
        if (pthread_atfork(NULL, NULL, after_fork_child) != 0) {
            PyErr_SetString(PyExc_RuntimeError,
                            "dcpx: pthread_atfork failed");
            return -1;
        }
        g_atfork = 1;
    }
    g_loaded = 1;
    return 0;
}

dcpx_cuda_device *dcpx_cuda_device_get(PyObject *module, int id)
{
    char msg[256];
    CUdevice dev;
    CUcontext saved = NULL;
    CUresult rc;
    dcpx_cuda_device *d;

    if (dcpx_cuda_load(module) < 0)
        return NULL;
    if (id < 0 || id >= g_ndevices || id >= DCPX_CUDA_MAX_DEVICES) {
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        snprintf(msg, sizeof(msg),
                 "dcpx: tensor on CUDA device %d, but this process sees %d "
                 "CUDA device(s) (CUDA_VISIBLE_DEVICES=%s)", id, g_ndevices,
                 vis ? vis : "unset");
        raise_msg(module, CUDA_ERROR_INVALID_DEVICE, msg);
        return NULL;
    }
    d = &g_dev[id];
    if (d->stream != NULL)
        return d;
    if (d->ctx == NULL) {
        if ((rc = dcpx_cu.cuDeviceGet(&dev, id)) != CUDA_SUCCESS) {
            dcpx_cuda_raise(module, rc, "cuDeviceGet");
            return NULL;
        }
        if ((rc = dcpx_cu.cuDevicePrimaryCtxRetain(&d->ctx, dev)) !=
            CUDA_SUCCESS) {
            d->ctx = NULL;
            dcpx_cuda_raise(module, rc, "cuDevicePrimaryCtxRetain");
            return NULL;
        }
        d->dev = dev;
    }
    if ((rc = dcpx_cu.cuCtxGetCurrent(&saved)) != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuCtxGetCurrent");
        return NULL;
    }
    if ((rc = dcpx_cu.cuCtxSetCurrent(d->ctx)) != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuCtxSetCurrent");
        return NULL;
    }
    rc = dcpx_cu.cuStreamCreate(&d->stream, CU_STREAM_NON_BLOCKING);
    dcpx_cu.cuCtxSetCurrent(saved);
    if (rc != CUDA_SUCCESS) {
        d->stream = NULL;
        dcpx_cuda_raise(module, rc, "cuStreamCreate");
        return NULL;
    }
    return d;
}

CUresult dcpx_cuda_event_create(PyObject *module, int d, CUevent *ev,
                                const char **call)
{
    CUcontext saved = NULL;
    CUresult rc;
    *call = "cuCtxSetCurrent";
    dcpx_cu.cuCtxGetCurrent(&saved);
    rc = dcpx_cu.cuCtxSetCurrent(dcpx_cuda_device_get(module, d)->ctx);
    if (rc == CUDA_SUCCESS) {
        *call = "cuEventCreate";
        rc = dcpx_cu.cuEventCreate(ev, CU_EVENT_DISABLE_TIMING);
        dcpx_cu.cuCtxSetCurrent(saved);
    }
    if (rc != CUDA_SUCCESS)
        *ev = NULL;
    return rc;
}

int dcpx_cuda_registry_add(void *p, size_t n)
{
    if (g_nreg == g_capreg) {
        size_t cap = g_capreg ? 2 * g_capreg : 8;
        reg_range *r = realloc(g_reg, cap * sizeof(*r));
        if (r == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        g_reg = r;
        g_capreg = cap;
    }
    g_reg[g_nreg].p = p;
    g_reg[g_nreg].n = n;
    g_nreg++;
    return 0;
}

int dcpx_cuda_registry_remove(void *p)
{
    for (size_t i = 0; i < g_nreg; i++) {
        if (g_reg[i].p == p) {
            g_reg[i] = g_reg[--g_nreg];
            return 1;
        }
    }
    return 0;
}

/* cuda_registered(): (count, bytes) of the host ranges this process has
 * page-locked and not yet unregistered; (0, 0) before the driver is loaded.
 * Makes no driver call: tests check with it that registrations balance. */
PyObject *dcpx_cuda_registered(PyObject *module, PyObject *unused)
{
    unsigned long long bytes = 0;
    (void)module;
    (void)unused;
    for (size_t i = 0; i < g_nreg; i++)
        bytes += g_reg[i].n;
    return Py_BuildValue("(nK)", (Py_ssize_t)g_nreg, bytes);
}

/* A context to make current for calls that need one but concern no device
 * in particular (registering host memory, which is PORTABLE): the first
 * device's. */
static dcpx_cuda_device *any_device(PyObject *module)
{
    for (int i = 0; i < g_ndevices && i < DCPX_CUDA_MAX_DEVICES; i++)
        if (g_dev[i].stream != NULL)
            return &g_dev[i];
    return dcpx_cuda_device_get(module, 0);
}

PyObject *dcpx_cuda_driver_version(PyObject *module, PyObject *unused)
{
    int version = 0;
    CUresult rc;
    (void)unused;
    if (dcpx_cuda_load(module) < 0)
        return NULL;
    if ((rc = dcpx_cu.cuDriverGetVersion(&version)) != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuDriverGetVersion");
        return NULL;
    }
    return Py_BuildValue("(ii)", version, g_ndevices);
}

/* cuda_host_register(buffer): page-lock a host buffer (a contiguous CPU
 * tensor: the stager's staging buffer) once.  True when pinned; False,
 * with a RuntimeWarning, when the driver refuses (out of memory, a limit
 * on locked memory): the stager then copies into pageable memory. */
PyObject *dcpx_cuda_host_register(PyObject *module, PyObject *args)
{
    PyObject *obj;
    dcpx_view v;
    dcpx_cuda_device *d;
    CUcontext saved = NULL;
    CUresult rc;

    if (!PyArg_ParseTuple(args, "O:cuda_host_register", &obj))
        return NULL;
    if ((d = any_device(module)) == NULL)
        return NULL;
    if (dcpx_view_from_object(obj, &v, 1) < 0)
        return NULL;
    if (v.device_type != DCPX_DL_CPU || !v.contiguous || v.nbytes == 0) {
        dcpx_view_release(&v);
        PyErr_SetString(PyExc_ValueError,
                        "dcpx: cuda_host_register needs a non-empty, "
                        "contiguous CPU buffer");
        return NULL;
    }
    void *p = v.data;
    size_t n = (size_t)v.nbytes;
    dcpx_view_release(&v); /* the caller keeps the memory alive */
    dcpx_cu.cuCtxGetCurrent(&saved);
    rc = dcpx_cu.cuCtxSetCurrent(d->ctx);
    if (rc == CUDA_SUCCESS) {
        Py_BEGIN_ALLOW_THREADS
        rc = dcpx_cu.cuMemHostRegister_v2(p, n, CU_MEMHOSTREGISTER_PORTABLE);
        Py_END_ALLOW_THREADS
        dcpx_cu.cuCtxSetCurrent(saved);
    }
    if (rc != CUDA_SUCCESS) {
        const char *name = NULL;
        if (dcpx_cu.cuGetErrorName(rc, &name) != CUDA_SUCCESS || !name)
            name = "unknown CUresult";
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                             "dcpx: cannot page-lock the %zu-byte staging "
                             "buffer (cuMemHostRegister: %s, %d); staging "
                             "into pageable memory instead, which is slower",
                             n, name, (int)rc) < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    if (dcpx_cuda_registry_add(p, n) < 0) {
        dcpx_cu.cuMemHostUnregister(p);
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* cuda_host_unregister(buffer): undo cuda_host_register.  A no-op for a
 * buffer dcpx did not register in this process (a forked child's copy of
 * its parent's buffer, or one already unregistered). */
PyObject *dcpx_cuda_host_unregister(PyObject *module, PyObject *args)
{
    PyObject *obj;
    dcpx_view v;
    CUcontext saved = NULL;
    CUresult rc;
    dcpx_cuda_device *d;

    if (!PyArg_ParseTuple(args, "O:cuda_host_unregister", &obj))
        return NULL;
    if (dcpx_view_from_object(obj, &v, 0) < 0)
        return NULL;
    void *p = v.data;
    dcpx_view_release(&v);
    if (!g_loaded || !dcpx_cuda_registry_remove(p))
        Py_RETURN_FALSE;
    if ((d = any_device(module)) == NULL)
        return NULL;
    dcpx_cu.cuCtxGetCurrent(&saved);
    rc = dcpx_cu.cuCtxSetCurrent(d->ctx);
    if (rc == CUDA_SUCCESS) {
        rc = dcpx_cu.cuMemHostUnregister(p);
        dcpx_cu.cuCtxSetCurrent(saved);
    }
    if (rc != CUDA_SUCCESS) {
        dcpx_cuda_raise(module, rc, "cuMemHostUnregister");
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* cuda_release_all(): unregister every buffer still registered, destroy
 * dcpx's streams and release the primary contexts (interpreter exit).  The
 * caller guarantees no staging is in flight.  Returns the number of
 * buffers unregistered.  Errors are ignored: this is teardown. */
PyObject *dcpx_cuda_release_all(PyObject *module, PyObject *unused)
{
    CUcontext saved = NULL;
    size_t n = 0;
    (void)module;
    (void)unused;
    if (!g_loaded)
        return PyLong_FromLong(0);
    dcpx_cu.cuCtxGetCurrent(&saved);
    for (int i = 0; i < g_ndevices && i < DCPX_CUDA_MAX_DEVICES; i++) {
        dcpx_cuda_device *d = &g_dev[i];
        if (d->ctx == NULL)
            continue;
        dcpx_cu.cuCtxSetCurrent(d->ctx);
        while (g_nreg > 0) {
            dcpx_cu.cuMemHostUnregister(g_reg[g_nreg - 1].p);
            g_nreg--;
            n++;
        }
        if (d->stream != NULL) {
            Py_BEGIN_ALLOW_THREADS
            dcpx_cu.cuStreamSynchronize(d->stream);
            Py_END_ALLOW_THREADS
            dcpx_cu.cuStreamDestroy_v2(d->stream);
        }
        dcpx_cu.cuCtxSetCurrent(saved);
        dcpx_cu.cuDevicePrimaryCtxRelease_v2(d->dev);
        d->ctx = NULL;
        d->stream = NULL;
    }
    return PyLong_FromSize_t(n);
}
