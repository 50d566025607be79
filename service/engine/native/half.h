/* float16 bits -> float32 in portable C (the kernels' code paths without F16C). */
#ifndef COSYVOICE_LITE_HALF_H
#define COSYVOICE_LITE_HALF_H

#include <stdint.h>
#include <string.h>

static inline float cvl_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        do { man <<= 1; e++; } while ((man & 0x400) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
