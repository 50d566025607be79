/* One decoder layer of the CosyVoice-300M LLM (wenet/espnet, pre-LayerNorm, relative-position attention) as a single
 * kernel call, for the step graph's rows (B rows x T new positions after a per-row cache):
 *   h = LN1(x); q, k, v = h · Wq, Wk, Wv (+ biases)
 *   score[j] = ((q + u) · k_j + (q + v_bias) · pos[d(j)]) * scale, for the cache columns j < past_len[b] and the new
 *              positions up to this one, where d(j) is the relative distance from this position to key j
 *   x1 = x + out(softmax(score) · v);  y = x1 + w2(relu(w1(LN2(x1))))
 * LayerNorms over the last axis with their own epsilon, every product int8 (int8_matmul.h) with its activations
 * quantized per row, the cache float16, `pos` the layer's projected positions as the step graph gets them (float32, or
 * float16 like the cache: half the bytes a decode step reads per cached position for them). */
#ifndef COSYVOICE_LITE_RELPOS_LAYER_H
#define COSYVOICE_LITE_RELPOS_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "int8_matmul.h"
#include "op.h"

typedef struct {
    int64_t batch, steps, cached, dim, heads, head_dim, ff;
    int64_t pos_rows;                /* R: the relative distances 0 .. R-1 that `pos` holds */
    float scale, eps1, eps2;         /* the score scale (1 / sqrt(head_dim)), the two LayerNorms' epsilon */
    const float* x;                  /* (B, T, dim) */
    const int64_t* past_len;         /* (B,): cache columns >= past_len[b] are not attended; new token t of row b sits at
                                      * position past_len[b] + t */
    const uint16_t *past_k, *past_v; /* (B, heads, C, head_dim) float16 bits, heads-first */
    const float* pos;                /* (heads, R, head_dim): row d is distance d; NULL with pos_half */
    const uint16_t* pos_half;        /* the same in float16 bits (a step twin whose pos inputs are float16), or NULL */
    const float *bias_u, *bias_v;    /* (heads, head_dim): pos_bias_u (with the keys), pos_bias_v (with the positions) */
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b; /* (dim,) */
    cvl_int8_weight q, k, v;         /* dim -> heads x head_dim, each with its bias */
    cvl_int8_weight out;             /* heads x head_dim -> dim */
    cvl_int8_weight ff1;             /* dim -> ff */
    cvl_int8_weight ff2;             /* ff -> dim */
    float* y;                        /* (B, T, dim) */
    float *k_out, *v_out;            /* (B, heads, T, head_dim) float32: the new positions' keys and values */
} cvl_relpos_problem;

/* The code paths of the layer's own passes (LayerNorm, ReLU, the attention): portable, avx2 (AVX2 with FMA and F16C)
 * and avx512 (AVX-512F/BW/VL with FMA and F16C); its products take theirs from the same features (int8_matmul.h). */
extern const cvl_variants cvl_relpos_layer_variants;

/* Whether `pos` holds every distance the step reads: past_len[b] + T - 1 for a row with cache columns to attend,
 * T - 1 for the new positions (the step graph's gather fails beyond them too). */
int cvl_relpos_positions_fit(const cvl_relpos_problem* p);

#define CVL_RELPOS_NO_MEMORY (-1)
#define CVL_RELPOS_POSITIONS_SHORT (-2)

/* 0 on success, CVL_RELPOS_NO_MEMORY when a work buffer cannot be allocated, CVL_RELPOS_POSITIONS_SHORT when
 * cvl_relpos_positions_fit does not hold (nothing is read then). Products and attention rows may be shared out over
 * ex->parallel; ex->spread splits the products of a decode step's few rows (exec.h). */
int cvl_relpos_layer(const cvl_relpos_problem* p, const cvl_exec* ex);

#endif
