/* Cached chunk-masked attention (cached_attention.h): the portable C against a float64 reference of the contract
 * (new frame i at position C+i sees every cached position and new position C+j iff floor((C+j)/chunk) <=
 * floor((C+i)/chunk)), then every other variant the run may take against the portable C (within the bf16 products'
 * tolerance; the float32 AVX2 kernel within 1e-5), on edge shapes: no cache, one frame, chunk 1 and chunks longer than
 * the call (INT64_MAX: full attention, the mode a non-causal estimator's twin runs in), frame counts around the
 * 8/16-lane and 32/64-frame tiles, odd and long cache lengths, head sizes the fast kernels hold (16, 32, 64; AVX2:
 * multiples of 8 up to 64) and others. */

#include "cached_attention.h"
#include "check.h"
#include "half.h"

typedef struct {
    int batch, frames, cached, heads, head_dim;
    int64_t chunk;
} shape;

static const shape SHAPES[] = {
    {1, 1, 0, 1, 16, 1},  {1, 5, 0, 2, 16, 2},  {2, 7, 3, 2, 32, 3},    {1, 50, 200, 8, 64, 25}, {1, 64, 10, 1, 64, 100},
    {1, 65, 31, 2, 32, 4}, {2, 70, 17, 2, 16, 7}, {1, 3, 5, 2, 8, 2},   {1, 6, 0, 1, 24, 1000},  {1, 17, 1, 3, 64, 1},
    {1, 1, 900, 2, 64, 50}, {2, 33, 601, 2, 32, 25}, {1, 9, 0, 2, 64, 4}, {1, 13, 40, 1, 48, 5}, {1, 4, 7, 2, 12, 3},
    {2, 70, 0, 2, 64, INT64_MAX}, {1, 9, 0, 3, 32, INT64_MAX}, /* full attention, no cache: the v1 estimator's */
    /* frames past the last whole vector of query lanes taken one at a time (the fast kernel's remainder): head sizes
     * 16, 32, 64; a remainder whose keys reach past the lanes' (a chunk boundary inside the tile); full attention */
    {1, 18, 5, 2, 16, 3}, {2, 20, 10, 2, 32, 7}, {1, 36, 0, 2, 64, INT64_MAX}, {1, 52, 33, 1, 64, 50},
};

/* A finite float16 of magnitude 2^-5 .. 2^3, as bits, and its value. */
static uint16_t random_half(rng* r) {
    const uint64_t bits = rng_next(r);
    return (uint16_t)(((bits & 1u) << 15) | ((10u + (bits >> 1) % 8u) << 10) | ((bits >> 8) & 0x3ffu));
}

static double half_value(uint16_t h) {
    const double v = ldexp(1.0 + (double)(h & 0x3ffu) / 1024.0, (int)((h >> 10) & 0x1fu) - 15);
    return h & 0x8000u ? -v : v;
}

static void reference(const shape* s, const float* q, const float* k, const float* v, const uint16_t* pk,
                      const uint16_t* pv, float scale, float* out) {
    const int M = s->frames, C = s->cached, DK = s->head_dim, D = s->heads * DK;
    double* p = malloc((size_t)(C + M) * sizeof(double));
    for (int b = 0; b < s->batch; b++)
        for (int h = 0; h < s->heads; h++)
            for (int i = 0; i < M; i++) {
                const int64_t limit = ((C + i) / s->chunk + 1) * s->chunk;
                const int seen = (int)(limit < C + M ? limit : C + M);
                double top = -INFINITY, sum = 0.0;
                for (int j = 0; j < seen; j++) {
                    double dot = 0.0;
                    for (int d = 0; d < DK; d++) {
                        const size_t qi = ((size_t)b * M + i) * D + h * DK + d;
                        dot += q[qi] * (j < C ? half_value(pk[((size_t)b * C + j) * D + h * DK + d])
                                              : k[((size_t)b * M + j - C) * D + h * DK + d]);
                    }
                    p[j] = dot * scale;
                    top = p[j] > top ? p[j] : top;
                }
                for (int j = 0; j < seen; j++) sum += p[j] = exp(p[j] - top);
                for (int d = 0; d < DK; d++) {
                    double acc = 0.0;
                    for (int j = 0; j < seen; j++)
                        acc += p[j] * (j < C ? half_value(pv[((size_t)b * C + j) * D + h * DK + d])
                                             : v[((size_t)b * M + j - C) * D + h * DK + d]);
                    out[((size_t)b * M + i) * D + h * DK + d] = (float)(acc / sum);
                }
            }
    free(p);
}

