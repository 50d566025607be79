/* Vector math shared by the kernels (AVX-512F, and AVX2 with FMA for 8-float vectors; each function carries its own
 * target attribute). */
#ifndef COSYVOICE_LITE_SIMD_MATH_H
#define COSYVOICE_LITE_SIMD_MATH_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define CVL_LOG2E 1.44269504088896341f /* log2(e): e^x = 2^(x log2 e) */

/* The lanes of a 16-float vector that hold the last `left` values (all 16 when 16 or more are left). */
static inline __mmask16 cvl_tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* e^x for x <= 0 (softmax scores minus their maximum, -x^2): range reduction by ln 2, degree-6 polynomial, 2^n by
 * scalef; float32 accuracy. */
__attribute__((target("avx512f,fma"), unused)) static inline __m512 cvl_exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(CVL_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* 2^x for x <= 0 (softmax scores in log2 units minus their maximum): x = n + f with |f| <= 1/2, a degree-5 minimax
 * polynomial for 2^f (relative error below 2e-7, as cvl_exp_nonpositive's), 2^n by scalef; below -126 (a masked score,
 * -inf) it gives 2^-126, as cvl_exp_nonpositive gives e^-87. Ten operations against sixteen: a softmax that scales its
 * scores by log2(e) beforehand (folded into the query scale) takes this one. */
__attribute__((target("avx512f,fma"), unused)) static inline __m512 cvl_exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.3264631853e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6714869142e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5507335812e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022242427e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314700365e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* 1/d for d >= 1 (no zeros, infinities or denormals): the 14-bit estimate and one Newton step, within about 1e-7
 * relative of the division, in three operations where a 16-lane division takes several times one's issue slot. */
__attribute__((target("avx512f,fma"), unused)) static inline __m512 cvl_reciprocal(__m512 d) {
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

/* The moments of n floats: their mean and sqrt(biased variance + eps), in two passes as torch computes a norm's, a float
 * sum per lane (a LayerNorm's row, a GroupNorm's group). */
__attribute__((target("avx512f,fma"), unused)) static inline void cvl_moments(const float* x, int64_t n, float eps,
                                                                               float* mean, float* sd) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(cvl_tail_mask(n - i), x + i));
    const float m = _mm512_reduce_add_ps(s) / (float)n;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 v = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = cvl_tail_mask(n - i);
        const __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, x + i), mv);
        v = _mm512_fmadd_ps(d, d, v);
    }
    *mean = m;
    *sd = sqrtf(_mm512_reduce_add_ps(v) / (float)n + eps);
}

/* erf(x) by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7) on |x|, the sign put back. */
__attribute__((target("avx512f,fma"), unused)) static inline __m512 cvl_erf(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 a = _mm512_abs_ps(x);
    __m512 t = cvl_reciprocal(_mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), a, one));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    __m512 e = cvl_exp2_nonpositive(_mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(-CVL_LOG2E)), a));
    __m512 r = _mm512_fnmadd_ps(p, e, one);
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(_mm512_castps_si512(x), sign)));
}

/* ---- AVX2 with FMA: 8 floats per vector ---- */

#define CVL_AVX2_MATH "avx2,fma"

/* All-ones in the lanes of an 8-float vector that hold the last `left` values (all 8 when 8 or more are left), for
 * _mm256_maskload_ps / _mm256_maskstore_ps (which touch no memory in the other lanes). */
__attribute__((target(CVL_AVX2_MATH), unused)) static inline __m256i cvl_tail_mask8(int64_t left) {
    const int n = left >= 8 ? 8 : (left <= 0 ? 0 : (int)left);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The next 8 floats at x of which `left` remain (the lanes past them 0), and their store. */
__attribute__((target(CVL_AVX2_MATH), unused)) static inline __m256 cvl_load8(const float* x, int64_t left) {
    return left >= 8 ? _mm256_loadu_ps(x) : _mm256_maskload_ps(x, cvl_tail_mask8(left));
}

__attribute__((target(CVL_AVX2_MATH), unused)) static inline void cvl_store8(float* y, int64_t left, __m256 v) {
    if (left >= 8)
        _mm256_storeu_ps(y, v);
    else
        _mm256_maskstore_ps(y, cvl_tail_mask8(left), v);
}

/* The sum, and the largest, of an 8-float vector's lanes. */
__attribute__((target(CVL_AVX2_MATH), unused)) static inline float cvl_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target(CVL_AVX2_MATH), unused)) static inline float cvl_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* cvl_exp_nonpositive on 8 lanes: the same reduction and polynomial; 2^n put into the exponent bits (n >= -126 after
 * the clamp, so the result stays a normal float). */
__attribute__((target(CVL_AVX2_MATH), unused)) static inline __m256 cvl_exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(CVL_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(two_n));
}

/* cvl_erf on 8 lanes (Abramowitz & Stegun 7.1.26, absolute error below 1.5e-7). */
__attribute__((target(CVL_AVX2_MATH), unused)) static inline __m256 cvl_erf8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, x);
    __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), a, one));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    __m256 e = cvl_exp_nonpositive8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), a));
    return _mm256_or_ps(_mm256_fnmadd_ps(p, e, one), _mm256_and_ps(x, sign));
}

/* cvl_moments on 8 lanes. */
__attribute__((target(CVL_AVX2_MATH), unused)) static inline void cvl_moments8(const float* x, int64_t n, float eps,
                                                                              float* mean, float* sd) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) s = _mm256_add_ps(s, cvl_load8(x + i, n - i));
    const float m = cvl_sum8(s) / (float)n;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 v = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 d = _mm256_and_ps(_mm256_sub_ps(cvl_load8(x + i, n - i), mv), /* 0 past the values */
                                       _mm256_castsi256_ps(cvl_tail_mask8(n - i)));
        v = _mm256_fmadd_ps(d, d, v);
    }
    *mean = m;
    *sd = sqrtf(cvl_sum8(v) / (float)n + eps);
}

#endif
