/* The int8 flow-cache frames (frame_codec.h): narrowing and widening give the same bits on every path (AVX2 + F16C and
 * the portable C), and the portable C is the numpy arithmetic written out (scale = max |x| / 127, quotient rounded
 * half to even; product in float32 rounded once), for float16 and float32, rows of several lengths, zero rows, and
 * values at the extremes of float16. */

#include "check.h"
#include "frame_codec.h"
#include "half.h"

enum { ROWS = 37 };

static void reference_narrow(const float* v, int64_t dim, int8_t* q, float* scale) {
    float amax = 0.f;
    for (int64_t j = 0; j < dim; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    const float s = amax > 0.f ? amax / 127.0f : 1.0f;
    for (int64_t j = 0; j < dim; j++) q[j] = (int8_t)rintf(v[j] / s);
    *scale = s;
}

static void check_dim(rng* r, cvl_features have, int64_t dim) {
    const int64_t n = ROWS * dim;
    float* x = random_floats(r, (size_t)n, 1.0f);
    uint16_t* h = malloc((size_t)n * sizeof *h);
    float* hx = malloc((size_t)n * sizeof *hx);
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = i / dim;
        x[i] *= row == 0 ? 0.f : row == 1 ? 60000.f : row == 2 ? 1e-6f : (float)(row % 7 + 1) * 3.3f;
        h[i] = cvl_float_to_half(x[i]);
        hx[i] = cvl_half_to_float(h[i]);
    }
    int8_t *q = malloc((size_t)n), *qp = malloc((size_t)n), *qr = malloc((size_t)n);
    float *s = malloc(ROWS * sizeof *s), *sp = malloc(ROWS * sizeof *sp), *sr = malloc(ROWS * sizeof *sr);
    float *w = malloc((size_t)n * sizeof *w), *wp = malloc((size_t)n * sizeof *wp);
    uint16_t *wh = malloc((size_t)n * sizeof *wh), *whp = malloc((size_t)n * sizeof *whp);
    for (int half = 0; half < 2; half++) {
        const float* values = half ? hx : x;
        for (int64_t row = 0; row < ROWS; row++) reference_narrow(values + row * dim, dim, qr + row * dim, sr + row);
        cvl_frames_limit(0);
        if (half) cvl_frames_narrow_f16(h, ROWS, dim, qp, sp); else cvl_frames_narrow_f32(x, ROWS, dim, qp, sp);
        cvl_frames_limit(have);
        if (half) cvl_frames_narrow_f16(h, ROWS, dim, q, s); else cvl_frames_narrow_f32(x, ROWS, dim, q, s);
        CHECK(!memcmp(qp, qr, (size_t)n) && !memcmp(sp, sr, ROWS * sizeof *sr), "portable narrow (half %d, dim %ld)", half, (long)dim);
        CHECK(!memcmp(q, qp, (size_t)n) && !memcmp(s, sp, ROWS * sizeof *s), "narrow paths differ (half %d, dim %ld)", half, (long)dim);
        CHECK(sp[0] == 1.0f, "a zero row's scale is 1");
    }
    for (int64_t i = 0; i < n; i++) wp[i] = (float)qr[i] * sr[i / dim]; /* the reference widening */
    cvl_frames_limit(have);
    cvl_frames_widen_f32(qr, sr, ROWS, dim, w);
    cvl_frames_widen_f16(qr, sr, ROWS, dim, wh);
    cvl_frames_limit(0);
    cvl_frames_widen_f16(qr, sr, ROWS, dim, whp);
    CHECK(!memcmp(w, wp, (size_t)n * sizeof *w), "widen f32 (dim %ld)", (long)dim);
    for (int64_t i = 0; i < n; i++) CHECK(whp[i] == cvl_float_to_half(wp[i]) && wh[i] == whp[i], "widen f16 at %ld", (long)i);
    /* the same rows as 3 blocks (12, 12 and 13 rows of the first 37) widened in one call into strided blocks: each block
     * as its own rows widen (the last row of each output block left alone, so a stride past the rows is honoured) */
    enum { BLOCKS = 3, BROWS = 12 };
    float* wb = malloc((size_t)BLOCKS * (BROWS + 1) * (size_t)dim * sizeof *wb);
    uint16_t* whb = malloc((size_t)BLOCKS * (BROWS + 1) * (size_t)dim * sizeof *whb);
    for (int64_t i = 0; i < BLOCKS * (BROWS + 1) * dim; i++) wb[i] = -7.f, whb[i] = 0x1234;
    cvl_frames_limit(have);
    cvl_frames_widen_blocks_f32(qr, BLOCKS, BROWS * dim, sr, BROWS, BROWS, dim, wb, (BROWS + 1) * dim);
    cvl_frames_widen_blocks_f16(qr, BLOCKS, BROWS * dim, sr, BROWS, BROWS, dim, whb, (BROWS + 1) * dim);
    for (int64_t b = 0; b < BLOCKS; b++)
        for (int64_t i = 0; i < (BROWS + 1) * dim; i++) {
            const int64_t at = b * (BROWS + 1) * dim + i, from = b * BROWS * dim + i;
            const int pad = i >= BROWS * dim;
            CHECK(pad ? wb[at] == -7.f : wb[at] == wp[from], "widen blocks f32 (block %ld, at %ld)", (long)b, (long)i);
            CHECK(pad ? whb[at] == 0x1234 : whb[at] == whp[from], "widen blocks f16 (block %ld, at %ld)", (long)b, (long)i);
        }
    free(wb), free(whb);
    free(x), free(h), free(hx), free(q), free(qp), free(qr), free(s), free(sp), free(sr), free(w), free(wp), free(wh), free(whp);
}

static void check_half_rounding(void) {
    /* round half to even at a tie, the largest finite half, overflow, the smallest subnormal and below it */
    CHECK(cvl_float_to_half(1.0f + 1.0f / 2048.0f) == 0x3c00, "tie rounds to even (down)");
    CHECK(cvl_float_to_half(1.0f + 3.0f / 2048.0f) == 0x3c02, "tie rounds to even (up)");
    CHECK(cvl_float_to_half(65504.0f) == 0x7bff && cvl_float_to_half(65520.0f) == 0x7c00, "the top of the range");
    CHECK(cvl_float_to_half(5.9604645e-8f) == 0x0001 && cvl_float_to_half(2.9802322e-8f) == 0x0000, "subnormals");
    CHECK(cvl_float_to_half(-2.0f) == 0xc000, "sign");
    for (uint32_t bits = 0; bits < 0x7c00; bits += 7) CHECK(cvl_float_to_half(cvl_half_to_float((uint16_t)bits)) == bits, "round trip %u", bits);
}

int main(int argc, char** argv) {
    const cvl_features have = run_features(argc, argv);
    rng r = {0x9e3779b97f4a7c15ull};
    check_half_rounding();
    const int64_t dims[] = {64, 8, 24, 5, 512, 520};
    for (size_t i = 0; i < sizeof dims / sizeof *dims; i++) check_dim(&r, have, dims[i]);
    printf("frame codec (features 0x%x): %d checks passed\n", (unsigned)(have & (CVL_AVX2 | CVL_F16C)), checks_run);
    return 0;
}
