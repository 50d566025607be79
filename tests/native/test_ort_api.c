/* The ONNX Runtime C API table (ort_api.h): each entry's position lies in the block of the API version that added it
 * (the ends of the blocks are ONNX Runtime's own static_asserts), no two entries share a position, and
 * cvl_ort_bind refuses a runtime older than CVL_ORT_API_VERSION with a message naming it, and fills every entry from
 * a new one. The runtime here is a fake: a table whose slot i holds a distinct address. */

#include "check.h"
#include "ort_api.h"

/* The last position of each API version's block: onnxruntime_c_api.cc ("Size of version N API cannot change"). */
static size_t block_end(uint32_t version) {
    switch (version) {
        case 1: return 101;
        case 17: return 275;
        case 22: return 317;
        case 24: return 411;
        default: return 0;
    }
}

static size_t block_start(uint32_t version) {
    switch (version) {
        case 1: return 0;
        case 17: return 266; /* after KernelContext_GetResource, the end of version 16 (265) */
        case 22: return 285; /* after SetEpDynamicOptions, the end of version 20 (284; none in 21) */
        case 24: return 390; /* after CreateExternalInitializerInfo, the end of version 23 (389) */
        default: return 1;
    }
}

#define SLOTS 420
static void* slots[SLOTS];
static const char* version_string;
static uint32_t newest;

static const OrtApi* get_api(uint32_t version) { return version >= 1 && version <= newest ? (const OrtApi*)slots : NULL; }
static const char* get_version(void) { return version_string; }

static void check_table(void) {
    for (size_t i = 0; i < cvl_ort_entry_count; i++) {
        const cvl_ort_entry* e = &cvl_ort_entries[i];
        CHECK(e->since <= CVL_ORT_API_VERSION, "%s: version %u above the library's %d", e->name, e->since, CVL_ORT_API_VERSION);
        CHECK(block_end(e->since) > 0 && e->position >= block_start(e->since) && e->position <= block_end(e->since),
              "%s: position %zu outside version %u's block", e->name, e->position, e->since);
        for (size_t j = 0; j < i; j++) CHECK(cvl_ort_entries[j].position != e->position, "%s: position taken", e->name);
        CHECK(e->offset % sizeof(void*) == 0 && e->offset < sizeof(cvl_ort), "%s: its place in cvl_ort", e->name);
    }
    CHECK(cvl_ort_entry_count * sizeof(void*) == sizeof(cvl_ort), "every member of cvl_ort has an entry");
}

static void check_bind(void) {
    for (size_t i = 0; i < SLOTS; i++) slots[i] = (void*)(uintptr_t)(0x1000 + 8 * i);
    const OrtApiBase base = {get_api, get_version};
    cvl_ort ort;
    char why[256];
    version_string = "1.20.1", newest = 20;
    CHECK(cvl_ort_bind(&base, &ort, why, sizeof why) == -1 && strstr(why, "1.20.1") && strstr(why, "1.24"),
          "an old runtime is refused: %s", why);
    CHECK(ort.CreateStatus == slots[0], "an old runtime still reports the failure through CreateStatus");
    version_string = "1.31.1", newest = 20; /* a version string that claims more than GetApi gives */
    CHECK(cvl_ort_bind(&base, &ort, why, sizeof why) == -1, "GetApi(%d) must answer", CVL_ORT_API_VERSION);
    version_string = "2.0.0", newest = 40;
    CHECK(cvl_ort_bind(&base, &ort, why, sizeof why) == -1, "another major version is refused");
    version_string = "1.31.1", newest = 31;
    CHECK(cvl_ort_bind(&base, &ort, why, sizeof why) == 0, "a new runtime binds: %s", why);
    for (size_t i = 0; i < cvl_ort_entry_count; i++) {
        const cvl_ort_entry* e = &cvl_ort_entries[i];
        CHECK(*(void**)((char*)&ort + e->offset) == slots[e->position], "%s from slot %zu", e->name, e->position);
    }
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    check_table();
    check_bind();
    report("test_ort_api", allowed);
    return 0;
}