static double worst_of(const float* got, const float* want, size_t n) {
    double top = 1e-6, worst = 0.0;
    for (size_t i = 0; i < n; i++) top = fmax(top, fabs(want[i]));
    for (size_t i = 0; i < n; i++) {
        CHECK(isfinite(got[i]), "value %zu is %f", i, (double)got[i]);
        worst = fmax(worst, fabs((double)got[i] - want[i]) / top);
    }
    return worst;
}

/* int8 caches (cvl_attention_cached): every variant the run may take against the same attention over the caches
 * widened to float16 as the engine widens them (frame_codec.h: int8 x scale, rounded once to float16). The kernels
 * that read float16 widen them so, and give the same bits; the AVX-512 BF16 kernel rounds int8 x scale to bf16 without
 * the float16 step, within its products' tolerance. */
static void check_int8_caches(rng* r, const shape* s, const cvl_attention_shape* as, const float* q, const float* k,
                              const float* v, cvl_features allowed) {
    const size_t n = (size_t)s->batch * s->frames * s->heads * s->head_dim;
    const size_t rows = (size_t)s->batch * s->cached * s->heads, nc = rows * s->head_dim;
    int8_t *k_int8 = malloc(nc ? nc : 1), *v_int8 = malloc(nc ? nc : 1);
    float *ks = malloc((rows ? rows : 1) * sizeof(float)), *v_scales = malloc((rows ? rows : 1) * sizeof(float));
    uint16_t *kh = malloc((nc ? nc : 1) * sizeof(uint16_t)), *vh = malloc((nc ? nc : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < rows; i++) ks[i] = 0.02f * (1.f + rng_float(r)), v_scales[i] = 0.03f * (1.f + rng_float(r));
    for (size_t i = 0; i < nc; i++) {
        k_int8[i] = (int8_t)((int)(rng_next(r) % 255) - 127), v_int8[i] = (int8_t)((int)(rng_next(r) % 255) - 127);
        kh[i] = cvl_float_to_half((float)k_int8[i] * ks[i / s->head_dim]);
        vh[i] = cvl_float_to_half((float)v_int8[i] * v_scales[i / s->head_dim]);
    }
    float *wide = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    const cvl_cached q8 = {NULL, NULL, k_int8, v_int8, ks, v_scales};
    const cvl_variants* vs = &cvl_cached_attention_variants;
    FOR_EACH_VARIANT(vs, allowed, i) {
        const cvl_features have = vs->variants[i].needs;
        if (cvl_pick_variant(vs, have, s->head_dim) != i) continue;
        CHECK(cvl_cached_attention(as, have, q, k, v, kh, vh, wide) == 0, "%s, widened caches", vs->variants[i].name);
        memset(got, 0xff, n * sizeof(float));
        CHECK(cvl_attention_cached(as, have, q, k, v, &q8, got) == 0, "%s, int8 caches", vs->variants[i].name);
        const int direct = strcmp(vs->variants[i].name, "avx512_bf16") == 0;
        const double worst = worst_of(got, wide, n);
        CHECK(direct ? worst < 2e-2 : worst == 0.0, "%s, int8 caches vs widened: %g (frames %d cached %d dk %d)",
              vs->variants[i].name, worst, s->frames, s->cached, s->head_dim);
    }
    free(k_int8), free(v_int8), free(ks), free(v_scales), free(kh), free(vh), free(wide), free(got);
}

static void check_shape(rng* r, const shape* s, cvl_features allowed) {
    const size_t n = (size_t)s->batch * s->frames * s->heads * s->head_dim;
    const size_t nc = (size_t)s->batch * s->cached * s->heads * s->head_dim;
    float *q = random_floats(r, n, 1.f), *k = random_floats(r, n, 1.f), *v = random_floats(r, n, 1.f);
    uint16_t* pk = malloc((nc ? nc : 1) * sizeof(uint16_t));
    uint16_t* pv = malloc((nc ? nc : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < nc; i++) pk[i] = random_half(r), pv[i] = random_half(r);
    const float scale = 1.f / sqrtf((float)s->head_dim);
    float *want = malloc(n * sizeof(float)), *portable = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    const cvl_attention_shape as = {s->batch, s->frames, s->cached, s->heads, s->head_dim, s->chunk, scale};
    reference(s, q, k, v, pk, pv, scale, want);
    CHECK(cvl_cached_attention(&as, 0, q, k, v, pk, pv, portable) == 0, "portable");
    CHECK(worst_of(portable, want, n) < 1e-5, "portable vs reference: frames %d cached %d dk %d chunk %ld", s->frames,
          s->cached, s->head_dim, (long)s->chunk);
    const cvl_variants* vs = &cvl_cached_attention_variants;
    FOR_EACH_VARIANT(vs, allowed, i) {
        const cvl_features have = vs->variants[i].needs;
        if (cvl_pick_variant(vs, have, s->head_dim) != i) continue; /* this head size takes another path */
        memset(got, 0xff, n * sizeof(float));
        CHECK(cvl_cached_attention(&as, have, q, k, v, pk, pv, got) == 0, "%s", vs->variants[i].name);
        const double worst = worst_of(got, portable, n), bound = strcmp(vs->variants[i].name, "avx2") ? 2e-2 : 1e-5;
        CHECK(worst < bound, "%s vs portable: %g (frames %d cached %d dk %d chunk %ld)", vs->variants[i].name, worst,
              s->frames, s->cached, s->head_dim, (long)s->chunk);
    }
    check_int8_caches(r, s, &as, q, k, v, allowed);
    free(q), free(k), free(v), free(pk), free(pv), free(want), free(portable), free(got);
}

/* Whether `vs` takes the variant named `name` with features `have` for head size `head_dim`. */
static int picks(const cvl_variants* vs, cvl_features have, int64_t head_dim, const char* name) {
    return strcmp(vs->variants[cvl_pick_variant(vs, have, head_dim)].name, name) == 0;
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x2545f4914f6cdd1dull};
    const cvl_variants* vs = &cvl_cached_attention_variants;
    CHECK(vs->variants[0].needs == 0, "variant 0 is the portable C");
    CHECK(cvl_pick_variant(vs, 0, 64) == 0, "no features: portable");
    CHECK(picks(vs, CVL_NEEDS_AMX_BF16, 16, "avx512_bf16"), "head size 16 takes the vector kernel, not tiles");
    CHECK(picks(vs, CVL_NEEDS_AMX_BF16, 64, "amx_bf16"), "head size 64 takes tiles");
    CHECK(picks(vs, CVL_NEEDS_AMX_BF16, 24, "portable"), "head size 24 without AVX2: portable");
    CHECK(picks(vs, CVL_NEEDS_AMX_BF16 | CVL_NEEDS_AVX2, 24, "avx2"), "head size 24 with AVX2: the float32 kernel");
    CHECK(picks(vs, CVL_NEEDS_AVX2, 64, "avx2") && picks(vs, CVL_NEEDS_AVX2, 8, "avx2"), "AVX2: head sizes 8 .. 64");
    CHECK(picks(vs, CVL_NEEDS_AVX2, 12, "portable") && picks(vs, CVL_NEEDS_AVX2, 128, "portable"), "others: portable");
    CHECK(picks(vs, CVL_AVX2 | CVL_FMA, 64, "portable"), "AVX2 without F16C: portable");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) check_shape(&r, &SHAPES[i], allowed);
    report("test_cached_attention", allowed);
    return 0;
}
