/* A stand-in for libcuda.so.1, for testing dcpx's CUDA path on machines
 * without a GPU (tests/test_cuda_standin.py builds it and points
 * DCPX_LIBCUDA at it).  It implements the driver entry points dcpx uses
 * over host memory, with the semantics dcpx relies on:
 *
 *  - "device memory" is host memory handed out by fake_device_alloc, tagged
 *    with its device; a copy from anywhere else, or spanning two
 *    allocations, fails like a bad pointer;
 *  - a stream is a worker thread running its queue in order: copies,
 *    event records, waits on events, and "kernels" (fake_launch_fill)
 *    that write device memory after a delay;
 *  - events complete when the stream reaches them; cuStreamWaitEvent makes
 *    a stream wait for the event's last record, without blocking the host;
 *  - contexts are per-thread current, as in CUDA: calls that need one fail
 *    with CUDA_ERROR_INVALID_CONTEXT without it, and a copy from another
 *    device's memory fails too;
 *  - cuInit in a forked child of an initialised process fails, as CUDA's.
 *
 * Checks, for the tests: `violations` counts copies that ran while a kernel
 * writing their source was queued and not finished (the consumer did not
 * order itself after the producer); host-to-device copies that ran before
 * a kernel using their destination, launched before them, had finished;
 * and reading kernels (fake_launch_read) that ran before a host-to-device
 * copy into what they read, launched before them, had finished (the load's
 * consumer was not ordered after the copy); and the per-entry-point call
 * counters.
 * Injection: fake_fail(name, nth, code) makes the nth next call of an entry
 * point return code; fake_fail_async(nth, code) makes the nth next copy
 * fail when it runs (a sticky error, reported by the synchronising calls);
 * fake_set_delay("copy"|"fill", us) slows copies or kernels, and
 * fake_set_delay("copy_jitter", us) each copy by a random 0..us more;
 * fake_hold_copies(1) keeps every copy from starting until
 * fake_hold_copies(0), so a test can act while a copy is known pending;
 * fake_hold_after(n) lets n more copies start first.
 * fake_device_alloc_adjacent carves allocations back to back out of one
 * block, so a test can place two allocations next to each other.
 * Batched copies: cuMemcpyBatchAsync (CUDA 12.8's ABI, with failIdx) and
 * cuMemcpyBatchAsync_v2 (13.0's), each copy checked as the single ones
 * are (a bad one fails the call, nothing queued, failIdx naming it), then
 * queued in reverse order: a batch has no order, and a caller that put
 * dependent copies in one batch sees the later one lose.
 * Reuse check: a host-to-device copy remembers a checksum of its source
 * when queued and compares it when it runs; a source changed in between
 * (a host buffer reused before the copy out of it was done) counts in
 * fake_reuse_violations().
 * Call log: every copy (queued, with stream, host and device address,
 * size, batch), event record, event synchronize and stream wait, in call
 * order (fake_log_len, fake_log_get), so that tests can check ordering and
 * reuse.
 * Environment: FAKE_CUDA_DEVICES (2), FAKE_CUDA_DRIVER_VERSION (12080). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_NO_DEVICE = 100,
    E_INVALID_DEVICE = 101,
    E_INVALID_CONTEXT = 201,
    E_INVALID_HANDLE = 400,
    E_NOT_READY = 600,
    E_ILLEGAL_ADDRESS = 700,
    E_ALREADY_REGISTERED = 712,
    E_NOT_REGISTERED = 713,
};

#define MAXDEV 8

typedef struct CUctx_st {
    int dev;
    int retained;
} ctx_t;

typedef struct CUevent_st {
    uint64_t recorded, completed;
    int refs;      /* 1 for the handle, +1 per queued op that uses it */
    int destroyed;
} event_t;

enum { OP_COPY, OP_RECORD, OP_WAIT, OP_FILL, OP_HTOD, OP_READ };

typedef struct op {
    int kind;
    char *dst;
    const char *src;
    size_t n;
    uint64_t sum;  /* OP_HTOD: the source's checksum when queued */
    event_t *ev;
    uint64_t gen;
    int fill;
    int fail;      /* async error to raise when run */
    int region;    /* OP_FILL, OP_HTOD, OP_READ: the allocation it uses */
    long before;   /* OP_HTOD, OP_READ: the other kind launched before it */
    struct op *next;
} op_t;

