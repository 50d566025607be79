/* One-dimensional convolutions with bf16 products and float32 sums (a vocoder's convolutions: HiFT's resblocks; a flow
 * estimator's: a U-Net's ResNet blocks, a DiT's grouped position convolutions). */
#ifndef COSYVOICE_LITE_CONV1D_H
#define COSYVOICE_LITE_CONV1D_H

#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "op.h"

/* y[b][o][t] = bias[o] + sum over tap j and input channel i of W[o][i][j] * xpad[b][i][t + j * dilation], where xpad
 * is x with pad_left zeros before and pad_right after each row (stride 1, one group: ONNX Conv on (B, C, T)). Both W
 * and x are rounded to bfloat16 (to nearest, ties to even) and each product summed in float32, in the order tap, then
 * channel pair, the odd channel of a pair before the even one (as vdpbf16ps does): every code path gives the same sums
 * but for the AVX-512 instruction's flushing of subnormal numbers.
 * With `alpha` the input first goes through a Snake activation, x + inv_alpha[i] * sin(alpha[i] * x)^2 per channel (a
 * HiFT resblock's, as its graph computes it in float32; sin by cvl_sin_squared), before the rounding. */
typedef struct {
    int64_t batch, c_in, c_out, t_in, taps, dilation, pad_left, pad_right;
    const float* x;         /* (batch, c_in, t_in) */
    const uint32_t* packed; /* (taps, ceil(c_in / 2), c_out): W's bf16 pairs, channel 2p in the low half (cvl_conv1d_pack) */
    const float* bias;      /* (c_out,) or NULL */
    float* y;               /* (batch, c_out, cvl_conv1d_out_len) */
    const float* alpha;     /* (c_in,): the Snake activation's, or NULL for none */
    const float* inv_alpha; /* (c_in,) with alpha */
    int64_t groups;         /* 0 or 1: one group; G: each output channel o reads the c_in / G input channels of its group
                             * o / (c_out / G) (an even count: a pair never spans two groups), `packed` then (taps,
                             * c_in / G / 2, c_out) */
} cvl_conv1d_problem;

/* Output length: t_in + pad_left + pad_right - dilation * (taps - 1) (negative: the input is too short). */
int64_t cvl_conv1d_out_len(const cvl_conv1d_problem* p);

/* W (c_out, c_in, taps) float32 into `packed` as above (the exporter does the same in numpy). */
void cvl_conv1d_pack(const float* w, int64_t c_out, int64_t c_in, int64_t taps, uint32_t* packed);

/* float32 -> bfloat16 bits, to nearest, ties to even (NaN stays NaN). */
uint16_t cvl_bf16_of(float v);

/* sin(x)^2 by x's distance r to the nearest multiple of pi (Cody-Waite in two parts) and sin(r)'s Taylor polynomial of
 * degree 9 (within 4e-6 of sin^2 for |x| < 2^12 * pi: far below a bf16 step), the same operations in every code path. */
float cvl_sin_squared(float x);

/* The code paths: portable; avx2 and avx512 (bf16 widened to float32: the same sums); avx512_bf16. */
extern const cvl_variants cvl_conv1d_variants;

/* 0 on success, -1 when the work buffer cannot be allocated, -2 when the groups do not divide the channels as above. */
int cvl_conv1d(const cvl_conv1d_problem* p, const cvl_exec* ex);

#endif
