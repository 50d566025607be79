/* The operators' shared ONNX Runtime glue (ort_kernel.h). */

#include "ort_kernel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

OrtStatus* cvl_status(const cvl_ort* ort, int code, const char* message) { return ort->CreateStatus(code, message); }

/* The ceiling the session's config entries ask for (CVL_KERNELS_CONFIG_KEY; absent: auto), or -1. */
static int ceiling_of(const cvl_ort* ort, const OrtKernelInfo* info, const char** value) {
    OrtKeyValuePairs* entries = NULL;
    OrtStatus* s = ort->KernelInfo_GetConfigEntries(info, &entries);
    if (s) {
        ort->ReleaseStatus(s);
        return -1;
    }
    const char* found = ort->GetKeyValue(entries, CVL_KERNELS_CONFIG_KEY);
    const int ceiling = found == NULL ? CVL_ISA_AUTO : cvl_isa_parse(found);
    *value = found != NULL && ceiling < 0 ? "an unknown value" : found;
    ort->ReleaseKeyValuePairs(entries);
    return ceiling;
}

OrtStatus* cvl_kernel_new(size_t bytes, const OrtApi* api, const OrtKernelInfo* info, const char* op, void** out) {
    *out = NULL;
    cvl_ort ort;
    cvl_ort_fill(api, &ort);
    const char* value = NULL;
    const int ceiling = ceiling_of(&ort, info, &value);
    char message[200];
    if (ceiling < 0) {
        snprintf(message, sizeof message, "%s: session config %s is %s: expected auto, no-amx or portable", op,
                 CVL_KERNELS_CONFIG_KEY, value != NULL ? value : "unreadable");
        return cvl_status(&ort, CVL_ORT_INVALID_ARGUMENT, message);
    }
    cvl_kernel_base* kb = calloc(1, bytes);
    if (kb == NULL) {
        snprintf(message, sizeof message, "%s: out of memory for the kernel", op);
        return cvl_status(&ort, CVL_ORT_FAIL, message);
    }
    kb->ort = ort;
    kb->have = cvl_isa_features((cvl_isa)ceiling);
    *out = kb;
    return NULL;
}

int64_t cvl_attr_int64(const cvl_ort* ort, const OrtKernelInfo* info, const char* name, int64_t fallback) {
    int64_t value = fallback;
    OrtStatus* s = ort->KernelInfoGetAttribute_int64(info, name, &value);
    if (s) ort->ReleaseStatus(s);
    return s ? fallback : value;
}

float cvl_attr_float(const cvl_ort* ort, const OrtKernelInfo* info, const char* name, float fallback) {
    float value = fallback;
    OrtStatus* s = ort->KernelInfoGetAttribute_float(info, name, &value);
    if (s) ort->ReleaseStatus(s);
    return s ? fallback : value;
}

static OrtStatus* shape_of(const cvl_ort* ort, const OrtValue* value, int want_type, cvl_tensor* t) {
    OrtTensorTypeAndShapeInfo* info;
    int type = 0;
    OrtStatus* s = ort->GetTensorTypeAndShape(value, &info);
    if (s) return s;
    s = ort->GetTensorElementType(info, &type);
    if (!s) s = ort->GetDimensionsCount(info, &t->rank);
    if (!s && t->rank > CVL_MAX_DIMS)
        s = cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "cosyvoice_lite: an input has too many dimensions");
    if (!s) s = ort->GetDimensions(info, t->dims, t->rank);
    ort->ReleaseTensorTypeAndShapeInfo(info);
    t->type = type;
    if (!s && want_type != CVL_T_ANY && type != want_type)
        s = cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "cosyvoice_lite: an input has the wrong element type");
    return s;
}

OrtStatus* cvl_read_inputs(const cvl_ort* ort, OrtKernelContext* ctx, const int* types, size_t count, size_t required,
                           const char* missing, cvl_tensor* t) {
    for (size_t i = 0; i < count; i++) {
        const OrtValue* value = NULL;
        OrtStatus* s = ort->KernelContext_GetInput(ctx, i, &value);
        if (s && i >= required) { /* an absent optional input */
            ort->ReleaseStatus(s);
            s = NULL;
        }
        if (s) return s;
        t[i].rank = 0;
        t[i].data = NULL;
        t[i].type = CVL_T_ANY;
        if (value == NULL) {
            if (i < required) return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, missing);
            continue;
        }
        if ((s = shape_of(ort, value, types[i], &t[i])) || (s = ort->GetTensorMutableData((OrtValue*)value, &t[i].data)))
            return s;
    }
    return NULL;
}

