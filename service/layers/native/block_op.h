/* What the ONNX Runtime operators over the estimator block kernel share (EstimatorBlock, a family's DiTBlock): once
 * an operator has read its inputs into a cvl_block_problem, its outputs y (B, M, D) float32 and the new frames' k, v
 * (1, B, M, H, DK) float16, and the kernel's call. */
#ifndef COSYVOICE_LITE_BLOCK_OP_H
#define COSYVOICE_LITE_BLOCK_OP_H

#include "estimator_block.h"
#include "ort_kernel.h"

/* A block operator's kernel: its attributes heads, scale, eps1 and eps3. */
typedef struct {
    cvl_kernel_base base;
    int64_t heads;
    float scale, eps1, eps3;
} cvl_block_kernel;

/* CreateKernelV2 of block operator `op`, the LayerNorms' epsilon `eps` where the node gives none. */
OrtStatus* cvl_block_create(const OrtApi* api, const OrtKernelInfo* info, const char* op, float eps, void** out);

/* The caches of b from a block operator's past_k, past_v inputs (both float16, or both int8) and its optional
 * past_k_scale, past_v_scale (B, C, H) float32 (present exactly when the caches are int8), b's batch, cached frames
 * and heads already set; 0 when they disagree. */
int cvl_block_caches(const cvl_tensor* past_k, const cvl_tensor* past_v, const cvl_tensor* k_scale,
                     const cvl_tensor* v_scale, cvl_block_problem* b);

/* Check b's chunk, make the three outputs, run the block; NULL, or an error status naming operator `op`. */
OrtStatus* cvl_block_run(const cvl_kernel_base* base, OrtKernelContext* ctx, cvl_block_problem* b, const char* op);

#endif
