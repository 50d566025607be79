/* cosyvoice_lite.CachedAttention: cvl_cached_attention (cached_attention.h) as an ONNX Runtime custom operator.
 * Inputs: q, k, v (B, M, H*DK) float32; past_k, past_v (B, C, H, DK) float16; chunk (1,) int64. Output: (B, M, H*DK)
 * float32. Attributes: heads (int), scale (float). Older estimator twins hold it (newer ones: EstimatorBlock). */

#include "cached_attention.h"
#include "op.h"
#include "ort_kernel.h"

typedef struct {
    cvl_kernel_base base;
    int64_t heads;
    float scale;
} kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    OrtStatus* s = cvl_kernel_new(sizeof(kernel), api, info, "CachedAttention", out);
    if (s) return s;
    kernel* kn = *out;
    kn->heads = cvl_attr_int64(&kn->base.ort, info, "heads", 0);
    kn->scale = cvl_attr_float(&kn->base.ort, info, "scale", 0.f);
    return NULL;
}

#define INPUTS 6
static const int types[INPUTS] = {CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT16, CVL_T_FLOAT16, CVL_T_INT64};

static int same3(const int64_t* a, const int64_t* b) { return a[0] == b[0] && a[1] == b[1] && a[2] == b[2]; }

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, INPUTS, "CachedAttention: an input is missing", t);
    if (s) return s;
    const int64_t* qd = t[0].dims;
    const int64_t* pd = t[3].dims;
    const int64_t heads = kn->heads;
    if (t[0].rank != 3 || t[1].rank != 3 || t[2].rank != 3 || t[3].rank != 4 || t[4].rank != 4 || !same3(qd, t[1].dims) ||
        !same3(qd, t[2].dims) || pd[0] != qd[0] || pd[2] != heads || heads < 1 || pd[2] * pd[3] != qd[2] ||
        t[4].dims[0] != pd[0] || t[4].dims[1] != pd[1] || t[4].dims[2] != pd[2] || t[4].dims[3] != pd[3] ||
        t[5].rank != 1 || t[5].dims[0] != 1)
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "CachedAttention: q, k, v (B,M,H*DK), past_k, past_v (B,C,H,DK), chunk (1,) disagree");
    const int64_t chunk = *(const int64_t*)t[5].data;
    if (chunk < 1) return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "CachedAttention: chunk must be >= 1");
    void* o;
    if ((s = cvl_output(ort, ctx, 0, qd, 3, &o))) return s;
    cvl_attention_shape shape = {(int)qd[0], (int)qd[1], (int)pd[1], (int)heads, (int)pd[3], chunk, kn->scale};
    if (qd[0] == 0 || qd[1] == 0) return NULL;
    if (cvl_cached_attention(&shape, kn->base.have, t[0].data, t[1].data, t[2].data, t[3].data, t[4].data, o) != 0)
        return cvl_status(ort, CVL_ORT_FAIL, "CachedAttention: out of memory for the work buffer");
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[1] = {CVL_T_FLOAT};
static const cvl_op_glue glue =
    CVL_OP_GLUE("CachedAttention", types, INPUTS, INPUTS, output_types, 1, create_v1, compute_v1, create, compute);
static const cvl_op cached_attention = {"CachedAttention", &cvl_cached_attention_variants, &glue.ort};
CVL_REGISTER_OP(cached_attention);