typedef struct CUstream_st {
    pthread_t th;
    op_t *head, *tail;
    int busy, stop;
    int dev;
} stream_t;

typedef struct {
    char *p;
    size_t n;
    void *block; /* what to free once no allocation uses it */
    int dev;
    int pending_fills;
    /* Launched and finished host-to-device copies into it, and kernels
     * (fills and reads) using it: an operation that snapshots, at launch,
     * how many of the other kind were launched before it must not run
     * before that many have finished (it was launched after them, so a
     * correct program ordered it after them). */
    long htod_launched, htod_done, use_launched, use_done;
} alloc_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static ctx_t g_ctx[MAXDEV];
static __thread ctx_t *t_cur;
static int g_init_pid;
static int g_async_err;
static long g_copy_delay_us, g_fill_delay_us;
static long g_copy_jitter_us; /* each copy: up to this much more, at random */
static unsigned g_jitter_seed = 1;
static int g_hold; /* copies wait while set (fake_hold_copies) */
static long g_pass; /* ... except this many more (fake_hold_after) */
static long g_violations, g_copies_run, g_copies_queued;
static long g_reuse_violations;
#define MAXALLOC 8192
static alloc_t g_alloc[MAXALLOC];
static int g_nalloc;
static struct { void *p; size_t n; } g_reg[256];
static int g_nreg;
static long g_dlpack_live;

/* Call counters and injected failures, by entry point name. */
#define NFN 64
static struct { const char *name; long calls; long fail_at; int code; } g_fn[NFN];
static int g_nfn;
static long g_async_fail_at;
static int g_async_fail_code;

static int ndev(void)
{
    const char *s = getenv("FAKE_CUDA_DEVICES");
    int n = s ? atoi(s) : 2;
    return n < 0 ? 0 : n > MAXDEV ? MAXDEV : n;
}

static int fn_slot(const char *name)
{
    for (int i = 0; i < g_nfn; i++)
        if (strcmp(g_fn[i].name, name) == 0)
            return i;
    if (g_nfn == NFN)
        return -1;
    g_fn[g_nfn].name = strdup(name);
    return g_nfn++;
}

/* Count the call; return the injected failure code, or 0. */
static int enter(const char *name)
{
    int code = 0;
    pthread_mutex_lock(&mu);
    int i = fn_slot(name);
    if (i >= 0) {
        g_fn[i].calls++;
        if (g_fn[i].fail_at > 0 && --g_fn[i].fail_at == 0)
            code = g_fn[i].code;
    }
    pthread_mutex_unlock(&mu);
    return code;
}

#define ENTER(name)                 \
    do {                            \
        int inj_ = enter(name);     \
        if (inj_)                   \
            return inj_;            \
    } while (0)

static void sleep_us(long us)
{
    if (us <= 0)
        return;
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static void event_unref(event_t *e) /* mu held */
{
    if (--e->refs == 0)
        free(e);
}

static int find_alloc(const void *p, size_t n) /* mu held */
{
    const char *c = p;
    for (int i = 0; i < g_nalloc; i++)
        if (g_alloc[i].p && c >= g_alloc[i].p &&
            c + n <= g_alloc[i].p + g_alloc[i].n)
            return i;
    return -1;
}

static uint64_t checksum(const void *p, size_t n)
{
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ c[i]) * 1099511628211ULL;
    return h;
}

/* The call log. */
enum { LOG_HTOD = 1, LOG_DTOH = 2, LOG_BATCH = 3, LOG_RECORD = 4,
       LOG_EVSYNC = 5, LOG_WAIT = 6 };
typedef struct {
    long kind;
    void *stream;
    const void *host;
    unsigned long long dptr;
    size_t n;
    void *event;
    long batch;   /* copies: the batch they were part of (1, 2, ...), or 0 */
} log_entry;
#define LOG_CAP (1 << 16)
static log_entry *g_log;
static long g_nlog, g_batches;

static void log_add(long kind, void *stream, const void *host,
                    unsigned long long dptr, size_t n, void *event,
                    long batch) /* mu held */
{
    if (g_log == NULL)
        g_log = calloc(LOG_CAP, sizeof(*g_log));
    if (g_log == NULL || g_nlog >= LOG_CAP) {
        g_nlog++;
        return;
    }
    g_log[g_nlog++] = (log_entry){kind, stream, host, dptr, n, event, batch};
}

