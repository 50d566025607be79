/* Cached chunk-masked attention for a chunk-causal flow estimator: a bf16 AVX-512 kernel and a portable one (the AVX2
 * kernel: attention_avx2.c, AMX tiles: attention_heads.c).
 *
 * Why a kernel of our own: in ONNX Runtime one such attention (8 heads of 64, 50 new frames over 200 cached) runs as
 * ~20 nodes (casts, transposes, two score products, concat, softmax, slices, two value products) and was half of an
 * estimator call; this kernel reads the float16 cache in place and takes the products with AVX512_BF16 dot products,
 * in under half the time (docs/perf-log.md). Layout: the query lanes of the score product are the frames (16 per
 * vector, 64 at a time), so the softmax runs down the key axis with vector max/exp/sum and no horizontal reductions;
 * the value product has the head's dims as lanes and takes the probabilities in key pairs. The scores are in log2 units
 * (log2 e folded into the query scale), so the softmax takes 2^x, six operations a vector fewer than e^x. A tile's few
 * frames past its last whole vector of lanes (a 50-frame chunk's last 2) are scored one at a time with the keys as
 * lanes rather than in a vector of 16 lanes that would be mostly padding: a 50-frame chunk's attention 10 % faster.
 * The cache may also be the engine's int8 frames (cvl_attention_cached): this kernel reads each int8 row times its
 * scale into bf16 as it goes (no float16 copy of the cache per call); the others get the rows widened to float16. */

#include "cached_attention.h"

#include "amx.h"
#include "attention_parts.h"
#include "half.h"
#include "simd_math.h"
#include "work.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define QL 64 /* query lanes of one score tile: 4 vectors of 16 frames */
#define FAST CVL_ATTENTION_VEC
/* Cached rows fetched this many keys ahead of their conversion: a head's rows are a row stride apart (every head's
 * values in between), read once per call from a cache no recent call touched. */
#define PREFETCH_KEYS 16

/* One batch entry's cached keys (or values), (C, H, DK) time-first: float16 rows, or int8 rows times one float32
 * scale per frame and head (`scale` (C, H): the engine's int8 frames, frame_codec.h). */
typedef struct {
    const uint16_t* half;
    const int8_t* q8;
    const float* scale;
} cached_rows;

/* The cache lines of cached row j of head h (and its scale) fetched ahead of their use. */
__attribute__((always_inline, unused)) static inline void prefetch_cached(const cached_rows* c, size_t j, int D, int H,
                                                                          int h, int DK) {
    if (c->q8 != NULL) {
        _mm_prefetch((const char*)(c->q8 + j * D + (size_t)h * DK), _MM_HINT_T0);
        _mm_prefetch((const char*)(c->scale + j * H + h), _MM_HINT_T0);
        return;
    }
    for (int at = 0; at < DK; at += 32) _mm_prefetch((const char*)(c->half + j * D + (size_t)h * DK + at), _MM_HINT_T0);
}

/* Cached row j of head h in float32 (NC vectors of 16): float16 widened, or int8 times its scale (one rounding). */
__attribute__((always_inline, target(FAST))) static inline void load_cached(const cached_rows* c, size_t j, int D, int H,
                                                                            int h, int NC, __m512* f) {
    if (c->q8 == NULL) {
        cvl_load_half(c->half + j * D + (size_t)h * 16 * NC, NC, f);
        return;
    }
    const __m512 scale = _mm512_set1_ps(c->scale[j * H + h]);
    const int8_t* row = c->q8 + j * D + (size_t)h * 16 * NC;
    for (int i = 0; i < NC; i++)
        f[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * i)))), scale);
}

/* ---- portable float32 kernel (any head size; the reference for the fast one) ---- */

