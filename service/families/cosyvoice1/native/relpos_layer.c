/* A CosyVoice-300M LLM decoder layer in one call (relpos_layer.h): the driver and the portable C of its passes.
 *
 * Why: v1 speaks 50 speech tokens a second, so its decode step is on the critical path twice as often as CosyVoice2's.
 * In ONNX Runtime a layer is ~60 nodes around its 6 int8 products (two LayerNorm patterns, the reshapes and transposes
 * of q, k and v and the shape arithmetic behind them, the float16 caches' casts, the two score matmuls, the gather of
 * the positional scores by relative distance, softmax, slices, the value products), and the step's shared geometry
 * (distance index, mask) ~100 more: ~890 small kernels a full-size step. Here a layer is its products with the rest
 * as single passes over one per-thread buffer; the attention reads the float16 cache and the positions in place and
 * scores a key with its positional term in one pass, computing only the distances the step attends. */

#include "relpos_layer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "relpos_layer_parts.h"
#include "work.h"

#define MAX_TASKS 16
#define NEEDS_AVX512 (CVL_AVX512F | CVL_AVX512BW | CVL_AVX512VL | CVL_FMA | CVL_F16C)

enum { PORTABLE, AVX2, AVX512 };
static const cvl_variant variants[] = {{"portable", 0}, {"avx2", CVL_NEEDS_AVX2}, {"avx512", NEEDS_AVX512}};
const cvl_variants cvl_relpos_layer_variants = {variants, 3, NULL};

/* ---- the portable passes ---- */

static void layer_norm_portable(const float* x, int64_t rows, int64_t n, const float* w, const float* b, float eps,
                                float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float mean = 0.f, var = 0.f;
        for (int64_t i = 0; i < n; i++) mean += x[i];
        mean /= (float)n;
        for (int64_t i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
        const float sd = sqrtf(var / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - mean) / sd * w[i] + b[i];
    }
}

static void relu_portable(float* x, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] > 0.f ? x[i] : 0.f;
}

/* qu . k + qv . p over dk (k float16 or, with kf, float32; p float32 or, with p16, float16): a key's content term and
 * its positional term, in one pass */
static float score(const float* qu, const uint16_t* k, const float* kf, const float* qv, const float* p,
                   const uint16_t* p16, int64_t dk) {
    float s = 0.f;
    for (int64_t d = 0; d < dk; d++)
        s += qu[d] * (kf ? kf[d] : cvl_half_to_float(k[d])) + qv[d] * (p16 ? cvl_half_to_float(p16[d]) : p[d]);
    return s;
}

static void attention_row_portable(const cvl_relpos_problem* p, const cvl_relpos_row* a, float* s) {
    const int64_t dk = p->head_dim, n = a->valid + a->t + 1;
    float* qu = s + (p->cached + p->steps + 15) / 16 * 16;
    float* qv = qu + (dk + 15) / 16 * 16;
    for (int64_t d = 0; d < dk; d++) {
        qu[d] = a->q[d] + a->u[d];
        qv[d] = a->q[d] + a->bv[d];
    }
    for (int64_t j = 0; j < a->valid; j++) {
        const int64_t r = (a->position - j) * dk;
        s[j] = score(qu, a->pk + j * dk, NULL, qv, CVL_RELPOS_POS_AT(a, r), dk) * p->scale;
    }
    for (int64_t j = 0; j <= a->t; j++) {
        const int64_t r = (a->t - j) * dk;
        s[a->valid + j] = score(qu, NULL, a->nk + j * dk, qv, CVL_RELPOS_POS_AT(a, r), dk) * p->scale;
    }
    float top = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - top);
        sum += s[j];
    }
    const float inv = 1.f / sum;
    memset(a->out, 0, (size_t)dk * sizeof(float));
    for (int64_t j = 0; j < a->valid; j++)
        for (int64_t d = 0; d < dk; d++) a->out[d] += s[j] * inv * cvl_half_to_float(a->pv[j * dk + d]);
    for (int64_t j = 0; j <= a->t; j++)
        for (int64_t d = 0; d < dk; d++) a->out[d] += s[a->valid + j] * inv * a->nv[j * dk + d];
}

