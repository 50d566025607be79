/* The ONNX Runtime custom operator cosyvoice_lite.CachedAttention around cvl_cached_attention.
 *
 * Loaded with SessionOptions.register_custom_ops_library(path) (service/engine/native.py). ONNX Runtime's C API is a
 * versioned, append-only table of function pointers: this file declares only the members it calls, by their fixed
 * positions in `OrtApi` (API version 1 block, unchanged since), and fills `OrtCustomOp` up to the members of API
 * version 16 (KernelComputeV2, which can return an error). Positions and layouts come from onnxruntime_c_api.h;
 * tests/test_native_attention.py runs the operator through the installed runtime.
 *
 * Inputs: q, k, v (B, M, H*DK) float32; past_k, past_v (B, C, H, DK) float16; chunk (1,) int64.
 * Output: (B, M, H*DK) float32. Attributes: heads (int), scale (float). */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cached_attention.h"

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;

typedef struct {
    const OrtApi* (*GetApi)(uint32_t version);
    const char* (*GetVersionString)(void);
} OrtApiBase;

enum { API_VERSION = 16 };
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { T_FLOAT = 1, T_INT64 = 7, T_FLOAT16 = 10 };

/* Positions in OrtApi. */
enum {
    CREATE_STATUS = 0,
    CREATE_CUSTOM_OP_DOMAIN = 26,
    CUSTOM_OP_DOMAIN_ADD = 27,
    ADD_CUSTOM_OP_DOMAIN = 28,
    GET_TENSOR_MUTABLE_DATA = 51,
    GET_TENSOR_ELEMENT_TYPE = 60,
    GET_DIMENSIONS_COUNT = 61,
    GET_DIMENSIONS = 62,
    GET_TENSOR_TYPE_AND_SHAPE = 65,
    KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85,
    KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
    KERNEL_CONTEXT_GET_INPUT = 90,
    KERNEL_CONTEXT_GET_OUTPUT = 91,
    RELEASE_STATUS = 93,
    RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99,
};

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
    int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
    int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t); /* API 13 */
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);   /* API 14 */
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
    OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**); /* API 16 */
    OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
} OrtCustomOp;

static const OrtApi* api;
#define API(index, type) ((type)((void* const*)api)[index])

typedef struct {
    int64_t heads;
    float scale;
} kernel;

static OrtStatus* status(int code, const char* message) {
    return API(CREATE_STATUS, OrtStatus* (*)(int, const char*))(code, message);
}

static void* create_kernel(const OrtCustomOp* op, const OrtApi* ort, const OrtKernelInfo* info) {
    (void)op;
    kernel* kn = malloc(sizeof *kn);
    if (kn == NULL) return NULL;
    kn->heads = 0;
    kn->scale = 0.f;
    OrtStatus* s = ((OrtStatus * (*)(const OrtKernelInfo*, const char*, int64_t*))((void* const*)ort)[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, "heads", &kn->heads);
    if (s) API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
    s = ((OrtStatus * (*)(const OrtKernelInfo*, const char*, float*))((void* const*)ort)[KERNEL_INFO_GET_ATTRIBUTE_FLOAT])(info, "scale", &kn->scale);
    if (s) API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
    return kn;
}

static OrtStatus* shape_of(const OrtValue* value, int want_type, int64_t* dims, size_t max_dims, size_t* count) {
    OrtTensorTypeAndShapeInfo* info;
    int type = 0;
    OrtStatus* s = API(GET_TENSOR_TYPE_AND_SHAPE, OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**))(value, &info);
    if (s) return s;
    s = API(GET_TENSOR_ELEMENT_TYPE, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int*))(info, &type);
    if (!s) s = API(GET_DIMENSIONS_COUNT, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*))(info, count);
    if (!s && *count > max_dims) s = status(ORT_INVALID_ARGUMENT, "CachedAttention: an input has too many dimensions");
    if (!s) s = API(GET_DIMENSIONS, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t))(info, dims, *count);
    API(RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(OrtTensorTypeAndShapeInfo*))(info);
    if (!s && type != want_type) s = status(ORT_INVALID_ARGUMENT, "CachedAttention: an input has the wrong element type");
    return s;
}

static OrtStatus* data_of(const OrtValue* value, void** data) {
    return API(GET_TENSOR_MUTABLE_DATA, OrtStatus* (*)(OrtValue*, void**))((OrtValue*)value, data);
}

