/* What the native kernels' C tests share: checks that stop the program, seeded random data, the variants a run may
 * take (every one the host has, or those under the ceiling named on the command line: `portable` forces the portable
 * C), and a `parallel` that runs a call's tasks on threads of its own. Built with the library's sources under
 * AddressSanitizer and UBSan by tests/test_native_c.py. */
#ifndef COSYVOICE_LITE_TEST_CHECK_H
#define COSYVOICE_LITE_TEST_CHECK_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "exec.h"
#include "op.h"

static int checks_run;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        checks_run++;                                                      \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

/* xorshift64*: the same data on every host. */
typedef struct {
    uint64_t s;
} rng;

static inline uint64_t rng_next(rng* r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 2685821657736338717ull;
}

/* Uniform in [-1, 1). */
static inline float rng_float(rng* r) { return (float)((double)(rng_next(r) >> 11) / (double)(1ull << 52) - 1.0); }

static inline float* random_floats(rng* r, size_t n, float scale) {
    float* x = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = rng_float(r) * scale;
    return x;
}

/* The features a run may use: the host's under the ceiling given as argv[1] ("auto" when absent). */
static inline cvl_features run_features(int argc, char** argv) {
    const int ceiling = cvl_isa_parse(argc > 1 ? argv[1] : "auto");
    CHECK(ceiling >= 0, "unknown ceiling %s (auto, no-amx, portable)", argv[1]);
    return cvl_isa_features((cvl_isa)ceiling);
}

/* ---- a parallel runner on threads of its own ---- */

typedef struct {
    cvl_task_fn task;
    void* ctx;
    size_t from, to;
} thread_share;

static void* run_share(void* arg) {
    thread_share* sh = arg;
    for (size_t i = sh->to; i-- > sh->from;) sh->task(sh->ctx, i); /* backwards: no task may rely on another's order */
    return NULL;
}

/* Runs the tasks on up to 3 threads (the caller's and two more), as ONNX Runtime's pool would. */
static inline void threads_parallel(void* runner, cvl_task_fn task, void* ctx, size_t tasks) {
    (void)runner;
    enum { THREADS = 3 };
    thread_share shares[THREADS];
    pthread_t ids[THREADS];
    for (int t = 0; t < THREADS; t++) shares[t] = (thread_share){task, ctx, tasks * t / THREADS, tasks * (t + 1) / THREADS};
    for (int t = 1; t < THREADS; t++) CHECK(pthread_create(&ids[t], NULL, run_share, &shares[t]) == 0, "pthread_create");
    run_share(&shares[0]);
    for (int t = 1; t < THREADS; t++) pthread_join(ids[t], NULL);
}

/* Every variant of `v` the run may take (its needs within `allowed`), as the features that select exactly it. */
#define FOR_EACH_VARIANT(v, allowed, index)                    \
    for (int index = 0; index < (v)->count; index++)           \
        if (cvl_has((allowed), (v)->variants[index].needs))

/* The feature sets a fused layer runs with: each of its variants' needs, then everything but AMX, then everything the
 * run allows (its parts, products and attention, take their own variants from the same set); those the run does not
 * allow and repeats are left out. Returns how many were written to `out` (at most count + 2). */
static inline int feature_sets(const cvl_variants* v, cvl_features allowed, cvl_features* out) {
    cvl_features candidates[16];
    int n = 0, kept = 0;
    for (int i = 0; i < v->count && n < 14; i++) candidates[n++] = v->variants[i].needs;
    candidates[n++] = allowed & ~(cvl_features)CVL_AMX_ANY;
    candidates[n++] = allowed;
    for (int i = 0; i < n; i++) {
        int seen = !cvl_has(allowed, candidates[i]);
        for (int j = 0; j < kept && !seen; j++) seen = out[j] == candidates[i];
        if (!seen) out[kept++] = candidates[i];
    }
    return kept;
}

/* Largest |a - b| / (|b| + floor) over n values. */
static inline double worst_relative(const float* a, const float* b, size_t n, double floor) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - (double)b[i]) / (fabs((double)b[i]) + floor);
        CHECK(isfinite(a[i]), "value %zu is %f", i, (double)a[i]);
        if (d > worst) worst = d;
    }
    return worst;
}

static inline void report(const char* test, cvl_features allowed) {
    printf("%s: %d checks passed (features 0x%x)\n", test, checks_run, (unsigned)allowed);
}

#endif
