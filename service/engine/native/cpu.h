/* What every kernel's choice of code path starts from. */
#ifndef COSYVOICE_LITE_CPU_H
#define COSYVOICE_LITE_CPU_H

#include <stdlib.h>
#include <string.h>

/* COSYVOICE_LITE_PORTABLE_KERNELS=1 makes every kernel take its portable code, as on a CPU without AVX-512 (tests;
 * each kernel reads it once, with its CPU check, and keeps the answer for the process). */
static inline int cvl_portable_forced(void) {
    const char* portable = getenv("COSYVOICE_LITE_PORTABLE_KERNELS");
    return portable != NULL && strcmp(portable, "1") == 0;
}

/* COSYVOICE_LITE_AMX=0 keeps the kernels off AMX tiles where the CPU has them (their AVX-512 code runs instead:
 * comparisons and tests; amx.h). */
static inline int cvl_amx_refused(void) {
    const char* amx = getenv("COSYVOICE_LITE_AMX");
    return amx != NULL && strcmp(amx, "0") == 0;
}

#endif