static int same3(const int64_t* a, const int64_t* b) { return a[0] == b[0] && a[1] == b[1] && a[2] == b[2]; }

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const OrtValue* in[6];
    int64_t dims[6][4];
    size_t nd[6];
    static const int types[6] = {T_FLOAT, T_FLOAT, T_FLOAT, T_FLOAT16, T_FLOAT16, T_INT64};
    for (size_t i = 0; i < 6; i++) {
        OrtStatus* s = API(KERNEL_CONTEXT_GET_INPUT, OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**))(ctx, i, &in[i]);
        if (!s && in[i] == NULL) s = status(ORT_INVALID_ARGUMENT, "CachedAttention: an input is missing");
        if (!s) s = shape_of(in[i], types[i], dims[i], 4, &nd[i]);
        if (s) return s;
    }
    const int64_t* qd = dims[0];
    const int64_t* pd = dims[3];
    int64_t heads = kn->heads;
    if (nd[0] != 3 || nd[1] != 3 || nd[2] != 3 || nd[3] != 4 || nd[4] != 4 || !same3(qd, dims[1]) || !same3(qd, dims[2]) ||
        pd[0] != qd[0] || pd[2] != heads || heads < 1 || pd[2] * pd[3] != qd[2] || dims[4][0] != pd[0] ||
        dims[4][1] != pd[1] || dims[4][2] != pd[2] || dims[4][3] != pd[3] || nd[5] != 1 || dims[5][0] != 1)
        return status(ORT_INVALID_ARGUMENT, "CachedAttention: q, k, v (B,M,H*DK), past_k, past_v (B,C,H,DK), chunk (1,) disagree");
    void* p[6];
    for (int i = 0; i < 6; i++) {
        OrtStatus* s = data_of(in[i], &p[i]);
        if (s) return s;
    }
    int64_t chunk = *(const int64_t*)p[5];
    if (chunk < 1) return status(ORT_INVALID_ARGUMENT, "CachedAttention: chunk must be >= 1");
    OrtValue* out;
    OrtStatus* s = API(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(ctx, 0, qd, 3, &out);
    if (s) return s;
    void* o;
    if ((s = data_of(out, &o))) return s;
    cvl_attention_shape shape = {(int)qd[0], (int)qd[1], (int)pd[1], (int)heads, (int)pd[3], chunk, kn->scale};
    if (qd[0] == 0 || qd[1] == 0) return NULL;
    if (cvl_cached_attention(&shape, p[0], p[1], p[2], p[3], p[4], o) != 0)
        return status(ORT_FAIL, "CachedAttention: out of memory for the work buffer");
    return NULL;
}

static void compute_v1(void* kp, OrtKernelContext* ctx) { /* not called: the runtime takes KernelComputeV2 */
    OrtStatus* s = compute(kp, ctx);
    if (s) API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return "CachedAttention"; }
static const char* cpu_provider(const OrtCustomOp* op) { (void)op; return NULL; }
static int input_type(const OrtCustomOp* op, size_t i) {
    (void)op;
    static const int types[6] = {T_FLOAT, T_FLOAT, T_FLOAT, T_FLOAT16, T_FLOAT16, T_INT64};
    return i < 6 ? types[i] : 0;
}
static size_t input_count(const OrtCustomOp* op) { (void)op; return 6; }
static int output_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static size_t output_count(const OrtCustomOp* op) { (void)op; return 1; }
static void destroy_kernel(void* kp) { free(kp); }
static int required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int one(const OrtCustomOp* op) { (void)op; return 1; }

static const OrtCustomOp cached_attention_op = {
    API_VERSION, create_kernel, op_name, cpu_provider, input_type, input_count, output_type, output_count,
    compute_v1, destroy_kernel, required, required, default_memory, one, one, one, one, NULL, compute,
};

OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    api = base->GetApi(API_VERSION);
    if (api == NULL) return NULL; /* cannot even report it: the runtime is older than API 16 (ONNX Runtime 1.16) */
    OrtCustomOpDomain* domain;
    OrtStatus* s = API(CREATE_CUSTOM_OP_DOMAIN, OrtStatus* (*)(const char*, OrtCustomOpDomain**))("cosyvoice_lite", &domain);
    if (!s) s = API(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*))(domain, &cached_attention_op);
    if (!s) s = API(ADD_CUSTOM_OP_DOMAIN, OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*))(options, domain);
    return s;
}
