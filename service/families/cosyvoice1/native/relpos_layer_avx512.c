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

/* qu . k + qv . p over dk (k float16 or, with kf, float32; p float32 or, with p16, float16): a key's content term and
 * its positional term */
__attribute__((target(VEC))) static inline float score(const float* qu, const uint16_t* k, const float* kf,
                                                       const float* qv, const float* p, const uint16_t* p16, int64_t dk) {
    __m512 a = _mm512_setzero_ps(), c = _mm512_setzero_ps();
    for (int64_t d = 0; d < dk; d += 16) {
        const __mmask16 m = cvl_tail_mask(dk - d);
        const __m512 key = kf ? _mm512_maskz_loadu_ps(m, kf + d) : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, k + d));
        const __m512 pos = p16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p16 + d)) : _mm512_maskz_loadu_ps(m, p + d);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qu + d), key, a);
        c = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qv + d), pos, c);
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
        s[j] = score(qu, a->pk + j * dk, NULL, qv, CVL_RELPOS_POS_AT(a, (a->position - j) * dk), dk) * p->scale;
    for (int64_t j = 0; j <= a->t; j++)
        s[a->valid + j] = score(qu, NULL, a->nk + j * dk, qv, CVL_RELPOS_POS_AT(a, (a->t - j) * dk), dk) * p->scale;
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

/* ---- a prefill's tile: 16 new positions as the vector lanes ----
 *
 * Row by row, each (query, key) pair costs a horizontal sum (score) and its value a broadcast weight: about half of a
 * 553-token prefill's layer. Here the tile's queries are the lanes: for each key one score vector by fused
 * multiply-adds over the head's dims (no horizontal sums), the positional term of each distance once for the whole
 * tile, then gathered per key (query t and key J are at distance valid + t - J), and the values summed the same way.
 * The same sums as attention_row up to their order. */

#define TL CVL_RELPOS_TILE
#define KB 8 /* keys (or distances) whose sums run side by side: eight independent chains of fused multiply-adds */

/* out[k] = sum over d of (a[d] lanes) x row_k[d], rows k = 0 .. nk-1 (nk <= KB) at `rows` + k * dk. */
__attribute__((target(VEC))) static inline void dot_rows(const float* a, const float* rows, int64_t dk, int nk, __m512* out) {
    __m512 acc[KB];
    for (int k = 0; k < KB; k++) acc[k] = _mm512_setzero_ps();
    if (nk == KB) {
        for (int64_t d = 0; d < dk; d++) {
            const __m512 x = _mm512_load_ps(a + d * TL);
            for (int k = 0; k < KB; k++) acc[k] = _mm512_fmadd_ps(x, _mm512_set1_ps(rows[k * dk + d]), acc[k]);
        }
    } else {
        for (int64_t d = 0; d < dk; d++) {
            const __m512 x = _mm512_load_ps(a + d * TL);
            for (int k = 0; k < nk; k++) acc[k] = _mm512_fmadd_ps(x, _mm512_set1_ps(rows[k * dk + d]), acc[k]);
        }
    }
    for (int k = 0; k < nk; k++) out[k] = acc[k];
}

