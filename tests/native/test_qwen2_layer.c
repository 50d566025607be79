/* The Qwen2 decoder layer (qwen2_layer.h): every feature set the run allows against the portable C within the
 * tolerance of its vector math and bf16 tile attention, on a decode step (one token), a batch with padding columns
 * masked, a prefill of 16 tokens or more (head by head in bf16: AVX-512 BF16, or tiles where the CPU has AMX), grouped
 * key/value heads and head sizes the head-by-head code does not hold (and that are no multiple of 8: the vector code's
 * tails), a decode step over a long cache; the spread of a step's products over threads changes nothing, bit for bit. */

#include "check.h"
#include "qwen2_layer.h"
#include "weights.h"

typedef struct {
    int64_t batch, steps, cached, dim, heads, kv_heads, head_dim, ff;
} shape;

static const shape SHAPES[] = {
    {1, 1, 0, 32, 2, 1, 16, 48}, {2, 1, 9, 64, 4, 2, 16, 96}, {1, 17, 5, 64, 2, 1, 32, 64},
    {1, 20, 0, 128, 2, 2, 64, 96}, {1, 3, 4, 36, 3, 3, 12, 20}, {2, 16, 40, 64, 2, 1, 32, 80},
    {1, 1, 300, 128, 2, 1, 64, 72}, {3, 1, 13, 40, 2, 2, 20, 44}, {1, 9, 2, 48, 3, 1, 16, 100},
};

typedef struct {
    owned_weight q, k, v, o, gate, up, down;
    float *rms1, *rms2;
} layer_weights;

static layer_weights make_layer(rng* r, const shape* s) {
    const int64_t hd = s->heads * s->head_dim, kd = s->kv_heads * s->head_dim;
    layer_weights w = {owned(r, s->dim, hd, 0, 1), owned(r, s->dim, kd, 0, 1), owned(r, s->dim, kd, 0, 1),
                       owned(r, hd, s->dim, 0, 0), owned(r, s->dim, s->ff, 0, 0), owned(r, s->dim, s->ff, 0, 0),
                       owned(r, s->ff, s->dim, 0, 0), random_floats(r, (size_t)s->dim, 0.2f),
                       random_floats(r, (size_t)s->dim, 0.2f)};
    for (int64_t i = 0; i < s->dim; i++) w.rms1[i] += 1.f, w.rms2[i] += 1.f;
    return w;
}

static void free_layer(layer_weights* w) {
    free_owned(&w->q), free_owned(&w->k), free_owned(&w->v), free_owned(&w->o);
    free_owned(&w->gate), free_owned(&w->up), free_owned(&w->down);
    free(w->rms1), free(w->rms2);
}

typedef struct {
    float *x, *mask, *cos, *sin;
    uint16_t *past_k, *past_v;
} layer_inputs;

/* Causal mask over cached + new positions; batch row 1 also masks its first two cached columns (left padding). */
static layer_inputs make_inputs(rng* r, const shape* s) {
    const int64_t T = s->steps, C = s->cached, W = C + T, dk = s->head_dim;
    const size_t nc = (size_t)(s->batch * s->kv_heads * C * dk);
    layer_inputs in = {random_floats(r, (size_t)(s->batch * T * s->dim), 1.f), malloc((size_t)(s->batch * T * W) * 4),
                       malloc((size_t)(s->batch * T * dk) * 4), malloc((size_t)(s->batch * T * dk) * 4),
                       malloc((nc ? nc : 1) * 2), malloc((nc ? nc : 1) * 2)};
    for (int64_t b = 0; b < s->batch; b++)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t j = 0; j < W; j++)
                in.mask[(b * T + t) * W + j] = j > C + t || (b == 1 && j < 2 && j < C) ? -1e30f : 0.f;
            for (int64_t d = 0; d < dk / 2; d++) {
                const float angle = (float)(C + t) * powf(10000.f, -2.f * (float)d / (float)dk);
                for (int64_t h = 0; h < 2; h++) {
                    in.cos[(b * T + t) * dk + h * dk / 2 + d] = cosf(angle);
                    in.sin[(b * T + t) * dk + h * dk / 2 + d] = sinf(angle);
                }
            }
        }
    for (size_t i = 0; i < nc; i++) {
        const uint64_t bits = rng_next(r);
        in.past_k[i] = (uint16_t)(((bits & 1u) << 15) | ((11u + (bits >> 1) % 5u) << 10) | ((bits >> 8) & 0x3ffu));
        in.past_v[i] = (uint16_t)(((bits >> 20 & 1u) << 15) | ((11u + (bits >> 21) % 5u) << 10) | ((bits >> 30) & 0x3ffu));
    }
    return in;
}

