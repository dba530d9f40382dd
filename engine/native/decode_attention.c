/* Decode attention on the CPU, reading K and V from the paged cache where they lie.
 *
 * One work item is one decode's one KV head: the item's query heads (the GQA group) are
 * scored against every cached token of the sequence, softmaxed, and applied to V. Nothing is
 * gathered or padded first, so K and V are read once from the cache and never copied.
 *
 * Layout, as in engine/attention/backend.py: a layer's cache is
 * [num_pages, 2, page_size, num_kv_heads, head_dim], K at index 0 and V at index 1.
 *
 * Rounding follows the torch backend's batched path: in bfloat16 the scores are rounded to
 * bfloat16 before scaling (its matmul returns bfloat16), the softmax runs in float32, the
 * probabilities are rounded to bfloat16, and the output is accumulated in float32 and rounded
 * once. In float32 nothing is rounded in between.
 *
 * Built on first use by engine/native/build.py (cc -O3 -march=native -fopenmp); the OpenMP
 * runtime is the one torch has already loaded, so the kernel shares torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec.h"

#define ATRIUM_DTYPE_FLOAT32 0
#define ATRIUM_DTYPE_BFLOAT16 1

#define MAX_GROUP 16   /* query heads per KV head handled in registers-or-stack */
#define MAX_CHUNKS 16  /* head_dim / 16, i.e. head_dim <= 256 */

typedef struct {
    int num_heads;
    int num_kv_heads;
    int page_size;
    float scale;
} shape_t;

/* One (decode, kv head) item: ``G`` query heads of ``D`` (a multiple of 16) values each. Both
 * are compile-time constants in the common instantiations below, so the loops over them unroll
 * and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_item(
    const void *q_seq, /* this decode's query row: [num_heads, D] */
    const void *cache, void *out_seq, const int32_t *table, int kv_len, int kvh,
    const shape_t *s, const int G, const int D, const int bf16, float *scores) {
    const int C = D / 16;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t tok_stride = (int64_t)s->num_kv_heads * D;
    const int64_t v_offset = (int64_t)s->page_size * tok_stride;
    const int64_t page_stride = 2 * v_offset;
    const char *cache_b = (const char *)cache + (size_t)kvh * D * elem;
    vf16 qv[MAX_GROUP][MAX_CHUNKS];
    vf16 acc[MAX_GROUP][MAX_CHUNKS];

    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            qv[g][c] = load16((const char *)q_seq + ((size_t)(kvh * G + g) * D + 16 * c) * elem,
                              bf16);

    /* Scores of every query head of the group against every cached token, page by page. */
    for (int t = 0, page = 0; t < kv_len; page++) {
        const char *k = cache_b + (size_t)table[page] * page_stride * elem;
        const int end = t + s->page_size < kv_len ? t + s->page_size : kv_len;
        for (; t < end; t++, k += tok_stride * elem) {
            vf16 kc[MAX_CHUNKS];
            for (int c = 0; c < C; c++) kc[c] = load16(k + 16 * c * elem, bf16);
            for (int g = 0; g < G; g++) {
                vf16 a = qv[g][0] * kc[0];
                for (int c = 1; c < C; c++) a += qv[g][c] * kc[c];
                float dot = hsum16(a);
                if (bf16) dot = bf16_round(dot);
                scores[(int64_t)g * kv_len + t] = dot * s->scale;
            }
        }
    }

    /* Softmax per query head, in float32. */
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * kv_len;
        float peak = -INFINITY;
        for (int t = 0; t < kv_len; t++) peak = sg[t] > peak ? sg[t] : peak;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int t = 0; t < kv_len; t++) {
            float e = exp_nonpositive(sg[t] - peak);
            sg[t] = e;
            total += e;
        }
        const float inv = 1.0f / total;
        if (bf16) {
#pragma omp simd
            for (int t = 0; t < kv_len; t++) sg[t] = bf16_round(sg[t] * inv);
        } else {
#pragma omp simd
            for (int t = 0; t < kv_len; t++) sg[t] *= inv;
        }
    }

    /* Probability-weighted sum of V, accumulated in float32. */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = (vf16){0};
    for (int t = 0, page = 0; t < kv_len; page++) {
        const char *v = cache_b + ((size_t)table[page] * page_stride + v_offset) * elem;
        const int end = t + s->page_size < kv_len ? t + s->page_size : kv_len;
        for (; t < end; t++, v += tok_stride * elem) {
            vf16 vc[MAX_CHUNKS];
            for (int c = 0; c < C; c++) vc[c] = load16(v + 16 * c * elem, bf16);
            for (int g = 0; g < G; g++) {
                const float p = scores[(int64_t)g * kv_len + t];
                for (int c = 0; c < C; c++) acc[g][c] += p * vc[c];
            }
        }
    }

    for (int g = 0; g < G; g++) {
        const size_t base = (size_t)(kvh * G + g) * D;
        for (int c = 0; c < C; c++)
            for (int i = 0; i < 16; i++) {
                if (bf16)
                    ((uint16_t *)out_seq)[base + 16 * c + i] = bf16_from_f32(acc[g][c][i]);
                else
                    ((float *)out_seq)[base + 16 * c + i] = acc[g][c][i];
            }
    }
}

