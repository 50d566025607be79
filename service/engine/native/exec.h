/* How one kernel call may run: the ISA features it may use and the threads it may share its work over. */
#ifndef COSYVOICE_LITE_EXEC_H
#define COSYVOICE_LITE_EXEC_H

#include <stddef.h>

#include "cpu.h"

/* Runs task(ctx, i) for i in [0, tasks), possibly on several threads, and returns when all are done. */
typedef void (*cvl_task_fn)(void* ctx, size_t i);
typedef void (*cvl_parallel_fn)(void* runner, cvl_task_fn task, void* ctx, size_t tasks);

typedef struct {
    /* The features the call's code may use: a subset of cvl_cpu_features() (cvl_isa_features of the caller's
     * ceiling); 0 runs the portable code. */
    cvl_features have;
    /* How many tasks a product of one row tile (a decode step's few rows) is split into: 1 (or 0) keeps it on the
     * calling thread, which streams most of the weights one core can read and leaves the other cores to other work;
     * more share its weight panels over `parallel`, for a caller that knows those threads are idle. At most
     * CVL_MAX_SPREAD; a result never depends on it (each panel's sums are the same). */
    int spread;
    cvl_parallel_fn parallel; /* NULL: everything on the calling thread */
    void* runner;             /* the first argument of `parallel` */
} cvl_exec;

#define CVL_MAX_SPREAD 16

/* Runs task(ctx, i) for i in [0, tasks): over ex->parallel when there is one and more than one task, else here. */
static inline void cvl_run_tasks(const cvl_exec* ex, cvl_task_fn task, void* ctx, size_t tasks) {
    if (ex->parallel != NULL && tasks > 1) {
        ex->parallel(ex->runner, task, ctx, tasks);
        return;
    }
    for (size_t i = 0; i < tasks; i++) task(ctx, i);
}

#endif
