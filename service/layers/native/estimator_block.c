/* The CosyVoice2 flow estimator's transformer block in one call (estimator_block.h).
 *
 * Why: in ONNX Runtime a block is ~45 nodes (two LayerNorm patterns, three q/k/v products that each quantize the same
 * input, the attention, GELU, residual adds, the reshapes that stack its keys/values for the caches); an estimator
 * call runs 56 blocks per guidance row, 10 Euler steps per chunk, on chunks of 6-50 frames. The products and the
 * attention run near their instruction rates, and what was around them cost a tenth of a full-size call on 24-50 new
 * frames and a quarter on 6 (docs/perf-log.md). Here the block's intermediates stay in one per-thread
 * buffer, q, k and v come from one product over the quantized input (per-column scales keep each one's result
 * unchanged) written where the attention reads them, the LayerNorms, GELU and residuals are single passes, and the
 * new keys/values leave in float16, as the caches keep them. */

#include "estimator_block.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cached_attention.h"
#include "simd_math.h"
#include "work.h"

#define VEC "avx512f,fma"
#define AVX2 "avx2,fma,f16c"
#define NEEDS_VECTOR (CVL_AVX512F | CVL_FMA | CVL_F16C) /* the element-wise passes */

static const cvl_variant variants[] = {{"portable", 0}, {"avx2", CVL_NEEDS_AVX2}, {"avx512", NEEDS_VECTOR}};
const cvl_variants cvl_estimator_block_variants = {variants, 3, NULL};

/* The code of the block's own passes: the variant's index. */
enum { PASSES_PORTABLE, PASSES_AVX2, PASSES_AVX512 };

static int passes_of(cvl_features have) {
    if (cvl_has(have, NEEDS_VECTOR)) return PASSES_AVX512;
    return cvl_has(have, CVL_NEEDS_AVX2) ? PASSES_AVX2 : PASSES_PORTABLE;
}

/* ---- LayerNorm over rows of n: (x - mean) / sqrt(var + eps) * w + b, two passes as torch computes it ---- */

static void layer_norm_portable(const float* x, int64_t rows, int64_t n, const float* w, const float* b, float eps,
                                float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float mean = 0.f, var = 0.f;
        for (int64_t i = 0; i < n; i++) mean += x[i];
        mean /= (float)n;
        for (int64_t i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
        float sd = sqrtf(var / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[i] = (x[i] - mean) / sd * w[i] + b[i];
    }
}

__attribute__((target(VEC))) static void layer_norm_fast(const float* x, int64_t rows, int64_t n, const float* w,
                                                         const float* b, float eps, float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float mean, sd_value;
        cvl_moments(x, n, eps, &mean, &sd_value);
        const __m512 m = _mm512_set1_ps(mean), sd = _mm512_set1_ps(sd_value);
        for (int64_t i = 0; i < n; i += 16) {
            __mmask16 k = cvl_tail_mask(n - i);
            __m512 d = _mm512_div_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m), sd);
            __m512 o = _mm512_fmadd_ps(d, _mm512_maskz_loadu_ps(k, w + i), _mm512_maskz_loadu_ps(k, b + i));
            _mm512_mask_storeu_ps(y + i, k, o);
        }
    }
}

__attribute__((target(AVX2))) static void layer_norm_avx2(const float* x, int64_t rows, int64_t n, const float* w,
                                                          const float* b, float eps, float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float mean, sd_value;
        cvl_moments8(x, n, eps, &mean, &sd_value);
        const __m256 m = _mm256_set1_ps(mean), sd = _mm256_set1_ps(sd_value);
        for (int64_t i = 0; i < n; i += 8) {
            __m256 d = _mm256_div_ps(_mm256_sub_ps(cvl_load8(x + i, n - i), m), sd);
            cvl_store8(y + i, n - i, _mm256_fmadd_ps(d, cvl_load8(w + i, n - i), cvl_load8(b + i, n - i)));
        }
    }
}

static void layer_norm(int passes, const float* x, int64_t rows, int64_t n, const float* w, const float* b, float eps,
                       float* y) {
    if (passes == PASSES_AVX512)
        layer_norm_fast(x, rows, n, w, b, eps, y);
    else if (passes == PASSES_AVX2)
        layer_norm_avx2(x, rows, n, w, b, eps, y);
    else
        layer_norm_portable(x, rows, n, w, b, eps, y);
}

/* ---- GELU in place: x / 2 * (1 + erf(x / sqrt 2)) ---- */

__attribute__((target(VEC))) static void gelu_fast(float* x, int64_t count) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), r2 = _mm512_set1_ps(0.70710678118654752f);
    for (int64_t i = 0; i < count; i += 16) {
        __mmask16 k = cvl_tail_mask(count - i);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        __m512 e = cvl_erf(_mm512_mul_ps(v, r2));
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_mul_ps(v, half), _mm512_add_ps(one, e)));
    }
}

