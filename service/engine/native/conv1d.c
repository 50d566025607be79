/* bf16 convolutions (conv1d.h): AVX-512 BF16; AVX-512 and AVX2 (bf16 widened to float32); portable.
 *
 * Why a kernel of our own: a vocoder chunk is ~2 GFLOP per 100 mel frames of small-channel convolutions at a high
 * sample rate; ONNX Runtime computes them in float32 (im2col and SGEMM), OpenVINO in bf16 about twice as fast, at the
 * cost of a second runtime (+250 MB resident). Here the input is rounded once into channel pairs (xp[pair][t], a
 * dword per time step), so every tap reads 16 consecutive time steps of a pair as one vector with no im2col copy, and
 * each weight pair is broadcast across them: a tile of RO output channels x TV vectors of time steps keeps RO * TV
 * accumulators in registers over every tap and pair. */

#include "conv1d.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "simd_math.h"
#include "work.h"

#define FAST "avx512f,avx512bw,avx512vl,avx512bf16,fma,f16c"
#define AVX512 "avx512f,avx512bw,avx512vl,fma,f16c" /* the packing, and the products of CPUs without AVX-512 BF16 */
#define AVX2 "avx2,fma,f16c"
#define NEEDS_AVX512 (CVL_AVX512F | CVL_AVX512BW | CVL_AVX512VL | CVL_FMA | CVL_F16C)
#define TV 2                  /* time vectors per tile: 32 steps (4: a quarter slower alone on Zen 4, in HiFT the same) */
#define TT (16 * TV)          /* time steps per tile */
#define RO 6                  /* output channels per tile: 12 accumulators (the switch in block_fast) */
#define BLOCK_TILES 6         /* time tiles per task: 192 steps */
_Static_assert(RO == 6, "block_fast dispatches rows 1 .. 5 and RO");

static const cvl_variant variants[] = {
    {"portable", 0},
    {"avx2", CVL_NEEDS_AVX2},
    {"avx512", NEEDS_AVX512},
    {"avx512_bf16", CVL_NEEDS_AVX512_BF16},
};
const cvl_variants cvl_conv1d_variants = {variants, 4, NULL};
enum { CODE_PORTABLE, CODE_AVX2, CODE_AVX512, CODE_AVX512_BF16 }; /* the variants' indexes */

int64_t cvl_conv1d_out_len(const cvl_conv1d_problem* p) {
    return p->t_in + p->pad_left + p->pad_right - p->dilation * (p->taps - 1);
}

