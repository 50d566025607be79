/* The kernels' per-thread work buffers (work.h): a buffer is reused while calls fit in it, grows for a larger one, and
 * a buffer over CVL_WORK_KEEP_BYTES is given back by the next call that needs no more than that (a prefill's layers
 * share one allocation; a decode step after it does not keep it); each thread has its own. */

#include "check.h"
#include "work.h"

#define KEEP_FLOATS (CVL_WORK_KEEP_BYTES / sizeof(float))

static void* other_thread(void* arg) {
    (void)arg;
    float* mine = cvl_work_floats(CVL_WORK_BLOCK, 16);
    return mine != NULL && cvl_work_held(CVL_WORK_BLOCK) == 16 * sizeof(float) ? mine : NULL;
}

static void check_slot(int slot) {
    CHECK(cvl_work_held(slot) == 0, "slot %d starts empty", slot);
    float* small = cvl_work_floats(slot, 1000);
    CHECK(small != NULL && ((uintptr_t)small & 63) == 0, "slot %d: a 64-byte aligned buffer", slot);
    small[999] = 1.f;
    CHECK(cvl_work_floats(slot, 500) == small, "slot %d: a smaller small call reuses the buffer", slot);
    CHECK(cvl_work_held(slot) == 1000 * sizeof(float), "slot %d: kept at its size", slot);

    float* large = cvl_work_floats(slot, 3 * KEEP_FLOATS);
    CHECK(large != NULL && cvl_work_held(slot) == CVL_WORK_KEEP_BYTES * 3, "slot %d: grows for a large call", slot);
    large[3 * KEEP_FLOATS - 1] = 2.f;
    for (int layer = 0; layer < 24; layer++)
        CHECK(cvl_work_floats(slot, 2 * KEEP_FLOATS + (size_t)layer) == large, "slot %d: layer %d shares it", slot, layer);
    CHECK(cvl_work_floats(slot, KEEP_FLOATS + 1) == large, "slot %d: a call just over the keep size shares it", slot);

    float* after = cvl_work_floats(slot, 2000);
    CHECK(after != NULL && cvl_work_held(slot) == 2000 * sizeof(float), "slot %d: a small call gives the large one back", slot);
    after[1999] = 3.f;
    CHECK(cvl_work_floats(slot, KEEP_FLOATS) != NULL && cvl_work_held(slot) == CVL_WORK_KEEP_BYTES,
          "slot %d: the keep size itself is small", slot);
    CHECK(cvl_work_floats(slot, 10) != NULL && cvl_work_held(slot) == CVL_WORK_KEEP_BYTES, "slot %d: and kept", slot);
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    CHECK(cvl_work_floats(-1, 4) == NULL && cvl_work_floats(CVL_WORK_SLOTS, 4) == NULL, "no slot out of range");
    CHECK(cvl_work_held(-1) == 0 && cvl_work_held(CVL_WORK_SLOTS) == 0, "nothing held out of range");
    for (int slot = 0; slot < CVL_WORK_SLOTS; slot++) check_slot(slot);
    const size_t mine = cvl_work_held(CVL_WORK_BLOCK);
    pthread_t t;
    void* theirs = NULL;
    CHECK(pthread_create(&t, NULL, other_thread, NULL) == 0 && pthread_join(t, &theirs) == 0, "a second thread ran");
    CHECK(theirs != NULL, "another thread gets a buffer of its own size");
    CHECK(cvl_work_held(CVL_WORK_BLOCK) == mine, "and this thread's is untouched");
    report("test_work", allowed);
    return 0;
}
