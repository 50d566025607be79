/* The relative-position layer's passes on AVX2 with FMA and F16C (relpos_layer_parts.h): 8 floats a vector; a head
 * size that is not a multiple of 8 finishes its last lanes in scalar code. */

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "half.h"
#include "relpos_layer_parts.h"
#include "simd_math.h"

#define AVX2 "avx2,fma,f16c"
#define VALUE_VECTORS 4 /* value sums kept in registers: 32 lanes of the head at a time */

/* All-ones in the lanes below `left` (all 8 from 8 on), for the masked loads and stores (no memory touched beyond). */
__attribute__((target(AVX2))) static inline __m256i lanes(int64_t left) {
    const int n = left >= 8 ? 8 : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__attribute__((target(AVX2))) static inline float lane_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target(AVX2))) static void layer_norm(const float* x, int64_t rows, int64_t n, const float* w,
                                                     const float* b, float eps, float* y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) s = _mm256_add_ps(s, _mm256_maskload_ps(x + i, lanes(n - i)));
        const __m256 mean = _mm256_set1_ps(lane_sum(s) / (float)n);
        __m256 var = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            const __m256i m = lanes(n - i);
            const __m256 d = _mm256_and_ps(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), mean), _mm256_castsi256_ps(m));
            var = _mm256_fmadd_ps(d, d, var);
        }
        const __m256 sd = _mm256_set1_ps(sqrtf(lane_sum(var) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 8) {
            const __m256i m = lanes(n - i);
            const __m256 d = _mm256_div_ps(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), mean), sd);
            _mm256_maskstore_ps(y + i, m, _mm256_fmadd_ps(d, _mm256_maskload_ps(w + i, m), _mm256_maskload_ps(b + i, m)));
        }
    }
}

__attribute__((target(AVX2))) static void relu(float* x, int64_t count) {
    for (int64_t i = 0; i < count; i += 8) {
        const __m256i m = lanes(count - i);
        _mm256_maskstore_ps(x + i, m, _mm256_max_ps(_mm256_maskload_ps(x + i, m), _mm256_setzero_ps()));
    }
}

/* qu . k + qv . p over dk (k float16 or, with kf, float32; p float32 or, with p16, float16): a key's content term and
 * its positional term */
__attribute__((target(AVX2))) static inline float score(const float* qu, const uint16_t* k, const float* kf,
                                                        const float* qv, const float* p, const uint16_t* p16,
                                                        int64_t dk) {
    __m256 a = _mm256_setzero_ps(), c = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dk; d += 8) {
        const __m256 key = kf ? _mm256_loadu_ps(kf + d) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k + d)));
        const __m256 pos = p16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p16 + d))) : _mm256_loadu_ps(p + d);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qu + d), key, a);
        c = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), pos, c);
    }
    float s = lane_sum(_mm256_add_ps(a, c));
    for (; d < dk; d++)
        s += qu[d] * (kf ? kf[d] : cvl_half_to_float(k[d])) + qv[d] * (p16 ? cvl_half_to_float(p16[d]) : p[d]);
    return s;
}

/* s[0 .. n) = e^(s - max) in place; returns their sum */
__attribute__((target(AVX2))) static float softmax_numerators(float* s, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i m = lanes(n - j);
        const __m256 v = _mm256_blendv_ps(top, _mm256_maskload_ps(s + j, m), _mm256_castsi256_ps(m));
        top = _mm256_max_ps(top, v);
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    const __m256 max = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t))));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i m = lanes(n - j);
        const __m256 e = _mm256_and_ps(cvl_exp_nonpositive8(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), max)),
                                       _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(s + j, m, e);
        sum = _mm256_add_ps(sum, e);
    }
    return lane_sum(sum);
}

/* out[d0 .. d0 + 8 * nv) = sum over j of s[j] * inv * value row j (float16 rows, or float32 ones with vf) */
__attribute__((target(AVX2))) static void value_block(const float* s, float inv, int64_t n, const uint16_t* v,
                                                      const float* vf, int64_t dk, int64_t d0, int nv, __m256* acc) {
    for (int64_t j = 0; j < n; j++) {
        const __m256 w = _mm256_set1_ps(s[j] * inv);
        for (int c = 0; c < nv; c++) {
            const int64_t at = j * dk + d0 + 8 * c;
            const __m256 x = vf ? _mm256_loadu_ps(vf + at) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(v + at)));
            acc[c] = _mm256_fmadd_ps(w, x, acc[c]);
        }
    }
}

__attribute__((target(AVX2))) static void attention_row(const cvl_relpos_problem* p, const cvl_relpos_row* a, float* s) {
    const int64_t dk = p->head_dim, n = a->valid + a->t + 1, whole = dk / 8 * 8;
    float* qu = s + (p->cached + p->steps + 15) / 16 * 16;
    float* qv = qu + (dk + 15) / 16 * 16;
    for (int64_t d = 0; d < dk; d += 8) {
        const __m256i m = lanes(dk - d);
        const __m256 q = _mm256_maskload_ps(a->q + d, m);
        _mm256_maskstore_ps(qu + d, m, _mm256_add_ps(q, _mm256_maskload_ps(a->u + d, m)));
        _mm256_maskstore_ps(qv + d, m, _mm256_add_ps(q, _mm256_maskload_ps(a->bv + d, m)));
    }
    for (int64_t j = 0; j < a->valid; j++)
        s[j] = score(qu, a->pk + j * dk, NULL, qv, CVL_RELPOS_POS_AT(a, (a->position - j) * dk), dk) * p->scale;
    for (int64_t j = 0; j <= a->t; j++)
        s[a->valid + j] = score(qu, NULL, a->nk + j * dk, qv, CVL_RELPOS_POS_AT(a, (a->t - j) * dk), dk) * p->scale;
    const float inv = 1.f / softmax_numerators(s, n);
    for (int64_t d0 = 0; d0 < whole; d0 += 8 * VALUE_VECTORS) {
        const int nv = whole - d0 >= 8 * VALUE_VECTORS ? VALUE_VECTORS : (int)((whole - d0) / 8);
        __m256 acc[VALUE_VECTORS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        value_block(s, inv, a->valid, a->pv, NULL, dk, d0, nv, acc);
        value_block(s + a->valid, inv, a->t + 1, NULL, a->nv, dk, d0, nv, acc);
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(a->out + d0 + 8 * c, acc[c]);
    }
    for (int64_t d = whole; d < dk; d++) { /* the head's last lanes */
        float o = 0.f;
        for (int64_t j = 0; j < a->valid; j++) o += s[j] * inv * cvl_half_to_float(a->pv[j * dk + d]);
        for (int64_t j = 0; j <= a->t; j++) o += s[a->valid + j] * inv * a->nv[j * dk + d];
        a->out[d] = o;
    }
}

const cvl_relpos_passes cvl_relpos_avx2_passes = {layer_norm, relu, attention_row, NULL};
