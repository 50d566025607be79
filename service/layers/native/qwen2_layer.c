/* A CosyVoice2 LLM decoder layer (Qwen2) in one call (qwen2_layer.h).
 *
 * Why: a decode step reads every weight once and its int8 products stream them at about one core's memory bandwidth
 * (most of a full-size step; docs/perf-log.md), but in ONNX Runtime each layer is ~75 nodes around its 7
 * products (the RMSNorm pattern twice, rotary halves, reshapes and transposes of q, k and v and the shape arithmetic
 * behind them, the casts of the float16 cache, the attention's matmuls, softmax and slices, SiLU): ~1,800 small
 * kernels a step, the rest of its time. Here a layer is its products, with the rest as single passes over one per-thread
 * buffer; the attention reads the float16 cache in place. A prefill's attention (16 new tokens or more) goes head by
 * head in bf16 (attention_heads.c): on AMX tiles where the CPU has them (it was a quarter of a 285-position prefill on
 * one thread), else with AVX-512 BF16 dot products (15 % of it row by row in float32).
 * The AVX2 code of the passes and the attention: qwen2_layer_avx2.c. */

#include "qwen2_layer.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_parts.h"
#include "half.h"
#include "qwen2_layer_parts.h"
#include "simd_math.h"
#include "work.h"

#define VEC "avx512f,avx512bw,avx512vl,fma,f16c"
#define MASKED CVL_QWEN2_MASKED
#define MAX_TASKS 16

#define NEEDS_VECTOR (CVL_AVX512F | CVL_AVX512BW | CVL_AVX512VL | CVL_FMA | CVL_F16C)

enum { PORTABLE = CVL_QWEN2_PORTABLE, AVX2 = CVL_QWEN2_AVX2, VECTOR = CVL_QWEN2_AVX512, HEADS_BF16, TILES };
static const cvl_variant variants[] = {{"portable", 0},
                                       {"avx2", CVL_NEEDS_AVX2},
                                       {"avx512", NEEDS_VECTOR},
                                       {"avx512_bf16", NEEDS_VECTOR | CVL_NEEDS_AVX512_BF16},
                                       {"amx_bf16", CVL_NEEDS_AMX_BF16}};

/* The code of the layer's own passes and one-token attention under `have`: PORTABLE, AVX2 or VECTOR. */
static int passes_of(cvl_features have) {
    if (cvl_has(have, NEEDS_VECTOR)) return VECTOR;
    return cvl_has(have, CVL_NEEDS_AVX2) ? AVX2 : PORTABLE;
}

/* A prefill's attention one head at a time (attention_heads.c) holds head sizes 32 and 64 (head_dim 0 asks for any):
 * on AMX tiles, else with AVX-512 BF16 dot products. */
static int pick(cvl_features have, int64_t head_dim) {
    if (passes_of(have) != VECTOR) return passes_of(have);
    const int heads = head_dim == 0 || head_dim == 32 || head_dim == 64;
    if (heads && cvl_has(have, CVL_NEEDS_AMX_BF16)) return TILES;
    return heads && cvl_has(have, CVL_NEEDS_AVX512_BF16) ? HEADS_BF16 : VECTOR;
}

const cvl_variants cvl_qwen2_layer_variants = {variants, 5, pick};

/* ---- RMSNorm over rows of n: w * (x * (1 / sqrt(mean(x^2) + eps))), as the step graph computes it ---- */

static void rms_norm_portable(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float s = 0.f;
        for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
        const float inv = 1.f / sqrtf(s / (float)n + eps);
        for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
    }
}

__attribute__((target(VEC))) static void rms_norm_fast(const float* x, int64_t rows, int64_t n, const float* w, float eps,
                                                       float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = _mm512_maskz_loadu_ps(cvl_tail_mask(n - i), x + i);
            s = _mm512_fmadd_ps(v, v, s);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(s) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16) {
            __mmask16 k = cvl_tail_mask(n - i);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv);
            _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, w + i), v));
        }
    }
}

static void rms_norm(int passes, const float* x, int64_t rows, int64_t n, const float* w, float eps, float* y) {
    if (passes == VECTOR)
        rms_norm_fast(x, rows, n, w, eps, y);
    else if (passes == AVX2)
        cvl_qwen2_rms_norm_avx2(x, rows, n, w, eps, y);
    else
        rms_norm_portable(x, rows, n, w, eps, y);
}

/* ---- g = silu(g) * u in place (silu(g) = g * sigmoid(g)) ---- */

