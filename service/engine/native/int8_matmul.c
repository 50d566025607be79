/* int8 weight products (y = x · W, x float32 quantized per row to uint8): AVX-512 VNNI, AMX tiles and portable (the
 * AVX2 code: int8_matmul_avx2.c).
 *
 * Why a kernel of our own: at batch 1 a decode step reads every weight once, so it is bound by memory bandwidth;
 * ONNX Runtime's int8 kernels stream weights at about half of what a kernel reading them in order reaches
 * (cpu-limits.md 1.3-1.4), because W is stored row-major and a column block reads K short strided rows. Here each
 * panel of 64 output columns is stored as one contiguous run (int8_matmul.h), read front to back, and a tile of up
 * to 6 rows of x shares every weight load (prefill: compute-bound, the panel stays in L2 while the row tiles pass). */

#include "int8_matmul.h"

#include "amx.h"
#include "int8_matmul_parts.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PANEL CVL_INT8_PANEL /* output columns per panel: 4 vectors of 16 int32 sums */
#define ROW_TILE 6    /* rows of x per tile: 24 accumulators */
#define MAX_TASKS CVL_MAX_SPREAD
#define TASK_BYTES (256 * 1024) /* weight bytes x row tiles per task: smaller jobs are not worth a wake-up */
#define FAST "avx512f,avx512bw,avx512vl,avx512vnni"
#define AMX_MIN_ROWS 8 /* fewer rows stay on VNNI: see cvl_int8_matmul */

size_t cvl_int8_packed_bytes(int64_t k, int64_t n) {
    return (size_t)((n + PANEL - 1) / PANEL) * (size_t)((k + 3) / 4) * PANEL * 4;
}

static const cvl_variant variants[] = {
    {"portable", 0},
    {"avx2", CVL_NEEDS_AVX2},
    {"avx512_vnni", CVL_NEEDS_AVX512_VNNI},
    {"amx_int8", CVL_NEEDS_AMX_INT8},
};
const cvl_variants cvl_int8_matmul_variants = {variants, 4, NULL};

/* ---- per-row quantization (DynamicQuantizeLinear of one row) ---- */

static void quantize_row_portable(const float* x, int64_t k, int64_t kp, uint8_t* q, float* scale, int32_t* zp) {
    float lo = 0.f, hi = 0.f;
    for (int64_t i = 0; i < k; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    cvl_int8_row_params(lo, hi, scale, zp);
    for (int64_t i = 0; i < k; i++) {
        float v = nearbyintf(x[i] / *scale) + (float)*zp;
        q[i] = (uint8_t)(v < 0.f ? 0.f : (v > 255.f ? 255.f : v));
    }
    memset(q + k, 0, (size_t)(kp - k));
}

__attribute__((target(FAST))) static void quantize_row_fast(const float* x, int64_t k, int64_t kp, uint8_t* q,
                                                            float* scale, int32_t* zp) {
    __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    if (i < k) {
        __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i); /* zeros elsewhere: the range includes 0 anyway */
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    cvl_int8_row_params(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), scale, zp);
    const __m512 s = _mm512_set1_ps(*scale);
    const __m512i z = _mm512_set1_epi32(*zp), zero = _mm512_setzero_si512(), top = _mm512_set1_epi32(255);
    for (i = 0; i < k; i += 16) {
        int64_t left = k - i;
        __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), s)); /* half to even */
        v = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(v, z), zero), top);
        _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(v));
    }
    memset(q + k, 0, (size_t)(kp - k));
}

/* ---- products of one panel with a tile of rows ---- */

/* One panel times every row, a row at a time. */
static void panel_portable(const cvl_int8_job* jb, int64_t panel) {
    const cvl_int8_problem* p = jb->p;
    const int8_t* w = p->packed + panel * jb->kq * PANEL * 4;
    for (int64_t r = 0; r < p->rows; r++) {
        int32_t acc[PANEL] = {0};
        const uint8_t* xr = jb->xq + r * jb->kp;
        for (int64_t q = 0; q < jb->kq; q++) {
            const int8_t* wq = w + q * PANEL * 4;
            for (int c = 0; c < PANEL; c++)
                for (int j = 0; j < 4; j++) acc[c] += (int32_t)xr[4 * q + j] * (int32_t)wq[4 * c + j];
        }
        for (int c = 0; c < PANEL; c++) {
            int64_t col = panel * PANEL + c;
            if (col >= p->n) break;
            float scale = p->w_scales ? jb->xs[r] * p->w_scales[col] : jb->xs[r];
            float v = (float)(acc[c] - jb->xzp[r] * p->colsum[col]) * scale;
            *cvl_int8_out_at(p, r, col) = p->bias ? v + p->bias[col] : v;
        }
    }
}

