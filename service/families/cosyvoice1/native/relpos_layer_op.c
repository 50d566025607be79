/* cosyvoice_lite.RelPosLayer: cvl_relpos_layer (relpos_layer.h) as an ONNX Runtime custom operator, registered by this
 * file (op.h) into the library's domain.
 * Inputs: x (B, T, D) float32; past_len (B,) int64; past_k, past_v (B, H, C, DK) float16; pos (H, R, DK) float32 or
 * float16;
 * LayerNorm 1 weight, bias (D,); q, k, v weights as Int8MatMul takes them, each with its bias (4 inputs each);
 * pos_bias_u, pos_bias_v (H x DK values); out (4 inputs); LayerNorm 2 weight, bias; ff1, ff2 (4 inputs each): 35
 * inputs; then spread (1,) int64, optional (exec.h: a step twin's graph input `decode_spread`). Outputs: y (B, T, D),
 * the new positions' k and v (B, H, T, DK), float32. Attributes: heads, ff (int), scale, eps1, eps2 (float). */

#include <string.h>

#include "op.h"
#include "ort_kernel.h"
#include "relpos_layer.h"

typedef struct {
    cvl_kernel_base base;
    int64_t heads, ff;
    float scale, eps1, eps2;
} kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    OrtStatus* s = cvl_kernel_new(sizeof(kernel), api, info, "RelPosLayer", out);
    if (s) return s;
    kernel* kn = *out;
    kn->heads = cvl_attr_int64(&kn->base.ort, info, "heads", 0);
    kn->ff = cvl_attr_int64(&kn->base.ort, info, "ff", 0);
    kn->scale = cvl_attr_float(&kn->base.ort, info, "scale", 0.f);
    kn->eps1 = cvl_attr_float(&kn->base.ort, info, "eps1", 1e-12f);
    kn->eps2 = cvl_attr_float(&kn->base.ort, info, "eps2", 1e-12f);
    return NULL;
}

#define REQUIRED 35
#define INPUTS 36
enum { X, PAST_LEN, PK, PV, POS, LN1_W, LN1_B, Q, K = 11, V = 15, BIAS_U = 19, BIAS_V, OUT, LN2_W = 25, LN2_B, FF1, FF2 = 31,
       SPREAD = 35 };
#define WEIGHT_TYPES CVL_T_INT8, CVL_T_INT32, CVL_T_FLOAT, CVL_T_FLOAT /* packed, colsum, scale(s), bias */
static const int types[INPUTS] = {
    CVL_T_FLOAT, CVL_T_INT64, CVL_T_FLOAT16, CVL_T_FLOAT16, CVL_T_ANY, CVL_T_FLOAT, CVL_T_FLOAT, /* x .. ln1 */
    WEIGHT_TYPES, WEIGHT_TYPES, WEIGHT_TYPES,                                                       /* q, k, v */
    CVL_T_FLOAT,  CVL_T_FLOAT,                                                                      /* pos biases */
    WEIGHT_TYPES, CVL_T_FLOAT,  CVL_T_FLOAT,  WEIGHT_TYPES, WEIGHT_TYPES,                           /* out .. ff2 */
    CVL_T_INT64,                                                                                    /* spread */
};

static int same_dims(const int64_t* a, const int64_t* b, size_t n) { return memcmp(a, b, n * sizeof(int64_t)) == 0; }

/* Whether x, past_len, the caches, pos, the norms and the positional biases agree (B, T, D, H, DK as the caches hold
 * them). */
static int activations_agree(const kernel* kn, const cvl_tensor* t, int64_t D, int64_t dk) {
    const int64_t* xd = t[X].dims;
    const int64_t* kd = t[PK].dims;
    const int64_t* pd = t[POS].dims;
    return t[X].rank == 3 && D >= 1 && t[PAST_LEN].rank == 1 && t[PAST_LEN].dims[0] == xd[0] && t[PK].rank == 4 &&
           t[PV].rank == 4 && same_dims(t[PV].dims, kd, 4) && kd[0] == xd[0] && kn->heads >= 1 && kd[1] == kn->heads &&
           dk >= 1 && dk <= 1024 && t[POS].rank == 3 && (t[POS].type == CVL_T_FLOAT || t[POS].type == CVL_T_FLOAT16) &&
           pd[0] == kn->heads && pd[2] == dk && kn->ff >= 1 &&
           cvl_count(t[LN1_W].dims, t[LN1_W].rank) == D && cvl_count(t[LN1_B].dims, t[LN1_B].rank) == D &&
           cvl_count(t[LN2_W].dims, t[LN2_W].rank) == D && cvl_count(t[LN2_B].dims, t[LN2_B].rank) == D &&
           cvl_count(t[BIAS_U].dims, t[BIAS_U].rank) == kn->heads * dk &&
           cvl_count(t[BIAS_V].dims, t[BIAS_V].rank) == kn->heads * dk;
}

