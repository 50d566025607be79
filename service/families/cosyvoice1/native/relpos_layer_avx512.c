/* The relative-position layer's passes on AVX-512F/BW/VL with FMA and F16C (relpos_layer_parts.h): 16 floats a
 * vector, a head's last lanes by masks (float16 rows through masked 16-bit loads). */

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "relpos_layer_parts.h"
#include "simd_math.h"

#define VEC "avx512f,avx512bw,avx512vl,fma,f16c"
#define VALUE_VECTORS 4 /* value sums kept in registers: 64 lanes of the head at a time */

__attribute__((target(VEC))) static void layer_norm(const float* x, int64_t rows, int64_t n, const float* w,
                                                    const float* b, float eps, float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(cvl_tail_mask(n - i), x + i));
        const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(s) / (float)n);
        __m512 var = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 k = cvl_tail_mask(n - i);
            const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + i), mean);
            var = _mm512_fmadd_ps(d, d, var);
        }
        const __m512 sd = _mm512_set1_ps(sqrtf(_mm512_reduce_add_ps(var) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 k = cvl_tail_mask(n - i);
            const __m512 d = _mm512_div_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mean), sd);
            _mm512_mask_storeu_ps(y + i, k, _mm512_fmadd_ps(d, _mm512_maskz_loadu_ps(k, w + i), _mm512_maskz_loadu_ps(k, b + i)));
        }
    }
}

__attribute__((target(VEC))) static void relu(float* x, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 k = cvl_tail_mask(count - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_max_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_setzero_ps()));
    }
}

/* qu . k + qv . p over dk (k float16 or, with kf, float32): a key's content term and its positional term */
__attribute__((target(VEC))) static inline float score(const float* qu, const uint16_t* k, const float* kf,
                                                       const float* qv, const float* p, int64_t dk) {
    __m512 a = _mm512_setzero_ps(), c = _mm512_setzero_ps();
    for (int64_t d = 0; d < dk; d += 16) {
        const __mmask16 m = cvl_tail_mask(dk - d);
        const __m512 key = kf ? _mm512_maskz_loadu_ps(m, kf + d) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, k + d));
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qu + d), key, a);
        c = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qv + d), _mm512_maskz_loadu_ps(m, p + d), c);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, c));
}

/* s[0 .. n) = e^(s - max) in place; returns their sum */
__attribute__((target(VEC))) static float softmax_numerators(float* s, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = cvl_tail_mask(n - j);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = cvl_tail_mask(n - j);
        const __m512 e = _mm512_maskz_mov_ps(m, cvl_exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), max)));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* out[d0 ..] += s[j] * inv * value row j over 16 * nv lanes of the head (float16 rows, or float32 ones with vf) */
__attribute__((target(VEC))) static void value_block(const float* s, float inv, int64_t n, const uint16_t* v,
                                                     const float* vf, int64_t dk, int64_t d0, int nv, __m512* acc) {
    for (int64_t j = 0; j < n; j++) {
        const __m512 w = _mm512_set1_ps(s[j] * inv);
        for (int c = 0; c < nv; c++) {
            const int64_t d = d0 + 16 * c, at = j * dk + d;
            const __mmask16 m = cvl_tail_mask(dk - d);
            const __m512 x = vf ? _mm512_maskz_loadu_ps(m, vf + at) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, v + at));
            acc[c] = _mm512_fmadd_ps(w, x, acc[c]);
        }
    }
}

__attribute__((target(VEC))) static void attention_row(const cvl_relpos_problem* p, const cvl_relpos_row* a, float* s) {
    const int64_t dk = p->head_dim, n = a->valid + a->t + 1;
    float* qu = s + (p->cached + p->steps + 15) / 16 * 16;
    float* qv = qu + (dk + 15) / 16 * 16;
    for (int64_t d = 0; d < dk; d += 16) {
        const __mmask16 m = cvl_tail_mask(dk - d);
        const __m512 q = _mm512_maskz_loadu_ps(m, a->q + d);
        _mm512_mask_storeu_ps(qu + d, m, _mm512_add_ps(q, _mm512_maskz_loadu_ps(m, a->u + d)));
        _mm512_mask_storeu_ps(qv + d, m, _mm512_add_ps(q, _mm512_maskz_loadu_ps(m, a->bv + d)));
    }
    for (int64_t j = 0; j < a->valid; j++)
        s[j] = score(qu, a->pk + j * dk, NULL, qv, a->pos + (a->position - j) * dk, dk) * p->scale;
    for (int64_t j = 0; j <= a->t; j++)
        s[a->valid + j] = score(qu, NULL, a->nk + j * dk, qv, a->pos + (a->t - j) * dk, dk) * p->scale;
    const float inv = 1.f / softmax_numerators(s, n);
    for (int64_t d0 = 0; d0 < dk; d0 += 16 * VALUE_VECTORS) {
        const int64_t left = (dk - d0 + 15) / 16;
        const int nv = left >= VALUE_VECTORS ? VALUE_VECTORS : (int)left;
        __m512 acc[VALUE_VECTORS] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        value_block(s, inv, a->valid, a->pv, NULL, dk, d0, nv, acc);
        value_block(s + a->valid, inv, a->t + 1, NULL, a->nv, dk, d0, nv, acc);
        for (int c = 0; c < nv; c++) _mm512_mask_storeu_ps(a->out + d0 + 16 * c, cvl_tail_mask(dk - d0 - 16 * c), acc[c]);
    }
}

const cvl_relpos_passes cvl_relpos_avx512_passes = {layer_norm, relu, attention_row};
