/* A flow estimator ResNet block's norm, Mish, mask and addend in one pass (norm_mish.h).
 *
 * Why: in ONNX Runtime each of these is 14-17 nodes (the norm's reductions and affine, Mish as clip, exp and a
 * rational function, the mask and the addend), each a pass over the block's activations; a ResNet block has two, an
 * estimator call 14 (CosyVoice2) or 16 (CosyVoice-300M) blocks per guidance row, 10 Euler steps per chunk. Here the
 * norm's moments take two passes over x and everything after them one.
 *
 * Mish: v * tanh(softplus(v)) with e = exp(-|v|) <= 1, so nothing overflows and no clip is needed:
 * v < 0: tanh = e(e + 2) / (e(e + 2) + 2) (the graph's own form, with exp(v) = e);
 * v >= 0: the same with exp(v) = 1/e, numerator and denominator times e^2: (1 + 2e) / (1 + 2e + 2e^2). */

#include "norm_mish.h"

#include <immintrin.h>
#include <math.h>

#include "simd_math.h"

#define VEC "avx512f,fma"
#define AVX2 "avx2,fma,f16c"
#define NEEDS_VECTOR (CVL_AVX512F | CVL_FMA)

static const cvl_variant variants[] = {{"portable", 0}, {"avx2", CVL_NEEDS_AVX2}, {"avx512", NEEDS_VECTOR}};
const cvl_variants cvl_norm_mish_variants = {variants, 3, NULL};
enum { CODE_PORTABLE, CODE_AVX2, CODE_AVX512 };

/* What one run of n contiguous values needs: its norm's moments, the affine (per value when `gammas` is set, one pair
 * for the run otherwise), the mask per value (or none) and the addend (per value, or one for the run). */
/* Below this Mish is 0 (exp(v) underflows; the vector exp stops at e^-87, which times a huge |v| would not be 0). */
#define MISH_ZERO_BELOW -87.f

typedef struct {
    float mean, sd, gamma, beta, add;
    const float *gammas, *betas, *mask, *adds;
} run_args;

float cvl_mish(float v) {
    const float e = expf(-fabsf(v));
    if (v < 0.f) {
        const float n = e * (e + 2.f);
        return v * (n / (n + 2.f));
    }
    const float n = 1.f + 2.f * e;
    return v * (n / (n + 2.f * e * e));
}

/* ---- the moments of n values: mean, and sqrt(biased variance + eps), two passes as torch computes them (the vector
 * code: simd_math.h's cvl_moments) ---- */

static void moments_portable(const float* x, int64_t n, float eps, float* mean, float* sd) {
    double s = 0.0, v = 0.0; /* one running sum of up to a group's channels times its frames: in double */
    for (int64_t i = 0; i < n; i++) s += x[i];
    const double m = s / (double)n;
    for (int64_t i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
    *mean = (float)m;
    *sd = (float)sqrt(v / (double)n + eps);
}

/* ---- one run: y = Mish((x - mean) / sd * gamma + beta) * mask + add ---- */

static void run_portable(const float* x, int64_t n, const run_args* a, float* y) {
    for (int64_t i = 0; i < n; i++) {
        const float g = a->gammas ? a->gammas[i] : a->gamma, b = a->betas ? a->betas[i] : a->beta;
        float v = cvl_mish((x[i] - a->mean) / a->sd * g + b);
        if (a->mask) v *= a->mask[i];
        y[i] = v + (a->adds ? a->adds[i] : a->add);
    }
}

__attribute__((target(VEC))) static void run_avx512(const float* x, int64_t n, const run_args* a, float* y) {
    const __m512 mean = _mm512_set1_ps(a->mean), sd = _mm512_set1_ps(a->sd), two = _mm512_set1_ps(2.f);
    const __m512 one = _mm512_set1_ps(1.f), low = _mm512_set1_ps(MISH_ZERO_BELOW);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = cvl_tail_mask(n - i);
        const __m512 g = a->gammas ? _mm512_maskz_loadu_ps(k, a->gammas + i) : _mm512_set1_ps(a->gamma);
        const __m512 b = a->betas ? _mm512_maskz_loadu_ps(k, a->betas + i) : _mm512_set1_ps(a->beta);
        const __m512 d = _mm512_div_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mean), sd);
        const __m512 v = _mm512_fmadd_ps(d, g, b);
        const __m512 e = cvl_exp_nonpositive(_mm512_min_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), v))); /* exp(-|v|) */
        const __m512 neg_n = _mm512_mul_ps(e, _mm512_add_ps(e, two));   /* v < 0: e(e + 2) over it + 2 */
        const __m512 pos_n = _mm512_fmadd_ps(two, e, one);              /* v >= 0: 1 + 2e over it + 2e^2 */
        const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_blend_ps(neg, pos_n, neg_n);
        const __m512 den = _mm512_mask_blend_ps(neg, _mm512_fmadd_ps(_mm512_mul_ps(two, e), e, pos_n),
                                                _mm512_add_ps(neg_n, two));
        const __mmask16 live = _mm512_cmp_ps_mask(v, low, _CMP_GE_OQ); /* below: exp(v) is 0 in float32 */
        __m512 o = _mm512_maskz_mul_ps(live, v, _mm512_mul_ps(num, cvl_reciprocal(den)));
        if (a->mask) o = _mm512_mul_ps(o, _mm512_maskz_loadu_ps(k, a->mask + i));
        o = _mm512_add_ps(o, a->adds ? _mm512_maskz_loadu_ps(k, a->adds + i) : _mm512_set1_ps(a->add));
        _mm512_mask_storeu_ps(y + i, k, o);
    }
}

