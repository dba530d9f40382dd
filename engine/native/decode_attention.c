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
#define _GNU_SOURCE /* syscall(), for the AMX permission in amx.h */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "vec.h"

#define MAX_CHUNKS (ATRIUM_MAX_DIM / 16) /* head_dim / 16 */
#define GROUP_MIN_TOKENS 32 /* the shortest shared prefix attended once for its group */
#ifndef ATRIUM_DECODE_ALONE
#define ATRIUM_DECODE_ALONE 0 /* 1: every decode attends on its own (a build for tests) */
#endif

typedef struct {
    int num_heads;
    int num_kv_heads;
    int page_size;
    float scale;
} shape_t;

/* Lane t of the result is the sum of the sixteen lanes of a[t]: a transposing tree of adds
 * (thirty shuffles for sixteen sums instead of sixteen horizontal reductions). The tree leaves
 * the sums in bit-reversed lane order, which the last shuffle undoes. */
static inline vf16 reduce16(const vf16 a[16]) {
    vf16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) {
        const vf16 x = a[2 * i], y = a[2 * i + 1];
        b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                       23) +
               __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    }
    for (int i = 0; i < 4; i++) {
        const vf16 x = b[2 * i], y = b[2 * i + 1];
        c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29,
                                       30, 31);
    }
    for (int i = 0; i < 2; i++) {
        const vf16 x = c[2 * i], y = c[2 * i + 1];
        d[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                       29) +
               __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                       31);
    }
    const vf16 e =
        __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14,
                                30) +
        __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15,
                                31);
    return __builtin_shufflevector(e, e, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

/* Ask for one head's rows (``row_bytes`` each) of tokens pos .. pos + 15 (those below
 * ``tokens``) ahead of use: pages lie scattered and are read once a step, so nothing else brings
 * them in time. */
static inline void prefetch_block(const char *base, const int32_t *table, int pos, int tokens,
                                  const shape_t *s, int64_t tok_bytes, int row_bytes) {
    const char *rows[16];
    const int n = tokens - pos < 16 ? tokens - pos : 16;
    paged_rows(base, table, pos, n, s->page_size, tok_bytes, 2 * s->page_size * tok_bytes, rows);
    for (int t = 0; t < n; t++)
        for (int line = 0; line < row_bytes; line += 64) __builtin_prefetch(rows[t] + line, 0, 3);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ATRIUM_DECODE_AVX2 1
#include <immintrin.h>
#else
#define ATRIUM_DECODE_AVX2 0
#endif

#if ATRIUM_DECODE_AVX2
/* float32 with AVX2 alone: sixteen 8-lane registers, where the sixteen-lane code below keeps
 * more values live than there are registers (a group's query heads, sixteen keys' partial
 * sums, a head's sixteen-lane accumulators) and spills them in its inner loops. Here a query
 * row stays in up to eight registers and eight keys' partial sums in eight more, the keys read
 * from memory by the multiply-adds themselves; eight sums across lanes take one tree of
 * horizontal adds. Values: three rows by 32 dimensions in twelve registers, each token's
 * probabilities broadcast against its V row. That is each decode's own tokens (a few rows); a
 * group's shared prefix (up to 24 rows) has a pass of its own, attend_prefix_f32_avx2_d. */
static const float ZERO_F32_ROW[ATRIUM_MAX_DIM] = {0};

/* Lane t: the sum of the eight lanes of a[t]. */
static inline __m256 sum_lanes8(const __m256 a[8]) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* Scaled scores of query rows q[0 .. R-1] (D floats each) against key rows k[0 .. 7] (rows past
 * the first n are zero rows), to scores[r * stride + t]; lanes past n get -inf. */
static inline __attribute__((always_inline)) void dots8(const float *const *q, int R,
                                                        const float *const *k, int n,
                                                        const int D, float scale, float *scores,
                                                        int64_t stride) {
    const __m256 live =
        _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)n), _CMP_LT_OQ);
    const __m256 none = _mm256_set1_ps(-INFINITY), scaled = _mm256_set1_ps(scale);
    for (int r = 0; r < R; r++) {
        /* Keys are read again for each row, from L1: hoisted out of this loop they would be
         * 64 registers' worth, and spill. */
        __asm__ volatile("" ::: "memory");
        __m256 a[8];
        for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
        for (int c0 = 0; c0 < D; c0 += 64) {
            const int w = D - c0 < 64 ? (D - c0) / 8 : 8;
            __m256 qv[8];
            for (int c = 0; c < w; c++) qv[c] = _mm256_loadu_ps(q[r] + c0 + 8 * c);
            for (int t = 0; t < 8; t++)
                for (int c = 0; c < w; c++)
                    a[t] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k[t] + c0 + 8 * c), a[t]);
        }
        _mm256_storeu_ps(scores + (int64_t)r * stride,
                         _mm256_blendv_ps(none, _mm256_mul_ps(sum_lanes8(a), scaled), live));
    }
}

/* A row of ``pad`` scores (a multiple of 16): its largest score, and the weights exp(score -
 * top) written over it with their sum returned. The generic code's steps and sums, sixteen
 * lanes as two registers (see vec.h). */
static inline float row_max_avx2(const float *sr, int pad) {
    __m256 lo = _mm256_set1_ps(-INFINITY), hi = lo;
    for (int t = 0; t < pad; t += 16) {
        lo = _mm256_max_ps(lo, _mm256_loadu_ps(sr + t));
        hi = _mm256_max_ps(hi, _mm256_loadu_ps(sr + t + 8));
    }
    return hmax8(_mm256_max_ps(lo, hi));
}

static inline float row_weights_avx2(float *sr, int pad, float top_s) {
    const __m256 top = _mm256_set1_ps(top_s);
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    for (int t = 0; t < pad; t += 16) {
        const __m256 e0 = vexp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sr + t), top));
        const __m256 e1 = vexp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sr + t + 8), top));
        lo = _mm256_add_ps(lo, e0);
        hi = _mm256_add_ps(hi, e1);
        _mm256_storeu_ps(sr + t, e0);
        _mm256_storeu_ps(sr + t + 8, e1);
    }
    return hsum8x2(lo, hi);
}

/* Scores of R query rows against tokens first .. first + tokens - 1 of a table's sequence, to
 * scores[r * pad + t] (pad a multiple of 16 >= tokens; -inf past the last token). The next
 * blocks' K (``ahead`` blocks of sixteen on) and this block's V are fetched ahead of use. */
static inline __attribute__((always_inline)) void scores_avx2(
    const float *const *q, int R, const char *cache_h, const int32_t *table, int first,
    int tokens, int pad, int ahead, const shape_t *s, const int D, float *scores) {
    const int64_t tok_bytes = (int64_t)s->num_kv_heads * D * 4;
    const int64_t v_bytes = s->page_size * tok_bytes, page_bytes = 2 * v_bytes;
    for (int t0 = 0; t0 < tokens; t0 += 8) {
        const int n = tokens - t0 < 8 ? tokens - t0 : 8;
        const char *rows[8];
        paged_rows(cache_h, table, first + t0, n, s->page_size, tok_bytes, page_bytes, rows);
        if (t0 % 16 == 0)
            prefetch_block(cache_h, table, first + t0 + 16 * ahead, first + tokens, s, tok_bytes,
                           D * 4);
        const float *k[8];
        for (int t = 0; t < 8; t++) {
            k[t] = t < n ? (const float *)rows[t] : ZERO_F32_ROW;
            if (t < n)
                for (int line = 0; line < D * 4; line += 64)
                    __builtin_prefetch(rows[t] + v_bytes + line, 0, 3);
        }
        dots8(q, R, k, n, D, s->scale, scores + t0, pad);
    }
    for (int r = 0; r < R; r++)
        for (int t = (tokens + 7) & ~7; t < pad; t++) scores[(int64_t)r * pad + t] = -INFINITY;
}