__attribute__((target(VEC))) static void silu_mul_fast(float* g, const float* u, int64_t count) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < count; i += 16) {
        __mmask16 k = cvl_tail_mask(count - i);
        __m512 v = _mm512_maskz_loadu_ps(k, g + i);
        __m512 e = cvl_exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v))); /* e^-|g| */
        __m512 d = _mm512_add_ps(one, e);
        __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), d); /* 1/(1+e^-g) or e^g/(1+e^g) */
        _mm512_mask_storeu_ps(g + i, k, _mm512_mul_ps(_mm512_mul_ps(v, sig), _mm512_maskz_loadu_ps(k, u + i)));
    }
}

static void silu_mul(int passes, float* g, const float* u, int64_t count) {
    if (passes == VECTOR) {
        silu_mul_fast(g, u, count);
        return;
    }
    if (passes == AVX2) {
        cvl_qwen2_silu_mul_avx2(g, u, count);
        return;
    }
    for (int64_t i = 0; i < count; i++) g[i] = g[i] * (1.f / (1.f + expf(-g[i]))) * u[i];
}

static void add_into(float* y, const float* x, int64_t count) {
    for (int64_t i = 0; i < count; i++) y[i] += x[i];
}

/* ---- rotary positions: v = v * cos + cat(-v[half:], v[:half]) * sin, per head, in place ---- */

__attribute__((target(VEC))) static void rotate_fast(float* v, int64_t heads, int64_t dk, const float* cos, const float* sin) {
    const int64_t half = dk / 2;
    for (int64_t h = 0; h < heads; h++, v += dk)
        for (int64_t d = 0; d < half; d += 16) {
            __mmask16 m = cvl_tail_mask(half - d);
            __m512 lo = _mm512_maskz_loadu_ps(m, v + d), hi = _mm512_maskz_loadu_ps(m, v + half + d);
            __m512 new_lo = _mm512_fnmadd_ps(hi, _mm512_maskz_loadu_ps(m, sin + d),
                                             _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(m, cos + d)));
            __m512 new_hi = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(m, sin + half + d),
                                            _mm512_mul_ps(hi, _mm512_maskz_loadu_ps(m, cos + half + d)));
            _mm512_mask_storeu_ps(v + d, m, new_lo);
            _mm512_mask_storeu_ps(v + half + d, m, new_hi);
        }
}

static void rotate(int passes, float* v, int64_t heads, int64_t dk, const float* cos, const float* sin) {
    if (passes == VECTOR) {
        rotate_fast(v, heads, dk, cos, sin);
        return;
    }
    if (passes == AVX2) {
        cvl_qwen2_rotate_avx2(v, heads, dk, cos, sin);
        return;
    }
    const int64_t half = dk / 2;
    float r[1024];
    for (int64_t h = 0; h < heads; h++, v += dk) {
        for (int64_t d = 0; d < half; d++) {
            r[d] = -v[half + d];
            r[half + d] = v[d];
        }
        for (int64_t d = 0; d < dk; d++) v[d] = v[d] * cos[d] + r[d] * sin[d];
    }
}

/* ---- attention of one (row b, kv head g, new token t) for the group's query heads ---- */

static float dot_half(const float* q, const uint16_t* k, int64_t dk) {
    float s = 0.f;
    for (int64_t d = 0; d < dk; d++) s += q[d] * cvl_half_to_float(k[d]);
    return s;
}

static float dot(const float* q, const float* k, int64_t dk) {
    float s = 0.f;
    for (int64_t d = 0; d < dk; d++) s += q[d] * k[d];
    return s;
}

static void axpy_half(float a, const uint16_t* v, int64_t dk, float* o) {
    for (int64_t d = 0; d < dk; d++) o[d] += a * cvl_half_to_float(v[d]);
}

static void axpy(float a, const float* v, int64_t dk, float* o) {
    for (int64_t d = 0; d < dk; d++) o[d] += a * v[d];
}

/* s[j] = e^(s[j] - top) where the mask keeps column j (else 0); returns their sum */
static float exp_sum(float* s, const float* mask, int64_t width, float top) {
    float sum = 0.f;
    for (int64_t j = 0; j < width; j++) {
        s[j] = mask[j] < MASKED ? 0.f : expf(s[j] - top);
        sum += s[j];
    }
    return sum;
}

