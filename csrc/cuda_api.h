/* The CUDA driver API as dcpx sees it: types and prototypes from the
 * Toolkit's cuda.h when setup.py found one (DCPX_HAVE_CUDA_H), else from
 * cuda_min.h; the entry points themselves are resolved at run time from
 * libcuda.so.1 (csrc/cuda.c), so the extension links against no CUDA
 * library and imports where none exists.
 *
 * Threading: dcpx_cuda_load() and dcpx_cuda_raise() run with the GIL held.
 * The function table is filled once, before any thread can see it, and is
 * read-only afterwards: threads without the GIL may call through it. */
#ifndef DCPX_CUDA_API_H
#define DCPX_CUDA_API_H

#include "dcpx.h"

#ifdef DCPX_HAVE_CUDA_H
#include <cuda.h>
#else
#include "cuda_min.h"
#endif

/* The oldest driver dcpx accepts (cuDriverGetVersion's 1000 * major +
 * 10 * minor): CUDA 11.0, older than any driver torch 2.x runs on. */
#define DCPX_CUDA_MIN_DRIVER 11000
#define DCPX_CUDA_MAX_DEVICES 64

#define DCPX_CUDA_FN(X)                                                   \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet)    \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease_v2)           \
    X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuStreamCreate)               \
    X(cuStreamDestroy_v2) X(cuStreamSynchronize) X(cuStreamWaitEvent)     \
    X(cuEventCreate) X(cuEventRecord) X(cuEventSynchronize)               \
    X(cuEventQuery) X(cuEventDestroy_v2) X(cuMemcpyDtoHAsync_v2)          \
    X(cuMemcpyHtoDAsync_v2)                                               \
    X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuGetErrorName)      \
    X(cuGetErrorString)

/* Batched copies (CUDA 12.8+), optional: resolved when the driver has
 * them, never required.  Two ABIs under two symbols: CUDA 12.8's
 * cuMemcpyBatchAsync (with failIdx) and CUDA 13.0's cuMemcpyBatchAsync_v2
 * (without; cuda.h 13 maps the plain name to it).  The attributes struct
 * is dcpx's own copy of CUmemcpyAttributes (checked against cuda.h below
 * when the Toolkit's is 12.8 or newer), so that a build with an older
 * cuda.h or with cuda_min.h can call either. */
typedef struct {
    int type;
    int id;
} dcpx_cu_mem_location;               /* CUmemLocation */
typedef struct {
    int srcAccessOrder;               /* CUmemcpySrcAccessOrder */
    dcpx_cu_mem_location srcLocHint;
    dcpx_cu_mem_location dstLocHint;
    unsigned int flags;
} dcpx_cu_memcpy_attrs;               /* CUmemcpyAttributes */
#define DCPX_CU_SRC_ACCESS_ORDER_STREAM 1
typedef CUresult (*dcpx_cu_batch_v1)(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                     size_t *sizes, size_t count,
                                     dcpx_cu_memcpy_attrs *attrs,
                                     size_t *attrsIdxs, size_t numAttrs,
                                     size_t *failIdx, CUstream hStream);
typedef CUresult (*dcpx_cu_batch_v2)(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                     size_t *sizes, size_t count,
                                     dcpx_cu_memcpy_attrs *attrs,
                                     size_t *attrsIdxs, size_t numAttrs,
                                     CUstream hStream);
#if defined(DCPX_HAVE_CUDA_H) && defined(CUDA_VERSION) && CUDA_VERSION >= 12080
#include <stddef.h>
_Static_assert(sizeof(dcpx_cu_memcpy_attrs) == sizeof(CUmemcpyAttributes) &&
               offsetof(dcpx_cu_memcpy_attrs, srcLocHint) ==
                   offsetof(CUmemcpyAttributes, srcLocHint) &&
               offsetof(dcpx_cu_memcpy_attrs, dstLocHint) ==
                   offsetof(CUmemcpyAttributes, dstLocHint) &&
               offsetof(dcpx_cu_memcpy_attrs, flags) ==
                   offsetof(CUmemcpyAttributes, flags) &&
               sizeof(CUmemcpySrcAccessOrder) == sizeof(int) &&
               sizeof(CUmemLocationType) == sizeof(int),
               "dcpx_cu_memcpy_attrs must match cuda.h's CUmemcpyAttributes");
_Static_assert(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM ==
                   DCPX_CU_SRC_ACCESS_ORDER_STREAM, "cuda.h's value");
#if CUDA_VERSION >= 13000 /* cuMemcpyBatchAsync is cuMemcpyBatchAsync_v2 */
_Static_assert(__builtin_types_compatible_p(
                   __typeof__(&cuMemcpyBatchAsync),
                   CUresult (*)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                CUmemcpyAttributes *, size_t *, size_t,
                                CUstream)),
               "cuMemcpyBatchAsync_v2's prototype as dcpx_cu_batch_v2's");
