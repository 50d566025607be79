/* int8 weight products on AVX2 (int8_matmul.h's `avx2` variant: CPUs without AVX-512 VNNI, e.g. AMD Zen 2/3).
 *
 * AVX2 has no unsigned x signed byte dot product with int32 sums: vpmaddubsw adds two u8 x s8 products in int16 and
 * saturates (255 x 127 x 2 > 32767), so it is not used. Both sides are widened to int16 instead and vpmaddwd adds each
 * pair of products into an int32 lane exactly: a quantized row is written as int16 once (cvl_int8_quantize_row_avx2),
 * and a group of 8 columns x 4 rows of W (32 bytes of a panel, int8_matmul.h) is sign-extended and its (row 0, row 1)
 * and (row 2, row 3) pairs gathered into two vectors of one column per lane. The integer sums are the portable C's, and
 * so is the float epilogue (the same operations in the same order, no FMA), so the results are bit for bit the same.
 * Tiles: up to 4 rows x 16 columns (8 accumulators, the 4 weight vectors shared by the rows), or one row (a decode
 * step) x the whole 64-column panel, read front to back. vpmaddwd's rate bounds it (docs/perf-log.md). */

#include "int8_matmul_parts.h"

#include <immintrin.h>
#include <string.h>

/* No "fma": with it the compiler may contract the epilogue's product and bias into one rounding. */
#define AVX2 "avx2"
#define PANEL CVL_INT8_PANEL
#define ROW_TILE 4 /* rows of a tile of 16 columns: 8 accumulators */

/* ---- per-row quantization (int8_matmul.c's quantize_row_portable, int16 out) ---- */

__attribute__((target(AVX2))) void cvl_int8_quantize_row_avx2(const float* x, int64_t k, int64_t kp, int16_t* q,
                                                              float* scale, int32_t* zp) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) { /* v < lo ? v : lo, as the portable C compares */
        const __m256 v = _mm256_loadu_ps(x + i);
        lo = _mm256_min_ps(v, lo);
        hi = _mm256_max_ps(v, hi);
    }
    float lanes_lo[8], lanes_hi[8], l = 0.f, h = 0.f;
    _mm256_storeu_ps(lanes_lo, lo);
    _mm256_storeu_ps(lanes_hi, hi);
    for (int j = 0; j < 8; j++) {
        l = lanes_lo[j] < l ? lanes_lo[j] : l;
        h = lanes_hi[j] > h ? lanes_hi[j] : h;
    }
    for (int64_t t = i; t < k; t++) {
        l = x[t] < l ? x[t] : l;
        h = x[t] > h ? x[t] : h;
    }
    cvl_int8_row_params(l, h, scale, zp);
    const __m256 s = _mm256_set1_ps(*scale);
    const __m256i z = _mm256_set1_epi32(*zp), zero = _mm256_setzero_si256(), top = _mm256_set1_epi32(255);
    for (i = 0; i + 8 <= k; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + i), s)); /* half to even */
        v = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(v, z), zero), top);
        v = _mm256_permute4x64_epi64(_mm256_packs_epi32(v, v), _MM_SHUFFLE(3, 1, 2, 0));
        _mm_storeu_si128((__m128i*)(q + i), _mm256_castsi256_si128(v));
    }
    for (; i < k; i++) {
        const float v = nearbyintf(x[i] / *scale) + (float)*zp;
        q[i] = (int16_t)(v < 0.f ? 0.f : (v > 255.f ? 255.f : v));
    }
    memset(q + k, 0, (size_t)(kp - k) * sizeof(int16_t));
}

/* ---- products ---- */

/* The (row 0, row 1) and (row 2, row 3) int16 weight pairs of 8 columns (32 bytes of a 4-row group) as two vectors,
 * lane l holding column order[l] = 0, 1, 4, 5, 2, 3, 6, 7 (unshuffled by store_sums). */
__attribute__((target(AVX2), always_inline)) static inline void weight_pairs(const int8_t* w, __m256i* a, __m256i* b) {
    const __m256 lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w)));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16))));
    *a = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
    *b = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* acc + the pair products of one row's 4 values x[0..3] (int16) with the weight pairs a (rows 0, 1), b (rows 2, 3). */
__attribute__((target(AVX2), always_inline)) static inline __m256i pair_sums(__m256i acc, const int16_t* x, __m256i a,
                                                                             __m256i b) {
    int32_t x01, x23;
    memcpy(&x01, x, sizeof x01);
    memcpy(&x23, x + 2, sizeof x23);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi32(x01), a));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi32(x23), b));
}

