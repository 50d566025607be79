/* Fun-CosyVoice3's DiT block (estimator_block.h with its AdaLN-zero modulation, rotary q and k, gated residuals and
 * tanh GELU): every variant the run may take against the portable C within the tolerance of its bf16 attention
 * products, on edge shapes (one frame, no cache, chunk boundaries, a rotated width of 0, one head's or every feature,
 * widths that are no multiple of 8), the modulation read per batch entry (a row's result independent of the batch it
 * is computed in), and the rotation checked against the pairs it turns. */

#include "check.h"
#include "estimator_block.h"
#include "half.h"
#include "blocks.h"
#include "weights.h"

typedef struct {
    int64_t batch, frames, cached, dim, heads, head_dim, ff, chunk, rope;
} shape;

static const shape SHAPES[] = {
    {1, 1, 0, 32, 2, 16, 64, 1, 16},    {2, 7, 5, 48, 2, 16, 40, 3, 16},   {2, 50, 20, 64, 4, 16, 128, 25, 16},
    {1, 20, 3, 24, 3, 8, 20, 4, 0},     {2, 13, 70, 36, 3, 12, 52, 5, 36}, {2, 56, 100, 64, 2, 32, 128, 50, 32},
};

typedef struct {
    owned_weight qkv, out, ff1, ff2;
    float *mul1, *add1, *gate1, *mul3, *add3, *gate3, *cos_, *sin_;
} dit_weights;

static dit_weights make_dit(rng* r, const shape* s) {
    const int64_t hd = s->heads * s->head_dim;
    const size_t per_batch = (size_t)(s->batch * s->dim), table = (size_t)(s->frames * (s->rope ? s->rope : 1));
    dit_weights w = {owned(r, s->dim, 3 * hd, 1, 1), owned(r, hd, s->dim, 0, 1), owned(r, s->dim, s->ff, 0, 1),
                     owned(r, s->ff, s->dim, 0, 1), random_floats(r, per_batch, 0.2f),
                     random_floats(r, per_batch, 0.1f),
                     random_floats(r, per_batch, 1.f), random_floats(r, per_batch, 0.2f),
                     random_floats(r, per_batch, 0.1f), random_floats(r, per_batch, 1.f), malloc(table * sizeof(float)),
                     malloc(table * sizeof(float))};
    for (size_t i = 0; i < per_batch; i++) w.mul1[i] += 1.f, w.mul3[i] += 1.f;
    for (int64_t m = 0; m < s->frames; m++) /* positions 40 + m, each frequency twice, as the DiT's tables hold them */
        for (int64_t i = 0; i < s->rope; i++) {
            const double angle = (double)(40 + m) * pow(10000.0, -(double)(i / 2 * 2) / (double)s->rope);
            w.cos_[m * s->rope + i] = (float)cos(angle);
            w.sin_[m * s->rope + i] = (float)sin(angle);
        }
    return w;
}

static void free_dit(dit_weights* w) {
    free_owned(&w->qkv), free_owned(&w->out), free_owned(&w->ff1), free_owned(&w->ff2);
    free(w->mul1), free(w->add1), free(w->gate1), free(w->mul3), free(w->add3), free(w->gate3), free(w->cos_),
        free(w->sin_);
}


/* The problem of `batch` rows of the batch starting at entry `first` (its modulation rows with it). */
static block_data data_of(rng* r, const shape* s) {
    return make_block_data(r, s->batch, s->frames, s->cached, s->dim, s->heads * s->head_dim);
}

static cvl_block_problem problem(const shape* s, const dit_weights* w, const block_data* d, int64_t batch,
                                 int64_t first) {
    const int64_t o = first * s->dim;
    return (cvl_block_problem){
        .batch = batch, .frames = s->frames, .cached = s->cached, .dim = s->dim, .heads = s->heads,
        .head_dim = s->head_dim, .ff = s->ff, .chunk = s->chunk, .scale = 1.f / sqrtf((float)s->head_dim),
        .eps1 = 1e-6f, .eps3 = 1e-6f, .x = d->x, .past_k = d->past_k, .past_v = d->past_v, .ln1_w = w->mul1 + o,
        .ln1_b = w->add1 + o, .ln3_w = w->mul3 + o, .ln3_b = w->add3 + o, .qkv = w->qkv.w, .out = w->out.w,
        .ff1 = w->ff1.w, .ff2 = w->ff2.w, .y = d->y, .k = d->k, .v = d->v, .ln_per_batch = 1, .gate1 = w->gate1 + o,
        .gate3 = w->gate3 + o, .rope_dim = s->rope, .rope_cos = w->cos_, .rope_sin = w->sin_, .gelu_tanh = 1,
    };
}

/* The new keys are the rotated ones: with the rotation off, the same block gives keys whose pairs, turned by the
 * tables, are the keys with it on (within float16 rounding). */
