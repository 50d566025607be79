/* The part of ONNX Runtime's C API our operators use, declared here from its documented, append-only layout.
 *
 * ONNX Runtime's C API is a table of function pointers (OrtApi) that only ever grows: an entry keeps its position in
 * every later version. We do not copy its header: the entries we call are listed once, in ort_api.c's table (name,
 * position, the API version that introduced it), and cvl_ort_bind checks the runtime against that table (its version
 * string and OrtApiBase.GetApi) before a single entry is read. Positions come from ONNX Runtime's
 * onnxruntime_c_api.cc (its static_asserts fix the end of each version's block). */
#ifndef COSYVOICE_LITE_ORT_API_H
#define COSYVOICE_LITE_ORT_API_H

#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtKeyValuePairs OrtKeyValuePairs;

typedef struct {
    const OrtApi* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

/* The API version every entry below exists from (KernelInfo_GetConfigEntries: ONNX Runtime 1.24). */
#define CVL_ORT_API_VERSION 24

enum { CVL_ORT_FAIL = 1, CVL_ORT_INVALID_ARGUMENT = 2 };                                    /* OrtErrorCode */
/* element types; CVL_T_ANY (ONNX's undefined) declares an input of any type, the kernel checks it (cvl_tensor.type) */
enum { CVL_T_ANY = 0, CVL_T_FLOAT = 1, CVL_T_INT8 = 3, CVL_T_INT32 = 6, CVL_T_INT64 = 7, CVL_T_FLOAT16 = 10 };

/* A custom operator as ONNX Runtime reads it, up to the members of OrtCustomOp version 16 (CreateKernelV2 and
 * KernelComputeV2, which can fail with a status); `version` = 16 tells the runtime to read no further. */
#define CVL_ORT_CUSTOM_OP_VERSION 16
typedef struct OrtCustomOp {
    uint32_t version;
    void* (*CreateKernel)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
    const char* (*GetName)(const struct OrtCustomOp*);
    const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
    int (*GetInputType)(const struct OrtCustomOp*, size_t);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
    int (*GetOutputType)(const struct OrtCustomOp*, size_t);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
    void (*KernelCompute)(void*, OrtKernelContext*);
    void (*KernelDestroy)(void*);
    int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t); /* 0 required, 1 optional */
    int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t);     /* version 13 */
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);       /* version 14 */
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
    OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**); /* 16 */
    OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
} OrtCustomOp;

/* The entries we call, typed; filled by cvl_ort_fill from the runtime's table. */
typedef struct {
    OrtStatus* (*CreateStatus)(int code, const char* message);
    void (*ReleaseStatus)(OrtStatus*);
    OrtStatus* (*CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);
    OrtStatus* (*CustomOpDomain_Add)(OrtCustomOpDomain*, const OrtCustomOp*);
    OrtStatus* (*AddCustomOpDomain)(OrtSessionOptions*, OrtCustomOpDomain*);
    OrtStatus* (*GetTensorMutableData)(OrtValue*, void** out);
    OrtStatus* (*GetTensorElementType)(const OrtTensorTypeAndShapeInfo*, int* out);
    OrtStatus* (*GetDimensionsCount)(const OrtTensorTypeAndShapeInfo*, size_t* out);
    OrtStatus* (*GetDimensions)(const OrtTensorTypeAndShapeInfo*, int64_t* dims, size_t count);
    OrtStatus* (*GetTensorTypeAndShape)(const OrtValue*, OrtTensorTypeAndShapeInfo** out);
    void (*ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo*);
    OrtStatus* (*KernelInfoGetAttribute_float)(const OrtKernelInfo*, const char* name, float* out);
    OrtStatus* (*KernelInfoGetAttribute_int64)(const OrtKernelInfo*, const char* name, int64_t* out);
    OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext*, size_t index, const OrtValue** out);
    OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext*, size_t index, const int64_t* dims, size_t count,
                                          OrtValue** out);
    OrtStatus* (*KernelContext_ParallelFor)(const OrtKernelContext*, void (*fn)(void*, size_t), size_t total,
                                            size_t batches, void* data);
    const char* (*GetKeyValue)(const OrtKeyValuePairs*, const char* key);
    void (*ReleaseKeyValuePairs)(OrtKeyValuePairs*);
    OrtStatus* (*KernelInfo_GetConfigEntries)(const OrtKernelInfo*, OrtKeyValuePairs** out);
} cvl_ort;

/* One entry of the table: its name in OrtApi, its position there, the API version that added it, and its place in
 * cvl_ort. */
typedef struct {
    const char* name;
    size_t position;
    uint32_t since;
    size_t offset;
} cvl_ort_entry;

extern const cvl_ort_entry cvl_ort_entries[];
extern const size_t cvl_ort_entry_count;

/* Whether the runtime behind `base` offers every entry (its version string names ONNX Runtime 1.N with N >=
 * CVL_ORT_API_VERSION and GetApi(CVL_ORT_API_VERSION) answers); on success fills `ort` and returns 0, else writes
 * why into `why` and returns -1. `ort->CreateStatus` is set in either case where the runtime has any API (to report
 * the failure), else NULL. */
int cvl_ort_bind(const OrtApiBase* base, cvl_ort* ort, char* why, size_t why_size);

/* `ort` from a table the runtime handed a kernel (an API already checked by cvl_ort_bind at registration). */
void cvl_ort_fill(const OrtApi* api, cvl_ort* ort);

#endif
