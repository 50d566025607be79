/* cosyvoice_lite.EstimatorBlock: cvl_estimator_block (estimator_block.h) as an ONNX Runtime custom operator,
 * registered by this file (op.h) into the library's domain.
 * Inputs: x (B, M, D) float32; past_k, past_v (B, C, H, DK) float16, or int8 with their scales (inputs 23, 24);
 * chunk (1,) int64; ln1 weight and bias (D,); the q|k|v weight as Int8MatMul takes it (n = 3*H*DK) with scales (1,)
 * or (3*H*DK,); ln3 weight and bias; then out (n = D), ff1 (n = F) and ff2 (n = D), each packed, colsum, scale (1,)
 * and bias: 23 inputs; then, with int8 caches, past_k_scale and past_v_scale (B, C, H) float32. Outputs: y (B, M, D)
 * float32, the new frames' k and v (1, B, M, H, DK) float16 (one block's slice of the estimator's new_k, new_v).
 * Attributes: heads (int), scale, eps1, eps3 (float). This file also holds what every block operator shares
 * (block_op.h: its kernel's attributes, outputs and call), which a family's DiTBlock uses too. */

#include <stdio.h>
#include <string.h>

#include "block_op.h"
#include "op.h"
#include "ort_kernel.h"

typedef cvl_block_kernel kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    return cvl_block_create(api, info, "EstimatorBlock", 1e-5f, out);
}

#define REQUIRED 23
#define INPUTS 25
enum { X, PK, PV, CHUNK, LN1W, LN1B, QKV, OUT = 9, LN3W = 13, LN3B, FF1, FF2 = 19, KS = 23, VS };
static const int types[INPUTS] = {
    CVL_T_FLOAT, CVL_T_ANY,     CVL_T_ANY,     CVL_T_INT64, CVL_T_FLOAT, CVL_T_FLOAT, /* x, past_k, past_v, chunk, ln1 */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,                                         /* qkv */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_FLOAT,                          /* out */
    CVL_T_FLOAT, CVL_T_FLOAT,                                                        /* ln3 */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_FLOAT,                          /* ff1 */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_FLOAT,                          /* ff2 */
    CVL_T_FLOAT, CVL_T_FLOAT,                                                        /* int8 caches' scales */
};

/* The block's problem from its inputs, or 0 when they disagree. */
static int problem_of(const kernel* kn, const cvl_tensor* t, cvl_block_problem* b) {
    const int64_t* xd = t[X].dims;
    const int64_t* kd = t[PK].dims;
    const int64_t heads = kn->heads, D = t[X].rank == 3 ? xd[2] : 0;
    const int64_t HD = t[PK].rank == 4 ? kd[2] * kd[3] : 0, F = cvl_count(t[FF1 + 3].dims, t[FF1 + 3].rank);
    int ok = t[X].rank == 3 && t[PK].rank == 4 && t[PV].rank == 4 && kd[0] == xd[0] && kd[2] == heads && heads >= 1 &&
             memcmp(t[PV].dims, kd, 4 * sizeof(int64_t)) == 0 && cvl_count(t[CHUNK].dims, t[CHUNK].rank) == 1 &&
             cvl_count(t[LN1W].dims, t[LN1W].rank) == D && cvl_count(t[LN1B].dims, t[LN1B].rank) == D &&
             cvl_count(t[LN3W].dims, t[LN3W].rank) == D && cvl_count(t[LN3B].dims, t[LN3B].rank) == D && D >= 1;
    ok = ok && cvl_weight_input(t, QKV, D, 3 * HD, 0, &b->qkv) && cvl_weight_input(t, OUT, HD, D, 1, &b->out) &&
         cvl_weight_input(t, FF1, D, F, 1, &b->ff1) && cvl_weight_input(t, FF2, F, D, 1, &b->ff2);
    if (!ok) return 0;
    b->batch = xd[0];
    b->frames = xd[1];
    b->cached = kd[1];
    b->dim = D;
    b->heads = heads;
    b->head_dim = kd[3];
    b->ff = F;
    b->chunk = *(const int64_t*)t[CHUNK].data;
    b->scale = kn->scale;
    b->eps1 = kn->eps1;
    b->eps3 = kn->eps3;
    b->x = t[X].data;
    if (!cvl_block_caches(&t[PK], &t[PV], &t[KS], &t[VS], b)) return 0;
    b->ln1_w = t[LN1W].data;
    b->ln1_b = t[LN1B].data;
    b->ln3_w = t[LN3W].data;
    b->ln3_b = t[LN3B].data;
    return 1;
}

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, REQUIRED, "EstimatorBlock: an input is missing", t);
    if (s) return s;
    cvl_block_problem b = {0};
    if (!problem_of(kn, t, &b))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "EstimatorBlock: x (B,M,D), past_k, past_v (B,C,H,DK) float16 (or int8 with their scales "
                          "(B,C,H)), chunk (1,), the LayerNorms (D,) and the q|k|v, out, ff1 and ff2 weights disagree");
    return cvl_block_run(&kn->base, ctx, &b, "EstimatorBlock");
}