static void check_rotation(rng* r, const shape* s) {
    if (s->rope == 0) return;
    dit_weights w = make_dit(r, s);
    block_data on = data_of(r, s), off = data_of(r, s);
    const size_t rows = (size_t)(s->batch * s->frames), hd = (size_t)(s->heads * s->head_dim);
    memcpy(off.x, on.x, rows * (size_t)s->dim * sizeof(float));
    memcpy(off.past_k, on.past_k, (size_t)(s->batch * s->cached) * hd * 2);
    memcpy(off.past_v, on.past_v, (size_t)(s->batch * s->cached) * hd * 2);
    const cvl_exec portable = {0, 1, threads_parallel, NULL};
    cvl_block_problem p_on = problem(s, &w, &on, s->batch, 0), p_off = problem(s, &w, &off, s->batch, 0);
    p_off.rope_dim = 0;
    CHECK(cvl_estimator_block(&p_on, &portable) == 0 && cvl_estimator_block(&p_off, &portable) == 0, "rotation");
    double worst = 0.0;
    for (size_t row = 0; row < rows; row++) {
        const int64_t m = (int64_t)row % s->frames;
        for (int64_t i = 0; i < (int64_t)hd; i++) {
            const uint16_t* plain = off.k + row * hd;
            const float a = cvl_half_to_float(plain[i & ~1]), b = cvl_half_to_float(plain[i | 1]);
            const int64_t at = m * s->rope + (i < s->rope ? i : 0);
            const float c = w.cos_[at], sn = w.sin_[at];
            const float want = i >= s->rope ? cvl_half_to_float(plain[i]) : (i % 2 ? b * c + a * sn : a * c - b * sn);
            const double got = cvl_half_to_float(on.k[row * hd + (size_t)i]);
            const double d = fabs((double)want - got) / (fabs(a) + fabs(b) + 1.0);
            worst = d > worst ? d : worst;
        }
        CHECK(memcmp(on.v + row * hd, off.v + row * hd, hd * 2) == 0, "the values are not rotated");
    }
    CHECK(worst < 4e-3, "rotated keys: %g", worst);
    free_block_data(&on), free_block_data(&off);
    free_dit(&w);
}

static void check_shape(rng* r, const shape* s, cvl_features allowed) {
    dit_weights w = make_dit(r, s);
    block_data ref = data_of(r, s), got = data_of(r, s);
    const size_t rows = (size_t)(s->batch * s->frames), kv = rows * (size_t)(s->heads * s->head_dim);
    const size_t cache = (size_t)(s->batch * s->cached * s->heads * s->head_dim) * 2;
    const cvl_block_problem pref = problem(s, &w, &ref, s->batch, 0);
    const cvl_exec portable = {0, 1, threads_parallel, NULL};
    CHECK(cvl_estimator_block(&pref, &portable) == 0, "portable");
    cvl_features sets[8];
    const int count = feature_sets(&cvl_estimator_block_variants, allowed, sets);
    for (int i = 0; i < count; i++) {
        memcpy(got.x, ref.x, rows * (size_t)s->dim * sizeof(float));
        memcpy(got.past_k, ref.past_k, cache), memcpy(got.past_v, ref.past_v, cache);
        const cvl_block_problem p = problem(s, &w, &got, s->batch, 0);
        const cvl_exec ex = {sets[i], 1, threads_parallel, NULL};
        CHECK(cvl_estimator_block(&p, &ex) == 0, "features 0x%x", (unsigned)sets[i]);
        const double worst = worst_relative(got.y, ref.y, rows * (size_t)s->dim, 1.0);
        CHECK(sets[i] == 0 ? worst == 0.0 : worst < 3e-2, "features 0x%x vs portable: %g (frames %ld cached %ld)",
              (unsigned)sets[i], worst, (long)s->frames, (long)s->cached);
        (void)kv;
    }
    if (s->batch > 1) { /* the last entry alone (its own modulation row) computes what it computed beside the others */
        block_data last = got;
        const size_t per_row = (size_t)(s->frames * s->dim), per_kv = (size_t)(s->frames * s->heads * s->head_dim);
        const size_t per_cache = (size_t)(s->cached * s->heads * s->head_dim);
        last.x = ref.x + (size_t)(s->batch - 1) * per_row;
        last.past_k = ref.past_k + (size_t)(s->batch - 1) * per_cache;
        last.past_v = ref.past_v + (size_t)(s->batch - 1) * per_cache;
        const cvl_block_problem p = problem(s, &w, &last, 1, s->batch - 1);
        CHECK(cvl_estimator_block(&p, &portable) == 0, "one entry");
        CHECK(memcmp(last.y, ref.y + (size_t)(s->batch - 1) * per_row, per_row * sizeof(float)) == 0 &&
                  memcmp(last.k, ref.k + (size_t)(s->batch - 1) * per_kv, per_kv * 2) == 0,
              "an entry's result depends on its batch");
    }
    free_block_data(&ref), free_block_data(&got);
    free_dit(&w);
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x2545f4914f6cdd1dull};
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        check_shape(&r, &SHAPES[i], allowed);
        check_rotation(&r, &SHAPES[i]);
    }
    report("test_dit_block", allowed);
    return 0;
}
