/* Cached chunk-masked attention on AVX2 with FMA and F16C (cached_attention.h's `avx2` variant: CPUs without AVX-512).
 *
 * float32 products throughout (AVX2 has no bf16 dot product), so it is nearer the portable C than the bf16 kernels.
 * Per head the float16 cache and the new keys/values are read once into float32 rows. Scores: the query lanes are the
 * frames (8 per vector, up to 32 a tile), queries dim-major, each key's dims broadcast, so the softmax runs down the key
 * axis with vector max/exp/sum and no horizontal sums; a lane's masked keys get probability 0 exactly. Values: the lanes
 * are the head's dims, a few frames at a time, each frame summing only the keys it sees. Head sizes: multiples of 8 up
 * to 64. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "attention_parts.h"
#include "simd_math.h"
#include "work.h"

#define VEC "avx2,fma,f16c"
#define QL 32     /* query lanes of one score tile: 4 vectors of 8 frames */
#define MAX_NC 8  /* vectors of 8 dims in a head: head sizes up to 64 */
#define CHAINS 8  /* independent accumulators of a score or value loop (FMA latency x issue rate) */

typedef struct {
    float* kf;     /* [T][DK] the head's keys, float32 */
    float* vf;     /* [T][DK] its values */
    float* tq;     /* [DK][QL] the tile's queries, scaled, dim-major */
    float* st;     /* [T][QL] scores, then probabilities (unnormalised), key-major */
    int32_t* lim;  /* [QL] keys each lane sees */
} tiles;

/* Head h of batch row b: its cached keys/values (float16) and new ones as float32 rows. */
__attribute__((target(VEC))) static void head_rows(const cvl_attention_shape* s, int b, int h, const float* k,
                                                  const float* v, const uint16_t* pk, const uint16_t* pv, tiles t) {
    const int M = s->new_frames, C = s->cached, DK = s->head_dim, D = s->heads * DK;
    for (int j = 0; j < C; j++) {
        const size_t at = ((size_t)b * C + j) * D + (size_t)h * DK;
        for (int d = 0; d < DK; d += 8) {
            _mm256_storeu_ps(t.kf + (size_t)j * DK + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pk + at + d))));
            _mm256_storeu_ps(t.vf + (size_t)j * DK + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(pv + at + d))));
        }
    }
    for (int j = 0; j < M; j++) {
        const size_t at = ((size_t)b * M + j) * D + (size_t)h * DK;
        for (int d = 0; d < DK; d += 8) {
            _mm256_storeu_ps(t.kf + (size_t)(C + j) * DK + d, _mm256_loadu_ps(k + at + d));
            _mm256_storeu_ps(t.vf + (size_t)(C + j) * DK + d, _mm256_loadu_ps(v + at + d));
        }
    }
}

/* Scores of QV vectors of query lanes (a constant after inlining) against keys [0, keys), KB keys at a time, masked
 * per lane; returns each vector's maximum in mx. */
__attribute__((always_inline, target(VEC))) static inline void scores(const int QV, int DK, int C, int keys, tiles t,
                                                                      __m256* mx) {
    const int KB = CHAINS / QV > 0 ? CHAINS / QV : 1;
    __m256i lim[4];
    for (int c = 0; c < QV; c++) {
        lim[c] = _mm256_loadu_si256((const __m256i*)(t.lim + 8 * c));
        mx[c] = _mm256_set1_ps(-INFINITY);
    }
    for (int j0 = 0; j0 < keys; j0 += KB) {
        const int nk = keys - j0 < KB ? keys - j0 : KB;
        __m256 a[CHAINS][4];
        for (int r = 0; r < KB; r++)
            for (int c = 0; c < QV; c++) a[r][c] = _mm256_setzero_ps();
        for (int d = 0; d < DK; d++) {
            __m256 qq[4];
            for (int c = 0; c < QV; c++) qq[c] = _mm256_loadu_ps(t.tq + (size_t)d * QL + 8 * c);
            for (int r = 0; r < KB; r++) {
                const __m256 kk = _mm256_broadcast_ss(t.kf + (size_t)(j0 + (r < nk ? r : 0)) * DK + d);
                for (int c = 0; c < QV; c++) a[r][c] = _mm256_fmadd_ps(qq[c], kk, a[r][c]);
            }
        }
        for (int r = 0; r < KB; r++) { /* KB bounds it: every index a constant, a[] stays in registers */
            const int j = j0 + r;
            if (r >= nk) continue;
            for (int c = 0; c < QV; c++) {
                __m256 sc = a[r][c];
                if (j >= C) { /* a new key: only the lanes whose chunk limit is past it see it */
                    const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim[c], _mm256_set1_epi32(j)));
                    sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, seen);
                }
                mx[c] = _mm256_max_ps(mx[c], sc);
                _mm256_storeu_ps(t.st + (size_t)j * QL + 8 * c, sc);
            }
        }
    }
}

/* The outputs of frames i0 .. i0+QG-1 from the probabilities: FB frames at a time (FB x NC accumulators, NC a constant
 * after inlining), frame i summing its own keys [0, lim[i]), scaled by its 1 / sum. */