static int attention_portable(const cvl_attention_shape* s, const float* q, const float* k, const float* v,
                              const uint16_t* pk, const uint16_t* pv, float* out) {
    const int M = s->new_frames, C = s->cached, H = s->heads, DK = s->head_dim, D = H * DK, T = C + M;
    float* w = cvl_work_floats(CVL_WORK_ATTENTION, (size_t)T + (size_t)DK);
    if (w == NULL) return -1;
    float* p = w;
    float* acc = w + T;
    for (int b = 0; b < s->batch; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < M; i++) {
                const float* qi = q + ((size_t)b * M + i) * D + h * DK;
                int lim = (int)cvl_key_limit(s, i);
                float mx = -INFINITY;
                for (int j = 0; j < lim; j++) {
                    float dot = 0.f;
                    if (j < C) {
                        const uint16_t* kj = pk + ((size_t)b * C + j) * D + h * DK;
                        for (int d = 0; d < DK; d++) dot += qi[d] * cvl_half_to_float(kj[d]);
                    } else {
                        const float* kj = k + ((size_t)b * M + (j - C)) * D + h * DK;
                        for (int d = 0; d < DK; d++) dot += qi[d] * kj[d];
                    }
                    p[j] = dot * s->scale;
                    if (p[j] > mx) mx = p[j];
                }
                float sum = 0.f;
                for (int j = 0; j < lim; j++) {
                    p[j] = expf(p[j] - mx);
                    sum += p[j];
                }
                for (int d = 0; d < DK; d++) acc[d] = 0.f;
                for (int j = 0; j < lim; j++) {
                    if (j < C) {
                        const uint16_t* vj = pv + ((size_t)b * C + j) * D + h * DK;
                        for (int d = 0; d < DK; d++) acc[d] += p[j] * cvl_half_to_float(vj[d]);
                    } else {
                        const float* vj = v + ((size_t)b * M + (j - C)) * D + h * DK;
                        for (int d = 0; d < DK; d++) acc[d] += p[j] * vj[d];
                    }
                }
                float* o = out + ((size_t)b * M + i) * D + h * DK;
                for (int d = 0; d < DK; d++) o[d] = acc[d] / sum;
            }
    return 0;
}

/* ---- AVX-512 BF16 kernel (head_dim 16, 32 or 64) ---- */

typedef struct {
    uint32_t* qp; /* [DK/2][QL] query pairs, scaled */
    float* st;    /* [TE][QL] scores, key-major */
    uint32_t* vp; /* [TE/2][DK] value pairs */
    uint32_t* pp; /* [TE/2][QL] probability pairs */
    uint32_t* kb; /* [TE+4][DK/2] the keys in bf16 pairs, key-major */
    uint32_t* qrows; /* [QL][DK/2] the queries in bf16 pairs, frame-major (then transposed into qp) */
    float* sr;    /* [TE+16] one remainder frame's scores */
} tiles;

static size_t tile_floats(int T, int DK) {
    size_t te = (size_t)T + 2;
    return (size_t)DK / 2 * QL + te * QL + te / 2 * DK + te / 2 * QL + (te + 4) * (size_t)DK / 2 + (size_t)QL * DK / 2 +
           (te + 16) + 64;
}

static tiles tiles_in(float* w, int T, int DK) {
    size_t te = (size_t)T + 2;
    tiles t;
    t.qp = (uint32_t*)w;
    t.st = w + (size_t)DK / 2 * QL;
    t.vp = (uint32_t*)(t.st + te * QL);
    t.pp = t.vp + te / 2 * DK;
    t.kb = t.pp + te / 2 * QL;
    t.qrows = t.kb + (te + 4) * (size_t)DK / 2;
    t.sr = (float*)(t.qrows + (size_t)QL * DK / 2);
    return t;
}

/* A tile's frames past its last whole vector of query lanes (at most REM_MAX of them, e.g. 2 of a 50-frame chunk) are
 * taken one at a time with the keys as lanes, instead of a vector of 16 lanes that would hold 14 padding frames. */
#define REM_MAX 4

/* One remainder frame's scores (its query's bf16 pairs `qr`, DK/2 words) with keys 0 .. maxlim-1 (their pairs in kb),
 * those from `lim` on masked, into sr; returns their maximum. */
__attribute__((always_inline, target(FAST))) static inline float remainder_scores(const int NC, const uint32_t* qr,
                                                                                 const uint32_t* kb, int maxlim,
                                                                                 int lim, float* sr) {
    const int NW = 8 * NC; /* words per key */
    const __mmask16 words = NC == 1 ? (__mmask16)0x00ff : (__mmask16)0xffff;
    const __m512bh q0 = (__m512bh)_mm512_maskz_loadu_epi32(words, qr);
    const __m512bh q1 = NC == 4 ? (__m512bh)_mm512_loadu_si512(qr + 16) : q0;
    float mx = -INFINITY;
    for (int j = 0; j < maxlim; j++) {
        const uint32_t* kj = kb + (size_t)j * NW;
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_maskz_loadu_epi32(words, kj));
        if (NC == 4) a = _mm512_dpbf16_ps(a, q1, (__m512bh)_mm512_loadu_si512(kj + 16));
        const float score = j >= lim ? -INFINITY : _mm512_reduce_add_ps(a);
        sr[j] = score;
        mx = score > mx ? score : mx;
    }
    return mx;
}