/* Adds sum over tokens t < n of p[r][t] * V[t] to up to 32 dimensions (from c0) of RN rows of
 * out, V[t] at rows[t]. Each V line comes in once for all RN rows, and the rows' twelve
 * accumulators are loaded and stored once per sixteen tokens. */
static inline __attribute__((always_inline)) void values_tile_avx2(
    const float *const *p, const int RN, const char *const *rows, int n, int c0, const int w,
    float *const *out) {
    __m256 o[3][4];
    for (int r = 0; r < RN; r++)
        for (int c = 0; c < w; c++) o[r][c] = _mm256_loadu_ps(out[r] + c0 + 8 * c);
    for (int t = 0; t < n; t++) {
        const float *v = (const float *)rows[t] + c0;
        for (int r = 0; r < RN; r++) {
            /* V read by each row's multiply-adds, from L1: held in registers for all the
             * rows it would take four more than there are. */
            __asm__ volatile("" ::: "memory");
            const __m256 pt = _mm256_broadcast_ss(p[r] + t);
            for (int c = 0; c < w; c++)
                o[r][c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * c), o[r][c]);
        }
    }
    for (int r = 0; r < RN; r++)
        for (int c = 0; c < w; c++) _mm256_storeu_ps(out[r] + c0 + 8 * c, o[r][c]);
}

/* out[r][0 .. D) = (prior row r's output * carry[r], or 0) + sum over the tokens of p[r][t] *
 * V[t], for R rows; p rows ``pad`` apart, prior rows D + 2 floats apart. Sixteen tokens at a
 * time, their rows found once; within them rows three at a time by 32 dimensions, so each V
 * row comes from L2 once per three rows rather than once per row. */
static inline __attribute__((always_inline)) void values_avx2(
    const float *p, int pad, int R, const char *v_base, const int32_t *table, int first,
    int tokens, const shape_t *s, const int D, const float *prior, const float *carry,
    float *const *out) {
    const int64_t tok_bytes = (int64_t)s->num_kv_heads * D * 4;
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++)
            out[r][d] = prior != NULL ? prior[(size_t)r * (D + 2) + d] * carry[r] : 0.0f;
    for (int t0 = 0; t0 < tokens; t0 += 16) {
        const int n = tokens - t0 < 16 ? tokens - t0 : 16;
        const char *rows[16];
        paged_rows(v_base, table, first + t0, n, s->page_size, tok_bytes,
                   2 * s->page_size * tok_bytes, rows);
        for (int r0 = 0; r0 < R; r0 += 3) {
            const int rn = R - r0 < 3 ? R - r0 : 3;
            const float *pr[3];
            for (int r = 0; r < rn; r++) pr[r] = p + (int64_t)(r0 + r) * pad + t0;
            for (int c0 = 0; c0 < D; c0 += 32) {
                const int w = D - c0 < 32 ? (D - c0) / 8 : 4;
#define VTILE(RN)                                                                  \
    if (w == 4)                                                                    \
        values_tile_avx2(pr, RN, rows, n, c0, 4, out + r0);                        \
    else                                                                           \
        values_tile_avx2(pr, RN, rows, n, c0, 2, out + r0);                        \
    break;
                switch (rn) {
                    case 1: VTILE(1)
                    case 2: VTILE(2)
                    default: VTILE(3)
                }
#undef VTILE
            }
        }
    }
}

#endif

/* The c-th 64 bytes of sixteen keys' rows (zero past the first n), transposed: a[j] holds the
 * j-th 32-bit value (a float, or a pair of bfloat16) of every key, a lane per key. */
static inline void transpose_keys(const char *const *rows, int n, int c, vu16 *a) {
    for (int t = 0; t < 16; t++) {
        if (t < n)
            memcpy(&a[t], rows[t] + 64 * c, 64);
        else
            a[t] = (vu16){0};
    }
    ATRIUM_TSTAGE(a, 8)
    ATRIUM_TSTAGE(a, 4)
    ATRIUM_TSTAGE(a, 2)
    ATRIUM_TSTAGE(a, 1)
}

/* A prefix row's scores (``pad`` of them) turned into weights exp(score - max) in place, rounded
 * to bfloat16 with ``bf16`` (as probabilities weighting V are); stats[0] gets the max and
 * stats[1] the sum of the unrounded weights. */
static inline void prefix_weights(float *sr, int pad, float *stats, int bf16) {
    vf16 peak = splat16(-INFINITY);
    for (int t = 0; t < pad; t += 16) peak = max16(peak, vload16(sr + t));
    const float top_s = hmax16(peak);
    const vf16 top = splat16(top_s);
    vf16 total = (vf16){0};
    for (int t = 0; t < pad; t += 16) {
        const vf16 e = vexp_nonpositive(vload16(sr + t) - top);
        total += e;
        vstore16(sr + t, bf16 ? vbf16_round(e) : e);
    }
    stats[0] = top_s;
    stats[1] = hsum16(total);
}

/* float32 scores of G query heads against tokens begin .. kv_len - 1, sixteen tokens at a
 * time: each head's sixteen dot products are summed across lanes together (``reduce16``), not
 * one by one. Scores are scaled; lanes past the last token hold -inf. */
static inline __attribute__((always_inline)) void score_f32(
    const float *q_seq, const char *cache_b, const int32_t *table, int begin, int kv_len,
    int kv_pad, int kvh, const shape_t *s, const int G, const int D, float *scores) {
    const int C = D / 16;
    const int64_t tok_bytes = (int64_t)s->num_kv_heads * D * 4;
    const int64_t v_bytes = s->page_size * tok_bytes, page_bytes = 2 * v_bytes;
    vf16 qv[ATRIUM_MAX_GROUP][MAX_CHUNKS];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) qv[g][c] = vload16(q_seq + (size_t)(kvh * G + g) * D + 16 * c);
    vf16 lane;
    for (int t = 0; t < 16; t++) lane[t] = (float)t;
    for (int t0 = 0; t0 < kv_len - begin; t0 += 16) {
        const int n = kv_len - begin - t0 < 16 ? kv_len - begin - t0 : 16;
        const char *k[16];
        paged_rows(cache_b, table, begin + t0, n, s->page_size, tok_bytes, page_bytes, k);
        /* The next block's K and this block's V (read by the value pass), ahead of use. */
        prefetch_block(cache_b, table, begin + t0 + 16, kv_len, s, tok_bytes, D * 4);
        for (int t = 0; t < n; t++)
            for (int line = 0; line < D * 4; line += 64) __builtin_prefetch(k[t] + v_bytes + line, 0, 3);
        for (int g = 0; g < G; g++) {
            vf16 a[16];
            for (int t = 0; t < 16; t++) {
                a[t] = (vf16){0};
                if (t < n)
                    for (int c = 0; c < C; c++) a[t] += qv[g][c] * vload16((const float *)k[t] + 16 * c);
            }
            vstore16(scores + (int64_t)g * kv_pad + t0,
                     select16(lane < splat16((float)n), reduce16(a) * s->scale, splat16(-INFINITY)));
        }
    }
}

