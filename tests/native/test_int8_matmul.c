/* Int8 products (int8_matmul.h): the portable C against a reference written from the contract (ONNX's
 * DynamicQuantizeLinear per row, exact integer sums, the scales and bias), then every other variant the run may take
 * against the portable C bit for bit (the integer sums are the same, so is the float epilogue), on edge shapes: K not
 * a multiple of 4 (nor of 32 or 64), N tails under 8, 16 and 64 and whole panels, every row count from 1 to 13 (the
 * 4-row AVX2 and 6-row VNNI tiles' remainders) and around the 8/16/32-row AMX blocks, windows read in place,
 * per-column scales, outputs in parts, one quantization for several products, spread tasks. */

#include "check.h"
#include "int8_matmul.h"
#include "weights.h"

typedef struct {
    int64_t rows, k, n;
} shape;

static const shape SHAPES[] = {
    {1, 1, 1}, {1, 3, 5}, {2, 7, 64}, {5, 30, 10}, {6, 256, 128}, {7, 100, 200}, {8, 64, 65}, {13, 520, 300},
    {16, 64, 64}, {17, 33, 130}, {32, 96, 64}, {33, 100, 70}, {40, 4, 16}, {3, 1024, 17},
};

/* Rows of x with the cases quantization must get right: zeros, one sign only, a constant, ties, large values. */
static float* make_rows(rng* r, int64_t rows, int64_t k) {
    float* x = random_floats(r, (size_t)(rows * k), 3.f);
    for (int64_t i = 0; i < k; i++) {
        if (rows > 1) x[k + i] = 0.f;                         /* row 1: all zeros (scale 1) */
        if (rows > 2) x[2 * k + i] = fabsf(x[2 * k + i]);      /* row 2: no negative value (zero point 0) */
        if (rows > 3) x[3 * k + i] = -0.5f;                    /* row 3: a constant */
        if (rows > 4) x[4 * k + i] = (float)(i % 7) * 0.5f;    /* row 4: values on the quantization grid */
        if (rows > 5) x[5 * k + i] *= 1e4f;                    /* row 5: large */
    }
    return x;
}

/* The reference: per-row DynamicQuantizeLinear (range widened to 0, scale range/255, zero point and values rounded
 * half to even, saturated), exact integer sums, then (sum - zp * colsum) * scale * w_scale(col) + bias. */
static void reference(const float* x, int64_t rows, int64_t k, int64_t stride, const weight* wt, int64_t n,
                      const float* scales, int per_column, const float* bias, float* y) {
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * stride;
        float lo = 0.f, hi = 0.f;
        for (int64_t i = 0; i < k; i++) {
            lo = fminf(lo, row[i]);
            hi = fmaxf(hi, row[i]);
        }
        const float scale = hi == lo ? 1.f : (hi - lo) / 255.f;
        const float zpf = fminf(fmaxf(0.f - lo / scale, 0.f), 255.f);
        const int32_t zp = (int32_t)nearbyintf(zpf);
        for (int64_t col = 0; col < n; col++) {
            int64_t acc = 0;
            for (int64_t i = 0; i < k; i++) {
                const float v = fminf(fmaxf(nearbyintf(row[i] / scale) + (float)zp, 0.f), 255.f);
                acc += (int64_t)v * wt->w[i * n + col];
            }
            const float s = per_column ? scale * scales[col] : scale * scales[0];
            const float v = (float)(acc - (int64_t)zp * wt->colsum[col]) * s;
            y[r * n + col] = bias ? v + bias[col] : v;
        }
    }
}

static void run_product(const float* x, int64_t rows, int64_t k, int64_t stride, const weight* wt, int64_t n,
                        const float* scales, int per_column, const float* bias, float* y, cvl_features have,
                        int spread) {
    cvl_int8_problem p = {.rows = rows, .k = k, .n = n, .x = x, .packed = wt->packed, .colsum = wt->colsum,
                          .w_scale = scales[0], .bias = bias, .y = y, .w_scales = per_column ? scales : NULL,
                          .x_stride = stride == k ? 0 : stride};
    const cvl_exec ex = {have, spread, threads_parallel, NULL};
    CHECK(cvl_int8_matmul(&p, &ex) == 0, "cvl_int8_matmul failed");
}

