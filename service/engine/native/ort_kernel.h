/* What every operator's ONNX Runtime glue shares: its kernel's options, reading inputs, making outputs, errors, and the
 * session's intra-op threads as the kernels' `parallel` (exec.h). */
#ifndef COSYVOICE_LITE_ORT_KERNEL_H
#define COSYVOICE_LITE_ORT_KERNEL_H

#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "int8_matmul.h"
#include "ort_api.h"

/* The session config entry that sets the kernels' ISA ceiling: "auto" (the default), "no-amx" or "portable"
 * (cpu.h; service/engine/native.py sets it from TTS_NATIVE_KERNELS). Read when a kernel is created. */
#define CVL_KERNELS_CONFIG_KEY "cosyvoice_lite.kernels"

/* The start of every kernel: the runtime's entries and the features its calls may use. */
typedef struct {
    cvl_ort ort;
    cvl_features have;
} cvl_kernel_base;

/* A new zeroed kernel of `bytes` (a struct starting with cvl_kernel_base) for operator `op`, its base filled, in *out:
 * NULL, or an error status (out of memory, an unknown ceiling in the session config) and *out NULL. */
OrtStatus* cvl_kernel_new(size_t bytes, const OrtApi* api, const OrtKernelInfo* info, const char* op, void** out);

/* A node attribute, or `fallback` when the node has none (the kernel then refuses the shapes it is given). */
int64_t cvl_attr_int64(const cvl_ort* ort, const OrtKernelInfo* info, const char* name, int64_t fallback);
float cvl_attr_float(const cvl_ort* ort, const OrtKernelInfo* info, const char* name, float fallback);

#define CVL_MAX_DIMS 8

/* One input: its dims, rank and data (rank 0 and data NULL for an absent optional input). */
typedef struct {
    int64_t dims[CVL_MAX_DIMS];
    size_t rank;
    void* data;
    int type; /* its element type (CVL_T_*) */
} cvl_tensor;

/* The node's inputs 0 .. count-1 into `t`, each element type checked against `types` (except CVL_T_ANY's). Inputs from `required` on are
 * optional. `missing`: the error for an absent required one. */
OrtStatus* cvl_read_inputs(const cvl_ort* ort, OrtKernelContext* ctx, const int* types, size_t count, size_t required,
                           const char* missing, cvl_tensor* t);

/* Output `index` of shape dims[0 .. rank-1] and its data. */
OrtStatus* cvl_output(const cvl_ort* ort, OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t rank,
                      void** data);

OrtStatus* cvl_status(const cvl_ort* ort, int code, const char* message);

int64_t cvl_count(const int64_t* dims, size_t rank);

/* How many tasks a decode step's products split into, from an optional (1,) int64 `spread` input (absent: 1). */
int cvl_spread_of(const cvl_tensor* spread);

/* The session's intra-op threads as a kernel's `parallel`: a runner lives on the stack of one compute call. */
typedef struct {
    const cvl_ort* ort;
    OrtKernelContext* ctx;
} cvl_ort_runner;

cvl_exec cvl_kernel_exec(const cvl_kernel_base* kb, cvl_ort_runner* runner, OrtKernelContext* ctx, int spread);

/* Whether inputs first.. (packed, colsum, scales[, bias]) hold a k -> n weight as Int8MatMul takes it; fills `w`. */
int cvl_weight_input(const cvl_tensor* t, int first, int64_t k, int64_t n, int with_bias, cvl_int8_weight* w);

/* The OrtCustomOp members every operator shares. */
const char* cvl_cpu_provider(const OrtCustomOp* op);
int cvl_all_required(const OrtCustomOp* op, size_t i);
int cvl_default_memory(const OrtCustomOp* op, size_t i);
int cvl_one(const OrtCustomOp* op);
void cvl_kernel_destroy(void* kernel);

/* What ONNX Runtime asks of an operator besides its kernel: its name, its inputs' types (those from `required` on
 * optional) and its outputs' types. The OrtCustomOp comes first, so the shared callbacks below read the rest from the
 * pointer the runtime passes them; an operator file declares one with CVL_OP_GLUE and registers &glue.ort. */
typedef struct {
    OrtCustomOp ort;
    const char* name;
    const int* input_types;
    size_t inputs, required;
    const int* output_types;
    size_t outputs;
} cvl_op_glue;

const char* cvl_glue_name(const OrtCustomOp* op);
int cvl_glue_input_type(const OrtCustomOp* op, size_t i);
size_t cvl_glue_input_count(const OrtCustomOp* op);
int cvl_glue_input_characteristic(const OrtCustomOp* op, size_t i);
int cvl_glue_output_type(const OrtCustomOp* op, size_t i);
size_t cvl_glue_output_count(const OrtCustomOp* op);

/* The glue of operator `name`: `inputs` inputs typed by `in_types` (required up to `required`), `outputs` outputs
 * typed by `out_types`, its kernel's CreateKernelV2/KernelComputeV2 and their version-1 wrappers (CVL_CREATE_V1,
 * CVL_COMPUTE_V1). */
#define CVL_OP_GLUE(name, in_types, inputs, required, out_types, outputs, create_v1, compute_v1, create, compute) \
    {{CVL_ORT_CUSTOM_OP_VERSION, create_v1, cvl_glue_name, cvl_cpu_provider, cvl_glue_input_type,                     \
      cvl_glue_input_count, cvl_glue_output_type, cvl_glue_output_count, compute_v1, cvl_kernel_destroy,              \
      cvl_glue_input_characteristic, cvl_all_required, cvl_default_memory, cvl_one, cvl_one, cvl_one, cvl_one, create, \
      compute},                                                                                                        \
     name, in_types, inputs, required, out_types, outputs}

/* The API version 1 KernelCompute of `name` calling `fn` (not called: the runtime takes KernelComputeV2). */
#define CVL_COMPUTE_V1(name, fn)                                          \
    static void name(void* kp, OrtKernelContext* ctx) {                   \
        OrtStatus* s = fn(kp, ctx);                                       \
        if (s) ((const cvl_kernel_base*)kp)->ort.ReleaseStatus(s);        \
    }

/* The API version 1 CreateKernel of a kernel made by CreateKernelV2 `create_v2` (not called either). */
#define CVL_CREATE_V1(name, create_v2)                                                           \
    static void* name(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {     \
        void* kernel = NULL;                                                                     \
        OrtStatus* s = create_v2(op, api, info, &kernel);                                        \
        if (s) {                                                                                 \
            cvl_ort ort;                                                                         \
            cvl_ort_fill(api, &ort);                                                             \
            ort.ReleaseStatus(s);                                                                \
        }                                                                                        \
        return kernel;                                                                           \
    }

#endif