/* Decodes over a shared prefix in float32: up to ATRIUM_DP_ROWS query rows (the members' query
 * heads for one KV head) attend the prefix together, sixteen keys at a time, each block of
 * keys transposed once (a lane per key, a register per dimension) so that each row's sixteen
 * scores are D multiply-adds with no sums across lanes; every key and value is read once for
 * all the rows. The result is what ``attend_item`` carries in as its prior: per row the output
 * weighted by exp(score - max), then the max and the sum of those weights. */
/* 24 rows: eight decodes of three query heads per KV head (SmolLM2's grouping) make one item,
 * so a group of eight reads and transposes its prefix once (with 16 rows it went in items of
 * five and three members, the prefix read twice; ~15% of the kernel's time at 32 decodes). */
#define ATRIUM_DP_ROWS 24
#define PREFIX_AHEAD 2 /* blocks of sixteen keys (or values) fetched ahead of use */

#if ATRIUM_DECODE_AVX2
/* The prefix pass of ``attend_prefix_f32`` (below) for AVX2, laid out like the chunk kernel's
 * AVX2 tile: the rows transposed, eight to a register (three for 24 rows), so that four keys'
 * scores are twelve accumulators fed by broadcast key values, and four head dims of the output
 * likewise by broadcast values, with no sums across lanes (rows one at a time against eight
 * keys took eighteen loads and a tree of horizontal adds per twelve multiply-adds). The scores
 * are kept key by key (24 to a key), the softmax runs down the lanes, and V is applied in
 * blocks of PF_TOKENS keys whose scores stay in L1. */
#define PF_ROWS 24   /* rows of a pass: three 8-lane registers; ATRIUM_DP_ROWS at most */
#define PF_TOKENS 64 /* keys of a value block */
_Static_assert(PF_ROWS == ATRIUM_DP_ROWS, "an item's rows fill one pass, its scores the scratch");
static inline __attribute__((always_inline)) void attend_prefix_f32_avx2_d(
    const float *qb, int live, const char *cache_h, const int32_t *table, int tokens,
    const shape_t *s, const int D, float *scores, float *const *out) {
    const int64_t tok_bytes = (int64_t)s->num_kv_heads * D * 4;
    const int64_t v_bytes = (int64_t)s->page_size * tok_bytes, page_bytes = 2 * v_bytes;
    const int tokens4 = (tokens + 3) & ~3;
    float qt[ATRIUM_MAX_DIM * PF_ROWS] __attribute__((aligned(32)));
    float ot[ATRIUM_MAX_DIM * PF_ROWS] __attribute__((aligned(32)));
    for (int d = 0; d < D; d++)
        for (int r = 0; r < PF_ROWS; r++)
            qt[d * PF_ROWS + r] = r < live ? qb[(size_t)r * D + d] : 0.0f;

    /* Scores: scores[t * PF_ROWS + r] = scale * k_t . q_r, keys past ``tokens`` -inf. */
    const __m256 scale = _mm256_set1_ps(s->scale);
    for (int t0 = 0; t0 < tokens; t0 += 16) {
        const int n = tokens - t0 < 16 ? tokens - t0 : 16, n4 = (n + 3) & ~3;
        const char *rows[16];
        paged_rows(cache_h, table, t0, n, s->page_size, tok_bytes, page_bytes, rows);
        prefetch_block(cache_h, table, t0 + 16 * PREFIX_AHEAD, tokens, s, tok_bytes, D * 4);
        for (int t = 0; t < n; t++)
            for (int line = 0; line < D * 4; line += 64)
                __builtin_prefetch(rows[t] + v_bytes + line, 0, 3); /* V, for the value pass */
        for (int t = n; t < n4; t++) rows[t] = (const char *)ZERO_F32_ROW;
        for (int j = 0; j < n4; j += 4) {
            const float *k[4];
            for (int jj = 0; jj < 4; jj++) k[jj] = (const float *)rows[j + jj];
            __m256 acc[4][3];
            dots4x24(qt, PF_ROWS, k, D, acc);
            for (int jj = 0; jj < 4; jj++)
                for (int v = 0; v < 3; v++)
                    _mm256_storeu_ps(scores + (size_t)(t0 + j + jj) * PF_ROWS + 8 * v,
                                     _mm256_mul_ps(acc[jj][v], scale));
        }
    }
    for (int t = tokens; t < tokens4; t++)
        for (int r = 0; r < PF_ROWS; r++) scores[(size_t)t * PF_ROWS + r] = -INFINITY;

    /* Weights exp(score - max) over the keys, eight rows a register; their sums unrounded. */
    __m256 peak[3], total[3];
    for (int v = 0; v < 3; v++) {
        peak[v] = _mm256_set1_ps(-INFINITY);
        total[v] = _mm256_setzero_ps();
    }
    for (int t = 0; t < tokens4; t++)
        for (int v = 0; v < 3; v++)
            peak[v] = _mm256_max_ps(peak[v], _mm256_loadu_ps(scores + (size_t)t * PF_ROWS + 8 * v));
    for (int t = 0; t < tokens4; t++)
        for (int v = 0; v < 3; v++) {
            float *st = scores + (size_t)t * PF_ROWS + 8 * v;
            const __m256 e = vexp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(st), peak[v]));
            total[v] = _mm256_add_ps(total[v], e);
            _mm256_storeu_ps(st, e);
        }
    float stats[2][PF_ROWS];
    for (int v = 0; v < 3; v++) {
        _mm256_storeu_ps(stats[0] + 8 * v, peak[v]);
        _mm256_storeu_ps(stats[1] + 8 * v, total[v]);
    }

    /* Values: ot[d * PF_ROWS + r] = sum over keys of weight(r, t) * V[t][d], a block of keys at
     * a time, four head dims by 24 rows in twelve accumulators. */
    memset(ot, 0, sizeof(float) * (size_t)D * PF_ROWS);
    for (int t0 = 0; t0 < tokens; t0 += PF_TOKENS) {
        const int n = tokens - t0 < PF_TOKENS ? tokens - t0 : PF_TOKENS;
        const char *rows[PF_TOKENS];
        paged_rows(cache_h + v_bytes, table, t0, n, s->page_size, tok_bytes, page_bytes, rows);
        const float *vrow[PF_TOKENS];
        for (int t = 0; t < n; t++) vrow[t] = (const float *)rows[t];
        const float *sb = scores + (size_t)t0 * PF_ROWS;
        for (int d = 0; d < D; d += 4) {
            __m256 acc[4][3];
            for (int dd = 0; dd < 4; dd++)
                for (int v = 0; v < 3; v++) acc[dd][v] = _mm256_load_ps(ot + (d + dd) * PF_ROWS + 8 * v);
            weighted4x24(sb, PF_ROWS, vrow, d, n, acc);
            for (int dd = 0; dd < 4; dd++)
                for (int v = 0; v < 3; v++) _mm256_store_ps(ot + (d + dd) * PF_ROWS + 8 * v, acc[dd][v]);
        }
    }
    for (int r = 0; r < live; r++) {
        for (int d = 0; d < D; d++) out[r][d] = ot[d * PF_ROWS + r];
        out[r][D] = stats[0][r];
        out[r][D + 1] = stats[1][r];
    }
}

static __attribute__((noinline)) void attend_prefix_f32_avx2(
    const float *qb, int live, const char *cache_h, const int32_t *table, int tokens,
    const shape_t *s, int D, float *scores, float *const *out) {
    if (D == 64)
        attend_prefix_f32_avx2_d(qb, live, cache_h, table, tokens, s, 64, scores, out);
    else
        attend_prefix_f32_avx2_d(qb, live, cache_h, table, tokens, s, D, scores, out);
}
#endif

