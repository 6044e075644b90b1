/* dcpx_run_workers: the one thread pool shape the C core uses (reader,
 * staging copy, pre-faulting): nthreads - 1 new threads plus the caller's,
 * all draining a shared work counter, then joined.  Kept apart from
 * module.c so that the fuzz targets can link it without the module. */
#include "dcpx.h"

#include <pthread.h>

void dcpx_run_workers(void *(*fn)(void *), void *arg, int nthreads)
{
    pthread_t tids[64];
    int started = 0;
    for (int i = 1; i < nthreads && i < 64; i++) {
        if (pthread_create(&tids[started], NULL, fn, arg) != 0)
            break;
        started++;
    }
    fn(arg);
    for (int i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
}
