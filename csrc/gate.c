/* The staging gate (csrc/gate.h).  The stager's waiting thread publishes a
 * watermark as each segment's device-to-host copies complete (csrc/
 * cuda_stage.c); the writer threads (csrc/writer.c) wait for it before they
 * read a staged tensor's bytes.  Plain C: a mutex and condition variable
 * around the watermark, an atomic reference count; no Python object is
 * touched outside the capsule functions, which run with the GIL. */
#include "gate.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define GATE_CAPSULE "dcpx.staging_gate"

/* A writer thread blocked in dcpx_gate_wait (on its stack). */
typedef struct waiter {
    uint64_t end;
    struct waiter *next;
} waiter;

struct dcpx_gate {
    atomic_long refs;
    const char *base;
    uint64_t size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t ready;   /* mu */
    int failed;       /* mu */
    waiter *waiters;  /* mu: threads in dcpx_gate_wait, for tests */
};

dcpx_gate *dcpx_gate_new(const char *base, uint64_t size)
{
    dcpx_gate *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return NULL;
    if (pthread_mutex_init(&g->mu, NULL) != 0) {
        free(g);
        return NULL;
    }
    if (pthread_cond_init(&g->cv, NULL) != 0) {
        pthread_mutex_destroy(&g->mu);
        free(g);
        return NULL;
    }
    atomic_init(&g->refs, 1);
    g->base = base;
    g->size = size;
    return g;
}

void dcpx_gate_incref(dcpx_gate *g)
{
    atomic_fetch_add(&g->refs, 1);
}

void dcpx_gate_decref(dcpx_gate *g)
{
    if (g != NULL && atomic_fetch_sub(&g->refs, 1) == 1) {
        pthread_cond_destroy(&g->cv);
        pthread_mutex_destroy(&g->mu);
        free(g);
    }
}

void dcpx_gate_publish(dcpx_gate *g, uint64_t ready)
{
    pthread_mutex_lock(&g->mu);
    if (ready > g->ready)
        g->ready = ready;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

void dcpx_gate_fail(dcpx_gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->failed = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

int dcpx_gate_wait(dcpx_gate *g, const void *p, size_t n)
{
    const char *c = p;
    uint64_t end;
    int rc;
    if (c < g->base || c >= g->base + g->size)
        return 0;
    end = (uint64_t)(c - g->base) + n;
    pthread_mutex_lock(&g->mu);
    waiter me = {end, g->waiters};
    g->waiters = &me;
    while (g->ready < end && !g->failed)
        pthread_cond_wait(&g->cv, &g->mu);
    for (waiter **w = &g->waiters; *w != NULL; w = &(*w)->next) {
        if (*w == &me) {
            *w = me.next;
            break;
        }
    }
    rc = g->ready >= end ? 0 : -1;
    pthread_mutex_unlock(&g->mu);
    return rc;
}

static void capsule_free(PyObject *cap)
{
    dcpx_gate_decref(PyCapsule_GetPointer(cap, GATE_CAPSULE));
}

PyObject *dcpx_gate_capsule(dcpx_gate *g)
{
    PyObject *cap = PyCapsule_New(g, GATE_CAPSULE, capsule_free);
    if (cap != NULL)
        dcpx_gate_incref(g);
    return cap;
}

dcpx_gate *dcpx_gate_from(PyObject *obj)
{
    if (!PyCapsule_IsValid(obj, GATE_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "dcpx: expected a staging gate, got "
                     "%.200s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PyCapsule_GetPointer(obj, GATE_CAPSULE);
}

PyObject *dcpx_gate_stats(PyObject *module, PyObject *obj)
{
    dcpx_gate *g = dcpx_gate_from(obj);
    unsigned long long ready;
    int failed, waiting;
    (void)module;
    if (g == NULL)
        return NULL;
    pthread_mutex_lock(&g->mu);
    ready = g->ready;
    failed = g->failed;
    waiting = 0; /* blocked: waiting for bytes not yet published */
    for (waiter *w = g->waiters; w != NULL; w = w->next)
        waiting += w->end > ready && !failed;
    pthread_mutex_unlock(&g->mu);
    return Py_BuildValue("(Kii)", ready, failed, waiting);
}