static inline __attribute__((always_inline)) void attend_prefix_f32(
    const float *qb, /* R query rows of D values, one after another; rows past ``live`` zero */
    const int R, /* a multiple of 4 (a compile-time constant below, so the rows unroll) */
    int live, const char *cache_h, /* the layer's cache, offset to this KV head */
    const int32_t *table, int tokens, const shape_t *s, const int D,
    float *scores, /* scratch: ATRIUM_DP_ROWS rows of ``tokens`` rounded up to 16 */
    float *const *out /* ``live`` rows of D + 2 floats: output, max, sum */) {
#if ATRIUM_DECODE_AVX2
    (void)R;
    attend_prefix_f32_avx2(qb, live, cache_h, table, tokens, s, D, scores, out);
    return;
#endif
    const int64_t tok_bytes = (int64_t)s->num_kv_heads * D * 4;
    const int64_t v_bytes = (int64_t)s->page_size * tok_bytes, page_bytes = 2 * v_bytes;
    const int pad = (tokens + 15) & ~15;
    vf16 lane;
    for (int t = 0; t < 16; t++) lane[t] = (float)t;

    for (int t0 = 0; t0 < tokens; t0 += 16) {
        const int n = tokens - t0 < 16 ? tokens - t0 : 16;
        const char *rows[16];
        paged_rows(cache_h, table, t0, n, s->page_size, tok_bytes, page_bytes, rows);
        prefetch_block(cache_h, table, t0 + 16 * PREFIX_AHEAD, tokens, s, tok_bytes, D * 4);
        vu16 kt[ATRIUM_MAX_DIM];
        for (int c = 0; c < D / 16; c++) transpose_keys(rows, n, c, kt + 16 * c);
        vf16 acc[ATRIUM_DP_ROWS];
        for (int r = 0; r < R; r++) acc[r] = (vf16){0};
        for (int d = 0; d < D; d++) {
            vf16 kd;
            memcpy(&kd, &kt[d], sizeof kd);
            for (int r = 0; r < R; r++) acc[r] += qb[r * D + d] * kd;
        }
        for (int r = 0; r < R; r++)
            vstore16(scores + (size_t)r * pad + t0,
                     select16(lane < splat16((float)n), acc[r] * s->scale, splat16(-INFINITY)));
    }

    for (int r = 0; r < live; r++) prefix_weights(scores + (size_t)r * pad, pad, out[r] + D, 0);

    /* Values: four rows at a time against each token's V row (read from the cache, which the
     * first row tile brought in). */
    const char *v_base = cache_h + v_bytes;
    const int C = D / 16, RT = 4;
    for (int r0 = 0; r0 < live; r0 += RT) {
        vf16 o[RT][ATRIUM_MAX_DIM / 16];
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < C; c++) o[r][c] = (vf16){0};
        for (int t0 = 0; t0 < tokens; t0 += 16) {
            const int n = tokens - t0 < 16 ? tokens - t0 : 16;
            const char *rows[16];
            paged_rows(v_base, table, t0, n, s->page_size, tok_bytes, page_bytes, rows);
            if (r0 == 0)
                prefetch_block(v_base, table, t0 + 16 * PREFIX_AHEAD, tokens, s, tok_bytes, D * 4);
            for (int t = 0; t < n; t++) {
                const float *v = (const float *)rows[t];
                for (int r = 0; r < RT; r++) {
                    const float p = scores[(size_t)(r0 + r) * pad + t0 + t];
                    for (int c = 0; c < C; c++) o[r][c] += p * vload16(v + 16 * c);
                }
            }
        }
        for (int r = 0; r < RT && r0 + r < live; r++)
            for (int c = 0; c < C; c++) vstore16(out[r0 + r] + 16 * c, o[r][c]);
    }
}

#if ATRIUM_DPBF16
/* bfloat16 scores of G query heads against every cached token, sixteen tokens at a time: each
 * dot product is D / 32 pair-dot instructions on the raw bfloat16 rows (products exact, sums in
 * float32), the sixteen tokens' partial sums reduced together. Scores are rounded to bfloat16
 * and scaled, as in the generic path. */
static inline __attribute__((always_inline)) void score_dpbf16(
    const void *q_seq, const char *cache_b, const int32_t *table, int begin, int kv_len,
    int kv_pad, int kvh, const shape_t *s, const int G, const int D, float *scores) {
    const int C2 = D / 32;
    const int64_t tok_stride = (int64_t)s->num_kv_heads * D;
    const int64_t tok_bytes = 2 * tok_stride, page_bytes = 2 * s->page_size * tok_bytes;
    __m512bh qb[ATRIUM_MAX_GROUP][MAX_CHUNKS / 2];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C2; c++)
            qb[g][c] = (__m512bh)_mm512_loadu_si512(
                (const uint16_t *)q_seq + (size_t)(kvh * G + g) * D + 32 * c);
    for (int t0 = 0; t0 < kv_len - begin; t0 += 16) {
        const int n = kv_len - begin - t0 < 16 ? kv_len - begin - t0 : 16;
        const uint16_t *k[16];
        paged_rows(cache_b, table, begin + t0, n, s->page_size, tok_bytes, page_bytes,
                   (const char **)k);
        /* The cache is read once per item, page by scattered page: fetch the next block's K
         * and this block's V (read by the value pass) ahead of use. */
        prefetch_block(cache_b, table, begin + t0 + 16, kv_len, s, tok_bytes, D * 2);
        for (int t = 0; t < n; t++)
            for (int line = 0; line < D * 2; line += 64)
                __builtin_prefetch((const char *)(k[t] + s->page_size * tok_stride) + line, 0, 3);
        for (int g = 0; g < G; g++) {
            vf16 a[16];
            for (int t = 0; t < 16; t++) {
                __m512 acc = _mm512_setzero_ps();
                if (t < n)
                    for (int c = 0; c < C2; c++)
                        acc = _mm512_dpbf16_ps(acc, qb[g][c],
                                               (__m512bh)_mm512_loadu_si512(k[t] + 32 * c));
                a[t] = (vf16)acc;
            }
            const vf16 dots = vbf16_round(reduce16(a)) * s->scale;
            vf16 lane;
            for (int t = 0; t < 16; t++) lane[t] = (float)t;
            /* Lanes past the last token pad the row to 16 with -inf. */
            vstore16(scores + (int64_t)g * kv_pad + t0,
                     select16(lane < splat16((float)n), dots, splat16(-INFINITY)));
        }
    }
}
#endif

#if ATRIUM_DPBF16
/* Decodes over a shared prefix without AMX: up to ATRIUM_DP_ROWS query rows (the members' query
 * heads for one KV head) attend the prefix together, sixteen keys at a time. Each block of keys
 * is transposed once (a lane per key, a register per pair of dimensions), so each row's sixteen
 * scores are D / 2 pair dot products with no horizontal sums, and every key and value is read
 * once for all the rows. The result is what ``attend_item`` carries in as its prior: per row
 * the output weighted by exp(score - max) (rounded to bfloat16, as probabilities are), then the
 * max and the sum of those weights. */
/* Scratch of one thread for ``attend_prefix_dp``: scores [ATRIUM_DP_ROWS][tokens rounded up to
 * 16] and the values as pairs of tokens [tokens / 2 rounded up][D] (uint32). */
static inline size_t prefix_dp_floats(int tokens, int D) {
    const size_t pad = (size_t)(tokens + 15) & ~(size_t)15;
    return ATRIUM_DP_ROWS * pad + pad / 2 * (size_t)D;
}

