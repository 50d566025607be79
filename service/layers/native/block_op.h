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

/* Check b's chunk, make the three outputs, run the block; NULL, or an error status naming operator `op`. */
OrtStatus* cvl_block_run(const cvl_kernel_base* base, OrtKernelContext* ctx, cvl_block_problem* b, const char* op);

#endif
