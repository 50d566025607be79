/* float16 bits <-> float32 in portable C (the kernels' code paths without F16C). */
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

/* float32 -> float16 bits, rounded to nearest even (as F16C's vcvtps2ph and numpy's astype(float16) round). */
static inline uint16_t cvl_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half: infinity */
    if (ax < 0x38800000u) { /* a subnormal half (or zero): the value in units of 2^-24, rounded */
        if (ax < 0x33000000u) return sign; /* at most half the smallest subnormal: zero */
        const uint32_t shift = 126 - (ax >> 23), man = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        uint32_t h = man >> shift;
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((ax >> 13) - (112u << 10)), rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

#endif