#else
_Static_assert(__builtin_types_compatible_p(
                   __typeof__(&cuMemcpyBatchAsync),
                   CUresult (*)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                CUmemcpyAttributes *, size_t *, size_t,
                                size_t *, CUstream)),
               "cuMemcpyBatchAsync's prototype as dcpx_cu_batch_v1's");
#endif
#endif

typedef struct {
#define DCPX_CUDA_MEMBER(name) __typeof__(name) *name;
    DCPX_CUDA_FN(DCPX_CUDA_MEMBER)
#undef DCPX_CUDA_MEMBER
} dcpx_cuda_api;

/* Filled by dcpx_cuda_load(); NULL members until then. */
extern dcpx_cuda_api dcpx_cu;

/* One device as dcpx uses it: its primary context (retained once, the
 * context torch uses) and dcpx's own non-blocking stream on it. */
typedef struct {
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
} dcpx_cuda_device;

/* GIL held.  Load the driver (once), check its version, cuInit.  0, or -1
 * with a dcpx._C.CudaError set. */
int dcpx_cuda_load(PyObject *module);
/* GIL held.  The device's context and stream, set up on first use; NULL
 * with an exception set for a device the process cannot see. */
dcpx_cuda_device *dcpx_cuda_device_get(PyObject *module, int device_id);
/* GIL held.  Raise dcpx._C.CudaError for `rc` returned by `what`
 * ("cuMemcpyDtoHAsync for tensor 'w'"), with the driver's name and
 * description of the code, and the code as the exception's `code`. */
void dcpx_cuda_raise(PyObject *module, CUresult rc, const char *what);
/* GIL held.  Create device d's event for the copies (context switched to
 * d's and restored); on failure *call names the call that failed.  Shared
 * by the stager and the loader, which word the error differently. */
CUresult dcpx_cuda_event_create(PyObject *module, int d, CUevent *ev,
                                const char **call);
/* The first failure of a batch of copies: the call, the pair (or -1) and
 * the device. */
typedef struct {
    CUresult rc;
    const char *call;
    Py_ssize_t index;  /* pair that failed, or -1 */
    int dev;
} dcpx_cuda_err;
/* Record a failure in e unless one is recorded already.  No GIL needed. */
void dcpx_cuda_note(dcpx_cuda_err *e, CUresult rc, const char *call,
                    Py_ssize_t index, int dev);

/* One asynchronous copy: n bytes between host memory and device memory of
 * device `dev`, for pair `index` of the caller's list.  `alloc`: the
 * caller's key for the device allocation dptr lies in (0: unknown). */
typedef struct {
    int dev;
    CUdeviceptr dptr;
    char *host;
    size_t n;
    Py_ssize_t index;
    unsigned long long alloc;
} dcpx_cuda_run;

/* A stream that waits for a device's copies once they are queued (the
 * loader's consumers). */
typedef struct {
    int dev;
    CUstream stream;
} dcpx_cuda_stream;

/* A batch of copies in one direction, shared by the stager (csrc/
 * cuda_stage.c, device to host) and the loader (csrc/cuda_load.c, host to
 * device): the copy loop, its events and the drain-on-error tail
 * (csrc/cuda_copy.c).  Set up with the GIL held; queued and waited for
 * without it. */
typedef struct {
    int htod;                      /* 1: host to device; 0: device to host */
    dcpx_cuda_run *runs;           /* sorted by dcpx_cuda_runs_sort */
    Py_ssize_t nruns;
    const dcpx_cuda_stream *cons;  /* waiters on each device's event */
    Py_ssize_t ncons;
    dcpx_cuda_device *devs[DCPX_CUDA_MAX_DEVICES];  /* with an event */
    CUevent ev[DCPX_CUDA_MAX_DEVICES];
    /* 0 nothing queued, 1 copies without their event, 2 copies and their
     * recorded event */
    int queued[DCPX_CUDA_MAX_DEVICES];
    /* the host side of every run is page-locked (set with the GIL): the
     * runs of a device may go in batched calls */
    int pinned;
    dcpx_cuda_err err;
} dcpx_cuda_batch;

/* Sort runs by device, keeping the caller's order within a device; with
 * `coalesce`, merge runs adjacent both on the device and on the host whose
 * sources are known to lie in one device allocation (the same non-zero
 * `alloc` key): a copy spanning two allocations that happen to be adjacent
 * in the address space is not one the driver guarantees.  Returns the new
 * number of runs. */
Py_ssize_t dcpx_cuda_runs_sort(dcpx_cuda_run *runs, Py_ssize_t n,
                               int coalesce);
/* GIL held.  Create the event of every device that has a run (context
 * switched to the device's and restored), setting b->devs.  0, or the
 * failing CUresult with *call naming the call and *dev the device. */
CUresult dcpx_cuda_batch_events(PyObject *module, dcpx_cuda_batch *b,
                                const char **call, int *dev);
