/* The flow estimator's transformer block (estimator_block.h): every variant the run may take against the portable C
 * within the tolerance of its bf16 attention products, on edge shapes (one frame, no cache, a long cache, chunk
 * boundaries, full attention with an attention chunk no call reaches, q|k|v widths not a multiple of 16 that take the
 * copy path, widths that are no multiple of 8 (the AVX2 passes' tails), head sizes the bf16 attention does not hold),
 * and a row's result independent of the batch it is computed in. */

#include "check.h"
#include "estimator_block.h"
#include "blocks.h"
#include "weights.h"

typedef struct {
    int64_t batch, frames, cached, dim, heads, head_dim, ff, chunk;
} shape;

static const shape SHAPES[] = {
    {1, 1, 0, 32, 2, 16, 64, 1}, {2, 7, 5, 48, 2, 16, 40, 3},  {1, 50, 20, 64, 4, 16, 128, 25},
    {1, 20, 3, 24, 3, 8, 20, 4}, {1, 17, 33, 64, 2, 32, 96, 16}, {1, 6, 0, 40, 1, 64, 72, 1000},
    {1, 1, 300, 72, 2, 64, 100, 50}, {2, 13, 70, 36, 3, 12, 52, 5},
    {2, 70, 0, 64, 2, 64, 96, INT64_MAX}, /* no cache, full attention over 70 frames: the v1 estimator's blocks */
};

typedef struct {
    owned_weight qkv, out, ff1, ff2;
    float *ln1_w, *ln1_b, *ln3_w, *ln3_b;
} block_weights;

static block_weights make_block(rng* r, const shape* s) {
    const int64_t hd = s->heads * s->head_dim;
    block_weights w = {owned(r, s->dim, 3 * hd, 1, 0), owned(r, hd, s->dim, 0, 1), owned(r, s->dim, s->ff, 0, 1),
                       owned(r, s->ff, s->dim, 0, 1), random_floats(r, (size_t)s->dim, 0.2f),
                       random_floats(r, (size_t)s->dim, 0.1f), random_floats(r, (size_t)s->dim, 0.2f),
                       random_floats(r, (size_t)s->dim, 0.1f)};
    for (int64_t i = 0; i < s->dim; i++) w.ln1_w[i] += 1.f, w.ln3_w[i] += 1.f;
    return w;
}

static void free_block(block_weights* w) {
    free_owned(&w->qkv), free_owned(&w->out), free_owned(&w->ff1), free_owned(&w->ff2);
    free(w->ln1_w), free(w->ln1_b), free(w->ln3_w), free(w->ln3_b);
}


static block_data data_of(rng* r, const shape* s) {
    return make_block_data(r, s->batch, s->frames, s->cached, s->dim, s->heads * s->head_dim);
}

static cvl_block_problem problem(const shape* s, const block_weights* w, const block_data* d, int64_t batch) {
    return (cvl_block_problem){
        .batch = batch, .frames = s->frames, .cached = s->cached, .dim = s->dim, .heads = s->heads,
        .head_dim = s->head_dim, .ff = s->ff, .chunk = s->chunk, .scale = 1.f / sqrtf((float)s->head_dim),
        .eps1 = 1e-5f, .eps3 = 1e-5f, .x = d->x, .past_k = d->past_k, .past_v = d->past_v, .ln1_w = w->ln1_w,
        .ln1_b = w->ln1_b, .ln3_w = w->ln3_w, .ln3_b = w->ln3_b, .qkv = w->qkv.w, .out = w->out.w, .ff1 = w->ff1.w,
        .ff2 = w->ff2.w, .y = d->y, .k = d->k, .v = d->v,
    };
}

static int worst_half(const uint16_t* a, const uint16_t* b, size_t n) {
    int worst = 0; /* largest difference in units of the last place (same sign and exponent range here) */
    for (size_t i = 0; i < n; i++) {
        const int d = abs((int)(a[i] & 0x7fff) - (int)(b[i] & 0x7fff));
        if (d > worst && (a[i] ^ b[i]) >> 15 == 0) worst = d;
    }
    return worst;
}

static void check_shape(rng* r, const shape* s, cvl_features allowed) {
    block_weights w = make_block(r, s);
    block_data ref = data_of(r, s), got = data_of(r, s);
    const size_t rows = (size_t)(s->batch * s->frames), kv = rows * (size_t)(s->heads * s->head_dim);
    const cvl_block_problem pref = problem(s, &w, &ref, s->batch);
    const cvl_exec portable = {0, 1, threads_parallel, NULL};
    CHECK(cvl_estimator_block(&pref, &portable) == 0, "portable");
    cvl_features sets[8];
    const int count = feature_sets(&cvl_estimator_block_variants, allowed, sets);
    for (int i = 0; i < count; i++) {
        memcpy(got.x, ref.x, rows * (size_t)s->dim * sizeof(float));
        memcpy(got.past_k, ref.past_k, (size_t)(s->batch * s->cached * s->heads * s->head_dim) * 2);
        memcpy(got.past_v, ref.past_v, (size_t)(s->batch * s->cached * s->heads * s->head_dim) * 2);
        const cvl_block_problem p = problem(s, &w, &got, s->batch);
        const cvl_exec ex = {sets[i], 1, threads_parallel, NULL};
        CHECK(cvl_estimator_block(&p, &ex) == 0, "features 0x%x", (unsigned)sets[i]);
        const double worst = worst_relative(got.y, ref.y, rows * (size_t)s->dim, 1.0);
        const int exact = sets[i] == 0;
        CHECK(exact ? worst == 0.0 : worst < 3e-2, "features 0x%x vs portable: %g (frames %ld cached %ld dk %ld)",
              (unsigned)sets[i], worst, (long)s->frames, (long)s->cached, (long)s->head_dim);
        CHECK(worst_half(got.k, ref.k, kv) <= (exact ? 0 : 64) && worst_half(got.v, ref.v, kv) <= (exact ? 0 : 64),
              "features 0x%x: new keys/values", (unsigned)sets[i]);
    }
    if (s->batch > 1) { /* the last row of the batch alone computes what it computed beside the others */
        block_data last = got;
        const size_t per_row = (size_t)(s->frames * s->dim), per_kv = (size_t)(s->frames * s->heads * s->head_dim);
        last.x = ref.x + (size_t)(s->batch - 1) * per_row;
        last.past_k = ref.past_k + (size_t)(s->batch - 1) * (size_t)(s->cached * s->heads * s->head_dim);
        last.past_v = ref.past_v + (size_t)(s->batch - 1) * (size_t)(s->cached * s->heads * s->head_dim);
        const cvl_block_problem p = problem(s, &w, &last, 1);
        CHECK(cvl_estimator_block(&p, &portable) == 0, "one row");
        CHECK(memcmp(last.y, ref.y + (size_t)(s->batch - 1) * per_row, per_row * sizeof(float)) == 0 &&
                  memcmp(last.k, ref.k + (size_t)(s->batch - 1) * per_kv, per_kv * 2) == 0,
              "a row's result depends on its batch");
    }
    free_block_data(&ref), free_block_data(&got);
    free_block(&w);
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x853c49e6748fea9bull};
    CHECK(cvl_estimator_block_variants.variants[0].needs == 0, "variant 0 is the portable C");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) check_shape(&r, &SHAPES[i], allowed);
    report("test_estimator_block", allowed);
    return 0;
}
