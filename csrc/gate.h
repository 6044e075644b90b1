/* A staging gate: how much of a host buffer holds its final bytes, for the
 * C writer threads that write from the buffer while the device-to-host
 * copies into its later parts still run (csrc/gate.c). */
#ifndef DCPX_GATE_H
#define DCPX_GATE_H

#include "dcpx.h"

typedef struct dcpx_gate dcpx_gate;

/* Any thread.  A gate over [base, base + size), nothing ready; one
 * reference.  NULL when out of memory. */
dcpx_gate *dcpx_gate_new(const char *base, uint64_t size);
void dcpx_gate_incref(dcpx_gate *g);
void dcpx_gate_decref(dcpx_gate *g);
/* Any thread, no GIL.  The first `ready` bytes of the buffer are final
 * (the watermark only grows). */
void dcpx_gate_publish(dcpx_gate *g, uint64_t ready);
/* Any thread, no GIL.  The bytes not yet published never will be. */
void dcpx_gate_fail(dcpx_gate *g);
/* No GIL (a writer thread).  Wait until [p, p + n) is final: 0; -1 if the
 * gate failed first.  Memory outside the gate's buffer is not waited for. */
int dcpx_gate_wait(dcpx_gate *g, const void *p, size_t n);

/* GIL held.  A capsule owning one new reference to g. */
PyObject *dcpx_gate_capsule(dcpx_gate *g);
/* GIL held.  The gate of such a capsule (borrowed), or NULL with
 * TypeError set. */
dcpx_gate *dcpx_gate_from(PyObject *obj);
/* gate_stats(gate) -> (ready, failed, blocked): blocked counts the writer
 * threads waiting for bytes not yet published.  For tests. */
PyObject *dcpx_gate_stats(PyObject *module, PyObject *obj);

#endif /* DCPX_GATE_H */