static const cvl_relpos_passes portable_passes = {layer_norm_portable, relu_portable, attention_row_portable, NULL};

static const cvl_relpos_passes* passes_for(cvl_features have) {
    switch (cvl_pick_variant(&cvl_relpos_layer_variants, have, 0)) {
    case AVX512:
        return &cvl_relpos_avx512_passes;
    case AVX2:
        return &cvl_relpos_avx2_passes;
    default:
        return &portable_passes;
    }
}

/* ---- the attention: one row per (batch row, head, new position), shared out in tasks ---- */

typedef struct {
    const cvl_relpos_problem* p;
    const cvl_relpos_passes* passes;
    const float* q; /* (B, T, heads, head_dim) */
    float* att;     /* (B, T, heads, head_dim) */
    int64_t rows, tasks;
    volatile int failed; /* a task could not allocate its scratch */
} attention_job;

static void attention_task(void* ctx, size_t task) {
    attention_job* jb = ctx;
    const cvl_relpos_problem* p = jb->p;
    const int tiled = jb->passes->attention_tile != NULL && p->steps >= CVL_RELPOS_TILE;
    const int64_t row_floats = cvl_relpos_scratch_floats(p), tile_floats = tiled ? cvl_relpos_tile_scratch_floats(p) : 0;
    float* s = cvl_work_floats(CVL_WORK_RELPOS_SCORES, (size_t)(row_floats > tile_floats ? row_floats : tile_floats));
    if (s == NULL) {
        jb->failed = 1;
        return;
    }
    const int64_t from = jb->rows * (int64_t)task / jb->tasks, to = jb->rows * (int64_t)(task + 1) / jb->tasks;
    if (!tiled) {
        for (int64_t i = from; i < to; i++) {
            const cvl_relpos_row row = cvl_relpos_row_of(p, jb->q, jb->att, i);
            jb->passes->attention_row(p, &row, s);
        }
        return;
    }
    /* a prefill: unit i is tile i % tiles of (batch row, head) i / tiles */
    const int64_t tiles = (p->steps + CVL_RELPOS_TILE - 1) / CVL_RELPOS_TILE;
    for (int64_t i = from; i < to; i++) {
        const int64_t bh = i / tiles, t0 = (i % tiles) * CVL_RELPOS_TILE, b = bh / p->heads, h = bh % p->heads;
        const int64_t n = p->steps - t0 < CVL_RELPOS_TILE ? p->steps - t0 : CVL_RELPOS_TILE;
        if (jb->passes->attention_tile(p, b, h, t0, n, jb->q, jb->att, s) == 0) continue;
        for (int64_t t = t0; t < t0 + n; t++) {
            const cvl_relpos_row row = cvl_relpos_row_of(p, jb->q, jb->att, bh * p->steps + t);
            jb->passes->attention_row(p, &row, s);
        }
    }
}

static int attention(const cvl_relpos_problem* p, const cvl_relpos_passes* passes, const float* q, float* att,
                     const cvl_exec* ex) {
    const int tiled = passes->attention_tile != NULL && p->steps >= CVL_RELPOS_TILE;
    const int64_t units = p->batch * p->heads * (tiled ? (p->steps + CVL_RELPOS_TILE - 1) / CVL_RELPOS_TILE : p->steps);
    attention_job jb = {p, passes, q, att, units, 1, 0};
    const int64_t work = p->batch * p->heads * p->steps * (p->cached + p->steps) * p->head_dim; /* what it reads, about */
    jb.tasks = ex->parallel && work >= (1 << 20) ? (jb.rows < MAX_TASKS ? jb.rows : MAX_TASKS) : 1;
    if (jb.tasks > 1)
        ex->parallel(ex->runner, attention_task, &jb, (size_t)jb.tasks);
    else
        attention_task(&jb, 0);
    return jb.failed ? -1 : 0;
}