__attribute__((target(VEC))) static int attention_tile(const cvl_relpos_problem* p, int64_t b, int64_t h, int64_t t0,
                                                       int64_t n, const float* q, float* att, float* s) {
    const int64_t T = p->steps, C = p->cached, H = p->heads, dk = p->head_dim, bh = b * H + h;
    const int64_t past = p->past_len[b], valid = past < 0 ? 0 : (past > C ? C : past);
    if (dk % 16 != 0 || n <= 0 || n > TL || (valid != past && valid != 0)) return 1; /* rows one by one */
    const int64_t keys = valid + t0 + n; /* keys J < keys: the cached columns below valid, then the new positions */
    float* qu = s;                        /* [dk][TL]: q + u, dim-major */
    float* qv = qu + dk * TL;             /* [dk][TL]: q + v_bias */
    float* bd = qv + dk * TL;             /* [keys][TL]: positional scores by distance */
    float* sc = bd + (C + T + TL) * TL;   /* [keys][TL]: scores, then unnormalised probabilities */
    float* kf = sc + (C + T + TL) * TL;   /* [valid][dk]: cached keys, float32 */
    float* vf = kf + C * dk;              /* [valid][dk]: cached values */
    float* ot = vf + C * dk;              /* [16][TL]: one output block, dim-major */
    const float* u = p->bias_u + h * dk;
    const float* bv = p->bias_v + h * dk;
    for (int64_t i = 0; i < TL; i++) {
        const float* row = i < n ? q + ((b * T + t0 + i) * H + h) * dk : NULL;
        for (int64_t d = 0; d < dk; d++) {
            qu[d * TL + i] = row ? row[d] + u[d] : 0.f;
            qv[d * TL + i] = row ? row[d] + bv[d] : 0.f;
        }
    }
    const uint16_t* pk = p->past_k + bh * C * dk;
    const uint16_t* pv = p->past_v + bh * C * dk;
    for (int64_t i = 0; i < valid * dk; i += 16) {
        _mm512_storeu_ps(kf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(pk + i))));
        _mm512_storeu_ps(vf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(pv + i))));
    }
    const float* nk = p->k_out + bh * T * dk;
    const float* nv = p->v_out + bh * T * dk;
    const float* pos = p->pos_half ? NULL : p->pos + h * p->pos_rows * dk;
    const uint16_t* pos16 = p->pos_half ? p->pos_half + h * p->pos_rows * dk : NULL;
    float* widened = ot + 16 * TL; /* [KB][dk]: a block of float16 positions in float32 */
    __m512 sums[KB];
    for (int64_t r = 0; r < keys; r += KB) { /* the positional term of every distance the tile reads */
        const int nr = keys - r < KB ? (int)(keys - r) : KB;
        if (pos16)
            for (int64_t i = 0; i < nr * dk; i += 16)
                _mm512_storeu_ps(widened + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(pos16 + r * dk + i))));
        dot_rows(qv, pos16 ? widened : pos + r * dk, dk, nr, sums);
        for (int k = 0; k < nr; k++) _mm512_store_ps(bd + (r + k) * TL, sums[k]);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const __m512 scale = _mm512_set1_ps(p->scale), none = _mm512_set1_ps(-INFINITY);
    __m512 top = none;
    for (int64_t j = 0; j < keys; j += KB) { /* scores: content term + the positional one at each lane's distance */
        const int nj = keys - j < KB ? (int)(keys - j) : KB;
        if (j + nj <= valid) {
            dot_rows(qu, kf + j * dk, dk, nj, sums);
        } else if (j >= valid) {
            dot_rows(qu, nk + (j - valid) * dk, dk, nj, sums);
        } else { /* a block across the cache's end: key by key */
            for (int k = 0; k < nj; k++) {
                const int64_t J = j + k;
                dot_rows(qu, J < valid ? kf + J * dk : nk + (J - valid) * dk, dk, 1, sums + k);
            }
        }
        for (int k = 0; k < nj; k++) {
            const int64_t J = j + k;
            /* lane i reads distance r = valid + t0 + i - J, if r >= 0 (a key it reaches) */
            const __m512i r = _mm512_add_epi32(_mm512_set1_epi32((int)(valid + t0 - J)), lane);
            const __mmask16 seen = _mm512_mask_cmpge_epi32_mask(live, r, _mm512_setzero_si512());
            const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(r, _mm512_set1_epi32(TL)), lane);
            const __m512 g = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), seen, at, bd, 4);
            const __m512 score = _mm512_mask_mov_ps(none, seen, _mm512_mul_ps(_mm512_add_ps(sums[k], g), scale));
            top = _mm512_max_ps(top, score);
            _mm512_store_ps(sc + J * TL, score);
        }
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        const __m512 x = _mm512_load_ps(sc + j * TL);
        const __mmask16 seen = _mm512_cmp_ps_mask(x, none, _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(seen, cvl_exp_nonpositive(_mm512_maskz_sub_ps(seen, x, top)));
        total = _mm512_add_ps(total, e);
        _mm512_store_ps(sc + j * TL, e);
    }
    float inv[TL];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f), total)));
    for (int64_t d0 = 0; d0 < dk; d0 += 16) { /* values: 16 of the head's dims at a time, the positions as lanes */
        __m512 acc[16];
        for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            const __m512 w = _mm512_load_ps(sc + j * TL);
            const float* v = (j < valid ? vf + j * dk : nv + (j - valid) * dk) + d0;
            for (int c = 0; c < 16; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_set1_ps(v[c]), acc[c]);
        }
        for (int c = 0; c < 16; c++) _mm512_store_ps(ot + c * TL, acc[c]);
        for (int64_t i = 0; i < n; i++) {
            float* dst = att + ((b * T + t0 + i) * H + h) * dk + d0;
            for (int c = 0; c < 16; c++) dst[c] = ot[c * TL + i] * inv[i];
        }
    }
    return 0;
}

const cvl_relpos_passes cvl_relpos_avx512_passes = {layer_norm, relu, attention_row, attention_tile};