static void *stream_main(void *arg)
{
    stream_t *s = arg;
    long delay;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (s->head == NULL && !s->stop)
            pthread_cond_wait(&cv, &mu);
        if (s->head == NULL)
            break;
        op_t *o = s->head;
        if ((o->kind == OP_COPY || o->kind == OP_HTOD) && g_hold) {
            if (g_pass > 0) {
                g_pass--;
            }
            else {
                pthread_cond_wait(&cv, &mu);
                continue;
            }
        }
        s->busy = 1;
        switch (o->kind) {
        case OP_COPY: {
            int a = find_alloc(o->src, o->n);
            if (a >= 0 && g_alloc[a].pending_fills > 0)
                g_violations++;
            delay = g_copy_delay_us +
                    (g_copy_jitter_us > 0
                         ? (long)(rand_r(&g_jitter_seed) % g_copy_jitter_us)
                         : 0);
            pthread_mutex_unlock(&mu);
            sleep_us(delay);
            if (!o->fail)
                memcpy(o->dst, o->src, o->n);
            pthread_mutex_lock(&mu);
            if (o->fail)
                g_async_err = o->fail;
            g_copies_run++;
            break;
        }
        case OP_HTOD:
            /* A write into device memory that a kernel queued before it
             * (on any stream) still reads or writes: the copy was not
             * ordered after that kernel. */
            if (g_alloc[o->region].use_done < o->before)
                g_violations++;
            /* The host source changed since the copy was queued: the
             * caller reused it before the copy out of it was done. */
            if (checksum(o->src, o->n) != o->sum)
                g_reuse_violations++;
            delay = g_copy_delay_us +
                    (g_copy_jitter_us > 0
                         ? (long)(rand_r(&g_jitter_seed) % g_copy_jitter_us)
                         : 0);
            pthread_mutex_unlock(&mu);
            sleep_us(delay);
            if (!o->fail)
                memcpy(o->dst, o->src, o->n);
            pthread_mutex_lock(&mu);
            if (o->fail)
                g_async_err = o->fail;
            g_alloc[o->region].htod_done++;
            g_copies_run++;
            break;
        case OP_READ:
            /* A consumer kernel reading device memory that a copy queued
             * before it has not finished writing. */
            if (g_alloc[o->region].htod_done < o->before)
                g_violations++;
            pthread_mutex_unlock(&mu);
            sleep_us(g_fill_delay_us);
            memcpy(o->dst, o->src, o->n);
            pthread_mutex_lock(&mu);
            g_alloc[o->region].use_done++;
            break;
        case OP_FILL:
            pthread_mutex_unlock(&mu);
            sleep_us(g_fill_delay_us);
            memset(o->dst, o->fill, o->n);
            pthread_mutex_lock(&mu);
            g_alloc[o->region].pending_fills--;
            g_alloc[o->region].use_done++;
            break;
        case OP_RECORD:
            if (o->ev->completed < o->gen)
                o->ev->completed = o->gen;
            event_unref(o->ev);
            break;
        case OP_WAIT:
            while (o->ev->completed < o->gen)
                pthread_cond_wait(&cv, &mu);
            event_unref(o->ev);
            break;
        }
        s->head = o->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->busy = 0;
        free(o);
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

static void push(stream_t *s, op_t *o) /* mu held */
{
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    pthread_cond_broadcast(&cv);
}

/* A forked child gets the lock in whatever state a stream thread (not in
 * the child) left it: start it afresh, so that the tests' calls into the
 * child's copy (counters) cannot deadlock. */
static void child_after_fork(void)
{
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&cv, NULL);
}

__attribute__((constructor)) static void fake_setup(void)
{
    pthread_atfork(NULL, NULL, child_after_fork);
}

/* ---- the driver API ---------------------------------------------------- */

CUresult cuInit(unsigned int flags)
{
    ENTER("cuInit");
    if (flags != 0)
        return E_INVALID_VALUE;
    if (g_init_pid != 0 && g_init_pid != getpid())
        return E_NOT_INITIALIZED; /* CUDA in a forked child */
    if (ndev() == 0)
        return E_NO_DEVICE;
    g_init_pid = getpid();
    return OK;
}