OrtStatus* cvl_output(const cvl_ort* ort, OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t rank,
                      void** data) {
    OrtValue* out;
    OrtStatus* s = ort->KernelContext_GetOutput(ctx, index, dims, rank, &out);
    return s ? s : ort->GetTensorMutableData(out, data);
}

int64_t cvl_count(const int64_t* dims, size_t rank) {
    int64_t c = 1;
    for (size_t i = 0; i < rank; i++) c *= dims[i];
    return c;
}

int cvl_spread_of(const cvl_tensor* spread) {
    if (spread->data == NULL || cvl_count(spread->dims, spread->rank) != 1) return 1;
    const int64_t tasks = *(const int64_t*)spread->data;
    return tasks < 1 ? 1 : (tasks > CVL_MAX_SPREAD ? CVL_MAX_SPREAD : (int)tasks);
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
    const cvl_ort_runner* r = runner;
    parallel_call call = {task, ctx};
    OrtStatus* s = r->ort->KernelContext_ParallelFor(r->ctx, parallel_trampoline, tasks, 0, &call);
    if (s) { /* the pool refused: do the tasks here */
        r->ort->ReleaseStatus(s);
        for (size_t i = 0; i < tasks; i++) task(ctx, i);
    }
}

cvl_exec cvl_kernel_exec(const cvl_kernel_base* kb, cvl_ort_runner* runner, OrtKernelContext* ctx, int spread) {
    *runner = (cvl_ort_runner){&kb->ort, ctx};
    return (cvl_exec){.have = kb->have, .spread = spread, .parallel = parallel_for, .runner = runner};
}

int cvl_weight_input(const cvl_tensor* t, int first, int64_t k, int64_t n, int with_bias, cvl_int8_weight* w) {
    const int64_t panels = (n + 63) / 64;
    const cvl_tensor* packed = &t[first];
    const int64_t* pd = packed->dims;
    if (n < 1 || packed->rank != 4 || pd[0] != panels || pd[1] != (k + 3) / 4 || pd[2] != 64 || pd[3] != 4) return 0;
    if (t[first + 1].rank != 1 || t[first + 1].dims[0] != panels * 64) return 0;
    const int64_t scales = cvl_count(t[first + 2].dims, t[first + 2].rank);
    if (scales != 1 && scales != n) return 0;
    if (with_bias && cvl_count(t[first + 3].dims, t[first + 3].rank) != n) return 0;
    *w = (cvl_int8_weight){n, packed->data, t[first + 1].data, t[first + 2].data, scales,
                           with_bias ? t[first + 3].data : NULL};
    return 1;
}

const char* cvl_cpu_provider(const OrtCustomOp* op) {
    (void)op;
    return NULL;
}

int cvl_all_required(const OrtCustomOp* op, size_t i) {
    (void)op;
    (void)i;
    return 0;
}

int cvl_default_memory(const OrtCustomOp* op, size_t i) {
    (void)op;
    (void)i;
    return 0;
}

int cvl_one(const OrtCustomOp* op) {
    (void)op;
    return 1;
}

/* The glue around `op` (cvl_op_glue starts with its OrtCustomOp). */
static const cvl_op_glue* glue_of(const OrtCustomOp* op) { return (const cvl_op_glue*)op; }

const char* cvl_glue_name(const OrtCustomOp* op) { return glue_of(op)->name; }

int cvl_glue_input_type(const OrtCustomOp* op, size_t i) {
    const cvl_op_glue* g = glue_of(op);
    return i < g->inputs ? g->input_types[i] : 0;
}

size_t cvl_glue_input_count(const OrtCustomOp* op) { return glue_of(op)->inputs; }

int cvl_glue_input_characteristic(const OrtCustomOp* op, size_t i) {
    return i >= glue_of(op)->required ? 1 : 0; /* 1: optional */
}

int cvl_glue_output_type(const OrtCustomOp* op, size_t i) {
    const cvl_op_glue* g = glue_of(op);
    return i < g->outputs ? g->output_types[i] : 0;
}

size_t cvl_glue_output_count(const OrtCustomOp* op) { return glue_of(op)->outputs; }

void cvl_kernel_destroy(void* kernel) { free(kernel); }