/* ---- the layer ---- */

int cvl_relpos_positions_fit(const cvl_relpos_problem* p) {
    if (p->batch > 0 && p->steps > p->pos_rows) return 0;
    for (int64_t b = 0; b < p->batch; b++) {
        const int64_t past = p->past_len[b], farthest = past > 0 && p->cached > 0 ? past : 0; /* + T - 1 */
        if (farthest > p->pos_rows - p->steps) return 0;
    }
    return 1;
}

static void add_into(float* y, const float* x, int64_t count) {
    for (int64_t i = 0; i < count; i++) y[i] += x[i];
}

/* (B, T, heads, dk) -> (B, heads, T, dk) */
static void heads_first(const float* x, int64_t batch, int64_t steps, int64_t heads, int64_t dk, float* y) {
    for (int64_t b = 0; b < batch; b++)
        for (int64_t t = 0; t < steps; t++)
            for (int64_t h = 0; h < heads; h++)
                memcpy(y + ((b * heads + h) * steps + t) * dk, x + ((b * steps + t) * heads + h) * dk,
                       (size_t)dk * sizeof(float));
}

int cvl_relpos_layer(const cvl_relpos_problem* p, const cvl_exec* ex) {
    const int64_t T = p->steps, R = p->batch * T, D = p->dim, HD = p->heads * p->head_dim, F = p->ff;
    if (R <= 0) return 0;
    if (!cvl_relpos_positions_fit(p)) return CVL_RELPOS_POSITIONS_SHORT;
    const cvl_relpos_passes* passes = passes_for(ex->have);
    /* h (R x D; the LayerNorm outputs), q and att (R x HD), x1 (R x D), f (R x F), and k, v (R x HD) for a prefill:
     * a decode step (T = 1) writes them where they go, (B, 1, heads, dk) being (B, heads, 1, dk) */
    const int64_t staged = T > 1 ? 2 * HD : 0;
    float* h = cvl_work_floats(CVL_WORK_RELPOS, (size_t)R * (size_t)(2 * D + 2 * HD + F + staged) + 64);
    if (h == NULL) return CVL_RELPOS_NO_MEMORY;
    float* q = h + R * D;
    float* att = q + R * HD;
    float* x1 = att + R * HD;
    float* f = x1 + R * D;
    float* k = T > 1 ? f + R * F : p->k_out;
    float* v = T > 1 ? k + R * HD : p->v_out;

    passes->layer_norm(p->x, R, D, p->ln1_w, p->ln1_b, p->eps1, h);
    const cvl_int8_weight* qkv_w[3] = {&p->q, &p->k, &p->v};
    float* const qkv_y[3] = {q, k, v};
    if (cvl_int8_weight_matmuls(h, R, D, qkv_w, qkv_y, 3, ex)) return CVL_RELPOS_NO_MEMORY;
    if (T > 1) {
        heads_first(k, p->batch, T, p->heads, p->head_dim, p->k_out);
        heads_first(v, p->batch, T, p->heads, p->head_dim, p->v_out);
    }
    if (attention(p, passes, q, att, ex) || cvl_int8_weight_matmul(att, R, HD, &p->out, x1, NULL, ex))
        return CVL_RELPOS_NO_MEMORY;
    add_into(x1, p->x, R * D);
    passes->layer_norm(x1, R, D, p->ln2_w, p->ln2_b, p->eps2, h);
    if (cvl_int8_weight_matmul(h, R, D, &p->ff1, f, NULL, ex)) return CVL_RELPOS_NO_MEMORY;
    passes->relu(f, R * F);
    const int failed = cvl_int8_weight_matmul(f, R, F, &p->ff2, p->y, NULL, ex);
    if (!failed) add_into(p->y, x1, R * D);
    return failed ? CVL_RELPOS_NO_MEMORY : 0;
}
