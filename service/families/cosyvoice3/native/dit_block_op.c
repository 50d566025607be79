/* cosyvoice_lite.DiTBlock: Fun-CosyVoice3's DiT block, cvl_estimator_block (service/layers/native/estimator_block.h)
 * with its AdaLN-zero modulation, rotary q and k and tanh GELU, as an ONNX Runtime custom operator registered by this
 * file (op.h) into the library's domain.
 * Inputs: x (B, M, D) float32; past_k, past_v (B, C, H, DK) float16 (or int8: then inputs 28 and 29, past_k_scale and
 * past_v_scale (B, C, H) float32, as EstimatorBlock takes them); chunk (1,) int64; cos, sin (M, R) float32 (the
 * rotary tables of the new frames, R even); the attention's modulation mul1 (= 1 + scale), add1 (= shift) and gate1,
 * each (B, 1, D) float32; the q|k|v weight as Int8MatMul takes it (n = 3*H*DK) with scales (1,) or (3*H*DK,) and its
 * bias; out (n = D, with bias); the feed-forward's mul3, add3, gate3 (B, 1, D); ff1 (n = F) and ff2 (n = D), each
 * packed, colsum, scale and bias: 28 inputs. Outputs: y (B, M, D) float32, the new frames' rotated k and their v
 * (1, B, M, H, DK) float16 (one block's slice of the estimator's new_k, new_v). Attributes: heads (int), scale, eps1,
 * eps3 (float). */

#include <string.h>

#include "block_op.h"
#include "op.h"
#include "ort_kernel.h"

typedef cvl_block_kernel kernel;

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
    (void)op;
    return cvl_block_create(api, info, "DiTBlock", 1e-6f, out);
}

#define REQUIRED 28
#define INPUTS 30
enum { X, PK, PV, CHUNK, COS, SIN, MUL1, ADD1, GATE1, QKV, OUT = 13, MUL3 = 17, ADD3, GATE3, FF1, FF2 = 24, KS = 28, VS };
#define WEIGHT_TYPES CVL_T_INT8, CVL_T_INT32, CVL_T_FLOAT, CVL_T_FLOAT /* packed, colsum, scale(s), bias */
static const int types[INPUTS] = {
    CVL_T_FLOAT, CVL_T_ANY,     CVL_T_ANY,     CVL_T_INT64, CVL_T_FLOAT, CVL_T_FLOAT, /* x .. sin */
    CVL_T_FLOAT, CVL_T_FLOAT,   CVL_T_FLOAT,                                      /* mul1, add1, gate1 */
    WEIGHT_TYPES, WEIGHT_TYPES,                                                   /* qkv, out */
    CVL_T_FLOAT, CVL_T_FLOAT,   CVL_T_FLOAT,                                      /* mul3, add3, gate3 */
    WEIGHT_TYPES, WEIGHT_TYPES,                                                   /* ff1, ff2 */
    CVL_T_FLOAT,  CVL_T_FLOAT,                                                    /* int8 caches' scales */
};

/* Whether input i holds one row of D per batch entry: (B, 1, D) or (B, D). */
static int per_batch(const cvl_tensor* t, int i, int64_t batch, int64_t dim) {
    return t[i].rank >= 2 && t[i].dims[0] == batch && t[i].dims[t[i].rank - 1] == dim &&
           cvl_count(t[i].dims, t[i].rank) == batch * dim;
}

