/* cosyvoice_lite.NormMish: cvl_norm_mish (norm_mish.h) as an ONNX Runtime custom operator, the twin of a ResNet block's
 * norm, Mish, mask and addend (export/fuse_resnet.py).
 * Inputs: x float32, (B, T, C) with groups 0 (LayerNorm over C) or (B, C, T) with groups G (GroupNorm); gamma, beta
 * (C,) float32; mask (B, 1, T) float32, optional (GroupNorm only); add float32, optional: x's shape, or (B, 1, C) /
 * (B, C, 1) (one value per batch and channel). Output: y of x's shape. Attributes: groups (default 0), epsilon
 * (default 1e-5). */

#include <string.h>

#include "norm_mish.h"
#include "op.h"
#include "ort_kernel.h"

typedef struct {
    cvl_kernel_base base;
    int64_t groups;
    float eps;
} kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    OrtStatus* s = cvl_kernel_new(sizeof(kernel), api, info, "NormMish", out);
    if (s) return s;
    kernel* kn = *out;
    kn->groups = cvl_attr_int64(&kn->base.ort, info, "groups", 0);
    kn->eps = cvl_attr_float(&kn->base.ort, info, "epsilon", 1e-5f);
    return NULL;
}

enum { X, GAMMA, BETA, MASK, ADD, INPUTS };
static const int types[INPUTS] = {CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT};

static int is_vector(const cvl_tensor* t, int64_t n) { return t->rank == 1 && t->dims[0] == n; }

static int has_dims(const cvl_tensor* t, int64_t a, int64_t b, int64_t c) {
    const int64_t dims[3] = {a, b, c};
    return t->rank == 3 && memcmp(t->dims, dims, sizeof dims) == 0;
}

/* How input `add` lines up with x (B, D1, D2): absent, its shape, or one value per batch and channel; -1 otherwise. */
static int add_shape_of(const cvl_tensor* add, const int64_t* xd, int groups) {
    if (add->data == NULL) return CVL_ADD_NONE;
    if (has_dims(add, xd[0], xd[1], xd[2])) return CVL_ADD_FULL;
    if (groups ? has_dims(add, xd[0], xd[1], 1) : has_dims(add, xd[0], 1, xd[2])) return CVL_ADD_PER_CHANNEL;
    return -1;
}

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, MASK, "NormMish: x, gamma or beta is missing", t);
    if (s) return s;
    const int64_t* xd = t[X].dims;
    const int grouped = kn->groups > 0;
    const int64_t channels = grouped ? xd[1] : xd[2];
    const int add_shape = t[X].rank == 3 ? add_shape_of(&t[ADD], xd, grouped) : -1;
    if (t[X].rank != 3 || kn->groups < 0 || !is_vector(&t[GAMMA], channels) || !is_vector(&t[BETA], channels) ||
        add_shape < 0 || (t[MASK].data != NULL && !(grouped && has_dims(&t[MASK], xd[0], 1, xd[2]))))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "NormMish: x (B, T, C) (groups 0) or (B, C, T), gamma and beta (C,), mask (B, 1, T) (groups "
                          "only) and add (x's shape, or one per batch and channel) disagree");
    void* y;
    if ((s = cvl_output(ort, ctx, 0, xd, 3, &y))) return s;
    const cvl_norm_mish_problem p = {
        .batch = xd[0], .channels = channels, .frames = grouped ? xd[2] : xd[1], .groups = kn->groups, .eps = kn->eps,
        .x = t[X].data, .gamma = t[GAMMA].data, .beta = t[BETA].data, .mask = t[MASK].data, .add = t[ADD].data,
        .add_shape = (cvl_add_shape)add_shape, .y = y,
    };
    cvl_ort_runner runner;
    const cvl_exec ex = cvl_kernel_exec(&kn->base, &runner, ctx, 1);
    if (cvl_norm_mish(&p, &ex) != 0)
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT, "NormMish: groups must divide the channels");
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[1] = {CVL_T_FLOAT};
static const cvl_op_glue glue =
    CVL_OP_GLUE("NormMish", types, INPUTS, MASK, output_types, 1, create_v1, compute_v1, create, compute);
static const cvl_op norm_mish = {"NormMish", &cvl_norm_mish_variants, &glue.ort};
CVL_REGISTER_OP(norm_mish);