/* 2^(score - mx) of a remainder frame's keys 0 .. maxe-1 (sr[maxlim] is set to -inf when maxe > maxlim, as the lanes'
 * padding key): their bf16 pairs into lane L of pp, their sum returned. */
__attribute__((always_inline, target(FAST))) static inline float remainder_probs(float* sr, int maxlim, int maxe, float mx,
                                                                                uint32_t* pp, int L) {
    if (maxe > maxlim) sr[maxlim] = -INFINITY;
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < maxe; j += 16) {
        const __mmask16 keys = cvl_tail_mask(maxe - j);
        const __m512 e = _mm512_maskz_mov_ps(keys, cvl_exp2_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(keys, sr + j), m)));
        sum = _mm512_add_ps(sum, e);
        uint32_t pairs[8];
        _mm256_storeu_si256((__m256i*)pairs, (__m256i)_mm512_cvtneps_pbh(e));
        for (int u = 0; u < 8 && j + 2 * u < maxe; u++) pp[(size_t)(j / 2 + u) * QL + L] = pairs[u];
    }
    return _mm512_reduce_add_ps(sum);
}

/* One tile of up to QL new frames (i0 .. i0+QG-1) of head h: QV vectors of query lanes (a constant after inlining, so a
 * chunk of a few frames does not pay for 64 lanes), and the frames past them (QG - 16 QV, at most REM_MAX) one at a
 * time (remainder_scores). */
