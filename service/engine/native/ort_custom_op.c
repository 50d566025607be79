/* ONNX Runtime custom operators around our kernels: cosyvoice_lite.CachedAttention (cvl_cached_attention),
 * cosyvoice_lite.Int8MatMul (cvl_int8_matmul) and cosyvoice_lite.EstimatorBlock (cvl_estimator_block).
 *
 * Loaded with SessionOptions.register_custom_ops_library(path) (service/engine/native.py). ONNX Runtime's C API is a
 * versioned, append-only table of function pointers: this file declares only the members it calls, by their fixed
 * positions in `OrtApi` (API version 1 block, unchanged since), and fills `OrtCustomOp` up to the members of API
 * version 16 (KernelComputeV2, which can return an error). Positions and layouts come from onnxruntime_c_api.h;
 * tests/test_native_attention.py and tests/test_native_int8.py run the operators through the installed runtime.
 *
 * CachedAttention. Inputs: q, k, v (B, M, H*DK) float32; past_k, past_v (B, C, H, DK) float16; chunk (1,) int64.
 * Output: (B, M, H*DK) float32. Attributes: heads (int), scale (float).
 * Int8MatMul. Inputs: x (..., K) float32; packed (P, ceil(K/4), 64, 4) int8 (int8_matmul.h); colsum (P*64,) int32;
 * w_scale (1,) float32; bias (N,) float32, optional. Output (..., N) float32. Attributes: n (int); window (int,
 * default 1): W > 1 takes x (..., T, C) and multiplies each run of W frames side by side (K = W * C) into
 * (..., T - W + 1, N), a width-W convolution without its im2col copy. Its work is shared out over the session's
 * intra-op threads (KernelContext_ParallelFor, API version 17).
 * EstimatorBlock. Inputs: x (B, M, D) float32; past_k, past_v (B, C, H, DK) float16; chunk (1,) int64; ln1 weight and
 * bias (D,); the q|k|v weight as Int8MatMul takes it (n = 3*H*DK) with scales (1,) or (3*H*DK,); ln3 weight and bias;
 * then out (n = D), ff1 (n = F) and ff2 (n = D), each packed, colsum, scale (1,) and bias: 23 inputs. Outputs: y
 * (B, M, D) float32, the new frames' k and v (1, B, M, H, DK) float16 (one block's slice of the estimator's new_k,
 * new_v). Attributes: heads (int), scale, eps1, eps3 (float).
 * Qwen2Layer. Inputs: x (B, T, D) float32; past_k, past_v (B, KVH, C, DK) float16; mask (B, 1, T, C+T), cos, sin
 * (B, 1, T, DK) float32; rms1 weight (D,); q, k, v weights as Int8MatMul takes them, each with its bias (4 inputs
 * each); o (packed, colsum, scale); rms2 weight; gate, up, down (3 inputs each): 32 inputs. Outputs: y (B, T, D),
 * the new tokens' k (rotated) and v (B, KVH, T, DK), float32. Attributes: heads, ff (int), scale, eps (float). */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cached_attention.h"
#include "estimator_block.h"
#include "int8_matmul.h"
#include "qwen2_layer.h"

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
enum { T_FLOAT = 1, T_INT8 = 3, T_INT32 = 6, T_INT64 = 7, T_FLOAT16 = 10 };
enum { PARALLEL_FOR_VERSION = 17 };

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
    KERNEL_CONTEXT_PARALLEL_FOR = 274, /* API version 17 */
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
static const OrtApi* api17; /* NULL when the runtime is older than API version 17: the products run on one thread */
#define API(index, type) ((type)((void* const*)api)[index])

typedef struct {
    int64_t heads;
    float scale;
} kernel;

static OrtStatus* status(int code, const char* message) {
    return API(CREATE_STATUS, OrtStatus* (*)(int, const char*))(code, message);
}