__attribute__((target(VEC))) static float exp_sum_fast(float* s, const float* mask, int64_t width, float top) {
    const __m512 t = _mm512_set1_ps(top), masked = _mm512_set1_ps(MASKED);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 16) {
        __mmask16 m = cvl_tail_mask(width - j);
        __mmask16 keep = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, mask + j), masked, _CMP_GE_OQ);
        __m512 e = _mm512_maskz_mov_ps(keep, cvl_exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + j), t)));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The portable code of one attention row (the vector code: attention_row_fast). */
static void attention_row(const qwen2_attention_job* jb, int64_t i, float* s) {
    const cvl_qwen2_problem* p = jb->p;
    const int64_t C = p->cached, dk = p->head_dim;
    const qwen2_attention_rows a = qwen2_rows_of(p, i);
    const int64_t r = a.r, width = a.width;
    const float* mask = a.mask;
    for (int64_t h = a.first_head; h < a.last_head; h++) {
        const float* q = jb->q + (r * p->heads + h) * dk;
        float* o = jb->att + (r * p->heads + h) * dk;
        float top = -INFINITY;
        for (int64_t j = 0; j < width; j++) {
            if (mask[j] < MASKED) continue;
            const float score = j < C ? dot_half(q, a.pk + j * dk, dk) : dot(q, a.nk + (j - C) * dk, dk);
            s[j] = score * p->scale + mask[j];
            top = s[j] > top ? s[j] : top;
        }
        const float sum = exp_sum(s, mask, width, top);
        memset(o, 0, (size_t)dk * sizeof(float));
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < width; j++) {
            if (mask[j] < MASKED) continue;
            if (j < C)
                axpy_half(s[j] * inv, a.pv + j * dk, dk, o);
            else
                axpy(s[j] * inv, a.nv + (j - C) * dk, dk, o);
        }
    }
}

/* The same row with every loop vectorized and inline: past keys by dot products (float16 read in place); new keys by
 * 16-column blocks of their transpose `kt` (dk x T), which needs no horizontal sums; values accumulated per 16 lanes
 * of dk in registers. */
__attribute__((target(VEC))) static void attention_row_fast(const qwen2_attention_job* jb, int64_t i, float* s, const float* kt) {
    const cvl_qwen2_problem* p = jb->p;
    const int64_t T = p->steps, C = p->cached, dk = p->head_dim;
    const qwen2_attention_rows a = qwen2_rows_of(p, i);
    const int64_t r = a.r, width = a.width;
    const float* mask = a.mask;
    const uint16_t *pk = a.pk, *pv = a.pv;
    const float* nv = a.nv;
    const __m512 scale = _mm512_set1_ps(p->scale), masked = _mm512_set1_ps(MASKED);
    for (int64_t h = a.first_head; h < a.last_head; h++) {
        const float* q = jb->q + (r * p->heads + h) * dk;
        float* o = jb->att + (r * p->heads + h) * dk;
        for (int64_t j = 0; j < C; j++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < dk; d += 16) {
                __mmask16 m = cvl_tail_mask(dk - d);
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d),
                                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, pk + j * dk + d)), acc);
            }
            s[j] = _mm512_reduce_add_ps(acc);
        }
        for (int64_t j = 0; j < T; j += 16) { /* new keys: s[C + j ..] = q . kt[:, j ..] (wholly masked blocks left) */
            __mmask16 m = cvl_tail_mask(T - j);
            if (!_mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, mask + C + j), masked, _CMP_GE_OQ)) continue;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < dk; d++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_maskz_loadu_ps(m, kt + d * T + j), acc);
            _mm512_mask_storeu_ps(s + C + j, m, acc);
        }
        __m512 top = _mm512_set1_ps(-INFINITY);
        int64_t end = 0; /* one past the last column the mask keeps */
        for (int64_t j = 0; j < width; j += 16) {
            __mmask16 m = cvl_tail_mask(width - j);
            __m512 bias = _mm512_maskz_loadu_ps(m, mask + j);
            __mmask16 keep = _mm512_mask_cmp_ps_mask(m, bias, masked, _CMP_GE_OQ);
            if (!keep) continue;
            __m512 v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep, s + j), scale, bias);
            _mm512_mask_storeu_ps(s + j, m, v);
            top = _mm512_mask_max_ps(top, keep, top, v);
            end = j + 32 - __builtin_clz((unsigned)keep);
        }
        const float sum = exp_sum_fast(s, mask, width, _mm512_reduce_max_ps(top));
        const __m512 inv = _mm512_set1_ps(1.f / sum);
        for (int64_t d = 0; d < dk; d += 16) {
            __mmask16 m = cvl_tail_mask(dk - d);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < C && j < end; j++)
                if (s[j] != 0.f)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(s[j]),
                                          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, pv + j * dk + d)), acc);
            for (int64_t j = 0; j < end - C; j++)
                if (s[C + j] != 0.f)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(s[C + j]), _mm512_maskz_loadu_ps(m, nv + j * dk + d), acc);
            _mm512_mask_storeu_ps(o + d, m, _mm512_mul_ps(acc, inv));
        }
    }
}