__attribute__((always_inline, target(FAST))) static inline void tile_bf16(
    const int NC, const int QV, const cvl_attention_shape* s, int b, int h, int i0, int QG, const float* q,
    const float* k, const cached_rows* kc, float* out, tiles t, __m512i il) {
    const int M = s->new_frames, C = s->cached, H = s->heads, DK = 16 * NC, D = H * DK;
    const float* qb = q + (size_t)b * M * D;
    const float* kn = k + (size_t)b * M * D;
    const float scale2 = s->scale * CVL_LOG2E; /* scores in log2 units: the softmax takes 2^x */
    const int QR = QG > QV * 16 ? QG - QV * 16 : 0; /* remainder frames */
    uint32_t* rows = t.qrows; /* [QV*16+QR][DK/2]: each frame's scaled query as bf16 pairs */
    const __m512 sc = _mm512_set1_ps(scale2);
    for (int i = 0; i < QV * 16 + QR; i++) {
        uint32_t* r = rows + (size_t)i * DK / 2;
        if (i >= QG) {
            memset(r, 0, (size_t)DK / 2 * sizeof(uint32_t));
            continue;
        }
        __m512 f[4];
        cvl_load_float(qb + (size_t)(i0 + i) * D + h * DK, NC, f);
        if (NC == 1)
            _mm256_storeu_si256((__m256i*)r, _mm512_castsi512_si256((__m512i)_mm512_cvtne2ps_pbh(
                                                 _mm512_setzero_ps(), _mm512_mul_ps(f[0], sc))));
        else
            for (int c = 0; c < NC; c += 2)
                _mm512_storeu_si512(r + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(f[c + 1], sc),
                                                                             _mm512_mul_ps(f[c], sc)));
    }
    for (int p = 0; p < DK / 2; p++)
        for (int i = 0; i < QV * 16; i++) t.qp[p * QL + i] = rows[(size_t)i * DK / 2 + p];
    int32_t limits[QL];
    int maxlim = 0;
    for (int i = 0; i < QV * 16; i++) {
        limits[i] = (int32_t)cvl_key_limit(s, i0 + (i < QG ? i : QG - 1));
        if (limits[i] > maxlim) maxlim = limits[i];
    }
    int32_t rem_limits[REM_MAX];
    for (int r = 0; r < QR; r++) {
        rem_limits[r] = (int32_t)cvl_key_limit(s, i0 + QV * 16 + r);
        if (rem_limits[r] > maxlim) maxlim = rem_limits[r];
    }
    const int maxe = (maxlim + 1) & ~1;
    __m512i lim[4];
    __m512 mx[4], sum[4];
    for (int c = 0; c < QV; c++) {
        lim[c] = _mm512_loadu_si512(limits + 16 * c);
        mx[c] = _mm512_set1_ps(-INFINITY);
        sum[c] = _mm512_setzero_ps();
    }
    for (int j0 = 0; j0 < maxlim; j0 += 4) { /* scores, four keys at a time */
        const int nk = maxlim - j0 < 4 ? maxlim - j0 : 4;
        for (int r = 0; r < 4 && j0 + PREFETCH_KEYS + r < C; r++) prefetch_cached(kc, (size_t)(j0 + PREFETCH_KEYS + r), D, H, h, DK);
        for (int r = 0; r < 4; r++) {
            int j = j0 + (r < nk ? r : 0);
            __m512 f[4];
            if (j < C)
                load_cached(kc, (size_t)j, D, H, h, NC, f);
            else
                cvl_load_float(kn + (size_t)(j - C) * D + h * DK, NC, f);
            if (NC == 1) {
                _mm256_storeu_si256((__m256i*)(t.kb + (size_t)(j0 + r) * DK / 2),
                                    _mm512_castsi512_si256((__m512i)_mm512_cvtne2ps_pbh(f[0], f[0])));
            } else {
                for (int c = 0; c < NC; c += 2)
                    _mm512_storeu_si512(t.kb + (size_t)(j0 + r) * DK / 2 + 8 * c,
                                        (__m512i)_mm512_cvtne2ps_pbh(f[c + 1], f[c]));
            }
        }
        __m512 a[4][4];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < QV; c++) a[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int p = 0; p < DK / 2; p++) {
            __m512bh qq[4];
            for (int c = 0; c < QV; c++) qq[c] = (__m512bh)_mm512_loadu_si512(t.qp + p * QL + 16 * c);
            for (int r = 0; r < 4; r++) {
                __m512bh kk = (__m512bh)_mm512_set1_epi32((int)t.kb[(size_t)(j0 + r) * DK / 2 + p]);
                for (int c = 0; c < QV; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], qq[c], kk);
            }
        }
        for (int r = 0; r < nk; r++) {
            const int j = j0 + r;
            for (int c = 0; c < QV; c++) {
                __m512 sc = a[r][c];
                if (j >= C) {
                    __mmask16 seen = _mm512_cmpgt_epi32_mask(lim[c], _mm512_set1_epi32(j));
                    sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, sc);
                }
                mx[c] = _mm512_max_ps(mx[c], sc);
                _mm512_storeu_ps(t.st + (size_t)j * QL + 16 * c, sc);
            }
        }
    }
    if (maxe > maxlim)
        for (int c = 0; c < QV; c++) _mm512_storeu_ps(t.st + (size_t)maxlim * QL + 16 * c, _mm512_set1_ps(-INFINITY));
    for (int jp = 0; jp < maxe / 2; jp++) /* probabilities (unnormalised), in key pairs */
        for (int c = 0; c < QV; c++) {
            __m512 e0 = cvl_exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(t.st + (size_t)(2 * jp) * QL + 16 * c), mx[c]));
            __m512 e1 = cvl_exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(t.st + (size_t)(2 * jp + 1) * QL + 16 * c), mx[c]));
            sum[c] = _mm512_add_ps(sum[c], _mm512_add_ps(e0, e1));
            _mm512_storeu_si512(t.pp + (size_t)jp * QL + 16 * c, cvl_bf16_pairs(e0, e1, il));
        }
    float inv[QL];
    for (int c = 0; c < QV; c++) _mm512_storeu_ps(inv + 16 * c, _mm512_div_ps(_mm512_set1_ps(1.f), sum[c]));
    for (int r = 0; r < QR; r++) {
        const int L = QV * 16 + r;
        const float top = remainder_scores(NC, rows + (size_t)L * DK / 2, t.kb, maxlim, rem_limits[r], t.sr);
        inv[L] = 1.f / remainder_probs(t.sr, maxlim, maxe, top, t.pp, L);
    }
    for (int i = 0; i < QG; i += 4) { /* values, four frames at a time */
        const int nr = QG - i < 4 ? QG - i : 4;
        __m512 o[4][4];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) o[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int jp = 0; jp < maxe / 2; jp++) {
            const uint32_t* vr = t.vp + (size_t)jp * DK;
            const uint32_t* pr = t.pp + (size_t)jp * QL + i;
            __m512bh vv[4];
            for (int c = 0; c < NC; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vr + 16 * c);
            for (int r = 0; r < 4; r++) {
                __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pr[r]);
                for (int c = 0; c < NC; c++) o[r][c] = _mm512_dpbf16_ps(o[r][c], vv[c], pb);
            }
        }
        for (int r = 0; r < nr; r++) {
            float* dst = out + ((size_t)b * M + i0 + i + r) * D + h * DK;
            __m512 scale = _mm512_set1_ps(inv[i + r]);
            for (int c = 0; c < NC; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(o[r][c], scale));
        }
    }
}