static inline __attribute__((always_inline)) void attend_prefix_dp(
    const uint16_t *const *q_rows, /* R query rows of D bfloat16 values; past ``live`` zero */
    const int R, /* a multiple of 4 (a compile-time constant below, so the rows unroll) */
    int live, const char *cache_h, /* the layer's cache, offset to this KV head */
    const int32_t *table, int tokens, const shape_t *s, const int D, float *scratch,
    float *const *out /* ``live`` rows of D + 2 floats: output, max, sum */) {
    const int J = D / 2; /* pairs of dimensions */
    const int64_t tok_bytes = (int64_t)s->num_kv_heads * D * 2;
    const int64_t v_bytes = (int64_t)s->page_size * tok_bytes, page_bytes = 2 * v_bytes;
    const int pad = (tokens + 15) & ~15;
    float *scores = scratch;
    uint32_t *vpairs = (uint32_t *)(scratch + (size_t)ATRIUM_DP_ROWS * pad);

    /* Scores, sixteen keys a block: the block's K transposed (kt[j]: pair j of each key). */
    for (int t0 = 0; t0 < tokens; t0 += 16) {
        const int n = tokens - t0 < 16 ? tokens - t0 : 16;
        const char *rows[16];
        paged_rows(cache_h, table, t0, n, s->page_size, tok_bytes, page_bytes, rows);
        prefetch_block(cache_h, table, t0 + 16 * PREFIX_AHEAD, tokens, s, tok_bytes, D * 2);
        vu16 kt[ATRIUM_MAX_DIM / 2];
        for (int c = 0; c < J / 16; c++) transpose_keys(rows, n, c, kt + 16 * c);
        vf16 acc[ATRIUM_DP_ROWS];
        for (int r = 0; r < R; r++) acc[r] = (vf16){0};
        for (int j = 0; j < J; j++)
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, q_rows[r] + 2 * j, 4);
                acc[r] = (vf16)_mm512_dpbf16_ps((__m512)acc[r], (__m512bh)_mm512_set1_epi32((int)pair),
                                                (__m512bh)kt[j]);
            }
        vf16 lane;
        for (int t = 0; t < 16; t++) lane[t] = (float)t;
        for (int r = 0; r < R; r++)
            vstore16(scores + (size_t)r * pad + t0,
                     select16(lane < splat16((float)n), vbf16_round(acc[r]) * s->scale,
                              splat16(-INFINITY)));
    }

    /* Weights exp(score - max), rounded to bfloat16 where they weight V; their sum unrounded. */
    for (int r = 0; r < live; r++) prefix_weights(scores + (size_t)r * pad, pad, out[r] + D, 1);

    /* V as pairs of tokens, once for all rows; then rows a few at a time against them. */
    const char *v_base = cache_h + v_bytes;
    for (int t0 = 0; t0 < tokens; t0 += 16) {
        const int n = tokens - t0 < 16 ? tokens - t0 : 16;
        const char *rows[16];
        paged_rows(v_base, table, t0, n, s->page_size, tok_bytes, page_bytes, rows);
        prefetch_block(v_base, table, t0 + 16 * PREFIX_AHEAD, tokens, s, tok_bytes, D * 2);
        for (int t = 0; t < n; t += 2)
            pair_rows(rows[t], t + 1 < n ? rows[t + 1] : (const char *)ATRIUM_ZERO_ROW, D,
                      vpairs + (size_t)(t0 + t) / 2 * D);
    }
    const int C = D / 16, RT = C <= 4 ? 6 : C <= 8 ? 3 : 1;
    for (int r0 = 0; r0 < live; r0 += RT) {
        const int nr = live - r0 < RT ? live - r0 : RT;
        vf16 o[6][ATRIUM_MAX_DIM / 16];
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < C; c++) o[r][c] = (vf16){0};
        for (int t = 0; t < tokens; t += 2) {
            const uint32_t *vp = vpairs + (size_t)t / 2 * D;
            for (int r = 0; r < nr; r++) {
                uint32_t even, odd;
                memcpy(&even, scores + (size_t)(r0 + r) * pad + t, 4);
                memcpy(&odd, scores + (size_t)(r0 + r) * pad + t + 1, 4);
                const __m512bh p =
                    (__m512bh)_mm512_set1_epi32((int)((even >> 16) | (odd & 0xffff0000u)));
                for (int c = 0; c < C; c++)
                    o[r][c] = (vf16)_mm512_dpbf16_ps((__m512)o[r][c],
                                                      (__m512bh)_mm512_loadu_si512(vp + 16 * c), p);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < C; c++) vstore16(out[r0 + r] + 16 * c, o[r][c]);
    }
}
#endif

/* One (decode, kv head) item: ``G`` query heads of ``D`` (a multiple of 16) values each. Both
 * are compile-time constants in the common instantiations below, so the loops over them unroll
 * and the accumulators stay in registers.
 *
 * With ``prior`` (float32, or bfloat16 with pair dot products) the item covers tokens
 * ``begin`` .. kv_len - 1 and carries in what its tokens before ``begin`` gave, as computed for its whole group at once:
 * per query head D floats of unnormalised output, then their running max and sum. */
static inline __attribute__((always_inline)) void attend_item(
    const void *q_seq, /* this decode's query row: [num_heads, D] */
    const void *cache, void *out_seq, const int32_t *table, int begin, int kv_len, int kvh,
    const float *prior, const shape_t *s, const int G, const int D, const int bf16,
    float *scores) {
    const int C = D / 16;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t tok_stride = (int64_t)s->num_kv_heads * D;
    const int64_t v_offset = (int64_t)s->page_size * tok_stride;
    const int64_t page_stride = 2 * v_offset;
    const char *cache_b = (const char *)cache + (size_t)kvh * D * elem;
    const int kv_pad = (kv_len - begin + 15) & ~15; /* each head's scores, whole vectors */
    const int dp = ATRIUM_DPBF16 && bf16 && D % 32 == 0; /* bfloat16 pair dot products */
    vf16 acc[ATRIUM_MAX_GROUP][MAX_CHUNKS];

    /* Scores of every query head of the group against every cached token. */
    if (dp) {
#if ATRIUM_DPBF16
        score_dpbf16(q_seq, cache_b, table, begin, kv_len, kv_pad, kvh, s, G, D, scores);
#endif
    } else if (!bf16) {
#if ATRIUM_DECODE_AVX2
        const float *q_rows[ATRIUM_MAX_GROUP];
        for (int g = 0; g < G; g++) q_rows[g] = (const float *)q_seq + (size_t)(kvh * G + g) * D;
        scores_avx2(q_rows, G, cache_b, table, begin, kv_len - begin, kv_pad, 1, s, D, scores);
#else
        score_f32((const float *)q_seq, cache_b, table, begin, kv_len, kv_pad, kvh, s, G, D,
                  scores);
#endif
    } else {
        /* bfloat16 without pair dot products: whole tokens, one score at a time. */
        vf16 qv[ATRIUM_MAX_GROUP][MAX_CHUNKS];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++)
                qv[g][c] = load16((const uint16_t *)q_seq + (size_t)(kvh * G + g) * D + 16 * c, 1);
        for (int t = 0, page = 0; t < kv_len; page++) {
            const char *k = cache_b + (size_t)table[page] * page_stride * elem;
            const int end = t + s->page_size < kv_len ? t + s->page_size : kv_len;
            /* Pages lie scattered: fetch the next page's K and this page's V (read by the
             * value pass) ahead of use. */
            const char *next = end < kv_len ? cache_b + (size_t)table[page + 1] * page_stride * elem
                                            : NULL;
            for (int i = 0; i < end - t; i++)
                for (size_t line = 0; line < D * elem; line += 64) {
                    if (next != NULL)
                        __builtin_prefetch(next + i * tok_stride * elem + line, 0, 3);
                    __builtin_prefetch(k + (v_offset + i * tok_stride) * elem + line, 0, 3);
                }
            for (; t < end; t++, k += tok_stride * elem) {
                vf16 kc[MAX_CHUNKS];
                for (int c = 0; c < C; c++) kc[c] = load16(k + 16 * c * elem, 1);
                for (int g = 0; g < G; g++) {
                    vf16 a = qv[g][0] * kc[0];
                    for (int c = 1; c < C; c++) a += qv[g][c] * kc[c];
                    scores[(int64_t)g * kv_pad + t] = bf16_round(hsum16(a)) * s->scale;
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int t = kv_len; t < kv_pad; t++) scores[(int64_t)g * kv_pad + t] = -INFINITY;
    }

    /* Softmax per query head, in float32, sixteen scores at a time (the -inf padding gives 0);
     * a prior's share is rescaled to the common max and added to the sum. */
    float carry[ATRIUM_MAX_GROUP];
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * kv_pad;
#if ATRIUM_DECODE_AVX2
        if (!bf16) {
            float top_s = row_max_avx2(sg, kv_pad), prior_sum = 0.0f, prior_max = -INFINITY;
            if (prior != NULL) {
                prior_max = prior[(size_t)g * (D + 2) + D];
                prior_sum = prior[(size_t)g * (D + 2) + D + 1];
                top_s = prior_max > top_s ? prior_max : top_s;
            }
            const float sum = row_weights_avx2(sg, kv_pad, top_s);
            const float carried = prior != NULL ? expf(prior_max - top_s) : 0.0f;
            const float inv = 1.0f / (sum + prior_sum * carried);
            carry[g] = carried * inv;
            const __m256 scale = _mm256_set1_ps(inv);
            for (int t = 0; t < kv_pad; t += 8)
                _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), scale));
            continue;
        }