/* kt (dk x T): the new keys of (b, g) transposed */
static void transpose_keys(const cvl_qwen2_problem* p, int64_t b, int64_t g, float* kt) {
    const int64_t T = p->steps, dk = p->head_dim;
    const float* k = p->k_out + (b * p->kv_heads + g) * T * dk;
    for (int64_t j = 0; j < T; j++)
        for (int64_t d = 0; d < dk; d++) kt[d * T + j] = k[j * dk + d];
}

static void attention_task(void* ctx, size_t task) {
    const qwen2_attention_job* jb = ctx;
    const int64_t from = jb->rows * (int64_t)task / jb->tasks, to = jb->rows * (int64_t)(task + 1) / jb->tasks;
    const int64_t T = jb->p->steps, width = jb->p->cached + T;
    const int transposed = jb->passes != PORTABLE; /* the vector code reads the new keys from kt */
    float* s = cvl_work_floats(CVL_WORK_QWEN_SCORES, (size_t)(width + 16 + (transposed ? jb->p->head_dim * T : 0)));
    if (s == NULL) {
        ((qwen2_attention_job*)ctx)->failed = 1;
        return;
    }
    float* kt = s + width + 16;
    int64_t kt_of = -1; /* the (b, g) whose keys kt holds */
    for (int64_t i = from; i < to; i++) {
        if (!transposed) {
            attention_row(jb, i, s);
            continue;
        }
        if (i / T != kt_of) {
            kt_of = i / T;
            transpose_keys(jb->p, kt_of / jb->p->kv_heads, kt_of % jb->p->kv_heads, kt);
        }
        if (jb->passes == AVX2)
            cvl_qwen2_attention_row_avx2(jb, i, s, kt);
        else
            attention_row_fast(jb, i, s, kt);
    }
}

/* ---- the attention of many new tokens (a prefill) one query head at a time: one task per (batch row, query head),
 * on AMX tiles or with AVX-512 BF16 dot products (attention_heads.c) ---- */

#define TILE_ROWS 16 /* new tokens from which the attention goes head by head: a prefill (decode steps have one) */

typedef struct {
    const cvl_qwen2_problem* p;
    const float* q;
    float* att;
    int64_t units, tasks; /* units: batch x heads */
    int tiles;            /* AMX tiles, else AVX-512 BF16 */
    volatile int failed;
} tile_job;

static void tile_task(void* ctx, size_t task) {
    tile_job* jb = ctx;
    const cvl_qwen2_problem* p = jb->p;
    const int64_t T = p->steps, C = p->cached, dk = p->head_dim, G = p->heads / p->kv_heads;
    for (int64_t u = jb->units * (int64_t)task / jb->tasks; u < jb->units * (int64_t)(task + 1) / jb->tasks; u++) {
        const int64_t b = u / p->heads, h = u % p->heads, bg = b * p->kv_heads + h / G;
        const cvl_head_attention a = {
            .rows = (int)T, .cached = (int)C, .new_keys = (int)T, .head_dim = (int)dk,
            .q = jb->q + (b * T * p->heads + h) * dk, .q_stride = p->heads * dk, .scale = p->scale,
            .past_k = p->past_k + bg * C * dk, .past_v = p->past_v + bg * C * dk, .cached_stride = dk,
            .new_k = p->k_out + bg * T * dk, .new_v = p->v_out + bg * T * dk, .new_stride = dk,
            .out = jb->att + (b * T * p->heads + h) * dk, .out_stride = p->heads * dk,
            .mask = p->mask + b * T * (C + T), .mask_stride = C + T, .masked_below = MASKED,
        };
        if ((jb->tiles ? cvl_amx_head_attention(&a) : cvl_bf16_head_attention(&a)) != 0) jb->failed = 1;
    }
}

/* TILES or HEADS_BF16 where a prefill's attention goes head by head (pick holds the head sizes), else 0. */
static int head_by_head(const cvl_qwen2_problem* p, cvl_features have) {
    const int picked = pick(have, p->head_dim);
    return p->steps >= TILE_ROWS && (picked == TILES || picked == HEADS_BF16) ? picked : 0;
}

