/* Per-thread work buffers of the kernels: grown on demand, kept for the thread's next call, freed when it ends. */
#ifndef COSYVOICE_LITE_WORK_H
#define COSYVOICE_LITE_WORK_H

#include <stddef.h>

enum {
    CVL_WORK_ATTENTION = 0,
    CVL_WORK_BLOCK = 1,
    CVL_WORK_QWEN = 2,
    CVL_WORK_QWEN_SCORES = 3,
    CVL_WORK_RELPOS = 4,
    CVL_WORK_RELPOS_SCORES = 5,
    CVL_WORK_CONV = 6,
    CVL_WORK_SLOTS = 7
};

/* A 64-byte aligned buffer of at least `floats` floats for this thread and `slot` (its contents are not kept when it
 * grows); NULL when it cannot be allocated. */
float* cvl_work_floats(int slot, size_t floats);

/* Free this thread's buffer of `slot` if it holds more than CVL_WORK_KEEP_BYTES: a rare large call (a long sentence's
 * one full-attention pass) does not stay resident in every thread that ran one. */
#define CVL_WORK_KEEP_BYTES ((size_t)4 << 20)
void cvl_work_trim(int slot);

#endif
