/* Intel AMX tiles (Sapphire Rapids and later): the kernels' tile configuration and int8 panel product. Whether this
 * process may use them is the CPU probe's answer (cpu.h: the AMX bits, set where Linux granted the tile data). */
#ifndef COSYVOICE_LITE_AMX_H
#define COSYVOICE_LITE_AMX_H

#include <stdint.h>

/* The one tile configuration every AMX kernel uses (all 8 tiles 16 rows x 64 bytes), loaded on the calling thread;
 * cvl_amx_end releases the tiles (a thread holding none has no tile state to save when it is switched out). */
void cvl_amx_begin(void);
void cvl_amx_end(void);

/* Integer sums of up to 32 rows of quantized activations with one 64-column weight panel (int8_matmul.h's layout):
 *   sums[r * 64 + c] = sum_k xq[r * kp64 + k] * W[k][c]   for r < 16 * row_tiles (1 or 2), c < 64
 * xq is uint8 with a row stride of kp64 (a multiple of 64), zero from the weights' k up to kp64 and in the rows past
 * the real ones; panel holds kq = ceil(k / 4) groups of 64 columns x 4 rows. Exactly the VNNI kernel's sums.
 * `next`: the panel the caller multiplies next (of the same kq), fetched into the cache meanwhile, or NULL.
 * Call between cvl_amx_begin and cvl_amx_end. */
void cvl_amx_int8_panel(const uint8_t* xq, int row_tiles, int64_t kp64, const int8_t* panel, int64_t kq, int32_t* sums,
                        const int8_t* next);

#endif