/* A node attribute, or `fallback` when the node has none (the kernel then refuses the shapes it is given). */
static int64_t attr_int64(const OrtApi* ort, const OrtKernelInfo* info, const char* name, int64_t fallback) {
    int64_t value = fallback;
    OrtStatus* s = ((OrtStatus * (*)(const OrtKernelInfo*, const char*, int64_t*))((void* const*)ort)[KERNEL_INFO_GET_ATTRIBUTE_INT64])(info, name, &value);
    if (s) API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
    return s ? fallback : value;
}

static float attr_float(const OrtApi* ort, const OrtKernelInfo* info, const char* name, float fallback) {
    float value = fallback;
    OrtStatus* s = ((OrtStatus * (*)(const OrtKernelInfo*, const char*, float*))((void* const*)ort)[KERNEL_INFO_GET_ATTRIBUTE_FLOAT])(info, name, &value);
    if (s) API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
    return s ? fallback : value;
}

static void* create_kernel(const OrtCustomOp* op, const OrtApi* ort, const OrtKernelInfo* info) {
    (void)op;
    kernel* kn = malloc(sizeof *kn);
    if (kn == NULL) return NULL;
    kn->heads = attr_int64(ort, info, "heads", 0);
    kn->scale = attr_float(ort, info, "scale", 0.f);
    return kn;
}

static OrtStatus* shape_of(const OrtValue* value, int want_type, int64_t* dims, size_t max_dims, size_t* count) {
    OrtTensorTypeAndShapeInfo* info;
    int type = 0;
    OrtStatus* s = API(GET_TENSOR_TYPE_AND_SHAPE, OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**))(value, &info);
    if (s) return s;
    s = API(GET_TENSOR_ELEMENT_TYPE, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int*))(info, &type);
    if (!s) s = API(GET_DIMENSIONS_COUNT, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*))(info, count);
    if (!s && *count > max_dims) s = status(ORT_INVALID_ARGUMENT, "cosyvoice_lite: an input has too many dimensions");
    if (!s) s = API(GET_DIMENSIONS, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t))(info, dims, *count);
    API(RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, void (*)(OrtTensorTypeAndShapeInfo*))(info);
    if (!s && type != want_type) s = status(ORT_INVALID_ARGUMENT, "cosyvoice_lite: an input has the wrong element type");
    return s;
}

static OrtStatus* data_of(const OrtValue* value, void** data) {
    return API(GET_TENSOR_MUTABLE_DATA, OrtStatus* (*)(OrtValue*, void**))((OrtValue*)value, data);
}

#define MAX_DIMS 8

/* The node's inputs 0 .. count-1: dims, rank and data of each, its element type checked against `types`. Inputs from
 * `required` on are optional: absent ones get rank 0 and data NULL. `missing`: the error for an absent required one. */
static OrtStatus* read_inputs(OrtKernelContext* ctx, const int* types, size_t count, size_t required, const char* missing,
                              int64_t (*dims)[MAX_DIMS], size_t* nd, void** data) {
    for (size_t i = 0; i < count; i++) {
        const OrtValue* value = NULL;
        OrtStatus* s = API(KERNEL_CONTEXT_GET_INPUT, OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**))(ctx, i, &value);
        if (s && i >= required) { /* an absent optional input */
            API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
            s = NULL;
        }
        if (s) return s;
        nd[i] = 0;
        data[i] = NULL;
        if (value == NULL) {
            if (i < required) return status(ORT_INVALID_ARGUMENT, missing);
            continue;
        }
        if ((s = shape_of(value, types[i], dims[i], MAX_DIMS, &nd[i])) || (s = data_of(value, &data[i]))) return s;
    }
    return NULL;
}

static int64_t count_of(const int64_t* dims, size_t nd) {
    int64_t c = 1;
    for (size_t i = 0; i < nd; i++) c *= dims[i];
    return c;
}

/* The KernelCompute of API version 1 (not called: the runtime takes KernelComputeV2, `fn`). */
#define COMPUTE_V1(name, fn)                                  \
    static void name(void* kp, OrtKernelContext* ctx) {       \
        OrtStatus* s = fn(kp, ctx);                           \
        if (s) API(RELEASE_STATUS, void (*)(OrtStatus*))(s);  \
    }

