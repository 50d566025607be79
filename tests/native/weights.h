/* Random int8 weights for the C tests, packed as int8_matmul.h lays them out. */
#ifndef COSYVOICE_LITE_TEST_WEIGHTS_H
#define COSYVOICE_LITE_TEST_WEIGHTS_H

#include "check.h"
#include "int8_matmul.h"

/* A random int8 (k, n) weight, packed as int8_matmul.h lays it out, with its column sums. */
typedef struct {
    int8_t* w; /* k x n, row-major */
    int8_t* packed;
    int32_t* colsum;
} weight;

static inline weight make_weight(rng* r, int64_t k, int64_t n) {
    weight wt = {malloc((size_t)(k * n)), calloc(cvl_int8_packed_bytes(k, n), 1), NULL};
    const int64_t kq = (k + 3) / 4, panels = (n + 63) / 64;
    wt.colsum = calloc((size_t)(panels * 64), sizeof(int32_t));
    for (int64_t i = 0; i < k * n; i++) wt.w[i] = (int8_t)((int64_t)(rng_next(r) % 255) - 127);
    for (int64_t row = 0; row < k; row++)
        for (int64_t col = 0; col < n; col++) {
            const int64_t p = col / 64, c = col % 64, q = row / 4, j = row % 4;
            wt.packed[((p * kq + q) * 64 + c) * 4 + j] = wt.w[row * n + col];
            wt.colsum[col] += wt.w[row * n + col];
        }
    return wt;
}

static inline void free_weight(weight* wt) {
    free(wt->w);
    free(wt->packed);
    free(wt->colsum);
}

/* A cvl_int8_weight over `wt` with one scale or one per column, and a bias or none (the arrays are the caller's). */
static inline cvl_int8_weight int8_weight(const weight* wt, int64_t n, const float* scales, int64_t scale_count,
                                          const float* bias) {
    return (cvl_int8_weight){n, wt->packed, wt->colsum, scales, scale_count, bias};
}

/* A weight with its scales and bias, owned together (the fused layers' tests). */
typedef struct {
    weight wt;
    float* scales;
    float* bias;
    cvl_int8_weight w;
} owned_weight;

/* A k -> n weight: scales ~0.5 / sqrt(k) (per column or one), a small bias or none. */
static inline owned_weight owned(rng* r, int64_t k, int64_t n, int per_column, int with_bias) {
    owned_weight o = {make_weight(r, k, n), random_floats(r, (size_t)n, 0.f), NULL, {0}};
    const float base = 0.5f / 127.f / sqrtf((float)k);
    for (int64_t i = 0; i < n; i++) o.scales[i] = base * (1.f + 0.5f * rng_float(r));
    o.bias = with_bias ? random_floats(r, (size_t)n, 0.1f) : NULL;
    o.w = int8_weight(&o.wt, n, o.scales, per_column ? n : 1, o.bias);
    return o;
}

static inline void free_owned(owned_weight* o) {
    free_weight(&o->wt);
    free(o->scales);
    free(o->bias);
}

#endif