__attribute__((target(FAST), always_inline)) static inline void store_row(const cvl_int8_job* jb, int64_t panel,
                                                                           int64_t row, __m512i c0, __m512i c1,
                                                                           __m512i c2, __m512i c3) {
    const cvl_int8_problem* p = jb->p;
    const __m512i zp = _mm512_set1_epi32(jb->xzp[row]);
    const __m512 scale = _mm512_set1_ps(jb->xs[row]);
    const __m512i sums[4] = {c0, c1, c2, c3};
    for (int j = 0; j < 4; j++) {
        int64_t col = panel * PANEL + 16 * j;
        if (col >= p->n) break;
        int64_t left = p->n - col;
        __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512i sum = _mm512_sub_epi32(sums[j], _mm512_mullo_epi32(zp, _mm512_loadu_si512(p->colsum + col)));
        __m512 cs = p->w_scales ? _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(m, p->w_scales + col)) : scale;
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), cs);
        if (p->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, p->bias + col));
        _mm512_mask_storeu_ps(cvl_int8_out_at(p, row, col), m, v);
    }
}

/* One panel times rows r0 .. r0+R-1 (R a constant after inlining, so every accumulator stays in a register). */
#define ACC(r)                                                                                                        \
    __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = _mm512_setzero_si512(), c##r##2 = _mm512_setzero_si512(),    \
            c##r##3 = _mm512_setzero_si512()
#define STEP(r)                                                                                                       \
    if (R > r) {                                                                                                      \
        int32_t quad;                                                                                                 \
        memcpy(&quad, x + r * kp + 4 * q, sizeof quad);                                                               \
        const __m512i a = _mm512_set1_epi32(quad);                                                                    \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, a, w0);                                                                \
        c##r##1 = _mm512_dpbusd_epi32(c##r##1, a, w1);                                                                \
        c##r##2 = _mm512_dpbusd_epi32(c##r##2, a, w2);                                                                \
        c##r##3 = _mm512_dpbusd_epi32(c##r##3, a, w3);                                                                \
    }