#define ATTENTION_INPUTS 6
static const int attention_types[ATTENTION_INPUTS] = {T_FLOAT, T_FLOAT, T_FLOAT, T_FLOAT16, T_FLOAT16, T_INT64};

static int same3(const int64_t* a, const int64_t* b) { return a[0] == b[0] && a[1] == b[1] && a[2] == b[2]; }

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    int64_t dims[ATTENTION_INPUTS][MAX_DIMS];
    size_t nd[ATTENTION_INPUTS];
    void* p[ATTENTION_INPUTS];
    OrtStatus* s = read_inputs(ctx, attention_types, ATTENTION_INPUTS, ATTENTION_INPUTS, "CachedAttention: an input is missing",
                               dims, nd, p);
    if (s) return s;
    const int64_t* qd = dims[0];
    const int64_t* pd = dims[3];
    int64_t heads = kn->heads;
    if (nd[0] != 3 || nd[1] != 3 || nd[2] != 3 || nd[3] != 4 || nd[4] != 4 || !same3(qd, dims[1]) || !same3(qd, dims[2]) ||
        pd[0] != qd[0] || pd[2] != heads || heads < 1 || pd[2] * pd[3] != qd[2] || dims[4][0] != pd[0] ||
        dims[4][1] != pd[1] || dims[4][2] != pd[2] || dims[4][3] != pd[3] || nd[5] != 1 || dims[5][0] != 1)
        return status(ORT_INVALID_ARGUMENT, "CachedAttention: q, k, v (B,M,H*DK), past_k, past_v (B,C,H,DK), chunk (1,) disagree");
    int64_t chunk = *(const int64_t*)p[5];
    if (chunk < 1) return status(ORT_INVALID_ARGUMENT, "CachedAttention: chunk must be >= 1");
    OrtValue* out;
    s = API(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(ctx, 0, qd, 3, &out);
    if (s) return s;
    void* o;
    if ((s = data_of(out, &o))) return s;
    cvl_attention_shape shape = {(int)qd[0], (int)qd[1], (int)pd[1], (int)heads, (int)pd[3], chunk, kn->scale};
    if (qd[0] == 0 || qd[1] == 0) return NULL;
    if (cvl_cached_attention(&shape, p[0], p[1], p[2], p[3], p[4], o) != 0)
        return status(ORT_FAIL, "CachedAttention: out of memory for the work buffer");
    return NULL;
}

COMPUTE_V1(compute_v1, compute)

static const char* op_name(const OrtCustomOp* op) { (void)op; return "CachedAttention"; }
static const char* cpu_provider(const OrtCustomOp* op) { (void)op; return NULL; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i < ATTENTION_INPUTS ? attention_types[i] : 0; }
static size_t input_count(const OrtCustomOp* op) { (void)op; return ATTENTION_INPUTS; }
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

/* ---- Int8MatMul ---- */

typedef struct {
    int64_t n, window;
} int8_kernel;

static void* int8_create_kernel(const OrtCustomOp* op, const OrtApi* ort, const OrtKernelInfo* info) {
    (void)op;
    int8_kernel* kn = malloc(sizeof *kn);
    if (kn == NULL) return NULL;
    kn->n = attr_int64(ort, info, "n", 0);
    kn->window = attr_int64(ort, info, "window", 1);
    return kn;
}

typedef struct {
    cvl_task_fn task;
    void* task_ctx;
} parallel_call;

static void parallel_trampoline(void* data, size_t i) {
    parallel_call* call = data;
    call->task(call->task_ctx, i);
}

static void parallel_for(void* runner, cvl_task_fn task, void* ctx, size_t tasks) {
    parallel_call call = {task, ctx};
    OrtStatus* s = ((OrtStatus * (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*))(
        (void* const*)api17)[KERNEL_CONTEXT_PARALLEL_FOR])(runner, parallel_trampoline, tasks, 0, &call);
    if (s) { /* the pool refused: do the tasks here */
        API(RELEASE_STATUS, void (*)(OrtStatus*))(s);
        for (size_t i = 0; i < tasks; i++) task(ctx, i);
    }
}