__attribute__((target(AVX2))) static void gelu_avx2(float* x, int64_t count) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), r2 = _mm256_set1_ps(0.70710678118654752f);
    for (int64_t i = 0; i < count; i += 8) {
        __m256 v = cvl_load8(x + i, count - i);
        __m256 e = cvl_erf8(_mm256_mul_ps(v, r2));
        cvl_store8(x + i, count - i, _mm256_mul_ps(_mm256_mul_ps(v, half), _mm256_add_ps(one, e)));
    }
}

static void gelu(int passes, float* x, int64_t count) {
    if (passes == PASSES_AVX512) {
        gelu_fast(x, count);
        return;
    }
    if (passes == PASSES_AVX2) {
        gelu_avx2(x, count);
        return;
    }
    for (int64_t i = 0; i < count; i++) x[i] = 0.5f * x[i] * (1.f + erff(x[i] * 0.70710678118654752f));
}

/* ---- GELU's tanh approximation in place: x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) ---- */

#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_K1 0.044715f

/* tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2 |u|) <= 1 (no overflow for any u; 1 + e in [1, 2]). */
__attribute__((target(VEC))) static void gelu_tanh_fast(float* x, int64_t count) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), k0 = _mm512_set1_ps(GELU_K0);
    const __m512 k1 = _mm512_set1_ps(GELU_K1), minus2 = _mm512_set1_ps(-2.0f * CVL_LOG2E); /* log2 units */
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t i = 0; i < count; i += 16) {
        __mmask16 k = cvl_tail_mask(count - i);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        __m512 u = _mm512_mul_ps(k0, _mm512_fmadd_ps(_mm512_mul_ps(k1, v), _mm512_mul_ps(v, v), v));
        __m512 a = _mm512_abs_ps(u);
        __m512 e = cvl_exp2_nonpositive(_mm512_mul_ps(minus2, a));
        __m512 t = _mm512_mul_ps(_mm512_sub_ps(one, e), cvl_reciprocal(_mm512_add_ps(one, e)));
        const __m512i u_sign = _mm512_and_si512(_mm512_castps_si512(u), sign);
        t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), u_sign));
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_mul_ps(v, half), _mm512_add_ps(one, t)));
    }
}

__attribute__((target(AVX2))) static void gelu_tanh_avx2(float* x, int64_t count) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), k0 = _mm256_set1_ps(GELU_K0);
    const __m256 k1 = _mm256_set1_ps(GELU_K1), minus2 = _mm256_set1_ps(-2.0f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < count; i += 8) {
        __m256 v = cvl_load8(x + i, count - i);
        __m256 u = _mm256_mul_ps(k0, _mm256_fmadd_ps(_mm256_mul_ps(k1, v), _mm256_mul_ps(v, v), v));
        __m256 a = _mm256_andnot_ps(sign, u);
        __m256 e = cvl_exp_nonpositive8(_mm256_mul_ps(minus2, a));
        __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        t = _mm256_or_ps(t, _mm256_and_ps(u, sign));
        cvl_store8(x + i, count - i, _mm256_mul_ps(_mm256_mul_ps(v, half), _mm256_add_ps(one, t)));
    }
}

static void gelu_tanh(int passes, float* x, int64_t count) {
    if (passes == PASSES_AVX512) {
        gelu_tanh_fast(x, count);
        return;
    }
    if (passes == PASSES_AVX2) {
        gelu_tanh_avx2(x, count);
        return;
    }
    for (int64_t i = 0; i < count; i++) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.f + tanhf(GELU_K0 * (v + GELU_K1 * v * v * v)));
    }
}

/* ---- rotary positions: the first `dim` features of each row (frames `frame`, `frame` + 1, ...) as pairs (a, b) ->
 * (a cos - b sin, b cos + a sin), cos and sin (frames, dim) holding each pair's angle twice (x-transformers'
 * rotate_half on pairs) ---- */

static void rotate_rows(float* x, int64_t rows, int64_t frame, int64_t width, int64_t dim, const float* cos_,
                        const float* sin_) {
    for (int64_t r = 0; r < rows; r++) {
        float* row = x + r * width;
        const float* c = cos_ + (frame + r) * dim;
        const float* s = sin_ + (frame + r) * dim;
        for (int64_t i = 0; i + 1 < dim; i += 2) {
            const float a = row[i], b = row[i + 1];
            row[i] = a * c[i] - b * s[i];
            row[i + 1] = b * c[i + 1] + a * s[i + 1];
        }
    }
}

/* ---- float32 -> float16 bits, rounded to nearest even (what ONNX's Cast does) ---- */