uint16_t cvl_bf16_of(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN: quiet, stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float float_of(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

void cvl_conv1d_pack(const float* w, int64_t c_out, int64_t c_in, int64_t taps, uint32_t* packed) {
    const int64_t pairs = (c_in + 1) / 2;
    for (int64_t j = 0; j < taps; j++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t o = 0; o < c_out; o++) {
                const uint32_t lo = cvl_bf16_of(w[(o * c_in + 2 * p) * taps + j]);
                const uint32_t hi = 2 * p + 1 < c_in ? cvl_bf16_of(w[(o * c_in + 2 * p + 1) * taps + j]) : 0;
                packed[(j * pairs + p) * c_out + o] = lo | hi << 16;
            }
}

#define PI_HI 3.14159274101257324219f /* pi in float32, and what it leaves out */
#define PI_LO (-8.74227765734758577e-8f)
#define INV_PI 0.318309886183790671538f
/* sin(r) = r + r^3 (S3 + r^2 (S5 + r^2 (S7 + r^2 S9))): Taylor's coefficients */
#define S3 (-1.66666666666666667e-1f)
#define S5 8.33333333333333333e-3f
#define S7 (-1.98412698412698413e-4f)
#define S9 2.75573192239858907e-6f

float cvl_sin_squared(float x) {
    const float k = nearbyintf(x * INV_PI);
    const float r = fmaf(-k, PI_LO, fmaf(-k, PI_HI, x)), r2 = r * r;
    const float s = fmaf(r * r2, fmaf(r2, fmaf(r2, fmaf(r2, S9, S7), S5), S3), r);
    return s * s;
}

__attribute__((target(AVX512))) static inline __m512 sin_squared16(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(INV_PI)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(PI_LO), _mm512_fnmadd_ps(k, _mm512_set1_ps(PI_HI), x));
    const __m512 r2 = _mm512_mul_ps(r, r);
    __m512 q = _mm512_fmadd_ps(r2, _mm512_set1_ps(S9), _mm512_set1_ps(S7));
    q = _mm512_fmadd_ps(r2, q, _mm512_set1_ps(S5));
    q = _mm512_fmadd_ps(r2, q, _mm512_set1_ps(S3));
    const __m512 s = _mm512_fmadd_ps(_mm512_mul_ps(r, r2), q, r);
    return _mm512_mul_ps(s, s);
}

/* What the convolution reads of x[i][t]: the Snake activation of it, when the problem has one (x plus inv_alpha times
 * sin^2, in one fused multiply-add in every code path). */
static inline float activated(const cvl_conv1d_problem* pr, int64_t i, float v) {
    return pr->alpha ? fmaf(pr->inv_alpha[i], cvl_sin_squared(v * pr->alpha[i]), v) : v;
}

/* One row of pairs: channels i (low halves) and i + 1 (high, absent: zeros) of x from `lo` and `hi`, activated and
 * rounded, at row[pad_left ..]; the rest of the row zero. */
static void pack_row_portable(const cvl_conv1d_problem* pr, int64_t i, const float* lo, const float* hi, int64_t width,
                              uint32_t* row) {
    memset(row, 0, sizeof(uint32_t) * (size_t)width);
    for (int64_t t = 0; t < pr->t_in && pr->pad_left + t < width; t++) {
        const uint32_t b0 = cvl_bf16_of(activated(pr, i, lo[t]));
        const uint32_t b1 = hi ? cvl_bf16_of(activated(pr, i + 1, hi[t])) : 0u;
        row[pr->pad_left + t] = b0 | b1 << 16;
    }
}

/* cvl_bf16_of on 16 lanes, the bits in each lane's low half. */
__attribute__((target(AVX512))) static inline __m512i bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

__attribute__((target(AVX512))) static inline __m512 activated16(const cvl_conv1d_problem* pr, int64_t i, __m512 v) {
    if (!pr->alpha) return v;
    const __m512 s2 = sin_squared16(_mm512_mul_ps(v, _mm512_set1_ps(pr->alpha[i])));
    return _mm512_fmadd_ps(_mm512_set1_ps(pr->inv_alpha[i]), s2, v);
}

__attribute__((target(AVX512))) static void pack_row_fast(const cvl_conv1d_problem* pr, int64_t i, const float* lo,
                                                        const float* hi, int64_t width, uint32_t* row) {
    const int64_t start = pr->pad_left, end = start + pr->t_in < width ? start + pr->t_in : width;
    memset(row, 0, sizeof(uint32_t) * (size_t)start);
    for (int64_t s = start; s < end; s += 16) {
        const __mmask16 m = cvl_tail_mask(end - s);
        const int64_t t = s - start;
        __m512i w = bf16_bits16(activated16(pr, i, _mm512_maskz_loadu_ps(m, lo + t)));
        if (hi) w = _mm512_or_si512(w, _mm512_slli_epi32(bf16_bits16(activated16(pr, i + 1, _mm512_maskz_loadu_ps(m, hi + t))), 16));
        _mm512_mask_storeu_epi32(row + s, m, w);
    }
    memset(row + end, 0, sizeof(uint32_t) * (size_t)(width - end));
}

typedef struct {
    const cvl_conv1d_problem* p;
    uint32_t* xp; /* (batch, x_pairs, width) */
    int64_t width, t_out, blocks;
    int64_t x_pairs; /* rows of pairs of x: ceil(c_in / 2) */
    int64_t pairs;   /* of them, what one group reads (all with one group): the weight's pairs */
    int64_t c_out_g; /* output channels of a group */
    int code; /* CODE_* */
} job;

/* Task i of the packing: row of pairs i (over every batch entry). */
static void pack_pairs(void* ctx, size_t i) {
    const job* jb = ctx;
    const cvl_conv1d_problem* pr = jb->p;
    const int64_t b = (int64_t)i / jb->x_pairs, q = (int64_t)i % jb->x_pairs, c = 2 * q;
    const float* lo = pr->x + (b * pr->c_in + c) * pr->t_in;
    const float* hi = c + 1 < pr->c_in ? lo + pr->t_in : NULL;
    uint32_t* row = jb->xp + (b * jb->x_pairs + q) * jb->width;
    if (jb->code >= CODE_AVX512)
        pack_row_fast(pr, c, lo, hi, jb->width, row);
    else
        pack_row_portable(pr, c, lo, hi, jb->width, row);
}

/* The rows of pairs output channel o reads: its group's, of batch entry b. */
static inline const uint32_t* group_rows(const job* jb, int64_t b, int64_t o) {
    return jb->xp + (b * jb->x_pairs + o / jb->c_out_g * jb->pairs) * jb->width;
}

/* How many output channels from o0, at most `most`, a tile takes: none past o0's group. */
static inline int tile_rows(const job* jb, int64_t o0, int most) {
    const int64_t left = (o0 / jb->c_out_g + 1) * jb->c_out_g - o0;
    return left < most ? (int)left : most;
}

static void block_portable(const job* jb, int64_t b, int64_t t0, int64_t t1) {
    const cvl_conv1d_problem* p = jb->p;
    for (int64_t o = 0; o < p->c_out; o++)
        for (int64_t t = t0; t < t1; t++) {
            const uint32_t* xp = group_rows(jb, b, o);
            float acc = 0.f;
            for (int64_t j = 0; j < p->taps; j++)
                for (int64_t q = 0; q < jb->pairs; q++) {
                    const uint32_t xv = xp[q * jb->width + t + j * p->dilation];
                    const uint32_t wv = p->packed[(j * jb->pairs + q) * p->c_out + o];
                    acc += float_of((uint16_t)(xv >> 16)) * float_of((uint16_t)(wv >> 16));
                    acc += float_of((uint16_t)xv) * float_of((uint16_t)wv);
                }
            p->y[(b * p->c_out + o) * jb->t_out + t] = p->bias ? acc + p->bias[o] : acc;
        }
}

/* One tile: R output channels from o0 by TV vectors of time steps from t0 (the last ones masked past t_out). */
__attribute__((always_inline, target(FAST))) static inline void tile_fast(const job* jb, int64_t b, int64_t o0, int R,
                                                                           int64_t t0) {
    const cvl_conv1d_problem* p = jb->p;
    const int64_t width = jb->width, pairs = jb->pairs, c_out = p->c_out;
    const uint32_t* xp = group_rows(jb, b, o0) + t0;
    __m512 acc[RO][TV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < TV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < p->taps; j++) {
        const uint32_t* xj = xp + j * p->dilation;
        const uint32_t* wj = p->packed + j * pairs * c_out + o0;
        for (int64_t q = 0; q < pairs; q++) {
            __m512bh xv[TV];
            for (int v = 0; v < TV; v++) xv[v] = (__m512bh)_mm512_loadu_si512(xj + q * width + 16 * v);
            const uint32_t* wq = wj + q * c_out;
            for (int r = 0; r < R; r++) {
                const __m512bh wv = (__m512bh)_mm512_set1_epi32((int)wq[r]);
                for (int v = 0; v < TV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv[v], wv);
            }
        }
    }
    const int64_t left = jb->t_out - t0;
    for (int r = 0; r < R; r++) {
        float* y = p->y + (b * c_out + o0 + r) * jb->t_out + t0;
        const __m512 bias = _mm512_set1_ps(p->bias ? p->bias[o0 + r] : 0.f);
        for (int v = 0; v < TV; v++) {
            if (left <= 16 * v) break;
            _mm512_mask_storeu_ps(y + 16 * v, cvl_tail_mask(left - 16 * v), _mm512_add_ps(acc[r][v], bias));
        }
    }
}

__attribute__((target(FAST))) static void block_fast(const job* jb, int64_t b, int64_t t0, int64_t t1) {
    for (int64_t o0 = 0, rows; o0 < jb->p->c_out; o0 += rows) {
        rows = tile_rows(jb, o0, RO);
        for (int64_t t = t0; t < t1; t += TT) switch (rows) {
                case 1: tile_fast(jb, b, o0, 1, t); break;
                case 2: tile_fast(jb, b, o0, 2, t); break;
                case 3: tile_fast(jb, b, o0, 3, t); break;
                case 4: tile_fast(jb, b, o0, 4, t); break;
                case 5: tile_fast(jb, b, o0, 5, t); break;
                default: tile_fast(jb, b, o0, RO, t); break; /* rows == RO */
            }
    }
}

/* Without bf16 instructions (AVX2; AVX-512 without BF16): each dword of pairs widened to its two floats (a bf16 is a
 * float's high half), the odd channel's product added before the even one's by fused multiply-adds. A product of two
 * bf16 values is exact in float32, so every sum is rounded as the portable C rounds it. A tile: R output channels by
 * TV_W vectors of time steps; the AVX2 tile is 4 by 2 vectors of 8 steps (14 of 16 registers), the AVX-512 one 6 by 2
 * of 16 (22 of 32): on Zen 4 as fast as vdpbf16ps. */
#define TV_W 2
#define R_AVX2 4

#define WIDENED_TILE(NAME, TARGET, VEC, IVEC, LANES, ROWS, LOADU, SET1, AND, SLLI, CAST, FMADD, ZERO, ADD, STORE)          \
    __attribute__((always_inline, target(TARGET))) static inline void NAME(const job* jb, int64_t b, int64_t o0, int R,  \
                                                                           int64_t t0) {                               \
        const cvl_conv1d_problem* p = jb->p;                                                                         \
        const int64_t width = jb->width, pairs = jb->pairs, c_out = p->c_out;                                        \
        const uint32_t* xp = group_rows(jb, b, o0) + t0;                                                             \
        const IVEC high = SET1((int)0xffff0000u);                                                                     \
        VEC acc[ROWS][TV_W];                                                                                           \
        for (int r = 0; r < R; r++)                                                                                    \
            for (int v = 0; v < TV_W; v++) acc[r][v] = ZERO();                                                         \
        for (int64_t j = 0; j < p->taps; j++) {                                                                       \
            const uint32_t* xj = xp + j * p->dilation;                                                                \
            const uint32_t* wj = p->packed + j * pairs * c_out + o0;                                                  \
            for (int64_t q = 0; q < pairs; q++) {                                                                     \
                VEC x_odd[TV_W], x_even[TV_W];                                                                         \
                for (int v = 0; v < TV_W; v++) {                                                                       \
                    const IVEC xv = LOADU((const void*)(xj + q * width + LANES * v));                                  \
                    x_odd[v] = CAST(AND(xv, high));                                                                    \
                    x_even[v] = CAST(SLLI(xv, 16));                                                                    \
                }                                                                                                      \
                const uint32_t* wq = wj + q * c_out;                                                                  \
                for (int r = 0; r < R; r++) {                                                                          \
                    const IVEC wv = SET1((int)wq[r]);                                                                  \
                    const VEC w_odd = CAST(AND(wv, high)), w_even = CAST(SLLI(wv, 16));                               \
                    for (int v = 0; v < TV_W; v++) acc[r][v] = FMADD(x_even[v], w_even, FMADD(x_odd[v], w_odd, acc[r][v])); \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        const int64_t left = jb->t_out - t0;                                                                          \
        for (int r = 0; r < R; r++) {                                                                                  \
            float* y = p->y + (b * c_out + o0 + r) * jb->t_out + t0;                                                  \
            for (int v = 0; v < TV_W && left > LANES * v; v++)                                                         \
                STORE(y + LANES * v, left - LANES * v, ADD(acc[r][v], p->bias ? p->bias[o0 + r] : 0.f));              \
        }                                                                                                              \
    }

__attribute__((target(AVX2))) static inline __m256i load8i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
__attribute__((target(AVX2))) static inline __m256 add8(__m256 v, float b) { return _mm256_add_ps(v, _mm256_set1_ps(b)); }
__attribute__((target(AVX512))) static inline __m512 add16(__m512 v, float b) { return _mm512_add_ps(v, _mm512_set1_ps(b)); }
__attribute__((target(AVX512))) static inline void store16(float* y, int64_t left, __m512 v) {
    _mm512_mask_storeu_ps(y, cvl_tail_mask(left), v);
}

WIDENED_TILE(tile_avx2, AVX2, __m256, __m256i, 8, R_AVX2, load8i, _mm256_set1_epi32, _mm256_and_si256,
             _mm256_slli_epi32, _mm256_castsi256_ps, _mm256_fmadd_ps, _mm256_setzero_ps, add8, cvl_store8)
WIDENED_TILE(tile_avx512, AVX512, __m512, __m512i, 16, RO, _mm512_loadu_si512, _mm512_set1_epi32, _mm512_and_si512,
             _mm512_slli_epi32, _mm512_castsi512_ps, _mm512_fmadd_ps, _mm512_setzero_ps, add16, store16)

__attribute__((target(AVX2))) static void block_avx2(const job* jb, int64_t b, int64_t t0, int64_t t1) {
    for (int64_t o0 = 0, rows; o0 < jb->p->c_out; o0 += rows) {
        rows = tile_rows(jb, o0, R_AVX2);
        for (int64_t t = t0; t < t1; t += 8 * TV_W) switch (rows) {
                case 1: tile_avx2(jb, b, o0, 1, t); break;
                case 2: tile_avx2(jb, b, o0, 2, t); break;
                case 3: tile_avx2(jb, b, o0, 3, t); break;
                default: tile_avx2(jb, b, o0, R_AVX2, t); break; /* rows == R_AVX2 */
            }
    }
}

__attribute__((target(AVX512))) static void block_avx512(const job* jb, int64_t b, int64_t t0, int64_t t1) {
    for (int64_t o0 = 0, rows; o0 < jb->p->c_out; o0 += rows) {
        rows = tile_rows(jb, o0, RO);
        for (int64_t t = t0; t < t1; t += 16 * TV_W) switch (rows) {
                case 1: tile_avx512(jb, b, o0, 1, t); break;
                case 2: tile_avx512(jb, b, o0, 2, t); break;
                case 3: tile_avx512(jb, b, o0, 3, t); break;
                case 4: tile_avx512(jb, b, o0, 4, t); break;
                case 5: tile_avx512(jb, b, o0, 5, t); break;
                default: tile_avx512(jb, b, o0, RO, t); break; /* rows == RO */
            }
    }
}

static void run_block(void* ctx, size_t i) {
    const job* jb = ctx;
    const int64_t b = (int64_t)i / jb->blocks, t0 = ((int64_t)i % jb->blocks) * TT * BLOCK_TILES;
    const int64_t t1 = t0 + TT * BLOCK_TILES < jb->t_out ? t0 + TT * BLOCK_TILES : jb->t_out;
    if (jb->code == CODE_AVX512_BF16)
        block_fast(jb, b, t0, t1);
    else if (jb->code == CODE_AVX512)
        block_avx512(jb, b, t0, t1);
    else if (jb->code == CODE_AVX2)
        block_avx2(jb, b, t0, t1);
    else
        block_portable(jb, b, t0, t1);
}

int cvl_conv1d(const cvl_conv1d_problem* p, const cvl_exec* ex) {
    const int64_t t_out = cvl_conv1d_out_len(p);
    if (t_out <= 0 || p->batch <= 0 || p->c_out <= 0) return 0;
    const int64_t groups = p->groups > 1 ? p->groups : 1, x_pairs = (p->c_in + 1) / 2;
    if (p->c_in % groups || p->c_out % groups || (groups > 1 && (p->c_in / groups) % 2)) return -2;
    /* every tile reads TT steps from each tap's offset: the rows run to the last tile's end */
    const int64_t tiles = (t_out + TT - 1) / TT, width = tiles * TT + p->dilation * (p->taps - 1);
    const size_t words = (size_t)(p->batch * x_pairs * width);
    uint32_t* xp = (uint32_t*)cvl_work_floats(CVL_WORK_CONV, words);
    if (xp == NULL) return -1;
    const int code = cvl_pick_variant(&cvl_conv1d_variants, ex->have, 0);
    job jb = {p, xp, width, t_out, (tiles + BLOCK_TILES - 1) / BLOCK_TILES, x_pairs, (p->c_in / groups + 1) / 2,
              p->c_out / groups, code};
    const size_t rows = (size_t)(p->batch * x_pairs), tasks = (size_t)(p->batch * jb.blocks);
    cvl_run_tasks(ex, pack_pairs, &jb, rows);
    cvl_run_tasks(ex, run_block, &jb, tasks);
    return 0;
}
