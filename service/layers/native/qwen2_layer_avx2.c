/* A Qwen2 decoder layer's own passes and one-token attention on AVX2 with FMA and F16C (qwen2_layer.h's `avx2`
 * variant: CPUs without AVX-512), the AVX-512 code's method on 8-float vectors: RMSNorm, SiLU, rotary positions, and
 * an attention row over the float16 cache read in place (past keys by dot products, new keys by 8-column blocks of
 * their transpose, values accumulated per 8 lanes of the head). float32 throughout. */

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "qwen2_layer_parts.h"
#include "simd_math.h"

#define AVX2 "avx2,fma,f16c"

__attribute__((target(AVX2))) void cvl_qwen2_rms_norm_avx2(const float* x, int64_t rows, int64_t n, const float* w,
                                                           float eps, float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 v = cvl_load8(x + i, n - i);
            s = _mm256_fmadd_ps(v, v, s);
        }
        const __m256 inv = _mm256_set1_ps(1.f / sqrtf(cvl_sum8(s) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 8)
            cvl_store8(y + i, n - i, _mm256_mul_ps(cvl_load8(w + i, n - i), _mm256_mul_ps(cvl_load8(x + i, n - i), inv)));
    }
}

__attribute__((target(AVX2))) void cvl_qwen2_silu_mul_avx2(float* g, const float* u, int64_t count) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < count; i += 8) {
        const __m256 v = cvl_load8(g + i, count - i);
        const __m256 e = cvl_exp_nonpositive8(_mm256_or_ps(v, sign)); /* e^-|g| */
        const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e)); /* 1/(1+e^-g), e^g/(1+e^g) */
        cvl_store8(g + i, count - i, _mm256_mul_ps(_mm256_mul_ps(v, sig), cvl_load8(u + i, count - i)));
    }
}

__attribute__((target(AVX2))) void cvl_qwen2_rotate_avx2(float* v, int64_t heads, int64_t dk, const float* cos,
                                                         const float* sin) {
    const int64_t half = dk / 2;
    for (int64_t h = 0; h < heads; h++, v += dk)
        for (int64_t d = 0; d < half; d += 8) {
            const int64_t left = half - d;
            const __m256 lo = cvl_load8(v + d, left), hi = cvl_load8(v + half + d, left);
            const __m256 new_lo = _mm256_fnmadd_ps(hi, cvl_load8(sin + d, left), _mm256_mul_ps(lo, cvl_load8(cos + d, left)));
            const __m256 new_hi =
                _mm256_fmadd_ps(lo, cvl_load8(sin + half + d, left), _mm256_mul_ps(hi, cvl_load8(cos + half + d, left)));
            cvl_store8(v + d, left, new_lo);
            cvl_store8(v + half + d, left, new_hi);
        }
}

/* 8 float16 values from p (of which `left` remain; 0 past them) as floats. */
__attribute__((target(AVX2))) static inline __m256 load_half8(const uint16_t* p, int64_t left) {
    if (left >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    uint16_t part[8] = {0};
    memcpy(part, p, (size_t)left * sizeof(uint16_t));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)part));
}

/* The lanes of mask[j .. j+8) (of which `left` remain) the mask keeps, as all-ones lanes. */
__attribute__((target(AVX2))) static inline __m256 kept(const float* mask, int64_t left) {
    const __m256 in = _mm256_castsi256_ps(cvl_tail_mask8(left));
    return _mm256_and_ps(in, _mm256_cmp_ps(cvl_load8(mask, left), _mm256_set1_ps(CVL_QWEN2_MASKED), _CMP_GE_OQ));
}

/* s[j] = e^(s[j] - top) where the mask keeps column j (else 0); returns their sum */
__attribute__((target(AVX2))) static float exp_sum_avx2(float* s, const float* mask, int64_t width, float top) {
    const __m256 t = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < width; j += 8) {
        const __m256 keep = kept(mask + j, width - j);
        const __m256 score = _mm256_maskload_ps(s + j, _mm256_castps_si256(keep));
        const __m256 e = _mm256_and_ps(keep, cvl_exp_nonpositive8(_mm256_sub_ps(score, t)));
        cvl_store8(s + j, width - j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return cvl_sum8(sum);
}

/* Scores of query head q over the row's keys: s[j] = q . key j (past keys by dot products, new ones by 8-column blocks
 * of kt; blocks the mask wholly drops are left), then scaled with the mask added; returns one past the last column the
 * mask keeps and the largest score in *top. */
__attribute__((target(AVX2))) static int64_t row_scores(const cvl_qwen2_problem* p, const qwen2_attention_rows* a,
                                                        const float* q, float* s, const float* kt, float* top) {
    const int64_t T = p->steps, C = p->cached, dk = p->head_dim, width = a->width;
    for (int64_t j = 0; j < C; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < dk; d += 8)
            acc = _mm256_fmadd_ps(cvl_load8(q + d, dk - d), load_half8(a->pk + j * dk + d, dk - d), acc);
        s[j] = cvl_sum8(acc);
    }
    for (int64_t j = 0; j < T; j += 8) {
        if (!_mm256_movemask_ps(kept(a->mask + C + j, T - j))) continue;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < dk; d++) acc = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), cvl_load8(kt + d * T + j, T - j), acc);
        cvl_store8(s + C + j, T - j, acc);
    }
    const __m256 scale = _mm256_set1_ps(p->scale);
    __m256 best = _mm256_set1_ps(-INFINITY);
    int64_t end = 0;
    for (int64_t j = 0; j < width; j += 8) {
        const __m256 keep = kept(a->mask + j, width - j);
        const int bits = _mm256_movemask_ps(keep);
        if (!bits) continue;
        const __m256 score = _mm256_maskload_ps(s + j, _mm256_castps_si256(keep));
        const __m256 v = _mm256_fmadd_ps(score, scale, cvl_load8(a->mask + j, width - j));
        cvl_store8(s + j, width - j, v);
        best = _mm256_blendv_ps(best, _mm256_max_ps(best, v), keep);
        end = j + 32 - __builtin_clz((unsigned)bits);
    }
    *top = cvl_max8(best);
    return end;
}

__attribute__((target(AVX2))) void cvl_qwen2_attention_row_avx2(const qwen2_attention_job* jb, int64_t i, float* s,
                                                                const float* kt) {
    const cvl_qwen2_problem* p = jb->p;
    const int64_t C = p->cached, dk = p->head_dim;
    const qwen2_attention_rows a = qwen2_rows_of(p, i);
    for (int64_t h = a.first_head; h < a.last_head; h++) {
        const float* q = jb->q + (a.r * p->heads + h) * dk;
        float* o = jb->att + (a.r * p->heads + h) * dk;
        float top;
        const int64_t end = row_scores(p, &a, q, s, kt, &top);
        const __m256 inv = _mm256_set1_ps(1.f / exp_sum_avx2(s, a.mask, a.width, top));
        for (int64_t d = 0; d < dk; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < C && j < end; j++)
                if (s[j] != 0.f) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), load_half8(a.pv + j * dk + d, dk - d), acc);
            for (int64_t j = 0; j < end - C; j++)
                if (s[C + j] != 0.f)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(s[C + j]), cvl_load8(a.nv + j * dk + d, dk - d), acc);
            cvl_store8(o + d, dk - d, _mm256_mul_ps(acc, inv));
        }
    }
}
