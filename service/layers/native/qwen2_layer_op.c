/* cosyvoice_lite.Qwen2Layer: cvl_qwen2_layer (qwen2_layer.h) as an ONNX Runtime custom operator, registered by this
 * file (op.h) into the library's domain.
 * Inputs: x (B, T, D) float32; past_k, past_v (B, KVH, C, DK) float16; mask (B, 1, T, C+T), cos, sin (B, 1, T, DK)
 * float32; rms1 weight (D,); q, k, v weights as Int8MatMul takes them, each with its bias (4 inputs each); o (packed,
 * colsum, scale); rms2 weight; gate, up, down (3 inputs each): 32 inputs; then spread (1,) int64, optional (exec.h: a
 * step twin's graph input `decode_spread`). Outputs: y (B, T, D), the new tokens' k (rotated) and v (B, KVH, T, DK),
 * float32. Attributes: heads, ff (int), scale, eps (float). */

#include <string.h>

#include "op.h"
#include "ort_kernel.h"
#include "qwen2_layer.h"

typedef struct {
    cvl_kernel_base base;
    int64_t heads, ff;
    float scale, eps;
} kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    OrtStatus* s = cvl_kernel_new(sizeof(kernel), api, info, "Qwen2Layer", out);
    if (s) return s;
    kernel* kn = *out;
    kn->heads = cvl_attr_int64(&kn->base.ort, info, "heads", 0);
    kn->ff = cvl_attr_int64(&kn->base.ort, info, "ff", 0);
    kn->scale = cvl_attr_float(&kn->base.ort, info, "scale", 0.f);
    kn->eps = cvl_attr_float(&kn->base.ort, info, "eps", 1e-6f);
    return NULL;
}

#define REQUIRED 32
#define INPUTS 33
enum { X, PK, PV, MASK, COS, SIN, RMS1, Q, K = 11, V = 15, O = 19, RMS2 = 22, GATE, UP = 26, DOWN = 29, SPREAD = 32 };
static const int types[INPUTS] = {
    CVL_T_FLOAT, CVL_T_FLOAT16, CVL_T_FLOAT16, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT, /* x .. rms1 */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_FLOAT,                                        /* q */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_FLOAT,                                        /* k */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_FLOAT,                                        /* v */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,                                                       /* o */
    CVL_T_FLOAT,                                                                                   /* rms2 */
    CVL_T_INT8,  CVL_T_INT32,   CVL_T_FLOAT,   CVL_T_INT8, CVL_T_INT32, CVL_T_FLOAT, CVL_T_INT8, CVL_T_INT32,
    CVL_T_FLOAT, /* gate, up, down */
    CVL_T_INT64, /* spread */
};

static int same_dims(const int64_t* a, const int64_t* b, size_t n) { return memcmp(a, b, n * sizeof(int64_t)) == 0; }

/* Whether x, the caches, mask, rotary tables and norms agree (B, T, D, KVH, DK as `q` holds them). */
static int activations_agree(const kernel* kn, const cvl_tensor* t, int64_t D, int64_t kvh, int64_t dk) {
    const int64_t* xd = t[X].dims;
    const int64_t* kd = t[PK].dims;
    const int64_t* md = t[MASK].dims;
    const int64_t* cd = t[COS].dims;
    return t[X].rank == 3 && t[PK].rank == 4 && t[PV].rank == 4 && same_dims(t[PV].dims, kd, 4) && kd[0] == xd[0] &&
           D >= 1 && kn->heads >= 1 && kvh >= 1 && kn->heads % kvh == 0 && dk >= 2 && dk % 2 == 0 && dk <= 1024 &&
           t[MASK].rank == 4 && md[0] == xd[0] && md[1] == 1 && md[2] == xd[1] && md[3] == kd[2] + xd[1] &&
           t[COS].rank == 4 && cd[0] == xd[0] && cd[1] == 1 && cd[2] == xd[1] && cd[3] == dk && t[SIN].rank == 4 &&
           same_dims(t[SIN].dims, cd, 4) && cvl_count(t[RMS1].dims, t[RMS1].rank) == D &&
           cvl_count(t[RMS2].dims, t[RMS2].rank) == D;
}

/* The layer's problem from its inputs, or 0 when they disagree. */
static int problem_of(const kernel* kn, const cvl_tensor* t, cvl_qwen2_problem* q) {
    const int64_t D = t[X].rank == 3 ? t[X].dims[2] : 0, heads = kn->heads, F = kn->ff;
    const int64_t kvh = t[PK].rank == 4 ? t[PK].dims[1] : 0, dk = t[PK].rank == 4 ? t[PK].dims[3] : 0;
    int ok = activations_agree(kn, t, D, kvh, dk);
    ok = ok && cvl_weight_input(t, Q, D, heads * dk, 1, &q->q) && cvl_weight_input(t, K, D, kvh * dk, 1, &q->k) &&
         cvl_weight_input(t, V, D, kvh * dk, 1, &q->v) && cvl_weight_input(t, O, heads * dk, D, 0, &q->o) &&
         cvl_weight_input(t, GATE, D, F, 0, &q->gate) && cvl_weight_input(t, UP, D, F, 0, &q->up) &&
         cvl_weight_input(t, DOWN, F, D, 0, &q->down);
    if (!ok) return 0;
    q->batch = t[X].dims[0];
    q->steps = t[X].dims[1];
    q->cached = t[PK].dims[2];
    q->dim = D;
    q->heads = heads;
    q->kv_heads = kvh;
    q->head_dim = dk;
    q->ff = F;
    q->scale = kn->scale;
    q->eps = kn->eps;
    q->x = t[X].data;
    q->past_k = t[PK].data;
    q->past_v = t[PV].data;
    q->mask = t[MASK].data;
    q->cos = t[COS].data;
    q->sin = t[SIN].data;
    q->rms1_w = t[RMS1].data;
    q->rms2_w = t[RMS2].data;
    return 1;
}

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, REQUIRED, "Qwen2Layer: an input is missing", t);
    if (s) return s;
    cvl_qwen2_problem q = {0};
    if (!problem_of(kn, t, &q))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "Qwen2Layer: x (B,T,D), past_k, past_v (B,KVH,C,DK), mask (B,1,T,C+T), cos, sin (B,1,T,DK), "
                          "the RMSNorm weights (D,) and the q, k, v, o, gate, up and down weights disagree");
    void* o[3];
    const int64_t y_dims[3] = {q.batch, q.steps, q.dim}, kv_dims[4] = {q.batch, q.kv_heads, q.steps, q.head_dim};
    for (size_t i = 0; i < 3; i++)
        if ((s = cvl_output(ort, ctx, i, i ? kv_dims : y_dims, i ? 4 : 3, &o[i]))) return s;
    q.y = o[0];
    q.k_out = o[1];
    q.v_out = o[2];
    cvl_ort_runner runner;
    const cvl_exec ex = cvl_kernel_exec(&kn->base, &runner, ctx, cvl_spread_of(&t[SPREAD]));
    if (cvl_qwen2_layer(&q, &ex) != 0) return cvl_status(ort, CVL_ORT_FAIL, "Qwen2Layer: out of memory for the work buffers");
    return NULL;
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[3] = {CVL_T_FLOAT, CVL_T_FLOAT, CVL_T_FLOAT};
static const cvl_op_glue glue =
    CVL_OP_GLUE("Qwen2Layer", types, INPUTS, REQUIRED, output_types, 3, create_v1, compute_v1, create, compute);
static const cvl_op qwen2_layer = {"Qwen2Layer", &cvl_qwen2_layer_variants, &glue.ort};
CVL_REGISTER_OP(qwen2_layer);
