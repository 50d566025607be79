/* int8 frames of a flow cache (service/layers/frame_cache.py, precision "int8"): each row of `dim` keys or values kept
 * as int8 times one float32 scale, max |x| / 127 (1 for a row of zeros). `narrow` writes rows from the graph's float16
 * or float32 outputs, `widen` gives them back in the graph's type for a call. The arithmetic is the numpy fallback's:
 * scale and quotient in float32, rounded half to even; the product in float32, rounded once to the output type; so
 * both give the same bits. Every array is contiguous, rows x dim (scale: rows). */
#ifndef COSYVOICE_LITE_FRAME_CODEC_H
#define COSYVOICE_LITE_FRAME_CODEC_H

#include <stdint.h>

#include "cpu.h"

void cvl_frames_narrow_f16(const uint16_t* x, int64_t rows, int64_t dim, int8_t* q, float* scale);
void cvl_frames_narrow_f32(const float* x, int64_t rows, int64_t dim, int8_t* q, float* scale);

/* The same for `blocks` blocks of `rows` rows each, block b's rows at x + b * x_stride, q + b * q_stride and
 * scale + b * s_stride (elements): a cache's new frames of every block in one call. */
void cvl_frames_narrow_blocks_f16(const uint16_t* x, int64_t blocks, int64_t x_stride, int64_t rows, int64_t dim,
                                  int8_t* q, int64_t q_stride, float* scale, int64_t s_stride);
void cvl_frames_narrow_blocks_f32(const float* x, int64_t blocks, int64_t x_stride, int64_t rows, int64_t dim,
                                  int8_t* q, int64_t q_stride, float* scale, int64_t s_stride);
void cvl_frames_widen_f16(const int8_t* q, const float* scale, int64_t rows, int64_t dim, uint16_t* out);
void cvl_frames_widen_f32(const int8_t* q, const float* scale, int64_t rows, int64_t dim, float* out);

/* Widening for `blocks` blocks of `rows` rows each, block b's at q + b * q_stride, scale + b * s_stride and
 * out + b * out_stride (elements): every block's frames a graph call reads, in one call. */
void cvl_frames_widen_blocks_f16(const int8_t* q, int64_t blocks, int64_t q_stride, const float* scale, int64_t s_stride,
                                 int64_t rows, int64_t dim, uint16_t* out, int64_t out_stride);
void cvl_frames_widen_blocks_f32(const int8_t* q, int64_t blocks, int64_t q_stride, const float* scale, int64_t s_stride,
                                 int64_t rows, int64_t dim, float* out, int64_t out_stride);

/* Let the codec use only the features in `have` (the C tests compare each path with the portable C; default: all). */
void cvl_frames_limit(cvl_features have);

#endif