__attribute__((target(AVX2))) static void run_avx2(const float* x, int64_t n, const run_args* a, float* y) {
    const __m256 mean = _mm256_set1_ps(a->mean), sd = _mm256_set1_ps(a->sd), two = _mm256_set1_ps(2.f);
    const __m256 one = _mm256_set1_ps(1.f), low = _mm256_set1_ps(MISH_ZERO_BELOW);
    for (int64_t i = 0; i < n; i += 8) {
        const int64_t left = n - i;
        const __m256 g = a->gammas ? cvl_load8(a->gammas + i, left) : _mm256_set1_ps(a->gamma);
        const __m256 b = a->betas ? cvl_load8(a->betas + i, left) : _mm256_set1_ps(a->beta);
        const __m256 d = _mm256_div_ps(_mm256_sub_ps(cvl_load8(x + i, left), mean), sd);
        const __m256 v = _mm256_fmadd_ps(d, g, b);
        const __m256 e = cvl_exp_nonpositive8(_mm256_min_ps(v, _mm256_sub_ps(_mm256_setzero_ps(), v)));
        const __m256 neg_n = _mm256_mul_ps(e, _mm256_add_ps(e, two));
        const __m256 pos_n = _mm256_fmadd_ps(two, e, one);
        const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 num = _mm256_blendv_ps(pos_n, neg_n, neg);
        const __m256 den = _mm256_blendv_ps(_mm256_fmadd_ps(_mm256_mul_ps(two, e), e, pos_n), _mm256_add_ps(neg_n, two), neg);
        const __m256 live = _mm256_cmp_ps(v, low, _CMP_GE_OQ);
        __m256 o = _mm256_and_ps(live, _mm256_mul_ps(v, _mm256_div_ps(num, den)));
        if (a->mask) o = _mm256_mul_ps(o, cvl_load8(a->mask + i, left));
        o = _mm256_add_ps(o, a->adds ? cvl_load8(a->adds + i, left) : _mm256_set1_ps(a->add));
        cvl_store8(y + i, left, o);
    }
}

typedef struct {
    const cvl_norm_mish_problem* p;
    int code;
    int64_t rows_per_task; /* LayerNorm: frames per task */
} job;

static void moments(int code, const float* x, int64_t n, float eps, float* mean, float* sd) {
    if (code == CODE_AVX512)
        cvl_moments(x, n, eps, mean, sd);
    else if (code == CODE_AVX2)
        cvl_moments8(x, n, eps, mean, sd);
    else
        moments_portable(x, n, eps, mean, sd);
}

static void run(int code, const float* x, int64_t n, const run_args* a, float* y) {
    if (code == CODE_AVX512)
        run_avx512(x, n, a, y);
    else if (code == CODE_AVX2)
        run_avx2(x, n, a, y);
    else
        run_portable(x, n, a, y);
}

/* LayerNorm: frames [i * rows_per_task, ...) of all batches, each a run of C channels. */
static void layer_task(void* ctx, size_t i) {
    const job* j = ctx;
    const cvl_norm_mish_problem* p = j->p;
    const int64_t rows = p->batch * p->frames, c = p->channels;
    const int64_t end = (int64_t)(i + 1) * j->rows_per_task < rows ? (int64_t)(i + 1) * j->rows_per_task : rows;
    run_args a = {.gammas = p->gamma, .betas = p->beta};
    for (int64_t r = (int64_t)i * j->rows_per_task; r < end; r++) {
        const float* x = p->x + r * c;
        moments(j->code, x, c, p->eps, &a.mean, &a.sd);
        if (p->add_shape == CVL_ADD_FULL) a.adds = p->add + r * c;
        if (p->add_shape == CVL_ADD_PER_CHANNEL) a.adds = p->add + r / p->frames * c;
        run(j->code, x, c, &a, p->y + r * c);
    }
}

/* GroupNorm: group i % G of batch i / G, its C / G channels each a run of T frames. */
static void group_task(void* ctx, size_t i) {
    const job* j = ctx;
    const cvl_norm_mish_problem* p = j->p;
    const int64_t b = (int64_t)i / p->groups, per = p->channels / p->groups, t = p->frames;
    const int64_t first = b * p->channels + (int64_t)i % p->groups * per; /* row index of its first channel */
    run_args a = {.mask = p->mask ? p->mask + b * t : NULL};
    moments(j->code, p->x + first * t, per * t, p->eps, &a.mean, &a.sd);
    for (int64_t r = first; r < first + per; r++) {
        const int64_t ch = r - b * p->channels;
        a.gamma = p->gamma[ch];
        a.beta = p->beta[ch];
        if (p->add_shape == CVL_ADD_FULL) a.adds = p->add + r * t;
        if (p->add_shape == CVL_ADD_PER_CHANNEL) a.add = p->add[r];
        run(j->code, p->x + r * t, t, &a, p->y + r * t);
    }
}

#define LAYER_ROWS 16 /* LayerNorm frames per task: 16 KB of activations at 256 channels */

int cvl_norm_mish(const cvl_norm_mish_problem* p, const cvl_exec* ex) {
    if (p->groups < 0 || p->channels < 1 || (p->groups > 0 && p->channels % p->groups != 0) ||
        (p->groups == 0 && p->mask != NULL) || (p->add_shape != CVL_ADD_NONE) != (p->add != NULL))
        return -2;
    if (p->batch < 1 || p->frames < 1) return 0;
    job j = {p, cvl_pick_variant(&cvl_norm_mish_variants, ex->have, 0), LAYER_ROWS};
    if (p->groups > 0) {
        cvl_run_tasks(ex, group_task, &j, (size_t)(p->batch * p->groups));
        return 0;
    }
    cvl_run_tasks(ex, layer_task, &j, (size_t)((p->batch * p->frames + LAYER_ROWS - 1) / LAYER_ROWS));
    return 0;
}
