/* Attention one query head at a time (attention_parts.h): a chunk-causal flow estimator's cached chunk-masked attention
 * (cached_attention.h's contract) and the LLM's prefill under its additive mask (qwen2_layer.c), head sizes 32 and 64;
 * the products on AMX bf16 tiles, or with AVX-512 BF16 dot products on the same layouts (the prefill on a CPU without
 * AMX).
 *
 * Why: with AVX-512 BF16 the attention was the largest part of a flow estimator call on a CPU with AMX (about a third
 * of it; docs/perf-log.md); a tile product does 16 x 16 x 32 bf16 multiply-adds at once. Without AMX, a prefill's
 * attention row by row in float32 was 15 % of a 286-position Qwen2 prefill. Per head: the keys go to bf16 dim pairs
 * transposed (kt[pair][key], 16 x 16 blocks transposed in registers), the values to key pairs (vp[key pair][dim]), the
 * scaled queries to bf16 rows. Then for each block of 16 new frames: scores = Q . K^T (frames x keys, float32), a
 * softmax along each frame's row up to its last visible key, the probabilities in bf16, and out = P . V, each row
 * divided by its sum. As the AVX-512 kernel: bf16 products, float32 sums, float32 softmax. The vector products take the
 * keys (scores) and the head's dims (values) as lanes, four frames at a time. */

#include "amx.h"
#include "attention_parts.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "simd_math.h"
#include "work.h"

#define VEC "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c"
#define TILES "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c"

typedef struct {
    const cvl_head_attention* a;
    int M, C, T, DK, Tp, Mp; /* Tp: keys rounded up to 32, Mp: query rows rounded up to 16 */
    uint32_t* kt;            /* [DK/2][Tp] key dim pairs, transposed */
    uint32_t* vp;            /* [Tp/2][DK] value key pairs */
    uint16_t* qb;            /* [Mp][DK] scaled queries, bf16 */
    float* sc;               /* [16][Tp] scores of one block of query rows */
    uint16_t* pb;            /* [16][Tp] its probabilities, bf16 */
    float* ob;               /* [16][DK] its output before the division */
} head_work;

/* out[a], out[a + d] = the `lo` and `hi` 64-bit lanes of in[a] and in[a + d] (permutex2var), for every a without bit d. */
__attribute__((target(VEC), always_inline)) static inline void exchange64(const __m512i* in, __m512i* out, int d, __m512i lo,
                                                                          __m512i hi) {
    for (int a = 0; a < 16; a++)
        if (!(a & d)) {
            out[a] = _mm512_permutex2var_epi64(in[a], lo, in[a + d]);
            out[a + d] = _mm512_permutex2var_epi64(in[a], hi, in[a + d]);
        }
}

/* 16 x 16 32-bit elements transposed in registers: r[i] lane j <- r[j] lane i. */
__attribute__((target(VEC), always_inline)) static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane now holds a 4 x 4 block transposed; move the blocks: pairs of lanes, then halves */
    exchange64(r, t, 4, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15));
    exchange64(t, r, 8, _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15));
}

/* 16 values of key (or value) `j` from dim `c`: a cached float16 row, a new float32 one, zeros past the last key. */
__attribute__((target(VEC), always_inline)) static inline __m512 key_vec(const head_work* w, const float* kn,
                                                                         const uint16_t* kc, int j, int c) {
    const cvl_head_attention* a = w->a;
    if (j < w->C) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(kc + (size_t)j * a->cached_stride + c)));
    if (j < w->T) return _mm512_loadu_ps(kn + (size_t)(j - w->C) * a->new_stride + c);
    return _mm512_setzero_ps();
}

/* Cached rows j0+from .. j0+to-1 of `kc` (keys or values) fetched into the cache ahead of their use. */
__attribute__((target(VEC))) static void prefetch_rows(const head_work* w, const uint16_t* kc, int j0, int from, int to) {
    for (int i = from; i < to && j0 + i < w->C; i++)
        for (int at = 0; at < w->DK; at += 32)
            _mm_prefetch((const char*)(kc + (size_t)(j0 + i) * w->a->cached_stride + at), _MM_HINT_T0);
}

