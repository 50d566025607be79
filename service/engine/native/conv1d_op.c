/* cosyvoice_lite.BF16Conv1d: cvl_conv1d (conv1d.h) as an ONNX Runtime custom operator, the twin of an ONNX Conv on
 * (B, C, T) with stride 1.
 * Inputs: x (B, C_in, T) float32; packed (taps, ceil(C_in / 2), C_out) int32: W's bf16 pairs (cvl_conv1d_pack,
 * export/fuse_ops.py); bias (C_out,) float32, optional; alpha and inv_alpha (C_in,) float32, optional together: a
 * Snake activation of x first (the one before each HiFT resblock convolution). Output (B, C_out, T + pads - dilation *
 * (taps - 1)) float32. Attributes: dilation (default 1), pad_left, pad_right (default 0), group (default 1: with G, packed
 * is (taps, C_in / G / 2, C_out), C_in / G even). Its work is shared out over the session's intra-op threads. */

#include "conv1d.h"
#include "op.h"
#include "ort_kernel.h"

typedef struct {
    cvl_kernel_base base;
    int64_t dilation, pad_left, pad_right, group;
} kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    OrtStatus* s = cvl_kernel_new(sizeof(kernel), api, info, "BF16Conv1d", out);
    if (s) return s;
    kernel* kn = *out;
    kn->dilation = cvl_attr_int64(&kn->base.ort, info, "dilation", 1);
    kn->pad_left = cvl_attr_int64(&kn->base.ort, info, "pad_left", 0);
    kn->pad_right = cvl_attr_int64(&kn->base.ort, info, "pad_right", 0);
    kn->group = cvl_attr_int64(&kn->base.ort, info, "group", 1);
    return NULL;
}

enum { X, PACKED, BIAS, ALPHA, INV_ALPHA, INPUTS };
static const int types[INPUTS] = {CVL_T_FLOAT, CVL_T_INT32, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT};

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, BIAS, "BF16Conv1d: an input is missing", t);
    if (s) return s;
    const int64_t* xd = t[X].dims;
    const int64_t* wd = t[PACKED].dims;
    const int64_t g = kn->group;
    if (g < 1) return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "BF16Conv1d: group must be >= 1");
    if (t[X].rank != 3 || t[PACKED].rank != 3 || wd[0] < 1 || wd[1] != (xd[1] / g + 1) / 2 || wd[2] < 1 ||
        (t[BIAS].data != NULL && (t[BIAS].rank != 1 || t[BIAS].dims[0] != wd[2])))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "BF16Conv1d: x (B, C_in, T), packed (taps, ceil(C_in/group/2), C_out) and bias (C_out,) disagree");
    const int snake = t[ALPHA].data != NULL;
    if (snake != (t[INV_ALPHA].data != NULL) ||
        (snake && (t[ALPHA].rank != 1 || t[ALPHA].dims[0] != xd[1] || t[INV_ALPHA].rank != 1 || t[INV_ALPHA].dims[0] != xd[1])))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "BF16Conv1d: alpha and inv_alpha come together, (C_in,) each");
    if (kn->dilation < 1 || kn->pad_left < 0 || kn->pad_right < 0)
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "BF16Conv1d: dilation must be >= 1 and pads >= 0");
    cvl_conv1d_problem prob = {.batch = xd[0], .c_in = xd[1], .c_out = wd[2], .t_in = xd[2], .taps = wd[0],
                               .dilation = kn->dilation, .pad_left = kn->pad_left, .pad_right = kn->pad_right,
                               .x = t[X].data, .packed = t[PACKED].data, .bias = t[BIAS].data,
                               .alpha = t[ALPHA].data, .inv_alpha = t[INV_ALPHA].data, .groups = g};
    const int64_t t_out = cvl_conv1d_out_len(&prob);
    if (t_out < 0)
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "BF16Conv1d: the input is shorter than the kernel's reach");
    const int64_t out_dims[3] = {xd[0], wd[2], t_out};
    void* o;
    if ((s = cvl_output(ort, ctx, 0, out_dims, 3, &o))) return s;
    prob.y = o;
    cvl_ort_runner runner;
    const cvl_exec ex = cvl_kernel_exec(&kn->base, &runner, ctx, 1);
    const int done = cvl_conv1d(&prob, &ex);
    if (done == -2)
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "BF16Conv1d: group must divide C_in and C_out, with an even C_in / group");
    if (done != 0) return cvl_status(ort, CVL_ORT_FAIL, "BF16Conv1d: out of memory for the work buffer");
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[1] = {CVL_T_FLOAT};
static const cvl_op_glue glue =
    CVL_OP_GLUE("BF16Conv1d", types, INPUTS, BIAS, output_types, 1, create_v1, compute_v1, create, compute);
static const cvl_op conv1d = {"BF16Conv1d", &cvl_conv1d_variants, &glue.ort};
CVL_REGISTER_OP(conv1d);
