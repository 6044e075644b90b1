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
#include <stdatomic.h>
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

/* Batched copies: at most one of the two ABIs is resolved (the newer
 * preferred); g_batch_off switches them off (cuda_batch_copies). */
static dcpx_cu_batch_v1 g_batch_v1;
static dcpx_cu_batch_v2 g_batch_v2;
static atomic_int g_batch_off;
static atomic_long g_count[DCPX_CUDA_N_COUNTERS];

void dcpx_cuda_count(int counter, long n)
{
    atomic_fetch_add_explicit(&g_count[counter], n, memory_order_relaxed);
}

const char *dcpx_cuda_batch_api(void)
{
    if (atomic_load(&g_batch_off))
        return NULL;
    if (g_batch_v2 != NULL)
        return "cuMemcpyBatchAsync_v2";
    if (g_batch_v1 != NULL)
        return "cuMemcpyBatchAsync";
    return NULL;
}

const char *dcpx_cuda_batch_call(int exact)
{
    if (g_batch_v2 != NULL)
        return exact ? "cuMemcpyBatchAsync_v2"
                     : "cuMemcpyBatchAsync_v2 (a batch starting with the copy)";
    return exact ? "cuMemcpyBatchAsync"
                 : "cuMemcpyBatchAsync (a batch starting with the copy)";
}

CUresult dcpx_cuda_memcpy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                size_t *sizes, size_t count, CUstream stream,
                                Py_ssize_t *failed)
{
    /* One set of attributes for every copy: the sources (dcpx's pinned
     * buffers, or device memory ordered by events) are read in stream
     * order; no location hints (they concern managed memory only). */
    dcpx_cu_memcpy_attrs attrs;
    size_t idx = 0, fail = (size_t)-1;
    CUresult rc;
    memset(&attrs, 0, sizeof(attrs));
    attrs.srcAccessOrder = DCPX_CU_SRC_ACCESS_ORDER_STREAM;
    *failed = -1;
    if (g_batch_v2 != NULL)
        return g_batch_v2(dsts, srcs, sizes, count, &attrs, &idx, 1, stream);
    if (g_batch_v1 == NULL)
        return CUDA_ERROR_NOT_SUPPORTED;
    rc = g_batch_v1(dsts, srcs, sizes, count, &attrs, &idx, 1, &fail, stream);
    if (rc != CUDA_SUCCESS && fail < count)
        *failed = (Py_ssize_t)fail;
    return rc;
}

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
    /* Batched copies came with CUDA 12.8 (cuMemcpyBatchAsync, with
     * failIdx); CUDA 13.0 added cuMemcpyBatchAsync_v2 (without) and kept
     * the old symbol for old binaries.  A symbol in a driver older than
     * its version is not one dcpx knows the ABI of. */
    g_batch_v1 = NULL;
    g_batch_v2 = NULL;
    if (version >= 13000)
        *(void **)&g_batch_v2 = dlsym(lib, "cuMemcpyBatchAsync_v2");
    if (version >= 12080 && g_batch_v2 == NULL)
        *(void **)&g_batch_v1 = dlsym(lib, "cuMemcpyBatchAsync");
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

int dcpx_cuda_registry_contains(const void *p, size_t n)
{
    const char *c = p;
    for (size_t i = 0; i < g_nreg; i++) {
        const char *r = g_reg[i].p;
        if (c >= r && c <= r + g_reg[i].n && n <= g_reg[i].n - (size_t)(c - r))
            return 1;
    }
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

/* cuda_copy_stats(): the copy calls made since the driver was loaded, and
 * which batched entry point is in use (None: one call per copy). */
PyObject *dcpx_cuda_copy_stats(PyObject *module, PyObject *unused)
{
    const char *api;
    (void)module;
    (void)unused;
    api = g_loaded ? dcpx_cuda_batch_api() : NULL;
    return Py_BuildValue(
        "{s:z,s:O,s:l,s:l,s:l,s:l,s:l,s:l}", "batch_api", api,
        "batch_available", (g_batch_v1 || g_batch_v2) ? Py_True : Py_False,
        "htod_calls", atomic_load(&g_count[DCPX_CUDA_N_HTOD]),
        "dtoh_calls", atomic_load(&g_count[DCPX_CUDA_N_DTOH]),
        "batch_htod_calls", atomic_load(&g_count[DCPX_CUDA_N_BATCH_HTOD]),
        "batch_dtoh_calls", atomic_load(&g_count[DCPX_CUDA_N_BATCH_DTOH]),
        "batched_htod", atomic_load(&g_count[DCPX_CUDA_N_BATCHED_HTOD]),
        "batched_dtoh", atomic_load(&g_count[DCPX_CUDA_N_BATCHED_DTOH]));
}

/* cuda_batch_copies(enabled=None): switch batched copies on or off for
 * this process (None: leave as is); returns the entry point now in use,
 * or None.  For tests and benchmarks that compare both paths. */
PyObject *dcpx_cuda_batch_copies(PyObject *module, PyObject *args)
{
    PyObject *on = Py_None;
    const char *api;
    if (!PyArg_ParseTuple(args, "|O:cuda_batch_copies", &on))
        return NULL;
    if (dcpx_cuda_load(module) < 0)
        return NULL;
    if (on != Py_None) {
        int t = PyObject_IsTrue(on);
        if (t < 0)
            return NULL;
        atomic_store(&g_batch_off, !t);
    }
    api = dcpx_cuda_batch_api();
    if (api == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(api);
}