/* kt and vp of keys j0 .. j0+15 of the head (j0 a multiple of 16): their dim pairs transposed, their value pairs.
 * Straight-line code with every block of 32 dims transposed in registers (rows gathered into small arrays in memory
 * first took 92 cycles a key and head, hot, for a head of 64), the values' rows fetched while the keys are transposed
 * and the next keys' rows while the values are paired. */
__attribute__((target(VEC))) static void prepare_keys(const head_work* w, int j0, __m512i il) {
    const cvl_head_attention* a = w->a;
    prefetch_rows(w, a->past_v, j0, 0, 16);
    for (int c = 0; c < w->DK; c += 32) { /* 16 dim pairs at a time */
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = (__m512i)_mm512_cvtne2ps_pbh(key_vec(w, a->new_k, a->past_k, j0 + i, c + 16),
                                                key_vec(w, a->new_k, a->past_k, j0 + i, c));
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(w->kt + (size_t)(c / 2 + i) * w->Tp + j0, r[i]);
    }
    prefetch_rows(w, a->past_k, j0, 16, 32);
    for (int jp = j0 / 2; jp < j0 / 2 + 8; jp++) /* value pairs */
        for (int c = 0; c < w->DK; c += 16) {
            const __m512 lo = key_vec(w, a->new_v, a->past_v, 2 * jp, c), hi = key_vec(w, a->new_v, a->past_v, 2 * jp + 1, c);
            _mm512_storeu_si512(w->vp + (size_t)jp * w->DK + c, cvl_bf16_pairs(lo, hi, il));
        }
}

/* qb of the head: its queries scaled, in bf16. */
__attribute__((target(VEC))) static void prepare_queries(const head_work* w) {
    const cvl_head_attention* a = w->a;
    const int DK = w->DK, NC = DK / 16;
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int i = 0; i < w->Mp; i++)
        for (int c = 0; c < NC; c += 2) {
            __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
            if (i < w->M) {
                lo = _mm512_mul_ps(_mm512_loadu_ps(a->q + (size_t)i * a->q_stride + 16 * c), scale);
                hi = _mm512_mul_ps(_mm512_loadu_ps(a->q + (size_t)i * a->q_stride + 16 * c + 16), scale);
            }
            _mm512_storeu_si512(w->qb + (size_t)i * DK + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
}

/* kt, vp and qb of the head. */
__attribute__((target(VEC))) static void prepare_head(const head_work* w) {
    const __m512i il = cvl_pair_order();
    for (int j0 = 0; j0 < w->Tp; j0 += 16) prepare_keys(w, j0, il);
    prepare_queries(w);
}

/* One past the last key query row i sees: its chunk's end, or its mask row's last kept column. */
__attribute__((target(VEC))) static int row_limit(const head_work* w, int i) {
    const cvl_head_attention* a = w->a;
    if (a->mask == NULL) return (int)cvl_key_limit(a->chunks, i);
    /* the mask row scanned from its end, 16 columns at a time (a causal prefill's rows end in masked columns: one
     * at a time, the scan was 4 % of a 285-position prefill) */
    const float* row = a->mask + (size_t)i * a->mask_stride;
    const __m512 floor = _mm512_set1_ps(a->masked_below);
    for (int end = w->T; end > 0; end -= 16) {
        const int from = end >= 16 ? end - 16 : 0;
        const __mmask16 in = cvl_tail_mask(end - from); /* kept: not below the floor, as the scalar test read */
        const __mmask16 kept = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, row + from), floor, _CMP_NLT_UQ);
        if (kept) return from + 32 - __builtin_clz((unsigned)kept);
    }
    return 0;
}

/* Scores of frames i0 .. i0+15 over keys [0, 16 * blocks): sc[r][key]. Tiles 0-3 sums, 4-5 the queries' two halves of
 * 32 dims, 6-7 keys. */