#endif
        vf16 peak = splat16(-INFINITY);
        for (int t = 0; t < kv_pad; t += 16) peak = max16(peak, vload16(sg + t));
        float top_s = hmax16(peak), prior_sum = 0.0f, prior_max = -INFINITY;
        if (prior != NULL) {
            prior_max = prior[(size_t)g * (D + 2) + D];
            prior_sum = prior[(size_t)g * (D + 2) + D + 1];
            top_s = prior_max > top_s ? prior_max : top_s;
        }
        const vf16 top = splat16(top_s);
        vf16 total = (vf16){0};
        for (int t = 0; t < kv_pad; t += 16) {
            const vf16 e = vexp_nonpositive(vload16(sg + t) - top);
            vstore16(sg + t, e);
            total += e;
        }
        const float carried = prior != NULL ? expf(prior_max - top_s) : 0.0f;
        const float inv = 1.0f / (hsum16(total) + prior_sum * carried);
        carry[g] = carried * inv;
        for (int t = 0; t < kv_pad; t += 16) {
            const vf16 p = vload16(sg + t) * inv;
            vstore16(sg + t, bf16 ? vbf16_round(p) : p);
        }
    }

#if ATRIUM_DECODE_AVX2
    if (!bf16) {
        float *out_rows[ATRIUM_MAX_GROUP];
        for (int g = 0; g < G; g++) out_rows[g] = (float *)out_seq + (size_t)(kvh * G + g) * D;
        values_avx2(scores, kv_pad, G, cache_b + v_offset * elem, table, begin, kv_len - begin, s,
                    D, prior, carry, out_rows);
        return;
    }