__attribute__((always_inline, target(VEC))) static inline void values(const int NC, const cvl_attention_shape* s,
                                                                      int b, int h, int i0, int QG, const float* inv,
                                                                      tiles t, float* out) {
    const int FB = CHAINS / NC > 0 ? CHAINS / NC : 1, DK = 8 * NC, D = s->heads * DK;
    for (int i = 0; i < QG; i += FB) {
        const int nf = QG - i < FB ? QG - i : FB;
        const int keys = t.lim[i + nf - 1]; /* limits grow with the frame */
        __m256 o[CHAINS][MAX_NC];
        for (int f = 0; f < FB; f++)
            for (int c = 0; c < NC; c++) o[f][c] = _mm256_setzero_ps();
        for (int j = 0; j < keys; j++) {
            const float* vr = t.vf + (size_t)j * DK;
            for (int f = 0; f < FB; f++) {
                const __m256 p = _mm256_broadcast_ss(t.st + (size_t)j * QL + i + (f < nf ? f : 0));
                for (int c = 0; c < NC; c++) o[f][c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), o[f][c]);
            }
        }
        for (int f = 0; f < FB; f++) {
            if (f >= nf) continue;
            float* dst = out + ((size_t)b * s->new_frames + i0 + i + f) * D + (size_t)h * DK;
            const __m256 scale = _mm256_set1_ps(inv[i + f]);
            for (int c = 0; c < NC; c++) _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(o[f][c], scale));
        }
    }
}

#define VALUES(NC) \
    case NC: values(NC, s, b, h, i0, QG, inv, t, out); break

/* One tile of QG <= QL new frames from i0 of head h: queries, scores, probabilities, outputs. */
__attribute__((target(VEC))) static void tile_avx2(const cvl_attention_shape* s, int b, int h, int i0, int QG,
                                                   const float* q, tiles t, float* out) {
    const int M = s->new_frames, C = s->cached, DK = s->head_dim, D = s->heads * DK, QV = (QG + 7) / 8;
    int keys = 0;
    for (int i = 0; i < 8 * QV; i++) {
        const float* src = q + ((size_t)b * M + i0 + (i < QG ? i : 0)) * D + (size_t)h * DK;
        for (int d = 0; d < DK; d++) t.tq[(size_t)d * QL + i] = i < QG ? src[d] * s->scale : 0.f;
        t.lim[i] = (int32_t)cvl_key_limit(s, i0 + (i < QG ? i : QG - 1));
        keys = t.lim[i] > keys ? t.lim[i] : keys;
    }
    __m256 mx[4], sum[4];
    switch (QV) {
        case 1: scores(1, DK, C, keys, t, mx); break;
        case 2: scores(2, DK, C, keys, t, mx); break;
        case 3: scores(3, DK, C, keys, t, mx); break;
        default: scores(4, DK, C, keys, t, mx); break;
    }
    for (int c = 0; c < QV; c++) sum[c] = _mm256_setzero_ps();
    for (int j = 0; j < keys; j++) /* probabilities: e^(score - max) where the lane sees key j, else 0 */
        for (int c = 0; c < QV; c++) {
            const __m256i lim = _mm256_loadu_si256((const __m256i*)(t.lim + 8 * c));
            const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, _mm256_set1_epi32(j)));
            float* at = t.st + (size_t)j * QL + 8 * c;
            const __m256 e = _mm256_and_ps(seen, cvl_exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(at), mx[c])));
            sum[c] = _mm256_add_ps(sum[c], e);
            _mm256_storeu_ps(at, e);
        }
    float inv[QL];
    for (int c = 0; c < QV; c++) _mm256_storeu_ps(inv + 8 * c, _mm256_div_ps(_mm256_set1_ps(1.f), sum[c]));
    switch (DK / 8) {
        VALUES(1);
        VALUES(2);
        VALUES(3);
        VALUES(4);
        VALUES(5);
        VALUES(6);
        VALUES(7);
        default: values(8, s, b, h, i0, QG, inv, t, out); break;
    }
}
#undef VALUES

int cvl_avx2_attention(const cvl_attention_shape* s, const float* q, const float* k, const float* v, const uint16_t* pk,
                       const uint16_t* pv, float* out) {
    const size_t T = (size_t)s->cached + (size_t)s->new_frames, DK = (size_t)s->head_dim;
    float* w = cvl_work_floats(CVL_WORK_ATTENTION, 2 * T * DK + DK * QL + T * QL + QL);
    if (w == NULL) return -1;
    const tiles t = {w, w + T * DK, w + 2 * T * DK, w + 2 * T * DK + DK * QL, (int32_t*)(w + 2 * T * DK + DK * QL + T * QL)};
    for (int b = 0; b < s->batch; b++)
        for (int h = 0; h < s->heads; h++) {
            head_rows(s, b, h, k, v, pk, pv, t);
            for (int i0 = 0; i0 < s->new_frames; i0 += QL)
                tile_avx2(s, b, h, i0, s->new_frames - i0 < QL ? s->new_frames - i0 : QL, q, t, out);
        }
    return 0;
}
