/* A flow estimator ResNet block's normalization and activation in one pass: y = Mish(norm(x) * gamma + beta), then
 * times a frame mask and plus an addend (the time embedding after the first convolution, the residual after the
 * second). CosyVoice-300M's blocks normalize by GroupNorm over (channels of a group, frames) in (B, C, T);
 * CosyVoice2's causal blocks by LayerNorm over the channels of each frame in (B, T, C). */
#ifndef COSYVOICE_LITE_NORM_MISH_H
#define COSYVOICE_LITE_NORM_MISH_H

#include <stdint.h>

#include "exec.h"
#include "op.h"

extern const cvl_variants cvl_norm_mish_variants;

/* How `add` lines up with y: absent, y's own shape, or one value per (batch, channel) for every frame. */
typedef enum { CVL_ADD_NONE = 0, CVL_ADD_FULL = 1, CVL_ADD_PER_CHANNEL = 2 } cvl_add_shape;

typedef struct {
    int64_t batch, channels, frames;
    /* 0: LayerNorm over the channels of each frame, x and y (B, T, C); G >= 1: GroupNorm over G groups of C / G
     * channels and all frames, x and y (B, C, T) (G divides C). */
    int64_t groups;
    float eps;
    const float* x;
    const float *gamma, *beta; /* (C,) */
    const float* mask;         /* (B, T), or NULL; GroupNorm's layout only */
    const float* add;          /* as add_shape says: (B, T, C) / (B, C, T), or (B, C); NULL with CVL_ADD_NONE */
    cvl_add_shape add_shape;
    float* y; /* may be x */
} cvl_norm_mish_problem;

/* Mish(v) = v * tanh(softplus(v)), as ONNX Runtime's graph of it computes it (float32, no overflow). */
float cvl_mish(float v);

/* Runs the problem over ex's threads; 0, or -2 when its shapes disagree (groups not dividing the channels, a mask with
 * LayerNorm). */
int cvl_norm_mish(const cvl_norm_mish_problem* p, const cvl_exec* ex);

#endif
