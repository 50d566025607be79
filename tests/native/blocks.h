/* The activations and float16 caches of the fused blocks' C tests (test_estimator_block.c, test_dit_block.c). */
#ifndef COSYVOICE_LITE_TEST_BLOCKS_H
#define COSYVOICE_LITE_TEST_BLOCKS_H

#include "check.h"

typedef struct {
    float *x, *y;
    uint16_t *past_k, *past_v, *k, *v;
} block_data;

/* A float16 of magnitude below 2 (exponent 10 .. 15), as bits. */
static inline uint16_t small_half(rng* r) {
    const uint64_t b = rng_next(r);
    return (uint16_t)(((b & 1u) << 15) | ((10u + (b >> 1) % 6u) << 10) | ((b >> 8) & 0x3ffu));
}

/* x random, the caches (batch, cached, hd) of small float16s, y and the new k, v to be written. */
static inline block_data make_block_data(rng* r, int64_t batch, int64_t frames, int64_t cached, int64_t dim,
                                         int64_t hd) {
    const size_t rows = (size_t)(batch * frames), nc = (size_t)(batch * cached * hd);
    block_data d = {random_floats(r, rows * (size_t)dim, 1.f), malloc(rows * (size_t)dim * sizeof(float)),
                    malloc((nc ? nc : 1) * 2),  malloc((nc ? nc : 1) * 2), malloc(rows * (size_t)hd * 2),
                    malloc(rows * (size_t)hd * 2)};
    for (size_t i = 0; i < nc; i++) d.past_k[i] = small_half(r), d.past_v[i] = small_half(r);
    return d;
}

static inline void free_block_data(block_data* d) {
    free(d->x), free(d->y), free(d->past_k), free(d->past_v), free(d->k), free(d->v);
}

#endif
