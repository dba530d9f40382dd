/* Two of the decoder layer's element-wise steps on the CPU, in bfloat16 and in float32, each
 * one pass over its rows instead of the three to seven torch kernels (and float32 copies) they
 * take in eager mode. (SiLU * up stays in torch: its vectorised exp beat this file's.)
 *
 * In bfloat16 each rounds where the torch code in engine/model/llama.py and
 * engine/model/rope.py rounds:
 *   rms_norm:  h = bf16(x * 1/sqrt(mean(x^2) + eps)) in float32, out = bf16(weight * h)
 *   rope:      a = bf16(x * cos), x = bf16(a + rotate_half(x) * signed_sin)
 * In float32 the same formulas round only where float32 arithmetic does.
 * Rows are spread over torch's OpenMP threads. Built by engine/native/build.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* x [rows, hidden] rows ``x_stride`` elements apart -> out [rows, hidden] contiguous. */
void atrium_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                          uint16_t *out, int64_t rows, int64_t hidden, float eps,
                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * hidden;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; i++) {
            const float v = bf16_load(xr + i);
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            o[i] = bf16_from_f32(bf16_load(weight + i) * bf16_round(bf16_load(xr + i) * inv));
    }
}

/* In place: x [rows, heads, head_dim] (heads contiguous, rows ``x_stride`` apart); cos and
 * sin [rows, head_dim] contiguous, sin's first half negated (rope.signed_sin). */
void atrium_rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                      int64_t rows, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * head_dim;
        const uint16_t *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *xh = x + r * x_stride + h * head_dim;
            float lo[256], hi[256];
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                lo[i] = bf16_load(xh + i);
                hi[i] = bf16_load(xh + half + i);
            }
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a_lo = bf16_round(lo[i] * bf16_load(c + i));
                const float a_hi = bf16_round(hi[i] * bf16_load(c + half + i));
                xh[i] = bf16_from_f32(a_lo + hi[i] * bf16_load(s + i));
                xh[half + i] = bf16_from_f32(a_hi + lo[i] * bf16_load(s + half + i));
            }
        }
    }
}

/* float32 twins of the two functions above. */
void atrium_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                         int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * hidden;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; i++) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

void atrium_rope_f32(float *x, int64_t x_stride, const float *cos, const float *sin,
                     int64_t rows, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim;
        const float *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *xh = x + r * x_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float lo = xh[i], hi = xh[half + i];
                xh[i] = lo * c[i] + hi * s[i];
                xh[half + i] = hi * c[half + i] + lo * s[half + i];
            }
        }
    }
}