#define INT8_INPUTS 5
static const int int8_types[INT8_INPUTS] = {T_FLOAT, T_INT8, T_INT32, T_FLOAT, T_FLOAT};

static OrtStatus* int8_compute(void* kp, OrtKernelContext* ctx) {
    const int8_kernel* kn = kp;
    int64_t dims[INT8_INPUTS][MAX_DIMS];
    size_t nd[INT8_INPUTS];
    void* p[INT8_INPUTS];
    OrtStatus* s = read_inputs(ctx, int8_types, INT8_INPUTS, 4, "Int8MatMul: an input is missing", dims, nd, p);
    if (s) return s;
    int64_t n = kn->n, rank = (int64_t)nd[0], w = kn->window;
    /* window W > 1: x (..., T, C) frames, each output row a window of W frames (k = W * C), T - W + 1 rows */
    int64_t c = rank > 0 ? dims[0][rank - 1] : 0, k = w * c, panels = (n + 63) / 64;
    if (w < 1 || (w > 1 && rank < 2))
        return status(ORT_INVALID_ARGUMENT, "Int8MatMul: window must be >= 1, and x (..., T, C) with a window");
    int64_t frames = w > 1 ? dims[0][rank - 2] : 1, rows = frames - w + 1 > 0 ? frames - w + 1 : 0;
    int64_t batches = rank > 0 ? count_of(dims[0], (size_t)(rank - (w > 1 ? 2 : 1))) : 0;
    if (n < 1 || rank < 1 || nd[1] != 4 || dims[1][0] != panels || dims[1][1] != (k + 3) / 4 || dims[1][2] != 64 ||
        dims[1][3] != 4 || nd[2] != 1 || dims[2][0] != panels * 64 || count_of(dims[3], nd[3]) != 1 ||
        (p[4] != NULL && (nd[4] != 1 || dims[4][0] != n)))
        return status(ORT_INVALID_ARGUMENT,
                      "Int8MatMul: x (..., K), packed (ceil(n/64), ceil(K/4), 64, 4), colsum (ceil(n/64)*64,), "
                      "w_scale (1,) and bias (n,) disagree");
    int64_t out_dims[MAX_DIMS];
    memcpy(out_dims, dims[0], sizeof(int64_t) * (size_t)rank);
    out_dims[rank - 1] = n;
    if (w > 1) out_dims[rank - 2] = rows;
    OrtValue* out;
    s = API(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(ctx, 0, out_dims, (size_t)rank, &out);
    if (s) return s;
    void* o;
    if ((s = data_of(out, &o))) return s;
    if (rows == 0 || batches == 0) return NULL;
    if (w == 1) {
        rows *= batches; /* every row side by side: one product */
        batches = 1;
    }
    for (int64_t b = 0; b < batches; b++) {
        cvl_int8_problem prob = {.rows = rows, .k = k, .n = n, .x = (const float*)p[0] + b * frames * c,
                                 .packed = p[1], .colsum = p[2], .w_scale = *(const float*)p[3], .bias = p[4],
                                 .y = (float*)o + b * rows * n, .x_stride = w > 1 ? c : 0};
        if (cvl_int8_matmul(&prob, api17 ? parallel_for : NULL, ctx) != 0)
            return status(ORT_FAIL, "Int8MatMul: out of memory for the work buffer");
    }
    return NULL;
}

COMPUTE_V1(int8_compute_v1, int8_compute)

static const char* int8_name(const OrtCustomOp* op) { (void)op; return "Int8MatMul"; }
static int int8_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i < INT8_INPUTS ? int8_types[i] : 0; }
static size_t int8_input_count(const OrtCustomOp* op) { (void)op; return INT8_INPUTS; }
static int int8_input_characteristic(const OrtCustomOp* op, size_t i) { (void)op; return i == 4 ? 1 : 0; } /* 1: optional */

