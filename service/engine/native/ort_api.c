/* The ONNX Runtime C API entries our operators call (ort_api.h): one table, checked against the runtime at load. */

#include "ort_api.h"

#include <stdio.h>
#include <stdlib.h>

#define ENTRY(name, position, since) {#name, position, since, offsetof(cvl_ort, name)}

/* Positions in OrtApi; `since`: the API version (= ONNX Runtime 1.N) whose block holds the entry. */
const cvl_ort_entry cvl_ort_entries[] = {
    ENTRY(CreateStatus, 0, 1),
    ENTRY(CreateCustomOpDomain, 26, 1),
    ENTRY(CustomOpDomain_Add, 27, 1),
    ENTRY(AddCustomOpDomain, 28, 1),
    ENTRY(GetTensorMutableData, 51, 1),
    ENTRY(GetTensorElementType, 60, 1),
    ENTRY(GetDimensionsCount, 61, 1),
    ENTRY(GetDimensions, 62, 1),
    ENTRY(GetTensorTypeAndShape, 65, 1),
    ENTRY(KernelInfoGetAttribute_float, 85, 1),
    ENTRY(KernelInfoGetAttribute_int64, 86, 1),
    ENTRY(KernelContext_GetInput, 90, 1),
    ENTRY(KernelContext_GetOutput, 91, 1),
    ENTRY(ReleaseStatus, 93, 1),
    ENTRY(ReleaseTensorTypeAndShapeInfo, 99, 1),
    ENTRY(KernelContext_ParallelFor, 274, 17),
    ENTRY(GetKeyValue, 297, 22),
    ENTRY(ReleaseKeyValuePairs, 300, 22),
    ENTRY(KernelInfo_GetConfigEntries, 391, 24),
};
const size_t cvl_ort_entry_count = sizeof cvl_ort_entries / sizeof cvl_ort_entries[0];

void cvl_ort_fill(const OrtApi* api, cvl_ort* ort) {
    void* const* table = (void* const*)api;
    for (size_t i = 0; i < cvl_ort_entry_count; i++)
        *(void**)((char*)ort + cvl_ort_entries[i].offset) = table[cvl_ort_entries[i].position];
}

/* The minor version of an "1.N[.P...]" version string, or -1. */
static long release_minor(const char* version) {
    char* end;
    if (version == NULL || strtol(version, &end, 10) != 1 || *end != '.') return -1;
    long minor = strtol(end + 1, &end, 10);
    return *end == '\0' || *end == '.' || *end == '-' || *end == '+' ? minor : -1;
}

int cvl_ort_bind(const OrtApiBase* base, cvl_ort* ort, char* why, size_t why_size) {
    const char* version = base->GetVersionString();
    const OrtApi* first = base->GetApi(1);
    ort->CreateStatus = first != NULL ? (OrtStatus * (*)(int, const char*))((void* const*)first)[0] : NULL;
    const long minor = release_minor(version);
    const OrtApi* api = minor >= CVL_ORT_API_VERSION ? base->GetApi(CVL_ORT_API_VERSION) : NULL;
    if (api == NULL) {
        snprintf(why, why_size,
                 "cosyvoice_lite: ONNX Runtime %s is too old for these kernels: they call C API entries up to version "
                 "%d (KernelInfo_GetConfigEntries: ONNX Runtime 1.%d or later)",
                 version != NULL ? version : "(unknown version)", CVL_ORT_API_VERSION, CVL_ORT_API_VERSION);
        return -1;
    }
    cvl_ort_fill(api, ort);
    for (size_t i = 0; i < cvl_ort_entry_count; i++) {
        if (*(void**)((char*)ort + cvl_ort_entries[i].offset) == NULL) {
            snprintf(why, why_size, "cosyvoice_lite: ONNX Runtime %s has no C API entry %s (position %zu)", version,
                     cvl_ort_entries[i].name, cvl_ort_entries[i].position);
            return -1;
        }
    }
    return 0;
}