/* Whether `s` holds the scales of int8 caches of b's shape: (B, C, H). */
static int scales_fit(const cvl_tensor* s, const cvl_block_problem* b) {
    const int64_t dims[3] = {b->batch, b->cached, b->heads};
    return s->data != NULL && s->rank == 3 && memcmp(s->dims, dims, sizeof dims) == 0;
}

int cvl_block_caches(const cvl_tensor* past_k, const cvl_tensor* past_v, const cvl_tensor* k_scale,
                     const cvl_tensor* v_scale, cvl_block_problem* b) {
    if (past_k->type != past_v->type) return 0;
    if (past_k->type == CVL_T_FLOAT16) {
        if (k_scale->data != NULL || v_scale->data != NULL) return 0; /* scales belong to int8 caches only */
        b->past_k = past_k->data;
        b->past_v = past_v->data;
        return 1;
    }
    if (past_k->type != CVL_T_INT8 || !scales_fit(k_scale, b) || !scales_fit(v_scale, b)) return 0;
    b->past_k_int8 = past_k->data;
    b->past_v_int8 = past_v->data;
    b->past_k_scale = k_scale->data;
    b->past_v_scale = v_scale->data;
    return 1;
}

OrtStatus* cvl_block_create(const OrtApi* api, const OrtKernelInfo* info, const char* op, float eps, void** out) {
    OrtStatus* s = cvl_kernel_new(sizeof(cvl_block_kernel), api, info, op, out);
    if (s) return s;
    cvl_block_kernel* kn = *out;
    kn->heads = cvl_attr_int64(&kn->base.ort, info, "heads", 0);
    kn->scale = cvl_attr_float(&kn->base.ort, info, "scale", 0.f);
    kn->eps1 = cvl_attr_float(&kn->base.ort, info, "eps1", eps);
    kn->eps3 = cvl_attr_float(&kn->base.ort, info, "eps3", eps);
    return NULL;
}

OrtStatus* cvl_block_run(const cvl_kernel_base* base, OrtKernelContext* ctx, cvl_block_problem* b, const char* op) {
    const cvl_ort* ort = &base->ort;
    char message[96];
    if (b->chunk < 1) {
        snprintf(message, sizeof message, "%s: chunk must be >= 1", op);
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, message);
    }
    void* o[3];
    const int64_t y_dims[3] = {b->batch, b->frames, b->dim};
    const int64_t kv_dims[5] = {1, b->batch, b->frames, b->heads, b->head_dim};
    for (size_t i = 0; i < 3; i++) {
        OrtStatus* s = cvl_output(ort, ctx, i, i ? kv_dims : y_dims, i ? 5 : 3, &o[i]);
        if (s) return s;
    }
    b->y = o[0];
    b->k = o[1];
    b->v = o[2];
    cvl_ort_runner runner;
    const cvl_exec ex = cvl_kernel_exec(base, &runner, ctx, 1);
    if (cvl_estimator_block(b, &ex) != 0) {
        snprintf(message, sizeof message, "%s: out of memory for the work buffers", op);
        return cvl_status(ort, CVL_ORT_FAIL, message);
    }
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[3] = {CVL_T_FLOAT, CVL_T_FLOAT16, CVL_T_FLOAT16};
static const cvl_op_glue glue =
    CVL_OP_GLUE("EstimatorBlock", types, INPUTS, REQUIRED, output_types, 3, create_v1, compute_v1, create, compute);
static const cvl_op estimator_block = {"EstimatorBlock", &cvl_estimator_block_variants, &glue.ort};
CVL_REGISTER_OP(estimator_block);
