/* bf16 convolutions (conv1d.h): the portable C against a reference written from the contract (W and x rounded to
 * bf16, padded rows, products summed in double), then every other variant the run may take against the portable C
 * (the same sums in the same order: equal but where the AVX-512 instruction flushes subnormal numbers, which these
 * inputs do not make), on edge shapes: odd channel counts (a pair's zero half), output channel counts around the
 * 6-row tiles, time lengths around the 64-step tiles and 3-tile tasks, asymmetric pads, dilations, taps of 1, batches,
 * outputs longer and shorter than the input, with and without bias, with and without a Snake activation of the input,
 * grouped convolutions (a group's output channels ending inside a tile), on threads and not. Also the packing, the rounding (ties to even, NaN kept) and the Snake's sin^2. */

#include "check.h"
#include "conv1d.h"

typedef struct {
    int64_t batch, c_in, c_out, t_in, taps, dilation, pad_left, pad_right, groups; /* groups 0: one */
} shape;

static const shape SHAPES[] = {
    {1, 1, 1, 1, 1, 1, 0, 0, 0},      {1, 2, 3, 5, 3, 1, 1, 1, 0},     {1, 3, 7, 17, 3, 1, 1, 1, 0},
    {2, 18, 6, 64, 7, 1, 3, 3, 0},    {1, 80, 13, 65, 7, 1, 3, 3, 0},  {1, 16, 12, 192, 11, 3, 15, 15, 0},
    {1, 9, 5, 193, 7, 5, 15, 15, 0},  {3, 4, 1, 100, 3, 5, 5, 5, 0},   {1, 6, 18, 257, 5, 1, 4, 0, 0},
    {1, 5, 8, 40, 3, 2, 0, 0, 0},     {2, 32, 32, 129, 1, 1, 0, 0, 0}, {1, 7, 11, 3, 7, 1, 3, 3, 0},
    /* grouped (the v3 DiT's position convolutions: 16 groups of 64, 31 taps, no pads): groups of output channels
     * that end inside a tile, one channel pair a group, odd output channels per group, several batches */
    {2, 64, 64, 95, 31, 1, 0, 0, 16}, {1, 8, 20, 70, 3, 1, 1, 1, 4}, {1, 4, 6, 33, 5, 2, 2, 2, 2},
    {3, 12, 9, 66, 7, 1, 3, 0, 3},
};

static int64_t groups_of(const shape* s) { return s->groups > 1 ? s->groups : 1; }