CUresult cuDriverGetVersion(int *v)
{
    ENTER("cuDriverGetVersion");
    const char *s = getenv("FAKE_CUDA_DRIVER_VERSION");
    *v = s ? atoi(s) : 12080;
    return OK;
}

#define NEED_INIT()                                          \
    do {                                                     \
        if (g_init_pid != getpid())                          \
            return E_NOT_INITIALIZED;                        \
    } while (0)
#define NEED_CTX()                                           \
    do {                                                     \
        NEED_INIT();                                         \
        if (t_cur == NULL)                                   \
            return E_INVALID_CONTEXT;                        \
    } while (0)

CUresult cuDeviceGetCount(int *n)
{
    ENTER("cuDeviceGetCount");
    NEED_INIT();
    *n = ndev();
    return OK;
}

CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    ENTER("cuDeviceGet");
    NEED_INIT();
    if (ordinal < 0 || ordinal >= ndev())
        return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

CUresult cuDevicePrimaryCtxRetain(ctx_t **pctx, CUdevice d)
{
    ENTER("cuDevicePrimaryCtxRetain");
    NEED_INIT();
    if (d < 0 || d >= ndev())
        return E_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    g_ctx[d].dev = d;
    g_ctx[d].retained++;
    pthread_mutex_unlock(&mu);
    *pctx = &g_ctx[d];
    return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    ENTER("cuDevicePrimaryCtxRelease_v2");
    NEED_INIT();
    if (d < 0 || d >= ndev() || g_ctx[d].retained == 0)
        return E_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    g_ctx[d].retained--;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuCtxGetCurrent(ctx_t **pctx)
{
    ENTER("cuCtxGetCurrent");
    NEED_INIT();
    *pctx = t_cur;
    return OK;
}

CUresult cuCtxSetCurrent(ctx_t *c)
{
    ENTER("cuCtxSetCurrent");
    NEED_INIT();
    t_cur = c;
    return OK;
}

CUresult cuStreamCreate(stream_t **ps, unsigned int flags)
{
    ENTER("cuStreamCreate");
    NEED_CTX();
    (void)flags;
    stream_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return E_OUT_OF_MEMORY;
    s->dev = t_cur->dev;
    if (pthread_create(&s->th, NULL, stream_main, s) != 0) {
        free(s);
        return E_OUT_OF_MEMORY;
    }
    *ps = s;
    return OK;
}

static void drain(stream_t *s) /* mu held */
{
    while (s->head != NULL || s->busy)
        pthread_cond_wait(&cv, &mu);
}

CUresult cuStreamSynchronize(stream_t *s)
{
    ENTER("cuStreamSynchronize");
    NEED_CTX();
    if (s == NULL)
        return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    drain(s);
    int err = g_async_err;
    pthread_mutex_unlock(&mu);
    return err;
}

CUresult cuStreamDestroy_v2(stream_t *s)
{
    ENTER("cuStreamDestroy_v2");
    NEED_CTX();
    if (s == NULL)
        return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    drain(s);
    s->stop = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(s->th, NULL);
    free(s);
    return OK;
}

CUresult cuEventCreate(event_t **pe, unsigned int flags)
{
    ENTER("cuEventCreate");
    NEED_CTX();
    (void)flags;
    event_t *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return E_OUT_OF_MEMORY;
    e->refs = 1;
    *pe = e;
    return OK;
}

CUresult cuEventDestroy_v2(event_t *e)
{
    ENTER("cuEventDestroy_v2");
    NEED_INIT();
    if (e == NULL)
        return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    e->destroyed = 1;
    event_unref(e);
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuEventRecord(event_t *e, stream_t *s)
{
    ENTER("cuEventRecord");
    NEED_CTX();
    if (e == NULL || e->destroyed)
        return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    log_add(LOG_RECORD, s, NULL, 0, 0, e, 0);
    uint64_t gen = ++e->recorded;
    if (s == NULL) { /* the legacy default stream: nothing queued here */
        e->completed = gen;
        pthread_cond_broadcast(&cv);
    }
    else {
        op_t *o = calloc(1, sizeof(*o));
        o->kind = OP_RECORD;
        o->ev = e;
        o->gen = gen;
        e->refs++;
        push(s, o);
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuEventQuery(event_t *e)
{
    ENTER("cuEventQuery");
    NEED_INIT();
    pthread_mutex_lock(&mu);
    int r = g_async_err ? g_async_err
                        : e->completed >= e->recorded ? OK : E_NOT_READY;
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuEventSynchronize(event_t *e)
{
    ENTER("cuEventSynchronize");
    NEED_INIT();
    if (e == NULL || e->destroyed)
        return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    log_add(LOG_EVSYNC, NULL, NULL, 0, 0, e, 0);
    uint64_t gen = e->recorded;
    while (e->completed < gen)
        pthread_cond_wait(&cv, &mu);
    int err = g_async_err;
    pthread_mutex_unlock(&mu);
    return err;
}

CUresult cuStreamWaitEvent(stream_t *s, event_t *e, unsigned int flags)
{
    ENTER("cuStreamWaitEvent");
    NEED_CTX();
    if (s == NULL || e == NULL || e->destroyed || flags != 0)
        return E_INVALID_HANDLE;
    pthread_mutex_lock(&mu);
    log_add(LOG_WAIT, s, NULL, 0, 0, e, 0);
    if (e->recorded > e->completed) {
        op_t *o = calloc(1, sizeof(*o));
        o->kind = OP_WAIT;
        o->ev = e;
        o->gen = e->recorded;
        e->refs++;
        push(s, o);
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

/* Queue one copy on s (mu held, checked already). */
static void queue_dtoh(void *dst, CUdeviceptr src, size_t n, stream_t *s,
                       long batch)
{
    op_t *o = calloc(1, sizeof(*o));
    o->kind = OP_COPY;
    o->dst = dst;
    o->src = (const char *)(uintptr_t)src;
    o->n = n;
    if (g_async_fail_at > 0 && --g_async_fail_at == 0)
        o->fail = g_async_fail_code;
    g_copies_queued++;
    log_add(LOG_DTOH, s, dst, src, n, NULL, batch);
    push(s, o);
}

static void queue_htod(CUdeviceptr dst, const void *src, size_t n, int a,
                       stream_t *s, long batch)
{
    op_t *o = calloc(1, sizeof(*o));
    o->kind = OP_HTOD;
    o->dst = (char *)(uintptr_t)dst;
    o->src = src;
    o->n = n;
    o->sum = checksum(src, n);
    o->region = a;
    if (g_async_fail_at > 0 && --g_async_fail_at == 0)
        o->fail = g_async_fail_code;
    o->before = g_alloc[a].use_launched;
    g_alloc[a].htod_launched++;
    g_copies_queued++;
    log_add(LOG_HTOD, s, src, dst, n, NULL, batch);
    push(s, o);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n,
                              stream_t *s)
{
    ENTER("cuMemcpyDtoHAsync_v2");
    NEED_CTX();
    if (s == NULL || dst == NULL)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    int a = find_alloc((void *)(uintptr_t)src, n);
    if (a < 0 || g_alloc[a].dev != t_cur->dev || s->dev != t_cur->dev) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_VALUE;
    }
    queue_dtoh(dst, src, n, s, 0);
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n,
                              stream_t *s)
{
    ENTER("cuMemcpyHtoDAsync_v2");
    NEED_CTX();
    if (s == NULL || src == NULL)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    int a = find_alloc((void *)(uintptr_t)dst, n);
    if (a < 0 || g_alloc[a].dev != t_cur->dev || s->dev != t_cur->dev) {
        pthread_mutex_unlock(&mu);
        return E_INVALID_VALUE;
    }
    queue_htod(dst, src, n, a, s, 0);
    pthread_mutex_unlock(&mu);
    return OK;
}

/* CUmemcpyAttributes, as cuda.h 12.8+ lays it out. */
typedef struct {
    int srcAccessOrder;
    struct { int type, id; } srcLocHint, dstLocHint;
    unsigned int flags;
} memcpy_attrs;

/* Both batched ABIs: every copy checked first (a bad one fails the call
 * with nothing queued, *fail naming it), then all queued, in reverse. */
static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                      size_t count, memcpy_attrs *attrs, size_t *idxs,
                      size_t nattrs, size_t *fail, stream_t *s)
{
    int *alloc;
    if (fail != NULL)
        *fail = (size_t)-1;
    if (s == NULL || count == 0 || !dsts || !srcs || !sizes || !attrs ||
        !idxs || nattrs == 0 || nattrs > count || idxs[0] != 0)
        return E_INVALID_VALUE;
    for (size_t k = 0; k < nattrs; k++)
        if (attrs[k].srcAccessOrder < 1 || attrs[k].srcAccessOrder > 3 ||
            (k > 0 && idxs[k] <= idxs[k - 1]) || idxs[k] >= count)
            return E_INVALID_VALUE;
    if ((alloc = calloc(count, sizeof(int))) == NULL)
        return E_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count; i++) {
        int d = find_alloc((void *)(uintptr_t)dsts[i], sizes[i]);
        int r = find_alloc((void *)(uintptr_t)srcs[i], sizes[i]);
        int a = d >= 0 ? d : r;
        /* one side device memory of this context's device, one host */
        if ((d >= 0) == (r >= 0) || g_alloc[a].dev != t_cur->dev ||
            s->dev != t_cur->dev || sizes[i] == 0) {
            pthread_mutex_unlock(&mu);
            free(alloc);
            if (fail != NULL)
                *fail = i;
            return E_INVALID_VALUE;
        }
        alloc[i] = d >= 0 ? d : -1;
    }
    long id = ++g_batches;
    log_add(LOG_BATCH, s, NULL, 0, count, NULL, id);
    for (size_t q = count; q-- > 0;) {
        if (alloc[q] >= 0)
            queue_htod(dsts[q], (const void *)(uintptr_t)srcs[q], sizes[q],
                       alloc[q], s, id);
        else
            queue_dtoh((void *)(uintptr_t)dsts[q], srcs[q], sizes[q], s, id);
    }
    pthread_mutex_unlock(&mu);
    free(alloc);
    return OK;
}

CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs,
                            size_t *sizes, size_t count, memcpy_attrs *attrs,
                            size_t *idxs, size_t nattrs, size_t *fail,
                            stream_t *s)
{
    if (fail != NULL)
        *fail = (size_t)-1;
    ENTER("cuMemcpyBatchAsync");
    NEED_CTX();
    return batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, fail, s);
}

CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs,
                               size_t *sizes, size_t count,
                               memcpy_attrs *attrs, size_t *idxs,
                               size_t nattrs, stream_t *s)
{
    ENTER("cuMemcpyBatchAsync_v2");
    NEED_CTX();
    return batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, NULL, s);
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags)
{
    ENTER("cuMemHostRegister_v2");
    NEED_CTX();
    (void)flags;
    if (p == NULL || n == 0)
        return E_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < g_nreg; i++) {
        if ((char *)p < (char *)g_reg[i].p + g_reg[i].n &&
            (char *)g_reg[i].p < (char *)p + n) {
            pthread_mutex_unlock(&mu);
            return E_ALREADY_REGISTERED;
        }
    }
    if (g_nreg == 256) {
        pthread_mutex_unlock(&mu);
        return E_OUT_OF_MEMORY;
    }
    g_reg[g_nreg].p = p;
    g_reg[g_nreg].n = n;
    g_nreg++;
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemHostUnregister(void *p)
{
    ENTER("cuMemHostUnregister");
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (int i = 0; i < g_nreg; i++) {
        if (g_reg[i].p == p) {
            g_reg[i] = g_reg[--g_nreg];
            pthread_mutex_unlock(&mu);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return E_NOT_REGISTERED;
}

static const struct { int code; const char *name, *desc; } g_names[] = {
    {OK, "CUDA_SUCCESS", "no error"},
    {E_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {E_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {E_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED",
     "initialization error"},
    {E_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {E_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {E_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
     "invalid device context"},
    {E_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle"},
    {E_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {E_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {E_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {E_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
};

static int name_index(CUresult rc)
{
    for (size_t i = 0; i < sizeof(g_names) / sizeof(g_names[0]); i++)
        if (g_names[i].code == rc)
            return (int)i;
    return -1;
}

CUresult cuGetErrorName(CUresult rc, const char **s)
{
    int i = name_index(rc);
    if (i < 0) {
        *s = NULL;
        return E_INVALID_VALUE;
    }
    *s = g_names[i].name;
    return OK;
}

CUresult cuGetErrorString(CUresult rc, const char **s)
{
    int i = name_index(rc);
    if (i < 0) {
        *s = NULL;
        return E_INVALID_VALUE;
    }
    *s = g_names[i].desc;
    return OK;
}

/* ---- control API for the tests (ctypes) -------------------------------- */

void fake_reset(void)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < g_nfn; i++) {
        g_fn[i].calls = 0;
        g_fn[i].fail_at = 0;
    }
    g_async_err = 0;
    g_async_fail_at = 0;
    g_copy_delay_us = g_fill_delay_us = g_copy_jitter_us = 0;
    g_hold = 0;
    pthread_cond_broadcast(&cv);
    g_violations = g_copies_run = g_copies_queued = 0;
    g_reuse_violations = 0;
    g_nlog = 0;
    pthread_mutex_unlock(&mu);
}

void fake_fail(const char *name, long nth, int code)
{
    pthread_mutex_lock(&mu);
    int i = fn_slot(name);
    if (i >= 0) {
        g_fn[i].fail_at = nth;
        g_fn[i].code = code;
    }
    pthread_mutex_unlock(&mu);
}

void fake_fail_async(long nth, int code)
{
    pthread_mutex_lock(&mu);
    g_async_fail_at = nth;
    g_async_fail_code = code;
    pthread_mutex_unlock(&mu);
}

void fake_set_delay(const char *what, long us)
{
    pthread_mutex_lock(&mu);
    if (strcmp(what, "copy") == 0)
        g_copy_delay_us = us;
    else if (strcmp(what, "copy_jitter") == 0)
        g_copy_jitter_us = us;
    else
        g_fill_delay_us = us;
    pthread_mutex_unlock(&mu);
}

void fake_hold_after(long n)
{
    pthread_mutex_lock(&mu);
    g_hold = 1;
    g_pass = n;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

void fake_hold_copies(int on)
{
    pthread_mutex_lock(&mu);
    g_hold = on;
    g_pass = 0;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

long fake_calls(const char *name)
{
    pthread_mutex_lock(&mu);
    int i = fn_slot(name);
    long n = i >= 0 ? g_fn[i].calls : 0;
    pthread_mutex_unlock(&mu);
    return n;
}

long fake_total_calls(void)
{
    long n = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < g_nfn; i++)
        n += g_fn[i].calls;
    pthread_mutex_unlock(&mu);
    return n;
}

long fake_violations(void) { return g_violations; }

long fake_reuse_violations(void)
{
    pthread_mutex_lock(&mu);
    long n = g_reuse_violations;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Entries logged since the last fake_reset (more than the log holds when
 * it overflowed: only the first LOG_CAP are kept). */
long fake_log_len(void)
{
    pthread_mutex_lock(&mu);
    long n = g_nlog;
    pthread_mutex_unlock(&mu);
    return n;
}

int fake_log_get(long i, log_entry *out)
{
    int rc = -1;
    pthread_mutex_lock(&mu);
    if (i >= 0 && i < g_nlog && i < LOG_CAP && g_log != NULL) {
        *out = g_log[i];
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}
long fake_copies_queued(void) { return g_copies_queued; }

long fake_copies_run(void)
{
    pthread_mutex_lock(&mu);
    long n = g_copies_run;
    pthread_mutex_unlock(&mu);
    return n;
}

int fake_registered(void)
{
    pthread_mutex_lock(&mu);
    int n = g_nreg;
    pthread_mutex_unlock(&mu);
    return n;
}

int fake_retained(int dev) { return g_ctx[dev].retained; }

/* `count` allocations of device `dev`, of sizes[i] bytes each, carved back
 * to back out of one block: out[i + 1] == out[i] + sizes[i] (like two
 * cudaMalloc segments the driver happened to place next to each other).
 * Each is an allocation of its own: a copy spanning two fails.  0, or -1. */
int fake_device_alloc_adjacent(int dev, int count, const size_t *sizes,
                               void **out)
{
    size_t total = 0;
    char *p = NULL;
    for (int i = 0; i < count; i++)
        total += sizes[i];
    if (count < 1 || posix_memalign((void **)&p, 256, total ? total : 1))
        return -1;
    memset(p, 0, total);
    pthread_mutex_lock(&mu);
    if (g_nalloc + count > MAXALLOC) {
        pthread_mutex_unlock(&mu);
        free(p);
        return -1;
    }
    for (int i = 0; i < count; i++) {
        alloc_t *a = &g_alloc[g_nalloc++];
        memset(a, 0, sizeof(*a));
        a->p = out[i] = p;
        a->n = sizes[i];
        a->block = out[0];
        a->dev = dev;
        p += sizes[i];
    }
    pthread_mutex_unlock(&mu);
    return 0;
}

void *fake_device_alloc(int dev, size_t n)
{
    void *p = NULL;
    return fake_device_alloc_adjacent(dev, 1, &n, &p) == 0 ? p : NULL;
}

void fake_device_free(void *p)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < g_nalloc; i++) {
        if (g_alloc[i].p == p) {
            void *block = g_alloc[i].block;
            int shared = 0;
            g_alloc[i] = g_alloc[--g_nalloc];
            for (int j = 0; j < g_nalloc; j++)
                shared |= g_alloc[j].block == block;
            if (!shared)
                free(block);
            break;
        }
    }
    pthread_mutex_unlock(&mu);
}

/* A "kernel" on stream s writing `byte` over [p, p + n) of device memory,
 * after the fill delay.  0, or -1 if p is not device memory. */
int fake_launch_fill(stream_t *s, void *p, int byte, size_t n)
{
    pthread_mutex_lock(&mu);
    int a = find_alloc(p, n);
    if (a < 0 || s == NULL) {
        pthread_mutex_unlock(&mu);
        return -1;
    }
    op_t *o = calloc(1, sizeof(*o));
    o->kind = OP_FILL;
    o->dst = p;
    o->n = n;
    o->fill = byte;
    o->region = a;
    g_alloc[a].pending_fills++;
    g_alloc[a].use_launched++;
    push(s, o);
    pthread_mutex_unlock(&mu);
    return 0;
}

/* A consumer "kernel" on stream s reading [p, p + n) of device memory into
 * the host buffer out, after the fill delay (a test reads `out` once the
 * stream is synchronised: the bytes the kernel saw).  0, or -1 if p is not
 * device memory. */
int fake_launch_read(stream_t *s, void *p, size_t n, void *out)
{
    pthread_mutex_lock(&mu);
    int a = find_alloc(p, n);
    if (a < 0 || s == NULL || out == NULL) {
        pthread_mutex_unlock(&mu);
        return -1;
    }
    op_t *o = calloc(1, sizeof(*o));
    o->kind = OP_READ;
    o->dst = out;
    o->src = p;
    o->n = n;
    o->region = a;
    o->before = g_alloc[a].htod_launched;
    g_alloc[a].use_launched++;
    push(s, o);
    pthread_mutex_unlock(&mu);
    return 0;
}

/* ---- a DLPack producer's half, for the tests' Python producer ---------- */

typedef struct {
    int32_t device_type, device_id;
} DLDevice;
typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLMTV {
    uint32_t major, minor;
    void *manager_ctx;
    void (*deleter)(struct DLMTV *);
    uint64_t flags;
    DLTensor dl_tensor;
    int64_t dims[2 * 8];
} DLMTV;

static void dl_delete(DLMTV *m)
{
    __atomic_fetch_sub(&g_dlpack_live, 1, __ATOMIC_SEQ_CST);
    free(m);
}

/* A DLManagedTensorVersioned (1.0) for `ndim` dims of `shape` (and
 * `strides`, or NULL) over device memory p on CUDA device dev. */
void *fake_dlpack(void *p, int dev, int ndim, const int64_t *shape,
                  const int64_t *strides, int code, int bits)
{
    if (ndim < 0 || ndim > 8)
        return NULL;
    DLMTV *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return NULL;
    m->major = 1;
    m->deleter = dl_delete;
    m->dl_tensor.data = p;
    m->dl_tensor.device.device_type = 2; /* kDLCUDA */
    m->dl_tensor.device.device_id = dev;
    m->dl_tensor.ndim = ndim;
    m->dl_tensor.dtype.code = (uint8_t)code;
    m->dl_tensor.dtype.bits = (uint8_t)bits;
    m->dl_tensor.dtype.lanes = 1;
    memcpy(m->dims, shape, sizeof(int64_t) * (size_t)ndim);
    m->dl_tensor.shape = m->dims;
    if (strides != NULL) {
        memcpy(m->dims + 8, strides, sizeof(int64_t) * (size_t)ndim);
        m->dl_tensor.strides = m->dims + 8;
    }
    __atomic_fetch_add(&g_dlpack_live, 1, __ATOMIC_SEQ_CST);
    return m;
}

long fake_dlpack_live(void) { return __atomic_load_n(&g_dlpack_live, __ATOMIC_SEQ_CST); }
