/* One decoder layer of the CosyVoice2 LLM (a Qwen2 body) as a single kernel call, for the step graph's rows:
 *   h = x + o(attention(rope(q(rms1(x))), rope(k(rms1(x))), v(rms1(x)); past keys/values, additive mask))
 *   y = h + down(silu(gate(rms2(h))) * up(rms2(h)))
 * RMSNorm with its weight and epsilon, grouped-query attention (query head h reads key/value head h / (heads /
 * kv_heads)) over the float16 cache and the new tokens under the step's additive mask, every product int8
 * (int8_matmul.h) with its activations quantized per row. */
#ifndef COSYVOICE_LITE_QWEN2_LAYER_H
#define COSYVOICE_LITE_QWEN2_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "int8_matmul.h"
#include "op.h"

typedef struct {
    int64_t batch, steps, cached, dim, heads, kv_heads, head_dim, ff;
    float scale, eps;                /* the attention's score scale, RMSNorm's epsilon */
    const float* x;                  /* (B, T, dim) */
    const uint16_t *past_k, *past_v; /* (B, kv_heads, C, head_dim) float16 bits, heads-first */
    const float* mask;               /* (B, 1, T, C + T) added to the scores (masked: -1e30) */
    const float *cos, *sin;          /* (B, 1, T, head_dim) rotary tables of the new positions */
    const float *rms1_w, *rms2_w;    /* (dim,) */
    cvl_int8_weight q, k, v;         /* dim -> heads x head_dim, dim -> kv_heads x head_dim (x2), with bias */
    cvl_int8_weight o;               /* heads x head_dim -> dim */
    cvl_int8_weight gate, up;        /* dim -> ff */
    cvl_int8_weight down;            /* ff -> dim */
    float* y;                        /* (B, T, dim) */
    float *k_out, *v_out;            /* (B, kv_heads, T, head_dim) float32: the new tokens' keys (rotated) and values */
} cvl_qwen2_problem;

/* The code paths of the layer's own passes and attention: portable, avx2 (AVX2 with FMA and F16C; float32 attention,
 * qwen2_layer_avx2.c), avx512 (AVX-512F/BW/VL with FMA and F16C), avx512_bf16 (with AVX-512 BF16 too: a prefill's
 * attention of 16 new tokens or more head by head in bf16, head sizes 32 and 64; attention_heads.c) and amx_bf16 (that
 * attention on AMX tiles); its products take theirs from the same features (int8_matmul.h). */
extern const cvl_variants cvl_qwen2_layer_variants;

/* 0 on success, -1 when a work buffer cannot be allocated. Products and attention rows may be shared out over
 * ex->parallel; ex->spread splits the products of a decode step's few rows (exec.h). */
int cvl_qwen2_layer(const cvl_qwen2_problem* p, const cvl_exec* ex);

#endif
