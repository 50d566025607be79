/* What the Qwen2 layer's code paths share (qwen2_layer.c: portable, AVX-512 and AMX; qwen2_layer_avx2.c): the
 * attention's job and the rows one attention row reads, and the AVX2 passes. */
#ifndef COSYVOICE_LITE_QWEN2_LAYER_PARTS_H
#define COSYVOICE_LITE_QWEN2_LAYER_PARTS_H

#include <stdint.h>

#include "qwen2_layer.h"

#define CVL_QWEN2_MASKED (-1e29f) /* mask entries below this are masked columns (the step graph writes -1e30) */

/* The code of the layer's own passes and one-token attention: its variants' indices below the AMX one. */
enum { CVL_QWEN2_PORTABLE, CVL_QWEN2_AVX2, CVL_QWEN2_AVX512 };

typedef struct {
    const cvl_qwen2_problem* p;
    const float* q;   /* (R, heads, dk) rotated */
    float* att;       /* (R, heads, dk) */
    int64_t rows;     /* B x kv_heads x T */
    int64_t tasks;
    int passes;       /* CVL_QWEN2_PORTABLE, _AVX2 or _AVX512 */
    volatile int failed; /* a task could not allocate its score buffer */
} qwen2_attention_job;

/* What one attention row (b, kv head g, new token t; i = (b * kv_heads + g) * T + t) reads and writes. */
typedef struct {
    int64_t r, width, first_head, last_head; /* r = b * T + t: its row of q, att and the mask; heads [first, last) */
    const float* mask;                       /* (C + T) */
    const uint16_t *pk, *pv;                 /* (C, dk) float16 */
    const float *nk, *nv;                    /* (T, dk) */
} qwen2_attention_rows;

static inline qwen2_attention_rows qwen2_rows_of(const cvl_qwen2_problem* p, int64_t i) {
    const int64_t T = p->steps, C = p->cached, dk = p->head_dim, G = p->heads / p->kv_heads;
    const int64_t t = i % T, bg = i / T, g = bg % p->kv_heads, r = (bg / p->kv_heads) * T + t;
    return (qwen2_attention_rows){r, C + T, g * G, (g + 1) * G, p->mask + r * (C + T), p->past_k + bg * C * dk,
                                  p->past_v + bg * C * dk, p->k_out + bg * T * dk, p->v_out + bg * T * dk};
}

/* The AVX2 code (AVX2, FMA, F16C) of qwen2_layer.c's passes: RMSNorm over rows of n, g = silu(g) * u, the rotary
 * positions of `heads` heads in place, and attention row i (the AVX-512 code's method: kt holds the new keys of its
 * (b, g) transposed, dk x T; s has room for C + T + 16 scores). */
void cvl_qwen2_rms_norm_avx2(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* y);
void cvl_qwen2_silu_mul_avx2(float* g, const float* u, int64_t count);
void cvl_qwen2_rotate_avx2(float* v, int64_t heads, int64_t dk, const float* cos, const float* sin);
void cvl_qwen2_attention_row_avx2(const qwen2_attention_job* jb, int64_t i, float* s, const float* kt);

#endif