#define SCORE(c)                                                                                                       \
    if (n > c) {                                                                                                       \
        _tile_loadd(6, w->kt + (size_t)(kb + c) * 16, stride);                                                         \
        _tile_dpbf16ps(c, 4, 6);                                                                                       \
        if (halves == 2) {                                                                                             \
            _tile_loadd(7, w->kt + (size_t)16 * w->Tp + (size_t)(kb + c) * 16, stride);                                \
            _tile_dpbf16ps(c, 5, 7);                                                                                   \
        }                                                                                                              \
        _tile_stored(c, w->sc + (size_t)(kb + c) * 16, stride);                                                        \
    }
__attribute__((target(TILES))) static void scores(const head_work* w, int i0, int blocks) {
    const int halves = w->DK / 32;
    const long stride = (long)w->Tp * 4;
    _tile_loadd(4, w->qb + (size_t)i0 * w->DK, w->DK * 2);
    if (halves == 2) _tile_loadd(5, w->qb + (size_t)i0 * w->DK + 32, w->DK * 2);
    for (int kb = 0; kb < blocks; kb += 4) {
        const int n = blocks - kb;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        SCORE(0)
        SCORE(1)
        SCORE(2)
        SCORE(3)
    }
}
#undef SCORE

/* Softmax of each query row up to its last visible key (lims[r], row_limit), into bf16 probabilities (zero up to
 * `width` keys, and at the columns an additive mask drops; the mask's kept values are added to the scores); writes
 * 1 / sum per row into inv. Rows past the queries are zero. */
__attribute__((target(VEC))) static void softmax_rows(const head_work* w, int i0, int width, const int* lims, float* inv) {
    const cvl_head_attention* a = w->a;
    const __m512 floor = _mm512_set1_ps(a->masked_below);
    for (int r = 0; r < 16; r++) {
        uint16_t* pr = w->pb + (size_t)r * w->Tp;
        const int i = i0 + r;
        if (i >= w->M) {
            memset(pr, 0, (size_t)width * sizeof(uint16_t));
            inv[r] = 0.f;
            continue;
        }
        float* sr = w->sc + (size_t)r * w->Tp;
        const float* mask = a->mask != NULL ? a->mask + (size_t)i * a->mask_stride : NULL;
        const int lim = lims[r];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < lim; j += 16) {
            __mmask16 seen = cvl_tail_mask(lim - j);
            __m512 v = _mm512_maskz_loadu_ps(seen, sr + j);
            if (mask != NULL) {
                const __m512 bias = _mm512_maskz_loadu_ps(seen, mask + j);
                seen = _mm512_mask_cmp_ps_mask(seen, bias, floor, _CMP_GE_OQ);
                v = _mm512_add_ps(v, bias);
                _mm512_mask_storeu_ps(sr + j, cvl_tail_mask(lim - j), _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, v));
            }
            mx = _mm512_mask_max_ps(mx, seen, mx, v);
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < width; j += 32) {
            __m512 e[2];
            for (int half = 0; half < 2; half++) {
                const int at = j + 16 * half;
                const __mmask16 seen = at < lim ? cvl_tail_mask(lim - at) : 0;
                const __m512 x = _mm512_maskz_loadu_ps(seen, sr + at); /* dropped columns: -inf, e^-inf = 0 */
                e[half] = _mm512_maskz_mov_ps(seen & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                              cvl_exp_nonpositive(_mm512_sub_ps(x, m)));
                sum = _mm512_add_ps(sum, e[half]);
            }
            _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[r] = total > 0.f ? 1.f / total : 0.f; /* a row that sees nothing gives zeros, as the vector kernels do */
    }
}

/* out rows i0 .. i0+15 = P . V over keys [0, 32 * blocks), divided by the row sums. Tiles 0-3 sums (16 dims
 * each), 4 probabilities, 5-7 values. */
#define VALUE(c, t)                                                                                                    \
    if (NC > c) {                                                                                                      \
        _tile_loadd(t, w->vp + (size_t)kv * 16 * w->DK + 16 * c, w->DK * 4);                                           \
        _tile_dpbf16ps(c, 4, t);                                                                                       \
    }