/* No GIL needed.  Per device: make its context current, one async copy
 * per run on dcpx's stream, record the device's event after its last
 * copy, and make every consumer stream of the device wait on it.  Stops at
 * the first failure (noted in b->err).  The caller's context is restored. */
void dcpx_cuda_batch_queue(dcpx_cuda_batch *b);
/* No GIL needed.  Wait for every device's queued copies, even after an
 * error, so the host memory is untouched once this returns; a failed wait
 * is noted as sync_call on the device.  The caller's context is restored. */
void dcpx_cuda_batch_wait(dcpx_cuda_batch *b, const char *sync_call);
/* GIL held.  Raise CudaError for b->err, naming the call, the pair's key
 * (pairs[index][2] when present, else its index) and the device. */
void dcpx_cuda_batch_raise(PyObject *module, const dcpx_cuda_batch *b,
                           PyObject *pairs);
/* GIL held.  Destroy the batch's events, each in its device's context. */
void dcpx_cuda_batch_destroy(dcpx_cuda_batch *b);
/* Batched copies.  dcpx_cuda_batch_api(): the entry point in use
 * ("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"), or NULL when the driver
 * has none or they are switched off (cuda_batch_copies(False)).  No GIL
 * needed; the answer may change only between calls that copy (the switch
 * is flipped with the GIL held, by tests and benchmarks). */
const char *dcpx_cuda_batch_api(void);
/* No GIL needed.  One batched call: `count` copies dsts[i] <- srcs[i] of
 * sizes[i] bytes, in either direction, on `stream` (its device's context
 * current), the sources read in stream order.  *failed: the copy the
 * driver named as failing (the 12.8 ABI), else -1.  CUDA_ERROR_NOT_SUPPORTED
 * without a batch entry point. */
CUresult dcpx_cuda_memcpy_batch(CUdeviceptr *dsts, CUdeviceptr *srcs,
                                size_t *sizes, size_t count, CUstream stream,
                                Py_ssize_t *failed);
/* The call a failed batch is reported as: the entry point (exact: the
 * driver named the failing copy), or the batch from its first copy. */
const char *dcpx_cuda_batch_call(int exact);
/* At most this many copies per batched call. */
#define DCPX_CUDA_BATCH_MAX 1024

/* Counters of the copy calls made since the driver was loaded (no GIL
 * needed to add to them); cuda_copy_stats() reports them. */
enum {
    DCPX_CUDA_N_HTOD,          /* cuMemcpyHtoDAsync calls */
    DCPX_CUDA_N_DTOH,          /* cuMemcpyDtoHAsync calls */
    DCPX_CUDA_N_BATCH_HTOD,    /* batched calls of host-to-device copies */
    DCPX_CUDA_N_BATCH_DTOH,    /* batched calls of device-to-host copies */
    DCPX_CUDA_N_BATCHED_HTOD,  /* copies made by those calls */
    DCPX_CUDA_N_BATCHED_DTOH,
    DCPX_CUDA_N_COUNTERS
};
void dcpx_cuda_count(int counter, long n);
/* GIL held.  Whether [p, p + n) lies in a range dcpx page-locked. */
int dcpx_cuda_registry_contains(const void *p, size_t n);
/* GIL held.  dcpx's stream on `dev` waits for the work queued so far on
 * the consumer's `stream` (an event recorded there); -1 with CudaError. */
int dcpx_cuda_after_consumer(PyObject *module, int dev, CUstream stream);

/* Whether this process forked after CUDA was set up in its parent: the
 * child must not touch the parent's CUDA state. */
int dcpx_cuda_forked(void);

/* Host ranges page-locked with cuMemHostRegister, so that the close of a
 * stager, interpreter exit and a forked child each know what is pinned.
 * GIL held. */
int dcpx_cuda_registry_add(void *p, size_t n);
int dcpx_cuda_registry_remove(void *p);

PyObject *dcpx_cuda_driver_version(PyObject *module, PyObject *unused);
PyObject *dcpx_cuda_host_register(PyObject *module, PyObject *args);
PyObject *dcpx_cuda_host_unregister(PyObject *module, PyObject *args);
PyObject *dcpx_cuda_release_all(PyObject *module, PyObject *unused);
PyObject *dcpx_cuda_registered(PyObject *module, PyObject *unused);
PyObject *dcpx_cuda_copy_into(PyObject *module, PyObject *args,
                              PyObject *kwds);
PyObject *dcpx_cuda_copy_from_host(PyObject *module, PyObject *args,
                                   PyObject *kwds);
PyObject *dcpx_cuda_wait(PyObject *module, PyObject *pending);
PyObject *dcpx_cuda_stage_wait(PyObject *module, PyObject *pending);
PyObject *dcpx_cuda_copy_stats(PyObject *module, PyObject *unused);
PyObject *dcpx_cuda_batch_copies(PyObject *module, PyObject *args);
PyObject *dcpx_cuda_load_pipeline(PyObject *module, PyObject *args,
                                  PyObject *kwds);

#endif /* DCPX_CUDA_API_H */