/* The block's problem from its inputs, or 0 when they disagree. */
static int problem_of(const kernel* kn, const cvl_tensor* t, cvl_block_problem* b) {
    const int64_t* xd = t[X].dims;
    const int64_t* kd = t[PK].dims;
    const int64_t heads = kn->heads, D = t[X].rank == 3 ? xd[2] : 0, B = t[X].rank == 3 ? xd[0] : 0;
    const int64_t M = t[X].rank == 3 ? xd[1] : 0, R = t[COS].rank == 2 ? t[COS].dims[1] : -1;
    const int64_t HD = t[PK].rank == 4 ? kd[2] * kd[3] : 0, F = cvl_count(t[FF1 + 3].dims, t[FF1 + 3].rank);
    int ok = t[X].rank == 3 && t[PK].rank == 4 && t[PV].rank == 4 && kd[0] == B && kd[2] == heads && heads >= 1 &&
             memcmp(t[PV].dims, kd, 4 * sizeof(int64_t)) == 0 && cvl_count(t[CHUNK].dims, t[CHUNK].rank) == 1 &&
             D >= 1 && R >= 0 && R % 2 == 0 && R <= HD && t[COS].dims[0] == M && t[SIN].rank == 2 &&
             memcmp(t[SIN].dims, t[COS].dims, 2 * sizeof(int64_t)) == 0;
    for (int i = MUL1; ok && i <= GATE1; i++) ok = per_batch(t, i, B, D);
    for (int i = MUL3; ok && i <= GATE3; i++) ok = per_batch(t, i, B, D);
    ok = ok && cvl_weight_input(t, QKV, D, 3 * HD, 1, &b->qkv) && cvl_weight_input(t, OUT, HD, D, 1, &b->out) &&
         cvl_weight_input(t, FF1, D, F, 1, &b->ff1) && cvl_weight_input(t, FF2, F, D, 1, &b->ff2);
    if (!ok) return 0;
    *b = (cvl_block_problem){
        .batch = B, .frames = M, .cached = kd[1], .dim = D, .heads = heads, .head_dim = kd[3], .ff = F,
        .chunk = *(const int64_t*)t[CHUNK].data, .scale = kn->scale, .eps1 = kn->eps1, .eps3 = kn->eps3,
        .x = t[X].data, .ln1_w = t[MUL1].data, .ln1_b = t[ADD1].data,
        .ln3_w = t[MUL3].data, .ln3_b = t[ADD3].data, .qkv = b->qkv, .out = b->out, .ff1 = b->ff1, .ff2 = b->ff2,
        .ln_per_batch = 1, .gate1 = t[GATE1].data, .gate3 = t[GATE3].data, .rope_dim = R, .rope_cos = t[COS].data,
        .rope_sin = t[SIN].data, .gelu_tanh = 1,
    };
    return cvl_block_caches(&t[PK], &t[PV], &t[KS], &t[VS], b);
}

static OrtStatus* compute(void* kp, OrtKernelContext* ctx) {
    const kernel* kn = kp;
    const cvl_ort* ort = &kn->base.ort;
    cvl_tensor t[INPUTS];
    OrtStatus* s = cvl_read_inputs(ort, ctx, types, INPUTS, REQUIRED, "DiTBlock: an input is missing", t);
    if (s) return s;
    cvl_block_problem b = {0};
    if (!problem_of(kn, t, &b))
        return cvl_status(ort, CVL_ORT_INVALID_ARGUMENT,
                          "DiTBlock: x (B,M,D), past_k, past_v (B,C,H,DK) (int8 with scales (B,C,H)), chunk (1,), cos, "
                          "sin (M,R), the modulations (B,1,D) and the q|k|v, out, ff1 and ff2 weights disagree");
    return cvl_block_run(&kn->base, ctx, &b, "DiTBlock");
}

CVL_COMPUTE_V1(compute_v1, compute)
CVL_CREATE_V1(create_v1, create)

static const int output_types[3] = {CVL_T_FLOAT, CVL_T_FLOAT16, CVL_T_FLOAT16};
static const cvl_op_glue glue =
    CVL_OP_GLUE("DiTBlock", types, INPUTS, REQUIRED, output_types, 3, create_v1, compute_v1, create, compute);
static const cvl_op dit_block = {"DiTBlock", &cvl_estimator_block_variants, &glue.ort};
CVL_REGISTER_OP(dit_block);
