/* What the attention kernels (cached_attention.c: AVX-512 BF16, attention_heads.c: one head at a time, on AMX tiles
 * or AVX-512 BF16; attention_avx2.c) share. */
#ifndef COSYVOICE_LITE_ATTENTION_PARTS_H
#define COSYVOICE_LITE_ATTENTION_PARTS_H

#include <immintrin.h>
#include <stdint.h>

#include "cached_attention.h"

#define CVL_ATTENTION_VEC "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c"

/* Last key position (exclusive) new frame `i` may see. */
static inline int64_t cvl_key_limit(const cvl_attention_shape* s, int i) {
    int64_t pos = (int64_t)s->cached + i;
    int64_t lim = (pos / s->chunk + 1) * s->chunk;
    int64_t total = (int64_t)s->cached + s->new_frames;
    return lim < total ? lim : total;
}

/* The word order cvl_bf16_pairs interleaves with: lane l of lo, then lane l of hi. */
__attribute__((target(CVL_ATTENTION_VEC), unused)) static inline __m512i cvl_pair_order(void) {
    short order[32];
    for (int l = 0; l < 16; l++) {
        order[2 * l] = (short)l;
        order[2 * l + 1] = (short)(l + 16);
    }
    return _mm512_loadu_si512(order);
}

/* 32-bit words (bf16(lo[l]), bf16(hi[l])): the pair layout vdpbf16ps and tdpbf16ps multiply and add. */
__attribute__((target(CVL_ATTENTION_VEC), unused)) static inline __m512i cvl_bf16_pairs(__m512 lo, __m512 hi, __m512i order) {
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* nc vectors of 16 values of a float16 row, or of a float32 row. */
__attribute__((target(CVL_ATTENTION_VEC), unused)) static inline void cvl_load_half(const uint16_t* row, int nc, __m512* r) {
    for (int c = 0; c < nc; c++) r[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 16 * c)));
}

__attribute__((target(CVL_ATTENTION_VEC), unused)) static inline void cvl_load_float(const float* row, int nc, __m512* r) {
    for (int c = 0; c < nc; c++) r[c] = _mm512_loadu_ps(row + 16 * c);
}

/* One query head's attention (attention_heads.c): `rows` query rows over `cached` float16 keys then
 * `new_keys` float32 ones (row strides in elements), scores scaled by `scale`, masked either by attention chunks
 * (`chunks`: row i sees cvl_key_limit(chunks, i) keys, the estimator's) or, with `mask`, by an additive mask (row i's
 * column j is added to the score where it is >= `masked_below`, else dropped: the LLM's). Head sizes 32 and 64. */
typedef struct {
    int rows, cached, new_keys, head_dim;
    const float* q;
    int64_t q_stride;
    float scale;
    const uint16_t *past_k, *past_v;
    int64_t cached_stride;
    const float *new_k, *new_v;
    int64_t new_stride;
    float* out;
    int64_t out_stride;
    const cvl_attention_shape* chunks;
    const float* mask;
    int64_t mask_stride;
    float masked_below;
} cvl_head_attention;

/* 0, or -1 when the work buffer cannot be allocated. Where cvl_amx_bf16(). */
int cvl_amx_head_attention(const cvl_head_attention* a);

/* The same with AVX-512 BF16 dot products instead of tiles (bf16 products, float32 sums and softmax; the same
 * layouts): a prefill's attention where the CPU has AVX-512 BF16 but no AMX. Where CVL_NEEDS_AVX512_BF16. */
int cvl_bf16_head_attention(const cvl_head_attention* a);

/* cvl_cached_attention's contract on AMX tiles, head by head (cvl_amx_head_attention). */
int cvl_amx_attention(const cvl_attention_shape* s, const float* q, const float* k, const float* v, const uint16_t* pk,
                      const uint16_t* pv, float* out);

/* cvl_cached_attention's contract on AVX2 with FMA and F16C in float32 (head sizes multiples of 8 up to 64): 0, or -1
 * when the work buffer cannot be allocated. */
int cvl_avx2_attention(const cvl_attention_shape* s, const float* q, const float* k, const float* v, const uint16_t* pk,
                       const uint16_t* pv, float* out);

#endif