static uint16_t half_of(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u)); /* inf, nan */
    if (mag >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (mag < 0x38800000u) {                                   /* a half subnormal (or zero) */
        if (mag < 0x33000000u) return (uint16_t)sign;          /* below half the smallest subnormal: 0 */
        const uint32_t e = mag >> 23, m = (mag & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e; /* 14 .. 24: value = m * 2^(e - 150), in units of 2^-24 */
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((mag >> 13) - (112u << 10)); /* rebias the exponent by 127 - 15 */
    const uint32_t rest = mag & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

__attribute__((target("avx512f,f16c"))) static void to_half_fast(const float* x, int64_t count, uint16_t* out) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16)
        _mm256_storeu_si256((__m256i*)(out + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < count; i++) out[i] = half_of(x[i]);
}

__attribute__((target(AVX2))) static void to_half_avx2(const float* x, int64_t count, uint16_t* out) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < count; i++) out[i] = half_of(x[i]);
}

static void to_half(int passes, const float* x, int64_t count, uint16_t* out) {
    if (passes == PASSES_AVX512) {
        to_half_fast(x, count, out);
        return;
    }
    if (passes == PASSES_AVX2) {
        to_half_avx2(x, count, out);
        return;
    }
    for (int64_t i = 0; i < count; i++) out[i] = half_of(x[i]);
}

static void add_into(float* y, const float* x, int64_t count) {
    for (int64_t i = 0; i < count; i++) y[i] += x[i];
}

/* ---- the block's own passes over a range of rows, shared out over the call's threads ---- */

/* Each batch entry's rows split in this many ranges: tasks enough to share a call's rows over two to four threads, few
 * enough that a range keeps whole vectors. A row's result never depends on the range it is in. */
#define ROW_SPLITS 4

enum { STAGE_NORM1, STAGE_ROTATE, STAGE_HALVES, STAGE_RESIDUAL1, STAGE_NORM3, STAGE_GELU, STAGE_RESIDUAL2 };

typedef struct {
    const cvl_block_problem* p;
    int passes, stage, failed;
    cvl_features have;
    float *h1, *q, *k, *v, *att, *h, *f;
} block_job;

/* The LayerNorm weight or bias row of batch entry b: one row for all, or its own (a DiT's modulation). */
static const float* norm_row(const cvl_block_problem* p, const float* w, int64_t b) {
    return p->ln_per_batch ? w + b * p->dim : w;
}

/* y = x + gate * y over n rows of D (gate: the batch entry's row), or y += x without a gate. */
static void residual_rows(float* y, const float* x, const float* gate, int64_t n, int64_t dim) {
    if (gate == NULL) {
        add_into(y, x, n * dim);
        return;
    }
    for (int64_t r = 0; r < n; r++, y += dim, x += dim)
        for (int64_t i = 0; i < dim; i++) y[i] = x[i] + gate[i] * y[i];
}

static void stage_task(void* ctx, size_t task) {
    block_job* j = ctx;
    const cvl_block_problem* p = j->p;
    const int64_t b = (int64_t)task / ROW_SPLITS, part = (int64_t)task % ROW_SPLITS, M = p->frames;
    const int64_t first = b * M + part * M / ROW_SPLITS, n = b * M + (part + 1) * M / ROW_SPLITS - first;
    const int64_t D = p->dim, HD = p->heads * p->head_dim, F = p->ff;
    if (n <= 0) return;
    switch (j->stage) {
    case STAGE_NORM1:
        layer_norm(j->passes, p->x + first * D, n, D, norm_row(p, p->ln1_w, b), norm_row(p, p->ln1_b, b), p->eps1,
                   j->h1 + first * D);
        break;
    case STAGE_ROTATE: /* rows first .. first + n - 1 are frames first - b * M .. of entry b */
        rotate_rows(j->q + first * HD, n, first - b * M, HD, p->rope_dim, p->rope_cos, p->rope_sin);
        rotate_rows(j->k + first * HD, n, first - b * M, HD, p->rope_dim, p->rope_cos, p->rope_sin);
        break;
    case STAGE_HALVES:
        to_half(j->passes, j->k + first * HD, n * HD, p->k + first * HD);
        to_half(j->passes, j->v + first * HD, n * HD, p->v + first * HD);
        break;
    case STAGE_RESIDUAL1:
        residual_rows(j->h + first * D, p->x + first * D, p->gate1 ? p->gate1 + b * D : NULL, n, D);
        break;
    case STAGE_NORM3:
        layer_norm(j->passes, j->h + first * D, n, D, norm_row(p, p->ln3_w, b), norm_row(p, p->ln3_b, b), p->eps3,
                   j->h1 + first * D);
        break;
    case STAGE_GELU:
        if (p->gelu_tanh)
            gelu_tanh(j->passes, j->f + first * F, n * F);
        else
            gelu(j->passes, j->f + first * F, n * F);
        break;
    default: /* STAGE_RESIDUAL2 */
        residual_rows(p->y + first * D, j->h + first * D, p->gate3 ? p->gate3 + b * D : NULL, n, D);
    }
}

