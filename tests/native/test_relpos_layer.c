/* The relative-position decoder layer (relpos_layer.h): every feature set the run allows against the portable C within
 * the tolerance of its vector math, on decode steps (one token), 7-token prefills and prefills of 16 to 40 (the AVX-512
 * code's tiles, held to 1e-3), batches of 1 to 5 rows whose
 * past lengths differ (0, 1, part of the cache, all of it, more than the cache holds), caches of 0, 1, 63 and 200
 * columns, head sizes 64, 32 and odd ones (20, 12: the vectors' last lanes). The cache columns at or past a row's
 * length hold NaN and `pos` holds exactly the distances the step reads (AddressSanitizer sees a read beyond), so a
 * masking or distance error shows; the spread of a step's products over threads changes nothing, bit for bit; a `pos`
 * one distance short is refused before anything is read. */

#include "check.h"
#include "half.h"
#include "relpos_layer.h"
#include "weights.h"

#define MAX_BATCH 5
#define NAN_HALF 0x7e00u

typedef struct {
    int64_t batch, steps, cached, dim, heads, head_dim, ff;
    int64_t past[MAX_BATCH];
} shape;

static const shape SHAPES[] = {
    {1, 1, 0, 64, 4, 16, 96, {0}},
    {3, 1, 63, 128, 4, 32, 160, {63, 0, 17}},
    {5, 1, 200, 64, 2, 32, 64, {200, 199, 1, 0, 150}},
    {2, 7, 1, 48, 3, 16, 40, {1, 0}},
    {4, 7, 63, 80, 4, 20, 72, {63, 5, 0, 30}},
    {2, 1, 1, 40, 2, 20, 24, {1, 5}},
    {1, 7, 200, 128, 2, 64, 128, {200}},
    {3, 7, 0, 36, 3, 12, 20, {0, 0, 0}},
    {2, 1, 200, 1024 / 8, 2, 64, 256, {120, 200}},
    /* prefills of 16 positions or more: the AVX-512 code takes them in tiles of 16 (the last one partial), the
     * positions following the cache (past length = cached columns, or none) or, past the cache, row by row */
    {2, 37, 0, 64, 2, 32, 96, {0, 0}},
    {3, 40, 63, 128, 2, 64, 128, {63, 0, 90}},
    {1, 16, 5, 48, 3, 16, 40, {5}},
    {2, 21, 7, 40, 2, 20, 24, {7, 3}},
};

typedef struct {
    owned_weight q, k, v, out, ff1, ff2;
    float *ln1_w, *ln1_b, *ln2_w, *ln2_b, *bias_u, *bias_v;
} layer_weights;

static float* around_one(rng* r, int64_t n) {
    float* w = random_floats(r, (size_t)n, 0.2f);
    for (int64_t i = 0; i < n; i++) w[i] += 1.f;
    return w;
}

static layer_weights make_layer(rng* r, const shape* s) {
    const int64_t hd = s->heads * s->head_dim;
    layer_weights w = {owned(r, s->dim, hd, 0, 1),   owned(r, s->dim, hd, 0, 1),   owned(r, s->dim, hd, 0, 1),
                       owned(r, hd, s->dim, 0, 1),   owned(r, s->dim, s->ff, 0, 1), owned(r, s->ff, s->dim, 0, 1),
                       around_one(r, s->dim),        random_floats(r, (size_t)s->dim, 0.1f),
                       around_one(r, s->dim),        random_floats(r, (size_t)s->dim, 0.1f),
                       random_floats(r, (size_t)hd, 0.3f), random_floats(r, (size_t)hd, 0.3f)};
    return w;
}

static void free_layer(layer_weights* w) {
    free_owned(&w->q), free_owned(&w->k), free_owned(&w->v), free_owned(&w->out), free_owned(&w->ff1);
    free_owned(&w->ff2);
    free(w->ln1_w), free(w->ln1_b), free(w->ln2_w), free(w->ln2_b), free(w->bias_u), free(w->bias_v);
}

/* The distances the step reads: past_len + T for a row with cache columns to attend, T for the new positions. */
static int64_t rows_needed(const shape* s) {
    int64_t need = s->steps;
    for (int64_t b = 0; b < s->batch; b++)
        if (s->past[b] > 0 && s->cached > 0 && s->past[b] + s->steps > need) need = s->past[b] + s->steps;
    return need;
}

