/* Per-thread work buffers (work.h). Allocating a block's ~1 MB of intermediates with malloc at every call would map and
 * fault in fresh pages each time (glibc serves such sizes with mmap); a buffer kept per thread is touched once. */

#include "work.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct {
    float* data[CVL_WORK_SLOTS];
    size_t floats[CVL_WORK_SLOTS];
} work_buffers;

static pthread_key_t work_key;
static pthread_once_t work_once = PTHREAD_ONCE_INIT;

static void work_free(void* p) {
    work_buffers* w = p;
    for (int i = 0; i < CVL_WORK_SLOTS; i++) free(w->data[i]);
    free(w);
}

static void work_init(void) { pthread_key_create(&work_key, work_free); }

float* cvl_work_floats(int slot, size_t floats) {
    if (slot < 0 || slot >= CVL_WORK_SLOTS) return NULL;
    pthread_once(&work_once, work_init);
    work_buffers* w = pthread_getspecific(work_key);
    if (w == NULL) {
        w = calloc(1, sizeof *w);
        if (w == NULL || pthread_setspecific(work_key, w) != 0) {
            free(w);
            return NULL;
        }
    }
    const int large_held = w->floats[slot] * sizeof(float) > CVL_WORK_KEEP_BYTES;
    if (floats > w->floats[slot] || (large_held && floats * sizeof(float) <= CVL_WORK_KEEP_BYTES)) {
        free(w->data[slot]);
        size_t bytes = (floats * sizeof(float) + 63) & ~(size_t)63;
        w->data[slot] = aligned_alloc(64, bytes);
        w->floats[slot] = w->data[slot] ? floats : 0;
    }
    return w->data[slot];
}

size_t cvl_work_held(int slot) {
    if (slot < 0 || slot >= CVL_WORK_SLOTS) return 0;
    pthread_once(&work_once, work_init);
    work_buffers* w = pthread_getspecific(work_key);
    return w == NULL || w->data[slot] == NULL ? 0 : w->floats[slot] * sizeof(float);
}