#define STORE(r) \
    if (R > r) store_row(jb, panel, r0 + r, c##r##0, c##r##1, c##r##2, c##r##3)

__attribute__((target(FAST), always_inline)) static inline void tile_fast(const cvl_int8_job* jb, int64_t panel,
                                                                           int64_t r0, const int R) {
    const int8_t* w = jb->p->packed + panel * jb->kq * PANEL * 4;
    const uint8_t* x = jb->xq + r0 * jb->kp;
    const int64_t kp = jb->kp, kq = jb->kq;
    ACC(0);
    ACC(1);
    ACC(2);
    ACC(3);
    ACC(4);
    ACC(5);
    for (int64_t q = 0; q < kq; q++, w += PANEL * 4) {
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        STEP(0)
        STEP(1)
        STEP(2)
        STEP(3)
        STEP(4)
        STEP(5)
    }
    STORE(0);
    STORE(1);
    STORE(2);
    STORE(3);
    STORE(4);
    STORE(5);
}
#undef ACC
#undef STEP
#undef STORE

__attribute__((target(FAST))) static void panel_fast(const cvl_int8_job* jb, int64_t panel) {
    int64_t r = 0, rows = jb->p->rows;
    for (; r + ROW_TILE <= rows; r += ROW_TILE) tile_fast(jb, panel, r, ROW_TILE);
    switch (rows - r) {
        case 5: tile_fast(jb, panel, r, 5); break;
        case 4: tile_fast(jb, panel, r, 4); break;
        case 3: tile_fast(jb, panel, r, 3); break;
        case 2: tile_fast(jb, panel, r, 2); break;
        case 1: tile_fast(jb, panel, r, 1); break;
        default: break;
    }
}

/* Panels [from, to) times every row on AMX tiles, 32 rows at a time (amx.h gives their integer sums), each panel's
 * last pass fetching the next panel into the cache. */
__attribute__((target(FAST))) static void panels_amx(const cvl_int8_job* jb, int64_t from, int64_t to) {
    int32_t sums[32 * PANEL] __attribute__((aligned(64)));
    const int64_t rows = jb->p->rows, panel_bytes = jb->kq * PANEL * 4;
    for (int64_t panel = from; panel < to; panel++) {
        const int8_t* w = jb->p->packed + panel * panel_bytes;
        for (int64_t r0 = 0; r0 < rows; r0 += 32) {
            const int64_t n = rows - r0 < 32 ? rows - r0 : 32;
            const int8_t* next = r0 + 32 >= rows && panel + 1 < to ? w + panel_bytes : NULL;
            cvl_amx_int8_panel(jb->xq + r0 * jb->kp, n > 16 ? 2 : 1, jb->kp, w, jb->kq, sums, next);
            for (int64_t r = 0; r < n; r++) {
                const int32_t* s = sums + r * PANEL;
                store_row(jb, panel, r0 + r, _mm512_load_si512(s), _mm512_load_si512(s + 16), _mm512_load_si512(s + 32),
                          _mm512_load_si512(s + 48));
            }
        }
    }
}

/* ---- tasks ---- */

static void quantize_task(void* ctx, size_t i) {
    const cvl_int8_job* jb = ctx;
    const cvl_int8_problem* p = jb->p;
    int64_t from = p->rows * (int64_t)i / jb->row_tasks, to = p->rows * (int64_t)(i + 1) / jb->row_tasks;
    const int64_t stride = p->x_stride > 0 ? p->x_stride : p->k;
    for (int64_t r = from; r < to; r++) {
        if (jb->fast)
            quantize_row_fast(p->x + r * stride, p->k, jb->kp, jb->xq + r * jb->kp, &jb->xr[r], &jb->xzp[r]);
        else if (jb->avx2)
            cvl_int8_quantize_row_avx2(p->x + r * stride, p->k, jb->kp, jb->xw + r * jb->kp, &jb->xr[r], &jb->xzp[r]);
        else
            quantize_row_portable(p->x + r * stride, p->k, jb->kp, jb->xq + r * jb->kp, &jb->xr[r], &jb->xzp[r]);
    }
}

static void product_task(void* ctx, size_t i) {
    const cvl_int8_job* jb = ctx;
    int64_t from = jb->panels * (int64_t)i / jb->tasks, to = jb->panels * (int64_t)(i + 1) / jb->tasks;
    if (jb->amx) {
        cvl_amx_begin();
        panels_amx(jb, from, to);
        cvl_amx_end();
        return;
    }
    for (int64_t panel = from; panel < to; panel++) {
        if (jb->fast)
            panel_fast(jb, panel);
        else if (jb->avx2)
            cvl_int8_panel_avx2(jb, panel);
        else
            panel_portable(jb, panel);
    }
}

/* The job of `p`'s rows: its work buffer allocated and every row quantized (once for all products of the same rows). */
static int quantize_rows(cvl_int8_job* jb, const cvl_int8_problem* p, const cvl_exec* ex) {
    const int spread = ex->spread < 1 ? 1 : (ex->spread > MAX_TASKS ? MAX_TASKS : ex->spread);
    const int fast = cvl_has(ex->have, CVL_NEEDS_AVX512_VNNI);
    *jb = (cvl_int8_job){.p = p, .kq = (p->k + 3) / 4, .fast = fast, .spread = spread};
    jb->avx2 = !fast && cvl_has(ex->have, CVL_NEEDS_AVX2);
    /* A tile product of 16 rows costs what one of a few rows costs, and a decode step's few rows are bound by reading
     * the weights, which VNNI streams faster than tile loads do: AMX from 8 rows on, where tiles started to pay
     * (docs/perf-log.md). */
    jb->amx = jb->fast && p->rows >= AMX_MIN_ROWS && cvl_has(ex->have, CVL_NEEDS_AMX_INT8);
    jb->kp = jb->amx ? (jb->kq * 4 + 63) / 64 * 64 : jb->kq * 4;
    const int64_t padded_rows = jb->amx ? (p->rows + 15) / 16 * 16 : p->rows;
    const size_t value_bytes = jb->avx2 ? sizeof(int16_t) : sizeof(uint8_t); /* per quantized value */
    size_t bytes = (size_t)p->rows * (2 * sizeof(float) + sizeof(int32_t)) +
                   (size_t)padded_rows * (size_t)jb->kp * value_bytes + 64;
    void* work = malloc(bytes);
    if (work == NULL) return -1;
    jb->xr = work;
    jb->xs = jb->xr + p->rows;
    jb->xzp = (int32_t*)(jb->xs + p->rows);
    jb->xq = (uint8_t*)(((uintptr_t)(jb->xzp + p->rows) + 63) & ~(uintptr_t)63);
    jb->xw = jb->avx2 ? (int16_t*)jb->xq : NULL;
    memset(jb->xq + p->rows * jb->kp, 0, (size_t)((padded_rows - p->rows) * jb->kp));
    jb->row_tasks = p->rows * p->k >= 65536 ? (p->rows < MAX_TASKS ? p->rows : MAX_TASKS) : 1;
    cvl_run_tasks(ex, quantize_task, jb, (size_t)jb->row_tasks);
    return 0;
}

/* y of `p` (same rows, k and x as the job's quantized rows, its own weight). */
static void products(cvl_int8_job* jb, const cvl_int8_problem* p, const cvl_exec* ex) {
    jb->p = p;
    jb->panels = (p->n + PANEL - 1) / PANEL;
    for (int64_t r = 0; r < p->rows; r++) jb->xs[r] = p->w_scales ? jb->xr[r] : jb->xr[r] * p->w_scale;
    /* One row tile (a decode step's few rows) is bound by memory bandwidth, and one core already streams most of
     * it (a second thread saves little; docs/perf-log.md): it runs on the calling thread and
     * leaves the other cores to the flow, unless the caller spreads it (cvl_exec.spread: the other cores are
     * idle). More rows are compute-bound: enough tasks to share the work when it is worth a wake-up, by weight bytes
     * times the row tiles that read them. */
    int64_t weight_bytes = jb->panels * jb->kq * PANEL * 4;
    int64_t passes = (p->rows + ROW_TILE - 1) / ROW_TILE;
    int64_t tasks = passes == 1 ? jb->spread : (weight_bytes * passes + TASK_BYTES - 1) / TASK_BYTES;
    tasks = tasks < 1 ? 1 : tasks;
    tasks = tasks > MAX_TASKS ? MAX_TASKS : tasks;
    jb->tasks = tasks > jb->panels ? jb->panels : tasks;
    cvl_run_tasks(ex, product_task, jb, (size_t)jb->tasks);
}

int cvl_int8_matmul(const cvl_int8_problem* p, const cvl_exec* ex) {
    if (p->rows <= 0 || p->n <= 0) return 0;
    cvl_int8_job jb;
    if (quantize_rows(&jb, p, ex) != 0) return -1;
    products(&jb, p, ex);
    free(jb.xr);
    return 0;
}

static cvl_int8_problem weight_problem(const float* x, int64_t rows, int64_t k, const cvl_int8_weight* w, float* y,
                                       float* const* parts) {
    return (cvl_int8_problem){
        .rows = rows, .k = k, .n = w->n, .x = x, .packed = w->packed, .colsum = w->colsum, .w_scale = w->scales[0],
        .bias = w->bias, .y = y, .w_scales = w->scale_count > 1 ? w->scales : NULL, .y_parts = parts,
        .part_n = parts ? w->n / 3 : 0,
    };
}

int cvl_int8_weight_matmul(const float* x, int64_t rows, int64_t k, const cvl_int8_weight* w, float* y, float* const* parts,
                           const cvl_exec* ex) {
    cvl_int8_problem p = weight_problem(x, rows, k, w, y, parts);
    return cvl_int8_matmul(&p, ex);
}

int cvl_int8_weight_matmuls(const float* x, int64_t rows, int64_t k, const cvl_int8_weight* const* ws, float* const* ys,
                            int count, const cvl_exec* ex) {
    if (rows <= 0 || count <= 0) return 0;
    cvl_int8_job jb;
    for (int i = 0; i < count; i++) {
        cvl_int8_problem p = weight_problem(x, rows, k, ws[i], ys[i], NULL);
        if (i == 0 && quantize_rows(&jb, &p, ex) != 0) return -1; /* the rows depend on x alone */
        if (p.n > 0) products(&jb, &p, ex);
    }
    free(jb.xr);
    return 0;
}
