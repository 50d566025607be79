/* y = x · W for int8 weights and float32 activations quantized per row to uint8 (the LLM decode step's projections). */
#ifndef COSYVOICE_LITE_INT8_MATMUL_H
#define COSYVOICE_LITE_INT8_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "exec.h"
#include "op.h"

/* Weights come packed in panels of 64 output columns, each panel K4 = ceil(k/4) groups of 64 columns x 4 rows of W:
 *   packed[((p * K4 + q) * 64 + c) * 4 + j] = W[4q + j][64p + c]   (zero where 4q + j >= k or 64p + c >= n)
 * so a panel is read front to back (export/native_twin.py writes it; cvl_int8_packed_bytes gives its size).
 * colsum[c] = sum over rows of W[.][c] for the padded columns (int32), w_scale the weights' one scale (zero point 0)
 * or w_scales one per column.
 *
 * Each row of x is quantized on its own exactly as ONNX's DynamicQuantizeLinear quantizes a tensor (range widened to
 * include 0, scale = range / 255, zero point rounded half to even, values rounded half to even and saturated), so
 * with one row the result is ONNX Runtime's DynamicQuantizeLinear + MatMulInteger + scale (+ bias), and a row's
 * result never depends on the other rows of a batch. */
typedef struct {
    int64_t rows, k, n;
    const float* x;        /* rows x k */
    const int8_t* packed;  /* cvl_int8_packed_bytes(k, n) */
    const int32_t* colsum; /* ceil(n/64)*64 */
    float w_scale;
    const float* bias; /* n, or NULL */
    float* y;          /* rows x n */
    /* n scales, one per column (products side by side, e.g. q | k | v, each quantized with its own scale), or NULL:
     * w_scale for every column. A column's result is the same either way. */
    const float* w_scales;
    /* With y_parts: output columns [i * part_n, (i + 1) * part_n) go to y_parts[i] (rows x part_n each) instead of y;
     * part_n a multiple of 16. */
    float* const* y_parts;
    int64_t part_n;
    /* Floats from one row of x to the next; 0: k (rows side by side). Less than k reads overlapping windows: with
     * x a (T, C) time-major signal, k = W * C and x_stride = C, row m is frames m .. m + W - 1 side by side, the
     * im2col row of a width-W convolution, without building it. */
    int64_t x_stride;
} cvl_int8_problem;

size_t cvl_int8_packed_bytes(int64_t k, int64_t n);

/* The code paths, by the features of `ex->have`: portable C (the reference: the same integer sums, so the same
 * results bit for bit), AVX2 (int16 pair products with exact int32 sums, a tile of up to 4 rows x 16 columns),
 * AVX-512 VNNI (a tile of up to 6 rows shares every weight load), AMX-INT8 (products of 8 rows or more as tile
 * products over the same panels; fewer rows take the VNNI code). */
extern const cvl_variants cvl_int8_matmul_variants;

/* 0 on success, -1 when the work buffer cannot be allocated. */
int cvl_int8_matmul(const cvl_int8_problem* p, const cvl_exec* ex);

/* A packed int8 weight as the fused kernels hold it, with n output columns: scales holds 1 scale, or n (one per column). */
typedef struct {
    int64_t n;
    const int8_t* packed;
    const int32_t* colsum;
    const float* scales;
    int64_t scale_count;
    const float* bias; /* n, or NULL */
} cvl_int8_weight;

/* y = x . w (rows x k -> rows x w->n), or with `parts` (3 buffers) its column thirds into parts[0..2] (q, k, v side by
 * side): cvl_int8_matmul over the weight's scale(s) and bias. */
int cvl_int8_weight_matmul(const float* x, int64_t rows, int64_t k, const cvl_int8_weight* w, float* y, float* const* parts,
                           const cvl_exec* ex);

/* y[i] = x . ws[i] for `count` weights of the same k, x quantized once (the rows' quantization depends on x alone, so
 * each result is cvl_int8_weight_matmul's bit for bit): q, k and v, or gate and up, of one RMSNorm output. */
int cvl_int8_weight_matmuls(const float* x, int64_t rows, int64_t k, const cvl_int8_weight* const* ws, float* const* ys,
                            int count, const cvl_exec* ex);

#endif