/* Row `row`'s results of columns col .. col+7 (its sums in weight_pairs' lane order): the portable C's epilogue. */
__attribute__((target(AVX2), always_inline)) static inline void store_sums(const cvl_int8_job* jb, int64_t row,
                                                                           int64_t col, __m256i sums) {
    const cvl_int8_problem* p = jb->p;
    const int64_t left = p->n - col;
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i zp = _mm256_set1_epi32(jb->xzp[row]);
    __m256i sum = _mm256_permute4x64_epi64(sums, _MM_SHUFFLE(3, 1, 2, 0)); /* columns 0 .. 7 in order */
    sum = _mm256_sub_epi32(sum, _mm256_mullo_epi32(zp, _mm256_loadu_si256((const __m256i*)(p->colsum + col))));
    __m256 scale = _mm256_set1_ps(jb->xs[row]);
    if (p->w_scales) scale = _mm256_mul_ps(scale, _mm256_maskload_ps(p->w_scales + col, m));
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale);
    if (p->bias) v = _mm256_add_ps(v, _mm256_maskload_ps(p->bias + col, m));
    float* out = cvl_int8_out_at(p, row, col); /* 8 columns never straddle two parts (part_n is a multiple of 16) */
    if (left >= 8)
        _mm256_storeu_ps(out, v);
    else
        _mm256_maskstore_ps(out, m, v);
}

/* Rows r0 .. r0+R-1 (R a constant after inlining, at most ROW_TILE) times columns c0 .. c0+15 of the panel. */
__attribute__((target(AVX2), always_inline)) static inline void tile_rows(const cvl_int8_job* jb, int64_t panel,
                                                                          int64_t r0, int c0, const int R) {
    const int8_t* w = jb->p->packed + panel * jb->kq * PANEL * 4 + c0 * 4;
    const int16_t* x = jb->xw + r0 * jb->kp;
    const int64_t kp = jb->kp, kq = jb->kq;
    __m256i acc[ROW_TILE][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t q = 0; q < kq; q++, w += PANEL * 4) {
        __m256i a0, b0, a1, b1;
        weight_pairs(w, &a0, &b0);
        weight_pairs(w + 32, &a1, &b1);
        for (int r = 0; r < R; r++) {
            acc[r][0] = pair_sums(acc[r][0], x + r * kp + 4 * q, a0, b0);
            acc[r][1] = pair_sums(acc[r][1], x + r * kp + 4 * q, a1, b1);
        }
    }
    const int64_t col = panel * PANEL + c0;
    for (int r = 0; r < R; r++) {
        store_sums(jb, r0 + r, col, acc[r][0]);
        if (col + 8 < jb->p->n) store_sums(jb, r0 + r, col + 8, acc[r][1]);
    }
}

/* One row (a decode step's) times the whole panel, read front to back: 8 accumulators, one weight group at a time. */
__attribute__((target(AVX2))) static void tile_row(const cvl_int8_job* jb, int64_t panel, int64_t row) {
    const int8_t* w = jb->p->packed + panel * jb->kq * PANEL * 4;
    const int16_t* x = jb->xw + row * jb->kp;
    __m256i acc[8];
    for (int g = 0; g < 8; g++) acc[g] = _mm256_setzero_si256();
    for (int64_t q = 0; q < jb->kq; q++, w += PANEL * 4) {
        for (int g = 0; g < 8; g++) {
            __m256i a, b;
            weight_pairs(w + 32 * g, &a, &b);
            acc[g] = pair_sums(acc[g], x + 4 * q, a, b);
        }
    }
    for (int g = 0; g < 8 && panel * PANEL + 8 * g < jb->p->n; g++) store_sums(jb, row, panel * PANEL + 8 * g, acc[g]);
}

/* Columns [c0, c0 + 16) of `panel` for rows r .. r+R-1, for every c0 that holds an output column. */
#define TILES(R)                                                                          \
    for (int c0 = 0; c0 < PANEL && panel * PANEL + c0 < jb->p->n; c0 += 16) tile_rows(jb, panel, r, c0, R)

__attribute__((target(AVX2))) void cvl_int8_panel_avx2(const cvl_int8_job* jb, int64_t panel) {
    const int64_t rows = jb->p->rows;
    int64_t r = 0;
    for (; r + ROW_TILE <= rows; r += ROW_TILE) TILES(ROW_TILE);
    switch (rows - r) {
        case 3: TILES(3); break;
        case 2: TILES(2); break;
        case 1: tile_row(jb, panel, r); break;
        default: break;
    }
}
#undef TILES