static const OrtCustomOp int8_matmul_op = {
    API_VERSION, int8_create_kernel, int8_name, cpu_provider, int8_input_type, int8_input_count, output_type,
    output_count, int8_compute_v1, destroy_kernel, int8_input_characteristic, required, default_memory, one, one, one,
    one, NULL, int8_compute,
};

/* ---- EstimatorBlock ---- */

typedef struct {
    int64_t heads;
    float scale, eps1, eps3;
} block_kernel;

static void* block_create_kernel(const OrtCustomOp* op, const OrtApi* ort, const OrtKernelInfo* info) {
    (void)op;
    block_kernel* kn = malloc(sizeof *kn);
    if (kn == NULL) return NULL;
    kn->heads = attr_int64(ort, info, "heads", 0);
    kn->scale = attr_float(ort, info, "scale", 0.f);
    kn->eps1 = attr_float(ort, info, "eps1", 1e-5f);
    kn->eps3 = attr_float(ort, info, "eps3", 1e-5f);
    return kn;
}

#define BLOCK_INPUTS 23
enum { B_X, B_PK, B_PV, B_CHUNK, B_LN1W, B_LN1B, B_QKV, B_OUT = 9, B_LN3W = 13, B_LN3B, B_FF1, B_FF2 = 19 };
static const int block_types[BLOCK_INPUTS] = {
    T_FLOAT, T_FLOAT16, T_FLOAT16, T_INT64, T_FLOAT, T_FLOAT,                  /* x, past_k, past_v, chunk, ln1 */
    T_INT8, T_INT32, T_FLOAT,                                                  /* qkv */
    T_INT8, T_INT32, T_FLOAT, T_FLOAT,                                         /* out */
    T_FLOAT, T_FLOAT,                                                          /* ln3 */
    T_INT8, T_INT32, T_FLOAT, T_FLOAT,                                         /* ff1 */
    T_INT8, T_INT32, T_FLOAT, T_FLOAT,                                         /* ff2 */
};

/* Whether inputs first.. (packed, colsum, scales[, bias]) hold a k -> n weight; fills `w`. */
static int block_weight(int64_t (*dims)[MAX_DIMS], const size_t* nd, void* const* p, int first, int64_t k, int64_t n,
                        int with_bias, cvl_int8_weight* w) {
    const int64_t panels = (n + 63) / 64;
    const int64_t* pd = dims[first];
    if (n < 1 || nd[first] != 4 || pd[0] != panels || pd[1] != (k + 3) / 4 || pd[2] != 64 || pd[3] != 4) return 0;
    if (nd[first + 1] != 1 || dims[first + 1][0] != panels * 64) return 0;
    int64_t scales = count_of(dims[first + 2], nd[first + 2]);
    if (scales != 1 && scales != n) return 0;
    if (with_bias && count_of(dims[first + 3], nd[first + 3]) != n) return 0;
    *w = (cvl_int8_weight){n, p[first], p[first + 1], p[first + 2], scales, with_bias ? p[first + 3] : NULL};
    return 1;
}