__attribute__((always_inline, target(FAST))) static inline void head_bf16(
    const int NC, const cvl_attention_shape* s, int b, int h, const float* q, const float* k, const float* v,
    const cached_rows* kc, const cached_rows* vc, float* out, tiles t, __m512i il) {
    const int M = s->new_frames, C = s->cached, H = s->heads, DK = 16 * NC, D = H * DK, T = C + M, TE = (T + 1) & ~1;
    const float* vn = v + (size_t)b * M * D;
    for (int jp = 0; jp < TE / 2; jp++) { /* value pairs of this head */
        __m512 r0[4], r1[4];
        for (int e = 0; e < 2 && 2 * jp + PREFETCH_KEYS + e < C; e++) prefetch_cached(vc, (size_t)(2 * jp + PREFETCH_KEYS + e), D, H, h, DK);
        for (int e = 0; e < 2; e++) {
            int j = 2 * jp + e;
            __m512* r = e ? r1 : r0;
            if (j < C)
                load_cached(vc, (size_t)j, D, H, h, NC, r);
            else if (j < T)
                cvl_load_float(vn + (size_t)(j - C) * D + h * DK, NC, r);
            else
                for (int c = 0; c < NC; c++) r[c] = _mm512_setzero_ps();
        }
        for (int c = 0; c < NC; c++) _mm512_storeu_si512(t.vp + (size_t)jp * DK + 16 * c, cvl_bf16_pairs(r0[c], r1[c], il));
    }
    for (int i0 = 0; i0 < M; i0 += QL) {
        const int QG = M - i0 < QL ? M - i0 : QL;
        const int whole = QG / 16, vectors = whole == 0 || QG % 16 > REM_MAX ? (QG + 15) / 16 : whole;
        switch (vectors) {
            case 1: tile_bf16(NC, 1, s, b, h, i0, QG, q, k, kc, out, t, il); break;
            case 2: tile_bf16(NC, 2, s, b, h, i0, QG, q, k, kc, out, t, il); break;
            case 3: tile_bf16(NC, 3, s, b, h, i0, QG, q, k, kc, out, t, il); break;
            default: tile_bf16(NC, 4, s, b, h, i0, QG, q, k, kc, out, t, il); break;
        }
    }
}

#define HEADS_BF16(NC)                                                                                                 \
    __attribute__((target(FAST))) static void heads_bf16_##NC(const cvl_attention_shape* s, const float* q,            \
                                                               const float* k, const float* v, const cvl_cached* kv,    \
                                                               float* out, tiles t) {                                   \
        __m512i il = cvl_pair_order();                                                                                 \
        const size_t rows = (size_t)s->cached * s->heads, values = rows * (size_t)s->head_dim;                         \
        for (int b = 0; b < s->batch; b++) {                                                                           \
            const cached_rows kc = {kv->k ? kv->k + b * values : NULL, kv->k_int8 ? kv->k_int8 + b * values : NULL,            \
                                    kv->k_scale ? kv->k_scale + b * rows : NULL};                                      \
            const cached_rows vc = {kv->v ? kv->v + b * values : NULL, kv->v_int8 ? kv->v_int8 + b * values : NULL,            \
                                    kv->v_scale ? kv->v_scale + b * rows : NULL};                                      \
            for (int h = 0; h < s->heads; h++) head_bf16(NC, s, b, h, q, k, v, &kc, &vc, out, t, il);                  \
        }                                                                                                              \
    }
