/* What the relative-position layer's code paths share (relpos_layer.c: portable and the driver; relpos_layer_avx2.c;
 * relpos_layer_avx512.c): one attention row's inputs, and each path's passes. */
#ifndef COSYVOICE_LITE_RELPOS_LAYER_PARTS_H
#define COSYVOICE_LITE_RELPOS_LAYER_PARTS_H

#include <stdint.h>

#include "relpos_layer.h"

/* One attention row: new position t of batch row b, head h (i = (b * heads + h) * T + t). */
typedef struct {
    int64_t t;
    int64_t valid;            /* cache columns it attends: past_len clamped to [0, C] */
    int64_t position;         /* past_len + t: the distance to cache column 0 (column j: position - j) */
    const float* q;           /* (head_dim) */
    const float *u, *bv;      /* (head_dim) pos_bias_u, pos_bias_v of head h */
    const float* pos;         /* (R, head_dim) of head h, float32; NULL when pos16 */
    const uint16_t* pos16;    /* the same in float16 bits, or NULL */
    const uint16_t *pk, *pv;  /* (C, head_dim) float16 */
    const float *nk, *nv;     /* (T, head_dim): the new positions' keys and values */
    float* out;               /* (head_dim) */
} cvl_relpos_row;

/* Row i of the attention; q and att are (B, T, heads, head_dim). */
static inline cvl_relpos_row cvl_relpos_row_of(const cvl_relpos_problem* p, const float* q, float* att, int64_t i) {
    const int64_t T = p->steps, C = p->cached, H = p->heads, dk = p->head_dim;
    const int64_t t = i % T, h = (i / T) % H, b = i / (T * H), bh = b * H + h, r = b * T + t;
    const int64_t past = p->past_len[b], valid = past < 0 ? 0 : (past > C ? C : past);
    return (cvl_relpos_row){
        .t = t, .valid = valid, .position = past + t, .q = q + (r * H + h) * dk, .u = p->bias_u + h * dk,
        .bv = p->bias_v + h * dk, .pos = p->pos_half ? NULL : p->pos + h * p->pos_rows * dk,
        .pos16 = p->pos_half ? p->pos_half + h * p->pos_rows * dk : NULL,
        .pk = valid ? p->past_k + bh * C * dk : NULL, .pv = valid ? p->past_v + bh * C * dk : NULL,
        .nk = p->k_out + bh * T * dk, .nv = p->v_out + bh * T * dk, .out = att + (r * H + h) * dk,
    };
}

/* The positional rows of distance-row offset r (distance x head_dim) for score(): (float32 row, NULL) or (NULL, float16
 * row), whichever the layer got. */
#define CVL_RELPOS_POS_AT(a, r) ((a)->pos16 ? NULL : (a)->pos + (r)), ((a)->pos16 ? (a)->pos16 + (r) : NULL)

/* Floats of one attention row's scratch: C + T scores, then q + u and q + v_bias, each padded to 16. */
static inline int64_t cvl_relpos_scratch_floats(const cvl_relpos_problem* p) {
    return (p->cached + p->steps + 15) / 16 * 16 + 2 * ((p->head_dim + 15) / 16 * 16) + 16;
}

/* New positions per attention tile of a prefill (the vector lanes of the tile's scores). */
#define CVL_RELPOS_TILE 16

/* Floats of one attention tile's scratch: the tile's q + u and q + v_bias dim-major, its positional and full scores
 * for every key it reaches (C + T + a tile), the cached keys and values widened to float32, its outputs, and a block
 * of 8 float16 position rows widened. */
static inline int64_t cvl_relpos_tile_scratch_floats(const cvl_relpos_problem* p) {
    const int64_t dk = (p->head_dim + 15) / 16 * 16, keys = p->cached + p->steps + CVL_RELPOS_TILE;
    return 2 * dk * CVL_RELPOS_TILE + 2 * keys * CVL_RELPOS_TILE + 2 * p->cached * dk + dk * CVL_RELPOS_TILE + 8 * dk + 64;
}

/* The passes of one code path: LayerNorm over rows of n ((x - mean) / sqrt(var + eps) * w + b, two passes as the
 * graph computes it), ReLU in place, one attention row into row.out (s: cvl_relpos_scratch_floats), and optionally
 * (NULL: none) a tile of a prefill's new positions t0 .. t0 + n - 1 (n <= CVL_RELPOS_TILE) of batch row b, head h, the
 * positions as vector lanes (s: cvl_relpos_tile_scratch_floats); it returns 0, or nonzero for a tile it does not take
 * (its rows then go one by one). */
typedef struct {
    void (*layer_norm)(const float* x, int64_t rows, int64_t n, const float* w, const float* b, float eps, float* y);
    void (*relu)(float* x, int64_t count);
    void (*attention_row)(const cvl_relpos_problem* p, const cvl_relpos_row* row, float* s);
    int (*attention_tile)(const cvl_relpos_problem* p, int64_t b, int64_t h, int64_t t0, int64_t n, const float* q,
                          float* att, float* s);
} cvl_relpos_passes;

extern const cvl_relpos_passes cvl_relpos_avx2_passes, cvl_relpos_avx512_passes;

#endif