/* The layer's problem from its inputs, or 0 when they disagree. */
static int problem_of(const kernel* kn, const cvl_tensor* t, cvl_relpos_problem* q) {
    const int64_t D = t[X].rank == 3 ? t[X].dims[2] : 0, dk = t[PK].rank == 4 ? t[PK].dims[3] : 0;
    const int64_t HD = kn->heads * dk, F = kn->ff;
    int ok = activations_agree(kn, t, D, dk);
    ok = ok && cvl_weight_input(t, Q, D, HD, 1, &q->q) && cvl_weight_input(t, K, D, HD, 1, &q->k) &&
         cvl_weight_input(t, V, D, HD, 1, &q->v) && cvl_weight_input(t, OUT, HD, D, 1, &q->out) &&
         cvl_weight_input(t, FF1, D, F, 1, &q->ff1) && cvl_weight_input(t, FF2, F, D, 1, &q->ff2);
    if (!ok) return 0;
    *q = (cvl_relpos_problem){
        .batch = t[X].dims[0], .steps = t[X].dims[1], .cached = t[PK].dims[2], .dim = D, .heads = kn->heads,
        .head_dim = dk, .ff = F, .pos_rows = t[POS].dims[1], .scale = kn->scale, .eps1 = kn->eps1, .eps2 = kn->eps2,
        .x = t[X].data, .past_len = t[PAST_LEN].data, .past_k = t[PK].data, .past_v = t[PV].data,
        .pos = t[POS].type == CVL_T_FLOAT ? t[POS].data : NULL, .pos_half = t[POS].type == CVL_T_FLOAT16 ? t[POS].data : NULL,
        .bias_u = t[BIAS_U].data, .bias_v = t[BIAS_V].data, .ln1_w = t[LN1_W].data, .ln1_b = t[LN1_B].data,
        .ln2_w = t[LN2_W].data, .ln2_b = t[LN2_B].data, .q = q->q, .k = q->k, .v = q->v, .out = q->out,
        .ff1 = q->ff1, .ff2 = q->ff2,
    };
    return 1;
}

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, REQUIRED, "RelPosLayer: an input is missing", t);
    if (s) return s;
    cvl_relpos_problem q = {0};
    if (!problem_of(kn, t, &q))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "RelPosLayer: x (B,T,D), past_len (B,), past_k, past_v (B,H,C,DK), pos (H,R,DK) float or float16, the "
                          "LayerNorms (D,), pos_bias_u/v (H*DK) and the q, k, v, out, ff1 and ff2 weights disagree");
    if (!cvl_relpos_positions_fit(&q))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "RelPosLayer: pos holds fewer relative distances than past_len + T of a row");
    void* o[3];
    const int64_t y_dims[3] = {q.batch, q.steps, q.dim}, kv_dims[4] = {q.batch, q.heads, q.steps, q.head_dim};
    for (size_t i = 0; i < 3; i++)
        if ((s = cvl_output(ort, ctx, i, i ? kv_dims : y_dims, i ? 4 : 3, &o[i]))) return s;
    q.y = o[0];
    q.k_out = o[1];
    q.v_out = o[2];
    cvl_ort_runner runner;
    const cvl_exec ex = cvl_kernel_exec(&kn->base, &runner, ctx, cvl_spread_of(&t[SPREAD]));
    if (cvl_relpos_layer(&q, &ex) != 0) return cvl_status(ort, CVL_ORT_FAIL, "RelPosLayer: out of memory for the work buffers");
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[3] = {CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT};
static const cvl_op_glue glue =
    CVL_OP_GLUE("RelPosLayer", types, INPUTS, REQUIRED, output_types, 3, create_v1, compute_v1, create, compute);
static const cvl_op relpos_layer = {"RelPosLayer", &cvl_relpos_layer_variants, &glue.ort};
CVL_REGISTER_OP(relpos_layer);
