/* int8 flow-cache frames (frame_codec.h): portable C, and AVX2 + F16C where the CPU has them (the same bits). Rows
 * are short (64 values at full size) and many (frames x heads x blocks per call), so each row is one pass over
 * registers; the CPU is probed once. */

#include "frame_codec.h"

#include <immintrin.h>
#include <math.h>

#include "cpu.h"
#include "half.h"

#define INT8_MAX_F 127.0f
#define VEC "avx2,f16c"
#define VEC_ROW 512 /* the longest row the vector code narrows (held in registers and the stack) */

static cvl_features limit = (cvl_features)-1; /* what the codec may use: the host's (cvl_frames_limit narrows it) */

void cvl_frames_limit(cvl_features have) { limit = have; }

static int vector_ok(int64_t dim) {
    static cvl_features host = 0;
    static int probed = 0;
    if (!probed) host = cvl_isa_features(CVL_ISA_AUTO), probed = 1;
    const cvl_features need = CVL_AVX2 | CVL_F16C;
    return (host & limit & need) == need && dim % 8 == 0 && dim <= VEC_ROW;
}

static inline float row_scale(float amax) { return amax > 0.f ? amax / INT8_MAX_F : 1.f; }

/* ---- portable ---- */

static void narrow_row(const float* v, int64_t dim, int8_t* q, float* scale) {
    float amax = 0.f;
    for (int64_t j = 0; j < dim; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float s = row_scale(amax);
    for (int64_t j = 0; j < dim; j++) q[j] = (int8_t)nearbyintf(v[j] / s);
    *scale = s;
}

static void narrow_half_row(const uint16_t* v, int64_t dim, int8_t* q, float* scale) {
    float amax = 0.f;
    for (int64_t j = 0; j < dim; j++) amax = fmaxf(amax, fabsf(cvl_half_to_float(v[j])));
    const float s = row_scale(amax);
    for (int64_t j = 0; j < dim; j++) q[j] = (int8_t)nearbyintf(cvl_half_to_float(v[j]) / s);
    *scale = s;
}

/* ---- AVX2 + F16C ---- */

__attribute__((target(VEC))) static void narrow_row_vec(const __m256* v, int64_t n8, int8_t* q, float* scale) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float s = row_scale(_mm_cvtss_f32(h));
    const __m256 vs = _mm256_set1_ps(s);
    for (int64_t i = 0; i < n8; i++) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i w = _mm256_cvtps_epi32(r);
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storel_epi64((__m128i*)(q + 8 * i), _mm_packs_epi16(p16, p16));
    }
    *scale = s;
}

__attribute__((target(VEC))) static void narrow_f16_vec(const uint16_t* x, int64_t rows, int64_t dim, int8_t* q,
                                                        float* scale) {
    __m256 v[VEC_ROW / 8];
    const int64_t n8 = dim / 8;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n8; i++) v[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + r * dim + 8 * i)));
        narrow_row_vec(v, n8, q + r * dim, scale + r);
    }
}

__attribute__((target(VEC))) static void narrow_f32_vec(const float* x, int64_t rows, int64_t dim, int8_t* q,
                                                        float* scale) {
    __m256 v[VEC_ROW / 8];
    const int64_t n8 = dim / 8;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n8; i++) v[i] = _mm256_loadu_ps(x + r * dim + 8 * i);
        narrow_row_vec(v, n8, q + r * dim, scale + r);
    }
}

__attribute__((target(VEC))) static inline __m256 widen8(const int8_t* q, __m256 s) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(w), s);
}

__attribute__((target(VEC))) static void widen_f16_vec(const int8_t* q, const float* scale, int64_t rows, int64_t dim,
                                                       uint16_t* out) {
    for (int64_t r = 0; r < rows; r++) {
        const __m256 s = _mm256_set1_ps(scale[r]);
        for (int64_t j = 0; j < dim; j += 8)
            _mm_storeu_si128((__m128i*)(out + r * dim + j), _mm256_cvtps_ph(widen8(q + r * dim + j, s), _MM_FROUND_TO_NEAREST_INT));
    }
}

__attribute__((target(VEC))) static void widen_f32_vec(const int8_t* q, const float* scale, int64_t rows, int64_t dim,
                                                       float* out) {
    for (int64_t r = 0; r < rows; r++) {
        const __m256 s = _mm256_set1_ps(scale[r]);
        for (int64_t j = 0; j < dim; j += 8) _mm256_storeu_ps(out + r * dim + j, widen8(q + r * dim + j, s));
    }
}

/* ---- entry points ---- */

void cvl_frames_narrow_f16(const uint16_t* x, int64_t rows, int64_t dim, int8_t* q, float* scale) {
    if (vector_ok(dim)) {
        narrow_f16_vec(x, rows, dim, q, scale);
        return;
    }
    for (int64_t r = 0; r < rows; r++) narrow_half_row(x + r * dim, dim, q + r * dim, scale + r);
}

void cvl_frames_narrow_f32(const float* x, int64_t rows, int64_t dim, int8_t* q, float* scale) {
    if (vector_ok(dim)) {
        narrow_f32_vec(x, rows, dim, q, scale);
        return;
    }
    for (int64_t r = 0; r < rows; r++) narrow_row(x + r * dim, dim, q + r * dim, scale + r);
}

void cvl_frames_widen_f16(const int8_t* q, const float* scale, int64_t rows, int64_t dim, uint16_t* out) {
    if (vector_ok(dim)) {
        widen_f16_vec(q, scale, rows, dim, out);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < dim; j++) out[r * dim + j] = cvl_float_to_half((float)q[r * dim + j] * scale[r]);
}

void cvl_frames_widen_f32(const int8_t* q, const float* scale, int64_t rows, int64_t dim, float* out) {
    if (vector_ok(dim)) {
        widen_f32_vec(q, scale, rows, dim, out);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < dim; j++) out[r * dim + j] = (float)q[r * dim + j] * scale[r];
}

void cvl_frames_narrow_blocks_f16(const uint16_t* x, int64_t blocks, int64_t x_stride, int64_t rows, int64_t dim,
                                  int8_t* q, int64_t q_stride, float* scale, int64_t s_stride) {
    for (int64_t b = 0; b < blocks; b++)
        cvl_frames_narrow_f16(x + b * x_stride, rows, dim, q + b * q_stride, scale + b * s_stride);
}

void cvl_frames_narrow_blocks_f32(const float* x, int64_t blocks, int64_t x_stride, int64_t rows, int64_t dim,
                                  int8_t* q, int64_t q_stride, float* scale, int64_t s_stride) {
    for (int64_t b = 0; b < blocks; b++)
        cvl_frames_narrow_f32(x + b * x_stride, rows, dim, q + b * q_stride, scale + b * s_stride);
}

void cvl_frames_widen_blocks_f16(const int8_t* q, int64_t blocks, int64_t q_stride, const float* scale, int64_t s_stride,
                                 int64_t rows, int64_t dim, uint16_t* out, int64_t out_stride) {
    for (int64_t b = 0; b < blocks; b++)
        cvl_frames_widen_f16(q + b * q_stride, scale + b * s_stride, rows, dim, out + b * out_stride);
}

void cvl_frames_widen_blocks_f32(const int8_t* q, int64_t blocks, int64_t q_stride, const float* scale, int64_t s_stride,
                                 int64_t rows, int64_t dim, float* out, int64_t out_stride) {
    for (int64_t b = 0; b < blocks; b++)
        cvl_frames_widen_f32(q + b * q_stride, scale + b * s_stride, rows, dim, out + b * out_stride);
}