#endif
    /* Probability-weighted sum of V, accumulated in float32 (from the prior's, rescaled). */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            acc[g][c] = prior != NULL ? vload16(prior + (size_t)g * (D + 2) + 16 * c) * carry[g]
                                      : (vf16){0};
    if (dp) {
#if ATRIUM_DPBF16
        /* Two tokens per pair dot product: their V rows interleaved, their probabilities
         * (bfloat16 values already) paired; the padding past kv_len has probability 0. */
        const char *v_base = cache_b + v_offset * elem;
        for (int t0 = 0; t0 < kv_len - begin; t0 += 16) {
            const int n = kv_len - begin - t0 < 16 ? kv_len - begin - t0 : 16;
            const char *rows[16];
            paged_rows(v_base, table, begin + t0, n, s->page_size, tok_stride * 2,
                       page_stride * 2, rows);
            for (int t = 0; t < n; t += 2) {
                uint32_t vp[ATRIUM_MAX_DIM];
                pair_rows(rows[t], t + 1 < n ? rows[t + 1] : (const char *)ATRIUM_ZERO_ROW, D, vp);
                for (int g = 0; g < G; g++) {
                    uint32_t even, odd;
                    memcpy(&even, scores + (int64_t)g * kv_pad + t0 + t, 4);
                    memcpy(&odd, scores + (int64_t)g * kv_pad + t0 + t + 1, 4);
                    const __m512bh p =
                        (__m512bh)_mm512_set1_epi32((int)((even >> 16) | (odd & 0xffff0000u)));
                    for (int c = 0; c < C; c++)
                        acc[g][c] = (vf16)_mm512_dpbf16_ps(
                            (__m512)acc[g][c], (__m512bh)_mm512_loadu_si512(vp + 16 * c), p);
                }
            }
        }
#endif
    } else {
        /* Tokens begin .. kv_len - 1 (the whole sequence without a prior). */
        const char *v_base = cache_b + v_offset * elem;
        for (int t0 = 0; t0 < kv_len - begin; t0 += 16) {
            const int n = kv_len - begin - t0 < 16 ? kv_len - begin - t0 : 16;
            const char *rows[16];
            paged_rows(v_base, table, begin + t0, n, s->page_size, tok_stride * elem,
                       page_stride * elem, rows);
            for (int t = 0; t < n; t++) {
                vf16 vc[MAX_CHUNKS];
                for (int c = 0; c < C; c++) vc[c] = load16(rows[t] + 16 * c * elem, bf16);
                for (int g = 0; g < G; g++) {
                    const float p = scores[(int64_t)g * kv_pad + t0 + t];
                    for (int c = 0; c < C; c++) acc[g][c] += p * vc[c];
                }
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

/* Each specialisation is a function of its own, called once per item: inlined together into
 * the parallel region they made one function so large that building it took a minute. */
#define ITEM_ARGS                                                                              \
    const void *q_seq, const void *cache, void *out_seq, const int32_t *table, int begin,      \
        int kv_len, int kvh, const float *prior, const shape_t *s, float *scores
#define DEFINE_ITEM(GG, D, BF)                                                                  \
    static __attribute__((noinline)) void attend_item_##GG##_##D##_##BF(ITEM_ARGS) {            \
        attend_item(q_seq, cache, out_seq, table, begin, kv_len, kvh, prior, s, GG, D, BF,      \
                    scores);                                                                    \
    }
#define DEFINE_ITEMS(D, BF)                                                                     \
    DEFINE_ITEM(1, D, BF)                                                                       \
    DEFINE_ITEM(2, D, BF)                                                                       \
    DEFINE_ITEM(3, D, BF)                                                                       \
    DEFINE_ITEM(4, D, BF)                                                                       \
    DEFINE_ITEM(8, D, BF)
DEFINE_ITEMS(64, 0)
DEFINE_ITEMS(64, 1)
DEFINE_ITEMS(128, 0)
DEFINE_ITEMS(128, 1)

static __attribute__((noinline)) void attend_item_any(ITEM_ARGS, int G, int D, int bf16) {
    if (bf16)
        attend_item(q_seq, cache, out_seq, table, begin, kv_len, kvh, prior, s, G, D, 1, scores);
    else
        attend_item(q_seq, cache, out_seq, table, begin, kv_len, kvh, prior, s, G, D, 0, scores);
}

/* Constant dtype, head size and group size for the common models, so each call is
 * specialised; anything else runs the same code with runtime sizes. */
static void attend_dispatch(ITEM_ARGS, int G, int D, int bf16) {
#define ITEM(GG, DD, BF) \
    attend_item_##GG##_##DD##_##BF(q_seq, cache, out_seq, table, begin, kv_len, kvh, prior, s, scores)
#define BY_GROUP(DD, BF)                 \
    switch (G) {                         \
        case 1: ITEM(1, DD, BF); return; \
        case 2: ITEM(2, DD, BF); return; \
        case 3: ITEM(3, DD, BF); return; \
        case 4: ITEM(4, DD, BF); return; \
        case 8: ITEM(8, DD, BF); return; \
        default: break;                  \
    }
    if (D == 64 && bf16) {
        BY_GROUP(64, 1)
    } else if (D == 64) {
        BY_GROUP(64, 0)
    } else if (D == 128 && bf16) {
        BY_GROUP(128, 1)
    } else if (D == 128) {
        BY_GROUP(128, 0)
    }
#undef BY_GROUP
#undef ITEM
    attend_item_any(q_seq, cache, out_seq, table, begin, kv_len, kvh, prior, s, scores, G, D, bf16);
}
#undef DEFINE_ITEMS
#undef DEFINE_ITEM
#undef ITEM_ARGS

/* The group prefix passes, likewise one function per specialisation: rows unrolled in fours
 * (R4, a multiple of 4), head size 64 constant. NAME(..., R4, D) picks one. */
#define PREFIX_ARGS(Q)                                                                          \
    Q q, int live, const char *cache_h, const int32_t *table, int tokens, const shape_t *s,     \
        float *scratch, float *const *out
#define PREFIX_ROWS(NAME, PASS, Q, RR)                                                          \
    static __attribute__((noinline)) void NAME##_##RR(PREFIX_ARGS(Q)) {                         \
        PASS(q, RR, live, cache_h, table, tokens, s, 64, scratch, out);                         \
    }
#define DEFINE_PREFIX_PASS(NAME, PASS, Q)                                                       \
    PREFIX_ROWS(NAME, PASS, Q, 4)                                                               \
    PREFIX_ROWS(NAME, PASS, Q, 8)                                                               \
    PREFIX_ROWS(NAME, PASS, Q, 12)                                                              \
    PREFIX_ROWS(NAME, PASS, Q, 16)                                                              \
    PREFIX_ROWS(NAME, PASS, Q, 20)                                                              \
    PREFIX_ROWS(NAME, PASS, Q, 24)                                                              \
    static __attribute__((noinline)) void NAME##_any(PREFIX_ARGS(Q), int R4, int D) {           \
        PASS(q, R4, live, cache_h, table, tokens, s, D, scratch, out);                          \
    }                                                                                           \
    static void NAME(PREFIX_ARGS(Q), int R4, int D) {                                           \
        if (D == 64) {                                                                          \
            switch (R4) {                                                                       \
                case 4: NAME##_4(q, live, cache_h, table, tokens, s, scratch, out); return;     \
                case 8: NAME##_8(q, live, cache_h, table, tokens, s, scratch, out); return;     \
                case 12: NAME##_12(q, live, cache_h, table, tokens, s, scratch, out); return;   \
                case 16: NAME##_16(q, live, cache_h, table, tokens, s, scratch, out); return;   \
                case 20: NAME##_20(q, live, cache_h, table, tokens, s, scratch, out); return;   \
                default: NAME##_24(q, live, cache_h, table, tokens, s, scratch, out); return;   \
            }                                                                                   \
        }                                                                                       \
        NAME##_any(q, live, cache_h, table, tokens, s, scratch, out, R4, D);                    \
    }

/* float32: the query rows side by side in ``q``, rows past ``live`` zero. */
DEFINE_PREFIX_PASS(prefix_f32, attend_prefix_f32, const float *)

#if ATRIUM_DPBF16
/* bfloat16: row pointers, padded with zero rows to a multiple of 4 here. */
DEFINE_PREFIX_PASS(prefix_dp_rows, attend_prefix_dp, const uint16_t *const *)

static void prefix_dp(const uint16_t *const *q_rows, int R, const char *cache_h,
                      const int32_t *table, int tokens, const shape_t *s, int D, float *scratch,
                      float *const *out) {
    const int R4 = (R + 3) & ~3;
    const uint16_t *rows[ATRIUM_DP_ROWS];
    for (int r = 0; r < R4; r++) rows[r] = r < R ? q_rows[r] : ATRIUM_ZERO_ROW;
    prefix_dp_rows(rows, R, cache_h, table, tokens, s, scratch, out, R4, D);
}
#endif
#undef DEFINE_PREFIX_PASS
#undef PREFIX_ROWS
#undef PREFIX_ARGS

#if ATRIUM_DPBF16 && ATRIUM_AMX
static __attribute__((noinline)) void prefix_amx_dispatch(const atrium_amx_keys_t *keys,
                                                          int tokens, int R, float scale,
                                                          atrium_amx_scratch_t *w, int D) {
    if (D == 64)
        atrium_amx_attend(keys, tokens, tokens - 1, R, scale, w, 64);
    else
        atrium_amx_attend(keys, tokens, tokens - 1, R, scale, w, D);
}
#endif

static int compare_int64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
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
    if (head_dim % 16 || head_dim > 16 * MAX_CHUNKS || G > ATRIUM_MAX_GROUP || G * num_kv_heads != num_heads)
        return -2;
    const size_t elem = dtype == ATRIUM_DTYPE_BFLOAT16 ? 2 : 4;
    const int bf16 = dtype == ATRIUM_DTYPE_BFLOAT16;
    /* Decodes in the order of their first page, so that those sharing a cached prefix run one
     * after another and find its K and V still in cache. */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(num_decodes > 0 ? num_decodes : 1));
    if (order == NULL) return -1;
    for (int d = 0; d < num_decodes; d++)
        order[d] = (kv_lens[d] > 0 ? (int64_t)pages[page_starts[d]] << 32 : 0) | (int64_t)d;
    qsort(order, (size_t)num_decodes, sizeof(int64_t), compare_int64);
#define SEQ(i) ((int)(order[i] & 0xffffffff))
    const int64_t items = (int64_t)num_decodes * num_kv_heads;
    int failed = 0;

    /* Groups: runs of decodes over the same leading pages (a cached prefix they share). Each
     * group's prefix is attended once for all its members (their query heads the rows of tile
     * products with AMX, amx.h, or of pair dot products over transposed keys without), and each
     * member then covers only its own tokens, carrying the prefix's share in (``prior``). */
    int32_t *shared = NULL;   /* [num_decodes] prefix tokens covered by the group, or 0 */
    float *partial = NULL;    /* [num_decodes][num_heads][D + 2] the prefix's share */
    int32_t *group_item = NULL; /* per prefix item: first member (index into order), members */
    int64_t group_items = 0;
    int max_shared = 0;
#if ATRIUM_DPBF16 && ATRIUM_AMX
    const int amx = bf16 && atrium_amx_permitted();
    const int per_item = (amx ? ATRIUM_AMX_ROWS : ATRIUM_DP_ROWS) / G; /* members an item holds */