typedef struct {
    float *y, *k, *v;
    size_t ny, nkv;
} layer_outputs;

static layer_outputs make_outputs(const shape* s) {
    const size_t ny = (size_t)(s->batch * s->steps * s->dim), nkv = (size_t)(s->batch * s->kv_heads * s->steps * s->head_dim);
    return (layer_outputs){malloc(ny * 4), malloc(nkv * 4), malloc(nkv * 4), ny, nkv};
}

static void run_layer(const shape* s, const layer_weights* w, const layer_inputs* in, const layer_outputs* out,
                      cvl_features have, int spread) {
    const cvl_qwen2_problem p = {
        .batch = s->batch, .steps = s->steps, .cached = s->cached, .dim = s->dim, .heads = s->heads,
        .kv_heads = s->kv_heads, .head_dim = s->head_dim, .ff = s->ff, .scale = 1.f / sqrtf((float)s->head_dim),
        .eps = 1e-6f, .x = in->x, .past_k = in->past_k, .past_v = in->past_v, .mask = in->mask, .cos = in->cos,
        .sin = in->sin, .rms1_w = w->rms1, .rms2_w = w->rms2, .q = w->q.w, .k = w->k.w, .v = w->v.w, .o = w->o.w,
        .gate = w->gate.w, .up = w->up.w, .down = w->down.w, .y = out->y, .k_out = out->k, .v_out = out->v,
    };
    const cvl_exec ex = {have, spread, threads_parallel, NULL};
    CHECK(cvl_qwen2_layer(&p, &ex) == 0, "features 0x%x", (unsigned)have);
}

static void check_shape(rng* r, const shape* s, cvl_features allowed) {
    layer_weights w = make_layer(r, s);
    layer_inputs in = make_inputs(r, s);
    layer_outputs ref = make_outputs(s), got = make_outputs(s);
    run_layer(s, &w, &in, &ref, 0, 1);
    cvl_features sets[8];
    const int count = feature_sets(&cvl_qwen2_layer_variants, allowed, sets);
    for (int i = 0; i < count; i++) {
        for (int spread = 1; spread <= 5; spread += 4) {
            run_layer(s, &w, &in, &got, sets[i], spread);
            const double worst = worst_relative(got.y, ref.y, ref.ny, 1.0);
            const int exact = sets[i] == 0;
            CHECK(exact ? worst == 0.0 : worst < 3e-2, "features 0x%x spread %d vs portable: %g (steps %ld cached %ld)",
                  (unsigned)sets[i], spread, worst, (long)s->steps, (long)s->cached);
            CHECK(worst_relative(got.k, ref.k, ref.nkv, 1.0) < (exact ? 1e-300 : 1e-4) &&
                      worst_relative(got.v, ref.v, ref.nkv, 1.0) < (exact ? 1e-300 : 1e-4),
                  "features 0x%x: new keys/values", (unsigned)sets[i]);
        }
    }
    free(ref.y), free(ref.k), free(ref.v), free(got.y), free(got.k), free(got.v);
    free(in.x), free(in.mask), free(in.cos), free(in.sin), free(in.past_k), free(in.past_v);
    free_layer(&w);
}

/* Whether `vs` takes the variant named `name` with features `have` for head size `head_dim`. */
static int picks(const cvl_variants* vs, cvl_features have, int64_t head_dim, const char* name) {
    return strcmp(vs->variants[cvl_pick_variant(vs, have, head_dim)].name, name) == 0;
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0xda942042e4dd58b5ull};
    const cvl_variants* vs = &cvl_qwen2_layer_variants;
    CHECK(vs->variants[0].needs == 0, "variant 0 is the portable C");
    CHECK(picks(vs, CVL_NEEDS_AMX_BF16, 16, "avx512"), "head size 16 keeps the vector attention");
    CHECK(picks(vs, CVL_NEEDS_AMX_BF16, 64, "amx_bf16"), "head size 64 takes tiles in a prefill");
    CHECK(picks(vs, CVL_NEEDS_AVX512_BF16, 64, "avx512_bf16") && picks(vs, CVL_NEEDS_AVX512_BF16, 16, "avx512"),
          "without AMX, head sizes 32 and 64 go head by head in bf16, 16 stays row by row");
    CHECK(picks(vs, CVL_NEEDS_AVX2, 64, "avx2") && picks(vs, CVL_AVX2 | CVL_FMA, 64, "portable"), "AVX2 needs F16C");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) check_shape(&r, &SHAPES[i], allowed);
    report("test_qwen2_layer", allowed);
    return 0;
}
