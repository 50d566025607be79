/* Intel AMX for the kernels (amx.h): the tile configuration and the int8 panel product.
 *
 * Why: a Sapphire Rapids core multiplies 16 x 16 x 64 int8 values in one tdpbusd, about three times what its two
 * AVX-512 VNNI ports do in the same time (docs/perf-log.md), and bf16 tiles likewise against vdpbf16ps. The flow estimator's products (6-100 rows per call) and the LLM's
 * prefill are bound by that arithmetic; a decode step's few rows are bound by memory and stay on VNNI
 * (int8_matmul.c says from how many rows tiles pay). */

#include "amx.h"

#include <immintrin.h>
#include <string.h>

#define GROUP_BYTES 256 /* one group of 4 weight rows of a 64-column panel */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows x 64 bytes. A constant: stores into a local config before ldtilecfg can be dropped by the compiler
 * (GCC 12 does not see that the instruction reads all 64 bytes). */
static const tile_config config __attribute__((aligned(64))) = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

__attribute__((target("amx-tile"))) void cvl_amx_begin(void) { _tile_loadconfig(&config); }

__attribute__((target("amx-tile"))) void cvl_amx_end(void) { _tile_release(); }

/* Tiles: 0-3 sums (row tile x column tile: 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)), 4-5 activations (one per
 * row tile), 6-7 weights (one per column tile). A weight tile is 16 groups (64 of k) x 16 columns: row g of it is
 * the panel's 64 bytes of those columns in group g, so it loads straight from the packed panel with a 256-byte
 * stride. The last, partial group of 16 is copied beside zeros first, so no load reads past the panel. */
__attribute__((target("amx-tile,amx-int8"))) void cvl_amx_int8_panel(const uint8_t* xq, int row_tiles, int64_t kp64,
                                                                      const int8_t* panel, int64_t kq, int32_t* sums,
                                                                      const int8_t* next) {
    const int64_t whole = kq / 16, rest = kq % 16, blocks = whole + (rest != 0);
    int8_t tail[16 * GROUP_BYTES] __attribute__((aligned(64)));
    if (rest) {
        memcpy(tail, panel + whole * 16 * GROUP_BYTES, (size_t)rest * GROUP_BYTES);
        memset(tail + rest * GROUP_BYTES, 0, (size_t)(16 - rest) * GROUP_BYTES);
    }
    for (int half = 0; half < 2; half++) { /* columns 0-31, then 32-63 */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < blocks; kb++) {
            /* the weights stream from memory: the first half fetches the next 16 groups whole (both halves read
             * them), the second the next panel's, a block ahead of the tile loads */
            const int8_t* ahead = half == 0 ? (kb + 1 < whole ? panel + (kb + 1) * 16 * GROUP_BYTES : NULL)
                                            : (next != NULL && kb < whole ? next + kb * 16 * GROUP_BYTES : NULL);
            if (ahead != NULL)
                for (int line = 0; line < 16 * GROUP_BYTES; line += 64) _mm_prefetch((const char*)ahead + line, _MM_HINT_T0);
            const int8_t* w = (kb < whole ? panel + kb * 16 * GROUP_BYTES : tail) + half * 128;
            _tile_loadd(6, w, GROUP_BYTES);
            _tile_loadd(7, w + 64, GROUP_BYTES);
            _tile_loadd(4, xq + kb * 64, kp64);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            if (row_tiles == 2) {
                _tile_loadd(5, xq + 16 * kp64 + kb * 64, kp64);
                _tile_dpbusd(2, 5, 6);
                _tile_dpbusd(3, 5, 7);
            }
        }
        int32_t* s = sums + half * 32;
        _tile_stored(0, s, 64 * sizeof(int32_t));
        _tile_stored(1, s + 16, 64 * sizeof(int32_t));
        if (row_tiles == 2) {
            _tile_stored(2, s + 16 * 64, 64 * sizeof(int32_t));
            _tile_stored(3, s + 16 * 64 + 16, 64 * sizeof(int32_t));
        }
    }
}
