/* What the int8 product's code paths share (int8_matmul.c: portable, AVX-512 VNNI and AMX; int8_matmul_avx2.c): the
 * job of one call's rows, where a result goes, the per-row quantization's parameters. */
#ifndef COSYVOICE_LITE_INT8_MATMUL_PARTS_H
#define COSYVOICE_LITE_INT8_MATMUL_PARTS_H

#include <math.h>
#include <stdint.h>

#include "int8_matmul.h"

#define CVL_INT8_PANEL 64 /* output columns per panel (int8_matmul.h's packed layout) */

typedef struct {
    const cvl_int8_problem* p;
    int64_t kq, kp, panels; /* groups of 4 weight rows, padded row length of xq, panels of 64 columns */
    uint8_t* xq;            /* rows x kp */
    int16_t* xw;            /* avx2: rows x kp, the quantized rows widened to int16 (xq then unused) */
    float* xr;              /* per-row scale of the quantized rows */
    float* xs;              /* per-row scale x w_scale (per-row scale alone with w_scales) */
    int32_t* xzp;           /* per-row zero point */
    int64_t tasks, row_tasks;
    int fast, amx; /* amx: xq rows padded with zeros to a multiple of 16, kp a multiple of 64 (amx.h) */
    int avx2;      /* AVX2 without AVX-512 VNNI: int8_matmul_avx2.c on xw */
    int spread;    /* cvl_exec.spread */
} cvl_int8_job;

/* Where the result of row `row`, column `col` goes. */
static inline float* cvl_int8_out_at(const cvl_int8_problem* p, int64_t row, int64_t col) {
    if (p->y_parts == NULL) return p->y + row * p->n + col;
    int64_t part = col / p->part_n;
    return p->y_parts[part] + row * p->part_n + (col - part * p->part_n);
}

/* DynamicQuantizeLinear's scale and zero point of a row whose values lie in [lo, hi]. */
static inline void cvl_int8_row_params(float lo, float hi, float* scale, int32_t* zp) {
    lo = lo < 0.f ? lo : 0.f;
    hi = hi > 0.f ? hi : 0.f;
    float s = hi == lo ? 1.f : (hi - lo) / 255.f;
    float z = 0.f - lo / s;
    z = z < 0.f ? 0.f : (z > 255.f ? 255.f : z);
    *scale = s;
    *zp = (int32_t)nearbyintf(z); /* the default rounding mode: half to even */
}

/* The AVX2 code (int8_matmul_avx2.c): one row quantized into int16 values (kp of them, zeros past k), bit for bit the
 * portable quantization; one panel times every row of the job, the same integer sums and float epilogue as the
 * portable C. */
void cvl_int8_quantize_row_avx2(const float* x, int64_t k, int64_t kp, int16_t* q, float* scale, int32_t* zp);
void cvl_int8_panel_avx2(const cvl_int8_job* jb, int64_t panel);

#endif