/* One batch entry's attention over its own cache (the same sums as the whole batch's: entries never mix). */
static void attention_task(void* ctx, size_t task) {
    block_job* j = ctx;
    const cvl_block_problem* p = j->p;
    const int64_t b = (int64_t)task, HD = p->heads * p->head_dim, rows = b * p->frames * HD, past = b * p->cached * HD;
    const int64_t scales = b * p->cached * p->heads;
    const cvl_attention_shape shape = {1, (int)p->frames, (int)p->cached, (int)p->heads, (int)p->head_dim, p->chunk,
                                       p->scale};
    const cvl_cached kv = {
        p->past_k ? p->past_k + past : NULL,        p->past_v ? p->past_v + past : NULL,
        p->past_k_int8 ? p->past_k_int8 + past : NULL,      p->past_v_int8 ? p->past_v_int8 + past : NULL,
        p->past_k_int8 ? p->past_k_scale + scales : NULL, p->past_v_int8 ? p->past_v_scale + scales : NULL,
    };
    if (cvl_attention_cached(&shape, j->have, j->q + rows, j->k + rows, j->v + rows, &kv, j->att + rows) != 0)
        j->failed = 1;
}

static void run(block_job* j, int stage, cvl_task_fn task, size_t tasks, const cvl_exec* ex) {
    j->stage = stage;
    cvl_run_tasks(ex, task, j, tasks);
}

int cvl_estimator_block(const cvl_block_problem* p, const cvl_exec* ex) {
    const int64_t rows = p->batch * p->frames, D = p->dim, HD = p->heads * p->head_dim, F = p->ff;
    if (rows <= 0) return 0;
    /* h1 (rows x D; LayerNorm outputs), q, k, v and att (rows x HD), h (rows x D), f (rows x F), and qkv (rows x 3HD)
     * where HD is not a multiple of 16 (the product cannot write its thirds in place) */
    const int64_t split = HD % 16 == 0 ? 0 : 3 * HD;
    float* h1 = cvl_work_floats(CVL_WORK_BLOCK, (size_t)rows * (size_t)(2 * D + 4 * HD + F + split) + 64);
    if (h1 == NULL) return -1;
    block_job j = {p, passes_of(ex->have), 0, 0, ex->have, h1, NULL, NULL, NULL, NULL, NULL, NULL};
    j.q = h1 + rows * D;
    j.k = j.q + rows * HD;
    j.v = j.k + rows * HD;
    j.att = j.v + rows * HD;
    j.h = j.att + rows * HD;
    j.f = j.h + rows * D;
    float* qkv = j.f + rows * F;
    const size_t ranges = (size_t)(p->batch * ROW_SPLITS);

    run(&j, STAGE_NORM1, stage_task, ranges, ex);
    if (!split) { /* q, k and v straight to where they are read */
        float* const parts[3] = {j.q, j.k, j.v};
        if (cvl_int8_weight_matmul(h1, rows, D, &p->qkv, NULL, parts, ex) != 0) return -1;
    } else {
        if (cvl_int8_weight_matmul(h1, rows, D, &p->qkv, qkv, NULL, ex) != 0) return -1;
        const size_t row_bytes = (size_t)HD * sizeof(float);
        for (int64_t r = 0; r < rows; r++) {
            const float* src = qkv + r * 3 * HD;
            memcpy(j.q + r * HD, src, row_bytes);
            memcpy(j.k + r * HD, src + HD, row_bytes);
            memcpy(j.v + r * HD, src + 2 * HD, row_bytes);
        }
    }
    if (p->rope_dim > 0) run(&j, STAGE_ROTATE, stage_task, ranges, ex);
    run(&j, 0, attention_task, (size_t)p->batch, ex);
    if (j.failed) return -1;
    run(&j, STAGE_HALVES, stage_task, ranges, ex);
    if (cvl_int8_weight_matmul(j.att, rows, HD, &p->out, j.h, NULL, ex) != 0) return -1;
    run(&j, STAGE_RESIDUAL1, stage_task, ranges, ex);
    run(&j, STAGE_NORM3, stage_task, ranges, ex);
    if (cvl_int8_weight_matmul(h1, rows, D, &p->ff1, j.f, NULL, ex) != 0) return -1;
    run(&j, STAGE_GELU, stage_task, ranges, ex);
    int failed = cvl_int8_weight_matmul(j.f, rows, F, &p->ff2, p->y, NULL, ex);
    if (!failed) run(&j, STAGE_RESIDUAL2, stage_task, ranges, ex);
    return failed ? -1 : 0;
}
