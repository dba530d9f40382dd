/* bfloat16 <-> float32 for the kernels in this folder (bfloat16 is stored as uint16_t). */
#ifndef ATRIUM_BF16_H
#define ATRIUM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch does; NaN stays a (quiet) NaN. Branch-free, so
 * loops that call it vectorise. */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* ``f`` as the nearest bfloat16, back in float32. */
static inline float bf16_round(float f) {
    uint16_t h = bf16_from_f32(f);
    return bf16_load(&h);
}

#endif
