/* One transformer block of a flow estimator as a single kernel call (its BasicTransformerBlock): CosyVoice2's over its
 * caches under the chunk mask, CosyVoice-300M's with none (cached = 0) and full attention (a chunk of INT64_MAX):
 *   h = x + ln1(x) -> q, k, v -> cached chunk-masked attention -> out (+ bias)
 *   y = h + ff2(gelu(ff1(ln3(h)) + bias)) + bias
 * LayerNorms over the last axis with their own epsilon, GELU exact (erf), every product int8 (int8_matmul.h) with
 * its activations quantized per row, the attention cached_attention.h's.
 *
 * The same block with AdaLN-zero modulation is Fun-CosyVoice3's DiT block (its official DiTBlock):
 *   h = x + gate1 * out(attention(rope(q), rope(k), v of ln1(x) * mul1 + add1))
 *   y = h + gate3 * ff2(gelu_tanh(ff1(ln3(h) * mul3 + add3)))
 * LayerNorms without weights of their own (the modulation is their weight and bias, one row per batch entry: mul = 1 +
 * scale, add = shift), q, k and v with biases, rotary positions on the first rope_dim features of q and k (before the
 * head split, interleaved pairs, as x-transformers rotates them), gated residuals, GELU's tanh approximation. */
#ifndef COSYVOICE_LITE_ESTIMATOR_BLOCK_H
#define COSYVOICE_LITE_ESTIMATOR_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "int8_matmul.h"
#include "op.h"

typedef struct {
    int64_t batch, frames, cached, dim, heads, head_dim, ff, chunk;
    float scale, eps1, eps3;           /* the attention's score scale, the two LayerNorms' epsilon */
    const float* x;                    /* (B, M, dim) */
    const uint16_t *past_k, *past_v;   /* (B, C, heads, head_dim) float16 bits, time-first; or NULL with: */
    const int8_t *past_k_int8, *past_v_int8;   /* (B, C, heads, head_dim) int8 rows, each times its scale: */
    const float *past_k_scale, *past_v_scale; /* (B, C, heads) (the engine's int8 frames, cached_attention.h) */
    const float *ln1_w, *ln1_b, *ln3_w, *ln3_b;
    cvl_int8_weight qkv;               /* dim -> 3 x heads x head_dim: the columns of q, then k, then v (no bias) */
    cvl_int8_weight out;               /* heads x head_dim -> dim */
    cvl_int8_weight ff1;               /* dim -> ff */
    cvl_int8_weight ff2;               /* ff -> dim */
    float* y;                          /* (B, M, dim) */
    uint16_t *k, *v;                   /* (B, M, heads, head_dim) float16 bits: the new frames' keys and values, as the
                                        * caches keep them (rounded to nearest even, as a Cast rounds) */
    /* A DiT block's (all zero / NULL for the others): */
    int64_t ln_per_batch;              /* 1: ln1_w/ln1_b/ln3_w/ln3_b are (B, dim), one modulation per batch entry */
    const float *gate1, *gate3;        /* (B, dim): the residuals' gates, or NULL (plain residuals) */
    int64_t rope_dim;                  /* features of each q and k row rotated (even, <= heads x head_dim), or 0 */
    const float *rope_cos, *rope_sin;  /* (M, rope_dim): each frequency twice, as the pairs take them */
    int gelu_tanh;                     /* 1: GELU's tanh approximation, 0: exact (erf) */
} cvl_block_problem;

/* The code paths of the block's own passes (LayerNorm, GELU, float16 rounding): portable, avx2 (AVX2 with FMA and
 * F16C), avx512 (AVX-512F with FMA and F16C); its products and attention take theirs from the same features
 * (int8_matmul.h, cached_attention.h). */
extern const cvl_variants cvl_estimator_block_variants;

/* 0 on success, -1 when a work buffer cannot be allocated. The products may share out their rows over ex->parallel. */
int cvl_estimator_block(const cvl_block_problem* p, const cvl_exec* ex);

#endif