static OrtStatus* block_compute(void* kp, OrtKernelContext* ctx) {
    const block_kernel* kn = kp;
    int64_t dims[BLOCK_INPUTS][MAX_DIMS];
    size_t nd[BLOCK_INPUTS];
    void* p[BLOCK_INPUTS];
    OrtStatus* s = read_inputs(ctx, block_types, BLOCK_INPUTS, BLOCK_INPUTS, "EstimatorBlock: an input is missing", dims, nd, p);
    if (s) return s;
    const int64_t* xd = dims[B_X];
    const int64_t* kd = dims[B_PK];
    const int64_t heads = kn->heads, D = nd[B_X] == 3 ? xd[2] : 0;
    const int64_t HD = nd[B_PK] == 4 ? kd[2] * kd[3] : 0, F = count_of(dims[B_FF1 + 3], nd[B_FF1 + 3]);
    cvl_block_problem b = {0};
    int ok = nd[B_X] == 3 && nd[B_PK] == 4 && nd[B_PV] == 4 && kd[0] == xd[0] && kd[2] == heads && heads >= 1 &&
             memcmp(dims[B_PV], kd, 4 * sizeof(int64_t)) == 0 && count_of(dims[B_CHUNK], nd[B_CHUNK]) == 1 &&
             count_of(dims[B_LN1W], nd[B_LN1W]) == D && count_of(dims[B_LN1B], nd[B_LN1B]) == D &&
             count_of(dims[B_LN3W], nd[B_LN3W]) == D && count_of(dims[B_LN3B], nd[B_LN3B]) == D && D >= 1;
    ok = ok && block_weight(dims, nd, p, B_QKV, D, 3 * HD, 0, &b.qkv) && block_weight(dims, nd, p, B_OUT, HD, D, 1, &b.out) &&
         block_weight(dims, nd, p, B_FF1, D, F, 1, &b.ff1) && block_weight(dims, nd, p, B_FF2, F, D, 1, &b.ff2);
    if (!ok)
        return status(ORT_INVALID_ARGUMENT,
                      "EstimatorBlock: x (B,M,D), past_k, past_v (B,C,H,DK), chunk (1,), the LayerNorms (D,) and the "
                      "q|k|v, out, ff1 and ff2 weights disagree");
    const int64_t chunk = *(const int64_t*)p[B_CHUNK];
    if (chunk < 1) return status(ORT_INVALID_ARGUMENT, "EstimatorBlock: chunk must be >= 1");
    OrtValue* out[3];
    void* o[3];
    const int64_t y_dims[3] = {xd[0], xd[1], D}, kv_dims[5] = {1, xd[0], xd[1], heads, kd[3]};
    for (size_t i = 0; i < 3; i++) {
        s = API(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(ctx, i, i ? kv_dims : y_dims, i ? 5 : 3, &out[i]);
        if (!s) s = data_of(out[i], &o[i]);
        if (s) return s;
    }
    b.batch = xd[0];
    b.frames = xd[1];
    b.cached = kd[1];
    b.dim = D;
    b.heads = heads;
    b.head_dim = kd[3];
    b.ff = F;
    b.chunk = chunk;
    b.scale = kn->scale;
    b.eps1 = kn->eps1;
    b.eps3 = kn->eps3;
    b.x = p[B_X];
    b.past_k = p[B_PK];
    b.past_v = p[B_PV];
    b.ln1_w = p[B_LN1W];
    b.ln1_b = p[B_LN1B];
    b.ln3_w = p[B_LN3W];
    b.ln3_b = p[B_LN3B];
    b.y = o[0];
    b.k = o[1];
    b.v = o[2];
    if (cvl_estimator_block(&b, api17 ? parallel_for : NULL, ctx) != 0)
        return status(ORT_FAIL, "EstimatorBlock: out of memory for the work buffers");
    return NULL;
}

COMPUTE_V1(block_compute_v1, block_compute)

static const char* block_name(const OrtCustomOp* op) { (void)op; return "EstimatorBlock"; }
static int block_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i < BLOCK_INPUTS ? block_types[i] : 0; }
static size_t block_input_count(const OrtCustomOp* op) { (void)op; return BLOCK_INPUTS; }
static size_t three(const OrtCustomOp* op) { (void)op; return 3; }
static int block_output_type(const OrtCustomOp* op, size_t i) { (void)op; return i ? T_FLOAT16 : T_FLOAT; }

static const OrtCustomOp estimator_block_op = {
    API_VERSION, block_create_kernel, block_name, cpu_provider, block_input_type, block_input_count, block_output_type,
    three, block_compute_v1, destroy_kernel, required, required, default_memory, one, one, one, one, NULL,
    block_compute,
};

/* ---- Qwen2Layer ---- */

typedef struct {
    int64_t heads, ff;
    float scale, eps;
} qwen2_kernel;

