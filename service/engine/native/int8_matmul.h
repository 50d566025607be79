/* y = x · W for int8 weights and float32 activations quantized per row to uint8 (the LLM decode step's projections). */
#ifndef COSYVOICE_LITE_INT8_MATMUL_H
#define COSYVOICE_LITE_INT8_MATMUL_H

#include <stddef.h>
#include <stdint.h>

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

/* Runs task(ctx, i) for i in [0, tasks), possibly on several threads, and returns when all are done. */
typedef void (*cvl_task_fn)(void* ctx, size_t i);
typedef void (*cvl_parallel_fn)(void* runner, cvl_task_fn task, void* ctx, size_t tasks);

size_t cvl_int8_packed_bytes(int64_t k, int64_t n);

/* 0 on success, -1 when the work buffer cannot be allocated. `parallel` may be NULL (one thread). */
int cvl_int8_matmul(const cvl_int8_problem* p, cvl_parallel_fn parallel, void* runner);

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
                           cvl_parallel_fn parallel, void* runner);

/* y[i] = x . ws[i] for `count` weights of the same k, x quantized once (the rows' quantization depends on x alone, so
 * each result is cvl_int8_weight_matmul's bit for bit): q, k and v, or gate and up, of one RMSNorm output. */
int cvl_int8_weight_matmuls(const float* x, int64_t rows, int64_t k, const cvl_int8_weight* const* ws, float* const* ys,
                            int count, cvl_parallel_fn parallel, void* runner);
/* 1 when cvl_int8_matmul takes its AVX-512 VNNI kernel on this CPU, 0 when the portable one. */
int cvl_int8_fast_kernel(void);

/* How many tasks a product of one row tile (a decode step's few rows) is split into from now on, in this process:
 * 1 (the default) runs it on the calling thread, which streams most of the weights one core can read and leaves the
 * other cores to the flow; more share its weight panels over the caller's threads (`parallel`), for a caller that
 * knows they are idle. Clamped to 1..16; a result never depends on it (each panel's sums are the same). */
void cvl_int8_set_spread(int tasks);

#endif
