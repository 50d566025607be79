/* Attention of new frames over cached keys/values under the chunk mask (the CosyVoice2 flow estimator's blocks). */
#ifndef COSYVOICE_LITE_CACHED_ATTENTION_H
#define COSYVOICE_LITE_CACHED_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* One call: q, k, v, out (B, M, H*DK) float32; past_k, past_v (B, C, H, DK) float16 bits (time-first, as the
 * engine caches them). New frame i is at position C+i; it sees every cached position and new position C+j iff
 * floor((C+j)/chunk) <= floor((C+i)/chunk). Scores are scaled by `scale` before the softmax.
 * The fast kernel (AVX-512 BF16) takes the products in bfloat16 with float32 sums; the portable one is float32. */
typedef struct {
    int batch, new_frames, cached, heads, head_dim;
    int64_t chunk;
    float scale;
} cvl_attention_shape;

/* 0 on success, -1 when the work buffer cannot be allocated. */
int cvl_cached_attention(const cvl_attention_shape* s, const float* q, const float* k, const float* v,
                         const uint16_t* past_k, const uint16_t* past_v, float* out);

/* Which kernel cvl_cached_attention uses for `head_dim` on this CPU: 1 the bf16 one, 0 the portable one. */
int cvl_fast_kernel(int head_dim);

#endif