static void* qwen2_create_kernel(const OrtCustomOp* op, const OrtApi* ort, const OrtKernelInfo* info) {
    (void)op;
    qwen2_kernel* kn = malloc(sizeof *kn);
    if (kn == NULL) return NULL;
    kn->heads = attr_int64(ort, info, "heads", 0);
    kn->ff = attr_int64(ort, info, "ff", 0);
    kn->scale = attr_float(ort, info, "scale", 0.f);
    kn->eps = attr_float(ort, info, "eps", 1e-6f);
    return kn;
}

#define QWEN2_INPUTS 32
enum { Q_X, Q_PK, Q_PV, Q_MASK, Q_COS, Q_SIN, Q_RMS1, Q_Q, Q_K = 11, Q_V = 15, Q_O = 19, Q_RMS2 = 22, Q_GATE, Q_UP = 26,
       Q_DOWN = 29 };
static const int qwen2_types[QWEN2_INPUTS] = {
    T_FLOAT, T_FLOAT16, T_FLOAT16, T_FLOAT, T_FLOAT, T_FLOAT, T_FLOAT, /* x, past_k, past_v, mask, cos, sin, rms1 */
    T_INT8, T_INT32, T_FLOAT, T_FLOAT,                                 /* q */
    T_INT8, T_INT32, T_FLOAT, T_FLOAT,                                 /* k */
    T_INT8, T_INT32, T_FLOAT, T_FLOAT,                                 /* v */
    T_INT8, T_INT32, T_FLOAT,                                          /* o */
    T_FLOAT,                                                           /* rms2 */
    T_INT8, T_INT32, T_FLOAT, T_INT8, T_INT32, T_FLOAT, T_INT8, T_INT32, T_FLOAT, /* gate, up, down */
};

static int same_dims(const int64_t* a, const int64_t* b, size_t n) { return memcmp(a, b, n * sizeof(int64_t)) == 0; }