__attribute__((target(TILES))) static void values(const head_work* w, int blocks, int i0, const float* inv) {
    const int NC = w->DK / 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kv = 0; kv < blocks; kv++) {
        _tile_loadd(4, w->pb + (size_t)kv * 32, w->Tp * 2);
        VALUE(0, 5)
        VALUE(1, 6)
        VALUE(2, 7)
        VALUE(3, 5)
    }
    _tile_stored(0, w->ob, w->DK * 4);
    _tile_stored(1, w->ob + 16, w->DK * 4);
    if (NC > 2) {
        _tile_stored(2, w->ob + 32, w->DK * 4);
        _tile_stored(3, w->ob + 48, w->DK * 4);
    }
    const int rows = w->M - i0 < 16 ? w->M - i0 : 16;
    for (int r = 0; r < rows; r++) {
        float* dst = w->a->out + (size_t)(i0 + r) * w->a->out_stride;
        const __m512 scale = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(w->ob + (size_t)r * w->DK + 16 * c), scale));
    }
}
#undef VALUE

/* The same products with AVX-512 BF16 dot products (a CPU without AMX): scores of four frames over four blocks of 16
 * keys at a time (the keys as lanes: a broadcast query pair against a row of kt), then their values (the head's dims
 * as lanes: a broadcast probability pair against a row of vp). */
__attribute__((target(VEC), always_inline)) static inline void scores_vec_blocks(const head_work* w, const uint32_t* q0,
                                                                                 const int N, int kb, float* sc) {
    const int NP = w->DK / 2;
    const uint32_t* q[4] = {q0, q0 + NP, q0 + 2 * NP, q0 + 3 * NP};
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < N; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < NP; p++) {
        const uint32_t* kt = w->kt + (size_t)p * w->Tp + (size_t)kb * 16;
        __m512bh k[4];
        for (int c = 0; c < N; c++) k[c] = (__m512bh)_mm512_loadu_si512(kt + 16 * c);
        for (int r = 0; r < 4; r++) {
            const __m512bh qq = (__m512bh)_mm512_set1_epi32((int)q[r][p]);
            for (int c = 0; c < N; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k[c], qq);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < N; c++) _mm512_storeu_ps(sc + (size_t)r * w->Tp + (size_t)(kb + c) * 16, acc[r][c]);
}

__attribute__((target(VEC))) static void scores_vec(const head_work* w, int i0, int blocks) {
    for (int r0 = 0; r0 < 16 && i0 + r0 < w->M; r0 += 4) { /* rows past the queries: zero queries in qb */
        const uint32_t* q0 = (const uint32_t*)(w->qb + (size_t)(i0 + r0) * w->DK);
        float* sc = w->sc + (size_t)r0 * w->Tp;
        int kb = 0;
        for (; kb + 4 <= blocks; kb += 4) scores_vec_blocks(w, q0, 4, kb, sc);
        for (; kb < blocks; kb++) scores_vec_blocks(w, q0, 1, kb, sc);
    }
}

__attribute__((target(VEC), always_inline)) static inline void values_vec_rows(const head_work* w, const int NC, int pairs,
                                                                              int i0, int r0, const float* inv) {
    __m512 o[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NC; c++) o[r][c] = _mm512_setzero_ps();
    const uint32_t* pr = (const uint32_t*)(w->pb + (size_t)r0 * w->Tp);
    const int row_words = w->Tp / 2;
    for (int jp = 0; jp < pairs; jp++) {
        const uint32_t* vr = w->vp + (size_t)jp * w->DK;
        __m512bh vv[4];
        for (int c = 0; c < NC; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vr + 16 * c);
        for (int r = 0; r < 4; r++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pr[(size_t)r * row_words + jp]);
            for (int c = 0; c < NC; c++) o[r][c] = _mm512_dpbf16_ps(o[r][c], vv[c], pb);
        }
    }
    for (int r = 0; r < 4 && i0 + r0 + r < w->M; r++) {
        float* dst = w->a->out + (size_t)(i0 + r0 + r) * w->a->out_stride;
        const __m512 scale = _mm512_set1_ps(inv[r0 + r]);
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(o[r][c], scale));
    }
}