#else
    const int per_item = ATRIUM_DP_ROWS / G;
#endif
    /* bfloat16 groups need pair dot products; float32 ones run on any CPU. */
    const int groupable = bf16 ? ATRIUM_DPBF16 && head_dim % 32 == 0 : 1;
    if (groupable && num_decodes > 1 && per_item > 1 && !ATRIUM_DECODE_ALONE) {
        shared = calloc((size_t)num_decodes, sizeof(int32_t));
        group_item = malloc(sizeof(int32_t) * 2 * (size_t)num_decodes);
        if (shared == NULL || group_item == NULL) failed = 1;
        for (int i = 0; i < num_decodes && !failed;) {
            const int32_t *t0 = pages + page_starts[SEQ(i)];
            int j = i + 1, min_len = kv_lens[SEQ(i)];
            while (j < num_decodes && kv_lens[SEQ(i)] > 0 && kv_lens[SEQ(j)] > 0 &&
                   pages[page_starts[SEQ(j)]] == t0[0]) {
                min_len = kv_lens[SEQ(j)] < min_len ? kv_lens[SEQ(j)] : min_len;
                j++;
            }
            /* Whole pages common to every member, each member keeping a token of its own. */
            int common = (min_len - 1) / page_size;
            for (int k = i + 1; k < j; k++) {
                const int32_t *tk = pages + page_starts[SEQ(k)];
                int p = 0;
                while (p < common && tk[p] == t0[p]) p++;
                common = p;
            }
            const int tokens = common * page_size;
            if (j - i >= 2 && tokens >= GROUP_MIN_TOKENS) {
                for (int k = i; k < j; k++) shared[SEQ(k)] = tokens;
                max_shared = tokens > max_shared ? tokens : max_shared;
                for (int k = i; k < j; k += per_item) {
                    group_item[2 * group_items] = k;
                    group_item[2 * group_items + 1] = j - k < per_item ? j - k : per_item;
                    group_items++;
                }
            }
            i = j;
        }
        if (group_items > 0 && !failed) {
            partial = malloc(sizeof(float) * (size_t)num_decodes * num_heads * (head_dim + 2));
            if (partial == NULL) failed = 1;
        }
    }
    const int64_t prefix_items = failed ? 0 : group_items * num_kv_heads;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        if (prefix_items > 0) {
            /* Each group's prefix, for up to per_item of its members, one KV head. */
            size_t floats = (size_t)ATRIUM_DP_ROWS * ((size_t)((max_shared + 15) & ~15) + head_dim);
#if ATRIUM_DPBF16
            if (bf16) floats = prefix_dp_floats(max_shared, head_dim);
#endif
#if ATRIUM_DPBF16 && ATRIUM_AMX
            if (amx) floats = atrium_amx_scratch_floats(head_dim);
            float *base = malloc(sizeof(float) * floats);
            atrium_amx_scratch_t w = {0};
            if (amx && base != NULL) {
                atrium_amx_scratch_bind(&w, base, head_dim);
                atrium_amx_configure();
            }
#else
            float *base = malloc(sizeof(float) * floats);
#endif
            if (base == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < prefix_items; item++) {
                if (base == NULL) continue;
                const int first = group_item[2 * (item / num_kv_heads)];
                const int members = group_item[2 * (item / num_kv_heads) + 1];
                const int kvh = (int)(item % num_kv_heads);
                const int tokens = shared[SEQ(first)];
                const int R = members * G;
#if ATRIUM_DPBF16 && ATRIUM_AMX
                if (amx) {
                    for (int r = 0; r < (R + 15) / 16 * 16; r++) {
                        const int seq = r < R ? SEQ(first + r / G) : 0;
                        w.lim[r] = tokens - 1;
                        atrium_amx_set_row(
                            &w, r,
                            r < R ? (const char *)q + ((size_t)seq * (size_t)q_row_stride +
                                                       (size_t)(kvh * G + r % G) * head_dim) * 2
                                  : NULL,
                            head_dim);
                    }
                    const atrium_amx_keys_t keys = {
                        (const char *)cache + (size_t)kvh * head_dim * 2,
                        pages + page_starts[SEQ(first)], page_size,
                        (int64_t)num_kv_heads * head_dim * 2};
                    prefix_amx_dispatch(&keys, tokens, R, scale, &w, head_dim);
                    for (int r = 0; r < R; r++) {
                        float *dst = partial + ((size_t)SEQ(first + r / G) * num_heads +
                                                (size_t)(kvh * G + r % G)) * (head_dim + 2);
                        memcpy(dst, w.ot + (size_t)r * head_dim, sizeof(float) * (size_t)head_dim);
                        dst[head_dim] = w.m[r];
                        dst[head_dim + 1] = w.l[r];
                    }
                    continue;
                }
#endif
                const void *rows[ATRIUM_DP_ROWS];
                float *dst[ATRIUM_DP_ROWS];
                for (int r = 0; r < R; r++) {
                    const size_t seq = (size_t)SEQ(first + r / G), head = (size_t)(kvh * G + r % G);
                    rows[r] = (const char *)q + (seq * (size_t)q_row_stride + head * head_dim) * elem;
                    dst[r] = partial + (seq * num_heads + head) * (head_dim + 2);
                }
                const char *cache_h = (const char *)cache + (size_t)kvh * head_dim * elem;
                const int32_t *table = pages + page_starts[SEQ(first)];
                if (!bf16) {
                    /* The rows side by side, zero past R up to a multiple of 4. */
                    float *qb = base + (size_t)ATRIUM_DP_ROWS * ((max_shared + 15) & ~15);
                    const int R4 = (R + 3) & ~3;
                    for (int r = 0; r < R4; r++) {
                        if (r < R)
                            memcpy(qb + (size_t)r * head_dim, rows[r], sizeof(float) * (size_t)head_dim);
                        else
                            memset(qb + (size_t)r * head_dim, 0, sizeof(float) * (size_t)head_dim);
                    }
                    prefix_f32(qb, R, cache_h, table, tokens, &s, base, dst, R4, head_dim);
                    continue;
                }
#if ATRIUM_DPBF16
                prefix_dp((const uint16_t *const *)rows, R, cache_h, table, tokens, &s, head_dim,
                          base, dst);
#endif
            }
#if ATRIUM_DPBF16 && ATRIUM_AMX
            if (amx && base != NULL) _tile_release();
#endif
            free(base);
        }
        float *scores = NULL;
        int64_t capacity = 0;
        /* A thread takes a decode's KV heads together: they share the cache's token rows. */
#pragma omp for schedule(dynamic, num_kv_heads)
        for (int64_t item = 0; item < items; item++) {
            if (failed) continue;
            const int seq = SEQ(item / num_kv_heads);
            const int kvh = (int)(item % num_kv_heads);
            const int kv_len = kv_lens[seq];
            const int begin = partial != NULL ? shared[seq] : 0;
            const float *prior =
                begin > 0 ? partial + ((size_t)seq * num_heads + (size_t)kvh * G) * (head_dim + 2)
                          : NULL;
            const int64_t need = (int64_t)G * ((kv_len - begin + 15) & ~15);
            if (need > capacity) {
                free(scores);
                capacity = need;
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
            attend_dispatch(q_seq, cache, out_seq, table, begin, kv_len, kvh, prior, &s, scores, G,
                            head_dim, bf16);
        }
        free(scores);
    }
#undef SEQ
    free(order);
    free(shared);
    free(partial);
    free(group_item);
    return failed ? -1 : 0;
}
