/* Per-thread work buffers of the kernels: grown on demand, kept for the thread's next call, freed when it ends. A buffer
 * larger than CVL_WORK_KEEP_BYTES (a prefill's, a long sentence's full-attention pass) is given back by the thread's
 * next call of that slot that needs no more than that: the layers of one large graph run (a prefill's 24) share one
 * allocation, and it does not stay resident in every thread that ran one. */
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

#define CVL_WORK_KEEP_BYTES ((size_t)4 << 20)

/* A 64-byte aligned buffer of at least `floats` floats for this thread and `slot` (its contents are not kept when it
 * grows or shrinks); NULL when it cannot be allocated. A request of at most CVL_WORK_KEEP_BYTES replaces a larger
 * buffer with one of its own size. Freeing a large buffer at the end of each call instead cost a 286-position Qwen2
 * prefill ~40 % under a fixed malloc mmap threshold (every layer's 15 MB mapped, zeroed and faulted in again). */
float* cvl_work_floats(int slot, size_t floats);

/* The bytes this thread's buffer of `slot` holds (0 for none): for tests. */
size_t cvl_work_held(int slot);

#endif