static OrtStatus* qwen2_compute(void* kp, OrtKernelContext* ctx) {
    const qwen2_kernel* kn = kp;
    int64_t dims[QWEN2_INPUTS][MAX_DIMS];
    size_t nd[QWEN2_INPUTS];
    void* p[QWEN2_INPUTS];
    OrtStatus* s = read_inputs(ctx, qwen2_types, QWEN2_INPUTS, QWEN2_INPUTS, "Qwen2Layer: an input is missing", dims, nd, p);
    if (s) return s;
    const int64_t* xd = dims[Q_X];
    const int64_t* kd = dims[Q_PK];
    const int64_t D = nd[Q_X] == 3 ? xd[2] : 0, heads = kn->heads, kvh = nd[Q_PK] == 4 ? kd[1] : 0;
    const int64_t dk = nd[Q_PK] == 4 ? kd[3] : 0, F = kn->ff;
    cvl_qwen2_problem q = {0};
    int ok = nd[Q_X] == 3 && nd[Q_PK] == 4 && nd[Q_PV] == 4 && same_dims(dims[Q_PV], kd, 4) && kd[0] == xd[0] && D >= 1 &&
             heads >= 1 && kvh >= 1 && heads % kvh == 0 && dk >= 2 && dk % 2 == 0 && dk <= 1024 && nd[Q_MASK] == 4 &&
             dims[Q_MASK][0] == xd[0] && dims[Q_MASK][1] == 1 && dims[Q_MASK][2] == xd[1] && dims[Q_MASK][3] == kd[2] + xd[1] &&
             nd[Q_COS] == 4 && dims[Q_COS][0] == xd[0] && dims[Q_COS][1] == 1 && dims[Q_COS][2] == xd[1] &&
             dims[Q_COS][3] == dk && nd[Q_SIN] == 4 && same_dims(dims[Q_SIN], dims[Q_COS], 4) &&
             count_of(dims[Q_RMS1], nd[Q_RMS1]) == D && count_of(dims[Q_RMS2], nd[Q_RMS2]) == D;
    ok = ok && block_weight(dims, nd, p, Q_Q, D, heads * dk, 1, &q.q) && block_weight(dims, nd, p, Q_K, D, kvh * dk, 1, &q.k) &&
         block_weight(dims, nd, p, Q_V, D, kvh * dk, 1, &q.v) && block_weight(dims, nd, p, Q_O, heads * dk, D, 0, &q.o) &&
         block_weight(dims, nd, p, Q_GATE, D, F, 0, &q.gate) && block_weight(dims, nd, p, Q_UP, D, F, 0, &q.up) &&
         block_weight(dims, nd, p, Q_DOWN, F, D, 0, &q.down);
    if (!ok)
        return status(ORT_INVALID_ARGUMENT,
                      "Qwen2Layer: x (B,T,D), past_k, past_v (B,KVH,C,DK), mask (B,1,T,C+T), cos, sin (B,1,T,DK), the "
                      "RMSNorm weights (D,) and the q, k, v, o, gate, up and down weights disagree");
    OrtValue* out[3];
    void* o[3];
    const int64_t y_dims[3] = {xd[0], xd[1], D}, kv_dims[4] = {xd[0], kvh, xd[1], dk};
    for (size_t i = 0; i < 3; i++) {
        s = API(KERNEL_CONTEXT_GET_OUTPUT, OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**))(ctx, i, i ? kv_dims : y_dims, i ? 4 : 3, &out[i]);
        if (!s) s = data_of(out[i], &o[i]);
        if (s) return s;
    }
    q.batch = xd[0];
    q.steps = xd[1];
    q.cached = kd[2];
    q.dim = D;
    q.heads = heads;
    q.kv_heads = kvh;
    q.head_dim = dk;
    q.ff = F;
    q.scale = kn->scale;
    q.eps = kn->eps;
    q.x = p[Q_X];
    q.past_k = p[Q_PK];
    q.past_v = p[Q_PV];
    q.mask = p[Q_MASK];
    q.cos = p[Q_COS];
    q.sin = p[Q_SIN];
    q.rms1_w = p[Q_RMS1];
    q.rms2_w = p[Q_RMS2];
    q.y = o[0];
    q.k_out = o[1];
    q.v_out = o[2];
    if (cvl_qwen2_layer(&q, api17 ? parallel_for : NULL, ctx) != 0)
        return status(ORT_FAIL, "Qwen2Layer: out of memory for the work buffers");
    return NULL;
}

COMPUTE_V1(qwen2_compute_v1, qwen2_compute)

static const char* qwen2_name(const OrtCustomOp* op) { (void)op; return "Qwen2Layer"; }
static int qwen2_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i < QWEN2_INPUTS ? qwen2_types[i] : 0; }
static size_t qwen2_input_count(const OrtCustomOp* op) { (void)op; return QWEN2_INPUTS; }

static const OrtCustomOp qwen2_layer_op = {
    API_VERSION, qwen2_create_kernel, qwen2_name, cpu_provider, qwen2_input_type, qwen2_input_count, output_type,
    three, qwen2_compute_v1, destroy_kernel, required, required, default_memory, one, one, one, one, NULL,
    qwen2_compute,
};

OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    api = base->GetApi(API_VERSION);
    if (api == NULL) return NULL; /* cannot even report it: the runtime is older than API 16 (ONNX Runtime 1.16) */
    OrtCustomOpDomain* domain;
    OrtStatus* s = API(CREATE_CUSTOM_OP_DOMAIN, OrtStatus* (*)(const char*, OrtCustomOpDomain**))("cosyvoice_lite", &domain);
    api17 = base->GetApi(PARALLEL_FOR_VERSION);
    if (!s) s = API(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*))(domain, &cached_attention_op);
    if (!s) s = API(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*))(domain, &int8_matmul_op);
    if (!s) s = API(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*))(domain, &estimator_block_op);
    if (!s) s = API(CUSTOM_OP_DOMAIN_ADD, OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*))(domain, &qwen2_layer_op);
    if (!s) s = API(ADD_CUSTOM_OP_DOMAIN, OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*))(options, domain);
    return s;
}