HEADS_BF16(1)
HEADS_BF16(2)
HEADS_BF16(4)

enum { PORTABLE, AVX2, VECTOR, TILES };
static const cvl_variant variants[] = {
    {"portable", 0},
    {"avx2", CVL_NEEDS_AVX2},
    {"avx512_bf16", CVL_NEEDS_AVX512_BF16},
    {"amx_bf16", CVL_NEEDS_AMX_BF16},
};

/* The bf16 kernels hold head sizes 16, 32 and 64 (tiles: 32 and 64), the AVX2 one multiples of 8 up to 64; head_dim 0
 * asks for any. */
static int pick(cvl_features have, int64_t head_dim) {
    if (cvl_has(have, CVL_NEEDS_AVX512_BF16) && (head_dim == 0 || head_dim == 16 || head_dim == 32 || head_dim == 64))
        return cvl_has(have, CVL_NEEDS_AMX_BF16) && head_dim % 32 == 0 ? TILES : VECTOR;
    const int avx2_holds = head_dim >= 0 && head_dim <= 64 && head_dim % 8 == 0;
    return cvl_has(have, CVL_NEEDS_AVX2) && avx2_holds ? AVX2 : PORTABLE;
}

const cvl_variants cvl_cached_attention_variants = {variants, 4, pick};

/* Int8 rows times their scales into float16 bits (rounded to nearest even, as the engine's widening rounds them). */
static void widen_rows(const int8_t* q8, const float* scale, size_t rows, int dk, uint16_t* out) {
    for (size_t r = 0; r < rows; r++)
        for (int d = 0; d < dk; d++) out[r * dk + d] = cvl_float_to_half((float)q8[r * dk + d] * scale[r]);
}

int cvl_attention_cached(const cvl_attention_shape* s, cvl_features have, const float* q, const float* k,
                         const float* v, const cvl_cached* kv, float* out) {
    const int variant = s->head_dim > 0 ? pick(have, s->head_dim) : PORTABLE; /* 0 in pick: any head size */
    if (variant != VECTOR && (kv->k_int8 != NULL || kv->v_int8 != NULL)) {
        /* the other kernels read float16 caches: the int8 rows widened first, as the engine would widen them */
        const size_t rows = (size_t)s->batch * s->cached * s->heads, values = rows * (size_t)s->head_dim;
        uint16_t* half = malloc(2 * (values ? values : 1) * sizeof(uint16_t));
        if (half == NULL) return -1;
        cvl_cached wide = *kv;
        if (kv->k_int8 != NULL) widen_rows(kv->k_int8, kv->k_scale, rows, s->head_dim, half), wide.k = half, wide.k_int8 = NULL;
        if (kv->v_int8 != NULL) widen_rows(kv->v_int8, kv->v_scale, rows, s->head_dim, half + values), wide.v = half + values, wide.v_int8 = NULL;
        const int done = cvl_attention_cached(s, have, q, k, v, &wide, out);
        free(half);
        return done;
    }
    if (variant == PORTABLE) return attention_portable(s, q, k, v, kv->k, kv->v, out);
    if (variant == TILES) return cvl_amx_attention(s, q, k, v, kv->k, kv->v, out);
    if (variant == AVX2) return cvl_avx2_attention(s, q, k, v, kv->k, kv->v, out);
    const int T = s->cached + s->new_frames;
    float* w = cvl_work_floats(CVL_WORK_ATTENTION, tile_floats(T, s->head_dim));
    if (w == NULL) return -1;
    tiles t = tiles_in(w, T, s->head_dim);
    if (s->head_dim == 16)
        heads_bf16_1(s, q, k, v, kv, out, t);
    else if (s->head_dim == 32)
        heads_bf16_2(s, q, k, v, kv, out, t);
    else
        heads_bf16_4(s, q, k, v, kv, out, t);
    return 0;
}

int cvl_cached_attention(const cvl_attention_shape* s, cvl_features have, const float* q, const float* k,
                         const float* v, const uint16_t* past_k, const uint16_t* past_v, float* out) {
    const cvl_cached kv = {past_k, past_v, NULL, NULL, NULL, NULL};
    return cvl_attention_cached(s, have, q, k, v, &kv, out);
}