typedef struct {
    float *x, *pos;
    int64_t* past_len;
    uint16_t *past_k, *past_v;
    int64_t pos_rows;
    uint16_t* pos_half; /* the positions in float16 in place of pos, or NULL */
} layer_inputs;

static uint16_t random_half(rng* r) { /* magnitudes 2^-4 .. 2^0 */
    const uint64_t bits = rng_next(r);
    return (uint16_t)(((bits & 1u) << 15) | ((11u + (bits >> 1) % 5u) << 10) | ((bits >> 8) & 0x3ffu));
}

static layer_inputs make_inputs(rng* r, const shape* s) {
    const int64_t C = s->cached, dk = s->head_dim, H = s->heads, R = rows_needed(s);
    const size_t nc = (size_t)(s->batch * H * C * dk);
    layer_inputs in = {random_floats(r, (size_t)(s->batch * s->steps * s->dim), 1.f),
                       random_floats(r, (size_t)(H * R * dk), 0.5f), malloc((size_t)s->batch * sizeof(int64_t)),
                       malloc((nc ? nc : 1) * 2), malloc((nc ? nc : 1) * 2), R, NULL};
    for (int64_t b = 0; b < s->batch; b++) {
        in.past_len[b] = s->past[b];
        for (int64_t h = 0; h < H; h++)
            for (int64_t j = 0; j < C; j++)
                for (int64_t d = 0; d < dk; d++) { /* columns past the row's length: NaN, never to be read */
                    const size_t at = (size_t)(((b * H + h) * C + j) * dk + d);
                    in.past_k[at] = j < s->past[b] ? random_half(r) : NAN_HALF;
                    in.past_v[at] = j < s->past[b] ? random_half(r) : NAN_HALF;
                }
    }
    return in;
}

typedef struct {
    float *y, *k, *v;
    size_t ny, nkv;
} layer_outputs;

static layer_outputs make_outputs(const shape* s) {
    const size_t ny = (size_t)(s->batch * s->steps * s->dim), nkv = (size_t)(s->batch * s->heads * s->steps * s->head_dim);
    return (layer_outputs){malloc(ny * 4), malloc(nkv * 4), malloc(nkv * 4), ny, nkv};
}

static void free_outputs(layer_outputs* o) { free(o->y), free(o->k), free(o->v); }

static cvl_relpos_problem problem(const shape* s, const layer_weights* w, const layer_inputs* in, const layer_outputs* out) {
    return (cvl_relpos_problem){
        .batch = s->batch, .steps = s->steps, .cached = s->cached, .dim = s->dim, .heads = s->heads,
        .head_dim = s->head_dim, .ff = s->ff, .pos_rows = in->pos_rows, .scale = 1.f / sqrtf((float)s->head_dim),
        .eps1 = 1e-12f, .eps2 = 1e-12f, .x = in->x, .past_len = in->past_len, .past_k = in->past_k,
        .past_v = in->past_v, .pos = in->pos, .bias_u = w->bias_u, .bias_v = w->bias_v, .ln1_w = w->ln1_w,
        .ln1_b = w->ln1_b, .ln2_w = w->ln2_w, .ln2_b = w->ln2_b, .q = w->q.w, .k = w->k.w, .v = w->v.w,
        .out = w->out.w, .ff1 = w->ff1.w, .ff2 = w->ff2.w, .y = out->y, .k_out = out->k, .v_out = out->v,
    };
}

static void run_layer(const shape* s, const layer_weights* w, const layer_inputs* in, const layer_outputs* out,
                      cvl_features have, int spread) {
    cvl_relpos_problem p = problem(s, w, in, out);
    if (in->pos_half) p.pos = NULL, p.pos_half = in->pos_half;
    const cvl_exec ex = {have, spread, threads_parallel, NULL};
    CHECK(cvl_relpos_layer(&p, &ex) == 0, "features 0x%x", (unsigned)have);
}