/* out rows i0 .. i0+15 = P . V over keys [0, 32 * blocks), divided by the row sums. */
__attribute__((target(VEC))) static void values_vec(const head_work* w, int blocks, int i0, const float* inv) {
    for (int r0 = 0; r0 < 16 && i0 + r0 < w->M; r0 += 4) {
        if (w->DK == 64)
            values_vec_rows(w, 4, 16 * blocks, i0, r0, inv);
        else
            values_vec_rows(w, 2, 16 * blocks, i0, r0, inv);
    }
}

static int head_attention(const cvl_head_attention* a, int tiles) {
    head_work w = {.a = a, .M = a->rows, .C = a->cached, .T = a->cached + a->new_keys, .DK = a->head_dim};
    w.Tp = (w.T + 31) / 32 * 32;
    w.Mp = (w.M + 15) / 16 * 16;
    const size_t kt = (size_t)w.DK / 2 * w.Tp, vp = (size_t)w.Tp / 2 * w.DK, qb = (size_t)w.Mp * w.DK / 2;
    const size_t sc = (size_t)16 * w.Tp, pb = (size_t)8 * w.Tp, ob = (size_t)16 * w.DK;
    float* base = cvl_work_floats(CVL_WORK_ATTENTION, kt + vp + qb + sc + pb + ob + 16);
    if (base == NULL) return -1;
    w.kt = (uint32_t*)base;
    w.vp = w.kt + kt;
    w.qb = (uint16_t*)(w.vp + vp);
    w.sc = (float*)w.qb + qb;
    w.pb = (uint16_t*)(w.sc + sc);
    w.ob = (float*)w.pb + pb;
    float inv[16];
    if (tiles) cvl_amx_begin();
    prepare_head(&w);
    for (int i0 = 0; i0 < w.M; i0 += 16) {
        int lims[16], lim = 0; /* each row's visible keys, once (a mask row is scanned for them); the block's widest */
        for (int r = 0; r < 16 && i0 + r < w.M; r++) {
            lims[r] = row_limit(&w, i0 + r);
            lim = lims[r] > lim ? lims[r] : lim;
        }
        if (tiles)
            scores(&w, i0, (lim + 15) / 16);
        else
            scores_vec(&w, i0, (lim + 15) / 16);
        softmax_rows(&w, i0, (lim + 31) / 32 * 32, lims, inv);
        if (tiles)
            values(&w, (lim + 31) / 32, i0, inv);
        else
            values_vec(&w, (lim + 31) / 32, i0, inv);
    }
    if (tiles) cvl_amx_end();
    return 0;
}

int cvl_amx_head_attention(const cvl_head_attention* a) { return head_attention(a, 1); }

int cvl_bf16_head_attention(const cvl_head_attention* a) { return head_attention(a, 0); }

int cvl_amx_attention(const cvl_attention_shape* s, const float* q, const float* k, const float* v, const uint16_t* pk,
                      const uint16_t* pv, float* out) {
    const int64_t M = s->new_frames, C = s->cached, D = (int64_t)s->heads * s->head_dim;
    for (int b = 0; b < s->batch; b++)
        for (int h = 0; h < s->heads; h++) {
            const int64_t at = (int64_t)h * s->head_dim;
            const cvl_head_attention a = {
                .rows = s->new_frames, .cached = s->cached, .new_keys = s->new_frames, .head_dim = s->head_dim,
                .q = q + b * M * D + at, .q_stride = D, .scale = s->scale,
                .past_k = pk + b * C * D + at, .past_v = pv + b * C * D + at, .cached_stride = D,
                .new_k = k + b * M * D + at, .new_v = v + b * M * D + at, .new_stride = D,
                .out = out + b * M * D + at, .out_stride = D, .chunks = s,
            };
            if (cvl_amx_head_attention(&a) != 0) return -1;
        }
    return 0;
}
