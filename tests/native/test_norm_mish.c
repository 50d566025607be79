/* A ResNet block's norm and Mish (norm_mish.h): every variant the run may take against a reference written from the
 * contract in double (the norm's moments over the group's channels and frames or a frame's channels, the affine, Mish
 * as log1p and tanh, the mask, the addend), on LayerNorm and GroupNorm layouts, channel counts off the vector width,
 * one frame, groups of one channel, every addend shape, with and without a mask, in place, on threads and not; Mish
 * itself over the whole float range (no overflow, the sign of its tiny values); and the shapes it refuses. */

#include "check.h"
#include "norm_mish.h"

typedef struct {
    int64_t batch, channels, frames, groups;
    int mask;
    cvl_add_shape add;
} shape;

static const shape SHAPES[] = {
    {1, 256, 50, 0, 0, CVL_ADD_PER_CHANNEL}, {2, 256, 7, 0, 0, CVL_ADD_FULL}, {1, 19, 1, 0, 0, CVL_ADD_NONE},
    {3, 37, 33, 0, 0, CVL_ADD_PER_CHANNEL},  {1, 256, 206, 8, 1, CVL_ADD_PER_CHANNEL}, {2, 256, 31, 8, 1, CVL_ADD_FULL},
    {1, 24, 1, 8, 0, CVL_ADD_NONE},          {2, 6, 17, 6, 1, CVL_ADD_FULL},  {1, 10, 45, 2, 0, CVL_ADD_PER_CHANNEL},
};

static double mish_reference(double v) { return v * tanh(v > 30.0 ? v : log1p(exp(v))); }

static void reference(const shape* s, const float* x, const float* gamma, const float* beta, const float* mask,
                      const float* add, float eps, float* y) {
    const int64_t c = s->channels, t = s->frames, g = s->groups ? s->groups : 1, per = c / g;
    for (int64_t b = 0; b < s->batch; b++)
        for (int64_t run = 0; run < (s->groups ? g : t); run++) {
            /* the values one set of moments covers: a group's channels over all frames, or one frame's channels */
            double sum = 0.0, sq = 0.0;
            const int64_t n = s->groups ? per * t : c;
            for (int64_t i = 0; i < n; i++) {
                const int64_t ch = s->groups ? run * per + i / t : i, fr = s->groups ? i % t : run;
                sum += x[s->groups ? (b * c + ch) * t + fr : (b * t + fr) * c + ch];
            }
            const double mean = sum / (double)n;
            for (int64_t i = 0; i < n; i++) {
                const int64_t ch = s->groups ? run * per + i / t : i, fr = s->groups ? i % t : run;
                const double d = x[s->groups ? (b * c + ch) * t + fr : (b * t + fr) * c + ch] - mean;
                sq += d * d;
            }
            const double sd = sqrt(sq / (double)n + eps);
            for (int64_t i = 0; i < n; i++) {
                const int64_t ch = s->groups ? run * per + i / t : i, fr = s->groups ? i % t : run;
                const int64_t at = s->groups ? (b * c + ch) * t + fr : (b * t + fr) * c + ch;
                double v = mish_reference((x[at] - mean) / sd * gamma[ch] + beta[ch]);
                if (mask) v *= mask[b * t + fr];
                if (s->add == CVL_ADD_FULL) v += add[at];
                if (s->add == CVL_ADD_PER_CHANNEL) v += add[b * c + ch];
                y[at] = (float)v;
            }
        }
}