int cvl_qwen2_layer(const cvl_qwen2_problem* p, const cvl_exec* ex) {
    const int64_t R = p->batch * p->steps, D = p->dim, dk = p->head_dim, HD = p->heads * dk, KD = p->kv_heads * dk;
    const int64_t F = p->ff, T = p->steps;
    const int passes = passes_of(ex->have);
    const cvl_parallel_fn parallel = ex->parallel;
    void* const runner = ex->runner;
    if (R <= 0) return 0;
    if (dk > 1024 || dk % 2 || p->kv_heads < 1 || p->heads % p->kv_heads) return -1;
    /* h (R x D; the RMSNorm outputs), q and att (R x HD), k and v (R x KD), x1 (R x D), g and u (R x F) */
    float* h = cvl_work_floats(CVL_WORK_QWEN, (size_t)R * (size_t)(2 * D + 2 * HD + 2 * KD + 2 * F) + 64);
    if (h == NULL || cvl_work_floats(CVL_WORK_QWEN_SCORES, (size_t)(p->cached + T + 16 + dk * T)) == NULL) return -1;
    float* q = h + R * D;
    float* att = q + R * HD;
    float* k = att + R * HD;
    float* v = k + R * KD;
    float* x1 = v + R * KD;
    float* g = x1 + R * D;
    float* u = g + R * F;

    rms_norm(passes, p->x, R, D, p->rms1_w, p->eps, h);
    const cvl_int8_weight* qkv_w[3] = {&p->q, &p->k, &p->v};
    float* const qkv_y[3] = {q, k, v};
    if (cvl_int8_weight_matmuls(h, R, D, qkv_w, qkv_y, 3, ex)) return -1;
    for (int64_t r = 0; r < R; r++) {
        const float* cos = p->cos + r * dk; /* (B, 1, T, dk): row r = b * T + t */
        const float* sin = p->sin + r * dk;
        rotate(passes, q + r * HD, p->heads, dk, cos, sin);
        rotate(passes, k + r * KD, p->kv_heads, dk, cos, sin);
    }
    const size_t row_bytes = (size_t)dk * sizeof(float);
    for (int64_t r = 0; r < R; r++) /* (B, T, kv_heads, dk) -> (B, kv_heads, T, dk) */
        for (int64_t c = 0; c < p->kv_heads; c++) {
            const int64_t b = r / T, t = r % T, to = ((b * p->kv_heads + c) * T + t) * dk;
            memcpy(p->k_out + to, k + r * KD + c * dk, row_bytes);
            memcpy(p->v_out + to, v + r * KD + c * dk, row_bytes);
        }
    int failed_attention;
    const int by_head = head_by_head(p, ex->have);
    if (by_head) {
        tile_job tj = {p, q, att, p->batch * p->heads, 1, by_head == TILES, 0};
        tj.tasks = parallel ? (tj.units < MAX_TASKS ? tj.units : MAX_TASKS) : 1;
        if (tj.tasks > 1)
            parallel(runner, tile_task, &tj, (size_t)tj.tasks);
        else
            tile_task(&tj, 0);
        failed_attention = tj.failed;
    } else {
        qwen2_attention_job jb = {p, q, att, p->batch * p->kv_heads * T, 1, passes, 0};
        const int64_t work = jb.rows * (p->cached + T) * (p->heads / p->kv_heads) * dk;
        jb.tasks = parallel && work >= (1 << 20) ? (jb.rows < MAX_TASKS ? jb.rows : MAX_TASKS) : 1;
        if (jb.tasks > 1)
            parallel(runner, attention_task, &jb, (size_t)jb.tasks);
        else
            attention_task(&jb, 0);
        failed_attention = jb.failed;
    }
    if (failed_attention || cvl_int8_weight_matmul(att, R, HD, &p->o, x1, NULL, ex)) return -1;
    add_into(x1, p->x, R * D);
    rms_norm(passes, x1, R, D, p->rms2_w, p->eps, h);
    const cvl_int8_weight* ff_w[2] = {&p->gate, &p->up};
    float* const ff_y[2] = {g, u};
    if (cvl_int8_weight_matmuls(h, R, D, ff_w, ff_y, 2, ex)) return -1;
    silu_mul(passes, g, u, R * F);
    int failed = cvl_int8_weight_matmul(g, R, F, &p->down, p->y, NULL, ex);
    if (!failed) add_into(p->y, x1, R * D);
    return failed ? -1 : 0;
}