/* One shape (optionally a window of `window` frames read in place) on every allowed variant. */
static void check_shape(rng* r, shape s, int window, int per_column, int with_bias, cvl_features allowed) {
    const int64_t channels = s.k, k = s.k * window, frames = s.rows + window - 1;
    weight wt = make_weight(r, k, s.n);
    float* x = make_rows(r, frames, channels);
    float* scales = random_floats(r, (size_t)s.n, 0.01f);
    for (int64_t i = 0; i < s.n; i++) scales[i] = fabsf(scales[i]) + 1e-4f;
    float* bias = with_bias ? random_floats(r, (size_t)s.n, 1.f) : NULL;
    const int64_t stride = window > 1 ? channels : k, count = s.rows * s.n;
    float* want = malloc((size_t)count * sizeof(float));
    float* portable = malloc((size_t)count * sizeof(float));
    float* got = malloc((size_t)count * sizeof(float));
    reference(x, s.rows, k, stride, &wt, s.n, scales, per_column, bias, want);
    run_product(x, s.rows, k, stride, &wt, s.n, scales, per_column, bias, portable, 0, 1);
    CHECK(worst_relative(portable, want, (size_t)count, 1e-3) < 1e-5, "portable vs reference, rows %ld k %ld n %ld",
          (long)s.rows, (long)k, (long)s.n);
    const cvl_variants* v = &cvl_int8_matmul_variants;
    FOR_EACH_VARIANT(v, allowed, i) {
        for (int spread = 1; spread <= 4; spread += 3) {
            memset(got, 0xff, (size_t)count * sizeof(float));
            run_product(x, s.rows, k, stride, &wt, s.n, scales, per_column, bias, got, v->variants[i].needs, spread);
            CHECK(memcmp(got, portable, (size_t)count * sizeof(float)) == 0,
                  "%s differs from portable: rows %ld k %ld n %ld window %d spread %d", v->variants[i].name,
                  (long)s.rows, (long)k, (long)s.n, window, spread);
        }
    }
    free(want), free(portable), free(got), free(x), free(scales), free(bias);
    free_weight(&wt);
}

/* q | k | v side by side in one product written to three buffers equals three separate products. */
static void check_parts_and_shared_quantization(rng* r, cvl_features allowed) {
    const int64_t rows = 9, k = 70, part = 32, n = 3 * part;
    weight wt = make_weight(r, k, n);
    float* x = make_rows(r, rows, k);
    float scale = 0.02f;
    float* whole = malloc((size_t)(rows * n) * sizeof(float));
    float* parts[3];
    for (int i = 0; i < 3; i++) parts[i] = malloc((size_t)(rows * part) * sizeof(float));
    const cvl_variants* v = &cvl_int8_matmul_variants;
    FOR_EACH_VARIANT(v, allowed, i) {
        const cvl_exec ex = {v->variants[i].needs, 1, threads_parallel, NULL};
        const cvl_int8_weight w = {n, wt.packed, wt.colsum, &scale, 1, NULL};
        CHECK(cvl_int8_weight_matmul(x, rows, k, &w, whole, NULL, &ex) == 0, "whole");
        CHECK(cvl_int8_weight_matmul(x, rows, k, &w, NULL, parts, &ex) == 0, "parts");
        for (int64_t r0 = 0; r0 < rows; r0++)
            for (int p = 0; p < 3; p++)
                CHECK(memcmp(parts[p] + r0 * part, whole + r0 * n + p * part, (size_t)part * sizeof(float)) == 0,
                      "%s: part %d of row %ld", v->variants[i].name, p, (long)r0);
        const cvl_int8_weight* ws[2] = {&w, &w};
        float* ys[2] = {parts[0], parts[1]};
        float* big[2] = {malloc((size_t)(rows * n) * sizeof(float)), malloc((size_t)(rows * n) * sizeof(float))};
        ys[0] = big[0], ys[1] = big[1];
        CHECK(cvl_int8_weight_matmuls(x, rows, k, ws, ys, 2, &ex) == 0, "matmuls");
        for (int j = 0; j < 2; j++)
            CHECK(memcmp(big[j], whole, (size_t)(rows * n) * sizeof(float)) == 0, "%s: shared quantization %d",
                  v->variants[i].name, j);
        free(big[0]), free(big[1]);
    }
    for (int i = 0; i < 3; i++) free(parts[i]);
    free(whole), free(x);
    free_weight(&wt);
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x9e3779b97f4a7c15ull};
    CHECK(cvl_int8_matmul_variants.variants[0].needs == 0, "variant 0 is the portable C");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        check_shape(&r, SHAPES[i], 1, (int)(i % 2), (int)(i % 3 != 0), allowed);
        if (SHAPES[i].k <= 256) check_shape(&r, SHAPES[i], 3, (int)(i % 2 == 0), 1, allowed); /* a width-3 window */
    }
    for (int64_t rows = 1; rows <= 13; rows++) { /* every remainder of the 4-row (AVX2) and 6-row (VNNI) tiles */
        check_shape(&r, (shape){rows, 100, 128}, 1, (int)(rows % 2), (int)(rows % 3 != 0), allowed); /* whole panels */
        check_shape(&r, (shape){rows, 37, 72}, rows % 4 == 1 ? 2 : 1, (int)(rows % 2 == 0), 1, allowed);
    }
    check_parts_and_shared_quantization(&r, allowed);
    const cvl_exec ex = {allowed, 1, NULL, NULL};
    cvl_int8_problem empty = {.rows = 0, .k = 4, .n = 4};
    CHECK(cvl_int8_matmul(&empty, &ex) == 0, "no rows is no work");
    report("test_int8_matmul", allowed);
    return 0;
}