/* A pos one distance short of what a row reads is refused, its outputs untouched. */
static void check_refusal(const shape* s, const layer_weights* w, layer_inputs* in, const layer_outputs* out) {
    const float marker = 12345.f;
    out->y[0] = marker;
    in->pos_rows -= 1;
    const cvl_relpos_problem p = problem(s, w, in, out);
    const cvl_exec ex = {0, 1, NULL, NULL};
    CHECK(!cvl_relpos_positions_fit(&p) && cvl_relpos_layer(&p, &ex) == CVL_RELPOS_POSITIONS_SHORT && out->y[0] == marker,
          "pos of %ld rows where %ld are read", (long)in->pos_rows, (long)in->pos_rows + 1);
    in->pos_rows += 1;
}

/* Positions in float16 (a step twin whose pos inputs are float16): every feature set computes what the portable C
 * computes from the same positions widened to float32 (the portable C itself bit for bit), so the float16 rows are
 * read at the same distances, in the decode rows and in a prefill's tiles alike. */
static void check_half_positions(const shape* s, const layer_weights* w, layer_inputs* in, const layer_outputs* ref,
                                 const layer_outputs* got, const cvl_features* sets, int count) {
    const size_t n = (size_t)(s->heads * in->pos_rows * s->head_dim);
    uint16_t* half = malloc(n * sizeof(uint16_t));
    float* full = in->pos;
    for (size_t i = 0; i < n; i++) half[i] = cvl_float_to_half(full[i]), full[i] = cvl_half_to_float(half[i]);
    run_layer(s, w, in, ref, 0, 1); /* the reference: float32 positions holding the float16 values */
    in->pos_half = half;
    for (int i = 0; i < count; i++) {
        run_layer(s, w, in, got, sets[i], 1);
        const int exact = sets[i] == 0;
        const double worst = worst_relative(got->y, ref->y, ref->ny, 1.0);
        CHECK(exact ? worst == 0.0 : worst < (s->steps >= 16 ? 1e-3 : 3e-2),
              "float16 positions, features 0x%x vs portable float32: y %g (batch %ld steps %ld cached %ld)",
              (unsigned)sets[i], worst, (long)s->batch, (long)s->steps, (long)s->cached);
    }
    in->pos_half = NULL;
    free(half);
}

static void check_shape(rng* r, const shape* s, cvl_features allowed) {
    layer_weights w = make_layer(r, s);
    layer_inputs in = make_inputs(r, s);
    layer_outputs ref = make_outputs(s), got = make_outputs(s);
    run_layer(s, &w, &in, &ref, 0, 1);
    cvl_features sets[8];
    const int count = feature_sets(&cvl_relpos_layer_variants, allowed, sets);
    for (int i = 0; i < count; i++)
        for (int spread = 1; spread <= 5; spread += 4) {
            run_layer(s, &w, &in, &got, sets[i], spread);
            const int exact = sets[i] == 0;
            const double worst = worst_relative(got.y, ref.y, ref.ny, 1.0);
            const double kv = fmax(worst_relative(got.k, ref.k, ref.nkv, 1.0), worst_relative(got.v, ref.v, ref.nkv, 1.0));
            /* float32 sums in another order (and a polynomial exp): far inside the tolerance on a prefill, where a
             * wrong key or distance in a tile would show */
            const double bound = s->steps >= 16 ? 1e-3 : 3e-2;
            CHECK(exact ? worst == 0.0 && kv == 0.0 : worst < bound && kv < 2e-2,
                  "features 0x%x spread %d vs portable: y %g, k/v %g (batch %ld steps %ld cached %ld head %ld)",
                  (unsigned)sets[i], spread, worst, kv, (long)s->batch, (long)s->steps, (long)s->cached,
                  (long)s->head_dim);
        }
    check_refusal(s, &w, &in, &got);
    check_half_positions(s, &w, &in, &ref, &got, sets, count);
    free_outputs(&ref), free_outputs(&got);
    free(in.x), free(in.pos), free(in.past_len), free(in.past_k), free(in.past_v);
    free_layer(&w);
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    rng r = {0x5be3c1d2a9e47f61ull};
    const cvl_variants* vs = &cvl_relpos_layer_variants;
    CHECK(vs->variants[0].needs == 0, "variant 0 is the portable C");
    CHECK(cvl_pick_variant(vs, CVL_NEEDS_AVX2, 0) == 1 && cvl_pick_variant(vs, CVL_NEEDS_AVX2 | CVL_AVX512F, 0) == 1,
          "AVX2 alone takes the avx2 variant");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) check_shape(&r, &SHAPES[i], allowed);
    report("test_relpos_layer", allowed);
    return 0;
}