static float round_bf16(float v) {
    const uint32_t u = (uint32_t)cvl_bf16_of(v) << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

/* W is (c_out, c_in / groups, taps): output channel o reads the input channels of its group. */
static void reference(const shape* s, const float* x, const float* w, const float* bias, const float* alpha,
                      const float* inv_alpha, float* y, int64_t t_out) {
    const int64_t cig = s->c_in / groups_of(s), cog = s->c_out / groups_of(s);
    for (int64_t b = 0; b < s->batch; b++)
        for (int64_t o = 0; o < s->c_out; o++)
            for (int64_t t = 0; t < t_out; t++) {
                double acc = 0.0;
                for (int64_t k = 0; k < cig; k++)
                    for (int64_t j = 0; j < s->taps; j++) {
                        const int64_t at = t + j * s->dilation - s->pad_left, i = o / cog * cig + k;
                        if (at < 0 || at >= s->t_in) continue;
                        double v = x[(b * s->c_in + i) * s->t_in + at];
                        if (alpha) v += inv_alpha[i] * pow(sin(alpha[i] * v), 2.0);
                        acc += (double)round_bf16(w[(o * cig + k) * s->taps + j]) * (double)round_bf16((float)v);
                    }
                y[(b * s->c_out + o) * t_out + t] = (float)acc + (bias ? bias[o] : 0.f);
            }
}

static void run(const shape* s, const float* x, const uint32_t* packed, const float* bias, const float* alpha,
                const float* inv_alpha, float* y, cvl_features have, int threads) {
    cvl_conv1d_problem p = {s->batch, s->c_in, s->c_out, s->t_in, s->taps, s->dilation, s->pad_left, s->pad_right,
                            x, packed, bias, y, alpha, inv_alpha, s->groups};
    const cvl_exec ex = {have, 1, threads ? threads_parallel : NULL, NULL};
    CHECK(cvl_conv1d(&p, &ex) == 0, "cvl_conv1d failed");
}

static void check_rounding(void) {
    CHECK(cvl_bf16_of(1.0f) == 0x3f80, "1.0");
    CHECK(cvl_bf16_of(-2.0f) == 0xc000, "-2.0");
    uint32_t u = 0x3f808000u; /* halfway between 0x3f80 and 0x3f81: ties to even, down */
    float v;
    memcpy(&v, &u, 4);
    CHECK(cvl_bf16_of(v) == 0x3f80, "tie to even (down): %x", cvl_bf16_of(v));
    u = 0x3f818000u; /* halfway between 0x3f81 and 0x3f82: up to even */
    memcpy(&v, &u, 4);
    CHECK(cvl_bf16_of(v) == 0x3f82, "tie to even (up): %x", cvl_bf16_of(v));
    const uint16_t nan = cvl_bf16_of(NAN);
    CHECK((nan & 0x7f80) == 0x7f80 && (nan & 0x7f) != 0, "NaN stays NaN: %x", nan);
}

static void check_sin_squared(void) {
    double worst = 0.0;
    for (int i = -200000; i <= 200000; i++) {
        const float x = (float)i * 0.01f; /* +-2000: far past any alpha * x a vocoder's activations reach */
        const double err = fabs((double)cvl_sin_squared(x) - pow(sin((double)x), 2.0));
        if (err > worst) worst = err;
    }
    CHECK(worst < 1e-5, "sin^2 off by %g", worst);
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x5eed0c0d1ull};
    check_rounding();
    check_sin_squared();
    for (size_t n = 0; n < sizeof SHAPES / sizeof SHAPES[0]; n++) {
        const shape* s = &SHAPES[n];
        cvl_conv1d_problem probe = {s->batch, s->c_in, s->c_out, s->t_in, s->taps, s->dilation, s->pad_left,
                                    s->pad_right, NULL, NULL, NULL, NULL, NULL, NULL, s->groups};
        const int64_t t_out = cvl_conv1d_out_len(&probe);
        CHECK(t_out > 0, "shape %zu: output length %lld", n, (long long)t_out);
        const int64_t cig = s->c_in / groups_of(s);
        const size_t ny = (size_t)(s->batch * s->c_out * t_out), pairs = (size_t)((cig + 1) / 2);
        float* x = random_floats(&r, (size_t)(s->batch * s->c_in * s->t_in), 2.f);
        float* w = random_floats(&r, (size_t)(s->c_out * cig * s->taps), 0.5f);
        float* bias = random_floats(&r, (size_t)s->c_out, 1.f);
        uint32_t* packed = malloc(sizeof(uint32_t) * (size_t)s->taps * pairs * (size_t)s->c_out);
        cvl_conv1d_pack(w, s->c_out, cig, s->taps, packed);
        if (cig % 2) /* the last pair's high half is a zero channel */
            for (int64_t o = 0; o < s->c_out; o++) CHECK(packed[(pairs - 1) * (size_t)s->c_out + (size_t)o] >> 16 == 0, "pad");
        float *want = malloc(sizeof(float) * ny), *base = malloc(sizeof(float) * ny), *got = malloc(sizeof(float) * ny);
        float* alpha = random_floats(&r, (size_t)s->c_in, 2.f);
        float* inv_alpha = malloc(sizeof(float) * (size_t)s->c_in);
        for (int64_t i = 0; i < s->c_in; i++) inv_alpha[i] = 1.f / (alpha[i] + 1e-9f);
        for (int mode = 0; mode < 4; mode++) {
            const float* bb = mode & 1 ? bias : NULL;
            const float* aa = mode & 2 ? alpha : NULL;
            const float* ia = mode & 2 ? inv_alpha : NULL;
            reference(s, x, w, bb, aa, ia, want, t_out);
            run(s, x, packed, bb, aa, ia, base, 0, 0);
            /* the Snake's polynomial sin may move an input across a bf16 rounding boundary: a step of 2^-8 in a term */
            CHECK(worst_relative(base, want, ny, 1.0) < (aa ? 2e-2 : 1e-5), "shape %zu mode %d: portable against the reference", n, mode);
            FOR_EACH_VARIANT(&cvl_conv1d_variants, allowed, v) {
                for (int threads = 0; threads < 2; threads++) {
                    for (size_t i = 0; i < ny; i++) got[i] = NAN;
                    run(s, x, packed, bb, aa, ia, got, cvl_conv1d_variants.variants[v].needs, threads);
                    CHECK(memcmp(got, base, sizeof(float) * ny) == 0, "shape %zu mode %d: %s differs from portable", n,
                          mode, cvl_conv1d_variants.variants[v].name);
                }
            }
        }
        free(x), free(w), free(bias), free(packed), free(want), free(base), free(got), free(alpha), free(inv_alpha);
    }
    const shape odd = {1, 6, 4, 8, 3, 1, 1, 1, 2}; /* 3 input channels a group: a pair would span two groups */
    float x[6 * 8] = {0}, y[4 * 8];
    uint32_t packed[3 * 2 * 4] = {0};
    cvl_conv1d_problem bad = {odd.batch, odd.c_in, odd.c_out, odd.t_in, odd.taps, odd.dilation, odd.pad_left,
                              odd.pad_right, x, packed, NULL, y, NULL, NULL, odd.groups};
    const cvl_exec ex = {allowed, 1, NULL, NULL};
    CHECK(cvl_conv1d(&bad, &ex) == -2, "an odd count of input channels a group is refused");
    bad.groups = 3;
    CHECK(cvl_conv1d(&bad, &ex) == -2, "groups that do not divide the output channels are refused");
    report("conv1d", allowed);
    return 0;
}
