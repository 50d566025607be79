/* cosyvoice_lite.Int8MatMul: cvl_int8_matmul (int8_matmul.h) as an ONNX Runtime custom operator.
 * Inputs: x (..., K) float32; packed (P, ceil(K/4), 64, 4) int8; colsum (P*64,) int32; w_scale (1,) float32; bias
 * (N,) float32, optional; spread (1,) int64, optional: how many tasks a product of a few rows splits into (exec.h; a
 * step twin's graph input `decode_spread`, export/native_twin.py). Output (..., N) float32. Attributes: n (int);
 * window (int, default 1): W > 1 takes x (..., T, C) and multiplies each run of W frames side by side (K = W * C) into
 * (..., T - W + 1, N), a width-W convolution without its im2col copy. Its work is shared out over the session's
 * intra-op threads. */

#include <string.h>

#include "int8_matmul.h"
#include "op.h"
#include "ort_kernel.h"

typedef struct {
    cvl_kernel_base base;
    int64_t n, window;
} kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    OrtStatus* s = cvl_kernel_new(sizeof(kernel), api, info, "Int8MatMul", out);
    if (s) return s;
    kernel* kn = *out;
    kn->n = cvl_attr_int64(&kn->base.ort, info, "n", 0);
    kn->window = cvl_attr_int64(&kn->base.ort, info, "window", 1);
    return NULL;
}

enum { X, PACKED, COLSUM, SCALE, BIAS, SPREAD, INPUTS };
static const int types[INPUTS] = {CVL_T_FLOAT, CVL_T_INT8, CVL_T_INT32, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_INT64};

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, BIAS, "Int8MatMul: an input is missing", t);
    if (s) return s;
    const int64_t n = kn->n, rank = (int64_t)t[X].rank, w = kn->window;
    /* window W > 1: x (..., T, C) frames, each output row a window of W frames (k = W * C), T - W + 1 rows */
    const int64_t c = rank > 0 ? t[X].dims[rank - 1] : 0, k = w * c, panels = (n + 63) / 64;
    if (w < 1 || (w > 1 && rank < 2))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "Int8MatMul: window must be >= 1, and x (..., T, C) with a window");
    const int64_t frames = w > 1 ? t[X].dims[rank - 2] : 1;
    int64_t rows = frames - w + 1 > 0 ? frames - w + 1 : 0;
    int64_t batches = rank > 0 ? cvl_count(t[X].dims, (size_t)(rank - (w > 1 ? 2 : 1))) : 0;
    const int64_t* pd = t[PACKED].dims;
    if (n < 1 || rank < 1 || t[PACKED].rank != 4 || pd[0] != panels || pd[1] != (k + 3) / 4 || pd[2] != 64 ||
        pd[3] != 4 || t[COLSUM].rank != 1 || t[COLSUM].dims[0] != panels * 64 ||
        cvl_count(t[SCALE].dims, t[SCALE].rank) != 1 ||
        (t[BIAS].data != NULL && (t[BIAS].rank != 1 || t[BIAS].dims[0] != n)))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "Int8MatMul: x (..., K), packed (ceil(n/64), ceil(K/4), 64, 4), colsum (ceil(n/64)*64,), "
                          "w_scale (1,) and bias (n,) disagree");
    int64_t out_dims[CVL_MAX_DIMS];
    memcpy(out_dims, t[X].dims, sizeof(int64_t) * (size_t)rank);
    out_dims[rank - 1] = n;
    if (w > 1) out_dims[rank - 2] = rows;
    void* o;
    if ((s = cvl_output(ort, ctx, 0, out_dims, (size_t)rank, &o))) return s;
    if (rows == 0 || batches == 0) return NULL;
    if (w == 1) {
        rows *= batches; /* every row side by side: one product */
        batches = 1;
    }
    cvl_ort_runner runner;
    const cvl_exec ex = cvl_kernel_exec(&kn->base, &runner, ctx, cvl_spread_of(&t[SPREAD]));
    for (int64_t b = 0; b < batches; b++) {
        cvl_int8_problem prob = {.rows = rows, .k = k, .n = n, .x = (const float*)t[X].data + b * frames * c,
                                 .packed = t[PACKED].data, .colsum = t[COLSUM].data,
                                 .w_scale = *(const float*)t[SCALE].data, .bias = t[BIAS].data,
                                 .y = (float*)o + b * rows * n, .x_stride = w > 1 ? c : 0};
        if (cvl_int8_matmul(&prob, &ex) != 0)
            return cvl_status(ort, CVL_ORT_FAIL, "Int8MatMul: out of memory for the work buffer");
    }
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[1] = {CVL_T_FLOAT};
static const cvl_op_glue glue =
    CVL_OP_GLUE("Int8MatMul", types, INPUTS, BIAS, output_types, 1, create_v1, compute_v1, create, compute);
static const cvl_op int8_matmul = {"Int8MatMul", &cvl_int8_matmul_variants, &glue.ort};
CVL_REGISTER_OP(int8_matmul);
