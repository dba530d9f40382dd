/* What the attention kernels in this folder share: a vectorisable exp for softmax, sixteen-float
 * vectors, and loads that widen bfloat16 to float32. */
#ifndef ATRIUM_VEC_H
#define ATRIUM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp for softmax arguments (x <= 0): Cody-Waite range reduction and a degree-6 polynomial,
 * within 2 ulp of expf over the range, written so that the compiler vectorises it. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Sixteen floats: the compiler maps these onto whatever vector registers the CPU has. */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));

static inline vf16 load16(const void *p, int bf16) {
    vf16 f;
    if (bf16) {
        vh16 h;
        memcpy(&h, p, sizeof h);
        vu16 u = __builtin_convertvector(h, vu16) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

static inline float hsum16(vf16 v) {
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#endif
