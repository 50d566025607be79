/* Attention of new frames over cached keys/values under a chunk mask (a chunk-causal flow estimator's blocks). */
#ifndef COSYVOICE_LITE_CACHED_ATTENTION_H
#define COSYVOICE_LITE_CACHED_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "cpu.h"
#include "op.h"

/* One call: q, k, v, out (B, M, H*DK) float32; past_k, past_v (B, C, H, DK) float16 bits (time-first, as the
 * engine caches them). New frame i is at position C+i; it sees every cached position and new position C+j iff
 * floor((C+j)/chunk) <= floor((C+i)/chunk); a chunk of at least C+M (INT64_MAX: no overflow) is full attention,
 * every frame seeing every key (a non-causal estimator's blocks, C = 0). Scores are scaled by `scale` before the softmax.
 * The fast kernels (AVX-512 BF16 for head sizes 16, 32 and 64; AMX-BF16 tiles for 32 and 64) take the products in
 * bfloat16 with float32 sums and a float32 softmax; the AVX2 one (head sizes multiples of 8 up to 64) and the portable
 * one (any head size) are float32 throughout. */
typedef struct {
    int batch, new_frames, cached, heads, head_dim;
    int64_t chunk;
    float scale;
} cvl_attention_shape;

/* The code paths: portable, avx2, avx512_bf16, amx_bf16; which one a call takes depends on the head size too. */
extern const cvl_variants cvl_cached_attention_variants;

/* The cached keys and values, (B, C, H, DK) time-first: float16 bits (k, v), or int8 (k_int8, v_int8), each row of DK
 * times its float32 scale (k_scale, v_scale: (B, C, H)), the engine's int8 frames (frame_codec.h). The AVX-512 BF16
 * kernel reads int8 rows as they are (int8 x scale in float32, then bf16); the others widen them to float16 first. */
typedef struct {
    const uint16_t *k, *v;
    const int8_t *k_int8, *v_int8;
    const float *k_scale, *v_scale;
} cvl_cached;

/* The attention over caches of either kind (cvl_cached): 0 on success, -1 when a work buffer cannot be allocated. */
int cvl_attention_cached(const cvl_attention_shape* s, cvl_features have, const float* q, const float* k,
                         const float* v, const cvl_cached* kv, float* out);

/* 0 on success, -1 when the work buffer cannot be allocated. `have`: the features the call may use (exec.h). */
int cvl_cached_attention(const cvl_attention_shape* s, cvl_features have, const float* q, const float* k,
                         const float* v, const uint16_t* past_k, const uint16_t* past_v, float* out);

#endif