/* Returns 0; -1 when a work buffer could not be allocated, -2 for an unsupported shape
 * (head_dim not a multiple of 16 or above 256, more than 16 query heads per KV head). */
int atrium_decode_attention(
    const void *q,        /* [num_decodes, num_heads, head_dim] rows ``q_row_stride`` apart */
    int64_t q_row_stride, /* elements between consecutive decodes' query rows */
    const void *cache,    /* one layer's cache, layout above */
    void *out,            /* [num_decodes, num_heads, head_dim], contiguous */
    const int32_t *pages, /* page ids: the step's block tables, one after another */
    const int32_t *page_starts, /* [num_decodes] where each decode's table starts in ``pages`` */
    const int32_t *kv_lens,     /* [num_decodes] tokens each decode attends to (>= 1) */
    int num_decodes, int num_heads, int num_kv_heads, int head_dim, int page_size, float scale,
    int dtype, int num_threads) {
    const shape_t s = {num_heads, num_kv_heads, page_size, scale};
    const int G = num_heads / num_kv_heads;
    if (head_dim % 16 || head_dim > 16 * MAX_CHUNKS || G > MAX_GROUP || G * num_kv_heads != num_heads)
        return -2;
    const size_t elem = dtype == ATRIUM_DTYPE_BFLOAT16 ? 2 : 4;
    const int64_t items = (int64_t)num_decodes * num_kv_heads;
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (failed) continue;
            const int seq = (int)(item / num_kv_heads);
            const int kvh = (int)(item % num_kv_heads);
            const int kv_len = kv_lens[seq];
            if ((int64_t)G * kv_len > capacity) {
                free(scores);
                capacity = (int64_t)G * kv_len;
                scores = malloc(sizeof(float) * (size_t)capacity);
                if (scores == NULL) {
                    capacity = 0;
                    failed = 1;
                    continue;
                }
            }
            const void *q_seq = (const char *)q + (size_t)seq * (size_t)q_row_stride * elem;
            void *out_seq = (char *)out + (size_t)seq * (size_t)num_heads * head_dim * elem;
            const int32_t *table = pages + page_starts[seq];
            /* Constant dtype, head size and group size for the common models, so each call
             * below is specialised; anything else runs the same code with runtime sizes. */
#define ATTEND(GG, D, BF) \
    attend_item(q_seq, cache, out_seq, table, kv_len, kvh, &s, GG, D, BF, scores)
#define BY_GROUP(D, BF)                \
    switch (G) {                       \
        case 1: ATTEND(1, D, BF); break; \
        case 2: ATTEND(2, D, BF); break; \
        case 3: ATTEND(3, D, BF); break; \
        case 4: ATTEND(4, D, BF); break; \
        case 8: ATTEND(8, D, BF); break; \
        default: ATTEND(G, D, BF); break; \
    }
            const int bf16 = dtype == ATRIUM_DTYPE_BFLOAT16;
            if (head_dim == 64 && bf16) {
                BY_GROUP(64, 1)
            } else if (head_dim == 64) {
                BY_GROUP(64, 0)
            } else if (head_dim == 128 && bf16) {
                BY_GROUP(128, 1)
            } else if (head_dim == 128) {
                BY_GROUP(128, 0)
            } else if (bf16) {
                ATTEND(G, head_dim, 1);
            } else {
                ATTEND(G, head_dim, 0);
            }
#undef BY_GROUP
#undef ATTEND
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