static void check_shape(const shape* s, cvl_features allowed, rng* r) {
    const size_t n = (size_t)(s->batch * s->channels * s->frames);
    float* x = random_floats(r, n, 3.f);
    for (size_t i = 0; i < n; i += 7) x[i] += 2.f; /* a mean off zero */
    float* gamma = random_floats(r, (size_t)s->channels, 2.f);
    float* beta = random_floats(r, (size_t)s->channels, 1.f);
    float* mask = s->mask ? random_floats(r, (size_t)(s->batch * s->frames), 1.f) : NULL;
    float* add = s->add == CVL_ADD_FULL            ? random_floats(r, n, 1.f)
                 : s->add == CVL_ADD_PER_CHANNEL ? random_floats(r, (size_t)(s->batch * s->channels), 1.f)
                                                 : NULL;
    float* want = malloc(n * sizeof(float));
    float* got = malloc(n * sizeof(float));
    const float eps = 1e-5f;
    reference(s, x, gamma, beta, mask, add, eps, want);
    FOR_EACH_VARIANT(&cvl_norm_mish_variants, allowed, v) {
        for (int threads = 0; threads < 3; threads++) {
            const int in_place = threads == 2;
            if (in_place) memcpy(got, x, n * sizeof(float));
            const cvl_norm_mish_problem p = {s->batch, s->channels, s->frames, s->groups, eps, in_place ? got : x, gamma,
                                             beta, mask, add, s->add, got};
            const cvl_exec ex = {cvl_norm_mish_variants.variants[v].needs, 1, threads ? threads_parallel : NULL, NULL};
            CHECK(cvl_norm_mish(&p, &ex) == 0, "shape (%lld, %lld, %lld, %lld)", (long long)s->batch,
                  (long long)s->channels, (long long)s->frames, (long long)s->groups);
            const double worst = worst_relative(got, want, n, 0.1);
            CHECK(worst < 2e-5, "%s, shape (%lld, %lld, %lld) groups %lld, threads %d: worst relative error %g",
                  cvl_norm_mish_variants.variants[v].name, (long long)s->batch, (long long)s->channels,
                  (long long)s->frames, (long long)s->groups, threads, worst);
        }
    }
    free(x), free(gamma), free(beta), free(mask), free(add), free(want), free(got);
}

/* Mish over the float range, through each variant (a one-channel LayerNorm with gamma 0 and beta the value). */
static void check_mish_range(cvl_features allowed) {
    static const float VALUES[] = {-1e30f, -100.f, -88.f, -20.f, -3.f, -1e-3f, -1e-30f, 0.f, 1e-30f, 1e-3f, 0.5f,
                                   3.f,    20.f,   88.f,  100.f, 1e30f};
    enum { N = sizeof VALUES / sizeof VALUES[0] };
    for (int i = 0; i < N; i++) {
        const double want = mish_reference((double)VALUES[i]);
        const float scalar = cvl_mish(VALUES[i]);
        CHECK(isfinite(scalar) && fabs(scalar - want) <= 1e-6 * fabs(want) + 1e-30, "mish(%g) = %g, want %g",
              (double)VALUES[i], (double)scalar, want);
        FOR_EACH_VARIANT(&cvl_norm_mish_variants, allowed, v) {
            float x[1] = {1.f}, gamma[1] = {0.f}, y[1];
            const cvl_norm_mish_problem p = {1, 1, 1, 0, 1e-5f, x, gamma, &VALUES[i], NULL, NULL, CVL_ADD_NONE, y};
            const cvl_exec ex = {cvl_norm_mish_variants.variants[v].needs, 1, NULL, NULL};
            CHECK(cvl_norm_mish(&p, &ex) == 0, "one value");
            CHECK(isfinite(y[0]) && fabs(y[0] - want) <= 2e-6 * fabs(want) + 1e-30, "%s: mish(%g) = %g, want %g",
                  cvl_norm_mish_variants.variants[v].name, (double)VALUES[i], (double)y[0], want);
        }
    }
}

static void check_refusals(void) {
    float x[12] = {0}, g[6] = {0}, y[12];
    const cvl_exec ex = {0, 1, NULL, NULL};
    cvl_norm_mish_problem p = {1, 6, 2, 4, 1e-5f, x, g, g, NULL, NULL, CVL_ADD_NONE, y};
    CHECK(cvl_norm_mish(&p, &ex) == -2, "4 groups of 6 channels");
    p.groups = 0;
    p.mask = x;
    CHECK(cvl_norm_mish(&p, &ex) == -2, "a mask with LayerNorm");
    p.mask = NULL;
    p.add_shape = CVL_ADD_FULL;
    CHECK(cvl_norm_mish(&p, &ex) == -2, "an add shape without an addend");
    p.add_shape = CVL_ADD_NONE;
    p.frames = 0;
    CHECK(cvl_norm_mish(&p, &ex) == 0, "no frames: nothing to do");
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x9e3779b97f4a7c15ull};
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) check_shape(&SHAPES[i], allowed, &r);
    check_mish_range(allowed);
    check_refusals();
    report("norm_mish", allowed);
    return 0;
}
