/* Prefill-chunk attention on the CPU, reading K and V from the paged cache where they lie.
 *
 * A chunk is a run of a sequence's new tokens (this step's K and V are already in the cache);
 * query i of a chunk of ``qo_len`` tokens over ``kv_len`` cached ones sees keys 0 .. kv_len -
 * qo_len + i. One work item is a tile of consecutive query positions of one chunk and one KV
 * head: its rows (positions x the GQA group's query heads, up to ROWS of them) are the lanes of
 * three sixteen-float vectors, so each key is scored against every row with broadcast
 * multiply-adds, and the online softmax (running max and sum per row, as flash attention does)
 * is elementwise over rows with no horizontal reductions. Keys go by in blocks of KB: widened to
 * float32 once per block for all rows, the block's scores masked on the diagonal, softmaxed
 * into the running sums, and their V added in. Blocks wholly past a tile's last query are never
 * read.
 *
 * Layout, as in engine/attention/backend.py: a layer's cache is
 * [num_pages, 2, page_size, num_kv_heads, head_dim], K at index 0 and V at index 1.
 *
 * Rounding follows torch's CPU flash attention (what the torch backend's SDPA calls run): in
 * bfloat16 the scores stay float32, the exponentials are rounded to bfloat16 before they weight
 * V (their sum is not), and the output is accumulated in float32, divided by the sum and
 * rounded once. In float32 nothing is rounded in between.
 *
 * Built on first use by engine/native/build.py, like decode_attention.c.
 */
#define _GNU_SOURCE /* syscall(), for the AMX permission in amx.h */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "vec.h"

#define ROWS 48 /* query rows (positions x group heads) of one item: NV vectors of 16 */
#define NV (ROWS / 16)
#define KB 16       /* keys per block */

typedef struct {
    const char *q;
    int64_t q_row_stride; /* elements between consecutive tokens' query rows */
    const char *cache;
    char *out; /* [tokens, num_heads, head_dim] contiguous */
    int num_heads;
    int num_kv_heads;
    int page_size;
    int group;
    float scale;
} args_t;

/* Per-thread scratch, in floats: Q and the output transposed (head_dim x ROWS), the key block
 * and its V (KB x head_dim), the block's scores (KB x ROWS), running max, sum and rescale. */
typedef struct {
    float *qt, *ot, *kb, *vb, *s, *m, *l, *alpha;
    int *lim;
} scratch_t;

static size_t scratch_floats(int head_dim) {
    return (size_t)2 * head_dim * ROWS + (size_t)2 * KB * head_dim + (size_t)KB * ROWS +
           4 * ROWS;
}

static void scratch_bind(scratch_t *w, float *base, int head_dim) {
    w->qt = base;
    w->ot = w->qt + (size_t)head_dim * ROWS;
    w->kb = w->ot + (size_t)head_dim * ROWS;
    w->vb = w->kb + (size_t)KB * head_dim;
    w->s = w->vb + (size_t)KB * head_dim;
    w->m = w->s + (size_t)KB * ROWS;
    w->l = w->m + ROWS;
    w->alpha = w->l + ROWS;
    w->lim = (int *)(w->alpha + ROWS);
}

/* Keys past a row's position (its ``lim``), and past the block's ``nk`` keys, are masked out of
 * a block's scores s [KB][ROWS]; only a block that reaches past the tile's first query's last
 * key (``first_lim``) has any. */
static inline void mask_block(float *s, const int *lim, int k0, int nk, int first_lim) {
    if (k0 + KB - 1 <= first_lim) return;
    for (int j = 0; j < KB; j++)
        for (int r = 0; r < ROWS; r++)
            if (j >= nk || k0 + j > lim[r]) s[j * ROWS + r] = -INFINITY;
}

/* One tile: ``tq`` query positions from position ``pos0`` of a chunk whose first token is
 * row ``row0`` of q/out; one KV head. ``D``, ``BF`` and ``DP`` (bfloat16 pair dot products:
 * Q, K, P and V multiplied as bfloat16 pairs, products exact, sums in float32, nothing
 * widened) are constants where inlined. */
static inline __attribute__((always_inline)) void attend_tile(
    const args_t *a, const int32_t *table, int qo_len, int kv_len, int pos0, int tq, int row0,
    int kvh, const scratch_t *w, const int D, const int BF, const int DP) {
    const size_t elem = BF ? 2 : 4;
    const int G = a->group;
    const int R = tq * G;
    const int64_t tok_bytes = (int64_t)a->num_kv_heads * D * (int64_t)elem;
    const int64_t v_offset = (int64_t)a->page_size * a->num_kv_heads * D;
    const char *head = a->cache + (size_t)kvh * D * elem; /* this KV head's K in a page */
    const int first_lim = kv_len - qo_len + pos0; /* last key the tile's first query sees */
    const int kv_end = first_lim + tq;            /* keys any row of the tile sees */
    /* Float layouts: qt [D][ROWS], ot [D][ROWS], kb/vb [KB][D], s [KB][ROWS]. With DP, qt
     * holds [D/2][ROWS] bfloat16 pairs of Q, vb [KB/2][D] pairs of V (tokens 2i, 2i + 1) and
     * kb [KB/2][ROWS] pairs of probabilities. */
    float *qt = w->qt, *ot = w->ot, *kb = w->kb, *vb = w->vb, *s = w->s;
    float *m = w->m, *l = w->l, *alpha = w->alpha;
    int *lim = w->lim;

    /* Row r is position r / G, head r % G of the group; rows past R are zero padding that
     * sees every key (finite, never written out). */
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        const int p = r / G, g = r % G;
        lim[r] = r < R ? first_lim + p : kv_end - 1;
        const char *src = a->q + ((size_t)(row0 + p) * (size_t)a->q_row_stride +
                                  (size_t)(kvh * G + g) * D) * elem;
        if (DP) {
            uint32_t *qt2 = (uint32_t *)qt;
            for (int i = 0; i < D / 2; i++) {
                uint32_t pair = 0;
                if (r < R) memcpy(&pair, src + 4 * (size_t)i, 4);
                qt2[i * ROWS + r] = pair;
            }
        } else {
            for (int d = 0; d < D; d++)
                qt[d * ROWS + r] = r >= R ? 0.0f
                                   : BF   ? bf16_load((const uint16_t *)src + d)
                                          : ((const float *)src)[d];
        }
    }
    memset(ot, 0, sizeof(float) * (size_t)D * ROWS);

    for (int k0 = 0; k0 < kv_end; k0 += KB) {
        const int nk = kv_end - k0 < KB ? kv_end - k0 : KB;
        const int nk4 = (nk + 3) & ~3;
        const char *krow[KB];
        paged_rows(head, table, k0, nk, a->page_size, tok_bytes, 2 * v_offset * (int64_t)elem,
                   krow);

        /* Scores, four keys at a time against all rows: s[j][r] = scale * k_j . q_r. */
        if (DP) {
#if ATRIUM_DPBF16
            for (int j = nk; j < nk4; j++) krow[j] = (const char *)ATRIUM_ZERO_ROW;
            for (int j = 0; j < nk4; j += 4) {
                __m512 acc[4][NV];
                for (int jj = 0; jj < 4; jj++)
                    for (int v = 0; v < NV; v++) acc[jj][v] = _mm512_setzero_ps();
                for (int i = 0; i < D / 2; i++) {
                    __m512bh q[NV];
                    for (int v = 0; v < NV; v++) {
                        q[v] = (__m512bh)_mm512_loadu_si512(qt + i * ROWS + 16 * v);
                        ATRIUM_IN_REGISTER(q[v]);
                    }
                    for (int jj = 0; jj < 4; jj++) {
                        uint32_t pair;
                        memcpy(&pair, krow[j + jj] + 4 * (size_t)i, 4);
                        const __m512bh k = (__m512bh)_mm512_set1_epi32((int)pair);
                        for (int v = 0; v < NV; v++)
                            acc[jj][v] = _mm512_dpbf16_ps(acc[jj][v], q[v], k);
                    }
                }
                for (int jj = 0; jj < 4; jj++)
                    for (int v = 0; v < NV; v++)
                        vstore16(s + (j + jj) * ROWS + 16 * v, (vf16)acc[jj][v] * a->scale);
            }
#endif
        } else {
            /* K and V widened to float32 once for all rows; rows past nk are zero. */
            for (int j = 0; j < nk; j++)
                for (int c = 0; c < D / 16; c++) {
                    vstore16(kb + j * D + 16 * c, load16(krow[j] + 16 * c * elem, BF));
                    vstore16(vb + j * D + 16 * c,
                             load16(krow[j] + (v_offset + 16 * c) * elem, BF));
                }
            for (int j = nk; j < nk4; j++) memset(kb + j * D, 0, sizeof(float) * D);
            for (int j = 0; j < nk4; j += 4) {
                vf16 acc[4][NV];
                for (int jj = 0; jj < 4; jj++)
                    for (int v = 0; v < NV; v++) acc[jj][v] = (vf16){0};
                for (int d = 0; d < D; d++) {
                    vf16 q[NV];
                    for (int v = 0; v < NV; v++) {
                        q[v] = vload16(qt + d * ROWS + 16 * v);
                        ATRIUM_IN_REGISTER(q[v]);
                    }
                    for (int jj = 0; jj < 4; jj++) {
                        const float kd = kb[(j + jj) * D + d];
                        for (int v = 0; v < NV; v++) acc[jj][v] += kd * q[v];
                    }
                }
                for (int jj = 0; jj < 4; jj++)
                    for (int v = 0; v < NV; v++)
                        vstore16(s + (j + jj) * ROWS + 16 * v, acc[jj][v] * a->scale);
            }
        }
        mask_block(s, lim, k0, nk, first_lim);

        /* Online softmax, sixteen rows at a time. */
        for (int v = 0; v < NV; v++) {
            const vf16 old = vload16(m + 16 * v);
            vf16 peak = old;
            for (int j = 0; j < KB; j++) peak = max16(peak, vload16(s + j * ROWS + 16 * v));
            const vf16 rescale = vexp_nonpositive(old - peak);
            vf16 total = vload16(l + 16 * v) * rescale;
            for (int j = 0; j < KB; j++) {
                const vf16 e = vexp_nonpositive(vload16(s + j * ROWS + 16 * v) - peak);
                total += e;
                vstore16(s + j * ROWS + 16 * v, BF ? vbf16_round(e) : e);
            }
            vstore16(m + 16 * v, peak);
            vstore16(l + 16 * v, total);
            vstore16(alpha + 16 * v, rescale);
        }

        /* Output: rescale by the new max, then add the block's probability-weighted V,
         * four head dims at a time. */
        if (DP) {
#if ATRIUM_DPBF16
            const int np = (nk + 1) / 2; /* token pairs */
            uint32_t *p2 = (uint32_t *)kb, *vp = (uint32_t *)vb;
            for (int i = 0; i < np; i++) {
                /* Probabilities are bfloat16 values already: their top halves, paired. */
                for (int v = 0; v < NV; v++) {
                    const vu16 even = (vu16)vload16(s + 2 * i * ROWS + 16 * v);
                    const vu16 odd = (vu16)vload16(s + (2 * i + 1) * ROWS + 16 * v);
                    const vu16 pair = (even >> 16) | (odd & 0xffff0000u);
                    memcpy(p2 + i * ROWS + 16 * v, &pair, sizeof pair);
                }
                const char *v0 = krow[2 * i] + v_offset * elem;
                const char *v1 = 2 * i + 1 < nk ? krow[2 * i + 1] + v_offset * elem
                                                : (const char *)ATRIUM_ZERO_ROW;
                pair_rows(v0, v1, D, vp + i * D);
            }
            for (int d = 0; d < D; d += 4) {
                __m512 acc[4][NV];
                for (int dd = 0; dd < 4; dd++)
                    for (int v = 0; v < NV; v++)
                        acc[dd][v] = (__m512)(vload16(ot + (d + dd) * ROWS + 16 * v) *
                                              vload16(alpha + 16 * v));
                for (int i = 0; i < np; i++) {
                    __m512bh p[NV];
                    for (int v = 0; v < NV; v++) {
                        p[v] = (__m512bh)_mm512_loadu_si512(p2 + i * ROWS + 16 * v);
                        ATRIUM_IN_REGISTER(p[v]);
                    }
                    for (int dd = 0; dd < 4; dd++) {
                        const __m512bh x = (__m512bh)_mm512_set1_epi32((int)vp[i * D + d + dd]);
                        for (int v = 0; v < NV; v++) acc[dd][v] = _mm512_dpbf16_ps(acc[dd][v], p[v], x);
                    }
                }
                for (int dd = 0; dd < 4; dd++)
                    for (int v = 0; v < NV; v++)
                        vstore16(ot + (d + dd) * ROWS + 16 * v, (vf16)acc[dd][v]);
            }
#endif
        } else {
            for (int d = 0; d < D; d += 4) {
                vf16 acc[4][NV];
                for (int dd = 0; dd < 4; dd++)
                    for (int v = 0; v < NV; v++)
                        acc[dd][v] = vload16(ot + (d + dd) * ROWS + 16 * v) * vload16(alpha + 16 * v);
                for (int j = 0; j < nk; j++) {
                    vf16 p[NV];
                    for (int v = 0; v < NV; v++) {
                        p[v] = vload16(s + j * ROWS + 16 * v);
                        ATRIUM_IN_REGISTER(p[v]);
                    }
                    for (int dd = 0; dd < 4; dd++) {
                        const float vd = vb[j * D + d + dd];
                        for (int v = 0; v < NV; v++) acc[dd][v] += vd * p[v];
                    }
                }
                for (int dd = 0; dd < 4; dd++)
                    for (int v = 0; v < NV; v++) vstore16(ot + (d + dd) * ROWS + 16 * v, acc[dd][v]);
            }
        }
    }

    for (int r = 0; r < R; r++) {
        const int p = r / G, g = r % G;
        const float inv = 1.0f / l[r];
        const size_t base = ((size_t)(row0 + p) * a->num_heads + (size_t)(kvh * G + g)) * D;
        for (int d = 0; d < D; d++) {
            const float x = ot[d * ROWS + r] * inv;
            if (BF)
                ((uint16_t *)a->out)[base + d] = bf16_from_f32(x);
            else
                ((float *)a->out)[base + d] = x;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ATRIUM_CHUNK_AVX2 1
#define HALF 24 /* rows a pass of the AVX2 tile keeps in registers: three 8-float vectors */
/* float32 keys and values past the end of a block of four: zero rows. */
static const float ATRIUM_ZERO_F32[ATRIUM_MAX_DIM] = {0};

/* The float32 tile with AVX2 alone (sixteen 8-float registers): the sixteen-lane code above
 * would keep 4 x 3 vectors of sixteen floats, 24 registers, and spill them on every
 * multiply-add. Here the tile's rows go in passes of HALF (a pass over rows that are all
 * padding is skipped): scores for four keys by 24 rows are twelve accumulators, the pass's
 * three query vectors and a broadcast key value; the output four head dims by 24 rows, the
 * pass's three probability vectors and a broadcast value. K and V are read from their pages
 * as they lie (no widening to copy). Each score and output sums in the same order as the
 * sixteen-lane code (head dims ascending, then keys ascending), with the same masks and
 * online softmax. */
static inline __attribute__((always_inline)) void attend_tile_avx2(
    const args_t *a, const int32_t *table, int qo_len, int kv_len, int pos0, int tq, int row0,
    int kvh, const scratch_t *w, const int D) {
    const int G = a->group;
    const int R = tq * G;
    const int passes = (R + HALF - 1) / HALF;
    const int nv = passes * HALF / 8; /* eight-row vectors the softmax covers */
    const int64_t tok_bytes = (int64_t)a->num_kv_heads * D * 4;
    const int64_t v_offset = (int64_t)a->page_size * a->num_kv_heads * D; /* elements */
    const char *head = a->cache + (size_t)kvh * D * 4;
    const int first_lim = kv_len - qo_len + pos0;
    const int kv_end = first_lim + tq;
    float *qt = w->qt, *ot = w->ot, *s = w->s;
    float *m = w->m, *l = w->l, *alpha = w->alpha;
    int *lim = w->lim;
    const __m256 scale = _mm256_set1_ps(a->scale);

    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        const int p = r / G, g = r % G;
        lim[r] = r < R ? first_lim + p : kv_end - 1;
        const float *src = (const float *)a->q + (size_t)(row0 + p) * (size_t)a->q_row_stride +
                           (size_t)(kvh * G + g) * D;
        for (int d = 0; d < D; d++) qt[d * ROWS + r] = r < R ? src[d] : 0.0f;
    }
    memset(ot, 0, sizeof(float) * (size_t)D * ROWS);

    for (int k0 = 0; k0 < kv_end; k0 += KB) {
        const int nk = kv_end - k0 < KB ? kv_end - k0 : KB;
        const int nk4 = (nk + 3) & ~3;
        const char *krow[KB];
        paged_rows(head, table, k0, nk, a->page_size, tok_bytes, 2 * v_offset * 4, krow);
        for (int j = nk; j < nk4; j++) krow[j] = (const char *)ATRIUM_ZERO_F32;

        /* Scores: s[j][r] = scale * k_j . q_r, four keys by one pass of rows at a time. */
        for (int j = 0; j < nk4; j += 4) {
            const float *k[4];
            for (int jj = 0; jj < 4; jj++) k[jj] = (const float *)krow[j + jj];
            for (int h = 0; h < passes; h++) {
                __m256 acc[4][3];
                dots4x24(qt + HALF * h, ROWS, k, D, acc);
                for (int jj = 0; jj < 4; jj++)
                    for (int v = 0; v < 3; v++)
                        _mm256_storeu_ps(s + (j + jj) * ROWS + HALF * h + 8 * v,
                                         _mm256_mul_ps(acc[jj][v], scale));
            }
        }
        mask_block(s, lim, k0, nk, first_lim);

        /* Online softmax, eight rows at a time. */
        for (int v = 0; v < nv; v++) {
            const __m256 old = _mm256_loadu_ps(m + 8 * v);
            __m256 peak = old;
            for (int j = 0; j < KB; j++) peak = _mm256_max_ps(peak, _mm256_loadu_ps(s + j * ROWS + 8 * v));
            const __m256 rescale = vexp_nonpositive8(_mm256_sub_ps(old, peak));
            __m256 total = _mm256_mul_ps(_mm256_loadu_ps(l + 8 * v), rescale);
            for (int j = 0; j < KB; j++) {
                const __m256 e =
                    vexp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j * ROWS + 8 * v), peak));
                total = _mm256_add_ps(total, e);
                _mm256_storeu_ps(s + j * ROWS + 8 * v, e);
            }
            _mm256_storeu_ps(m + 8 * v, peak);
            _mm256_storeu_ps(l + 8 * v, total);
            _mm256_storeu_ps(alpha + 8 * v, rescale);
        }

        /* Output: rescale by the new max, then add the block's probability-weighted V, four
         * head dims by one pass of rows at a time. */
        const float *vrow[KB];
        for (int j = 0; j < nk; j++) vrow[j] = (const float *)krow[j] + v_offset;
        for (int d = 0; d < D; d += 4)
            for (int h = 0; h < passes; h++) {
                __m256 acc[4][3];
                const __m256 al[3] = {_mm256_loadu_ps(alpha + HALF * h),
                                      _mm256_loadu_ps(alpha + HALF * h + 8),
                                      _mm256_loadu_ps(alpha + HALF * h + 16)};
                for (int dd = 0; dd < 4; dd++)
                    for (int v = 0; v < 3; v++)
                        acc[dd][v] = _mm256_mul_ps(
                            _mm256_loadu_ps(ot + (d + dd) * ROWS + HALF * h + 8 * v), al[v]);
                weighted4x24(s + HALF * h, ROWS, vrow, d, nk, acc);
                for (int dd = 0; dd < 4; dd++)
                    for (int v = 0; v < 3; v++)
                        _mm256_storeu_ps(ot + (d + dd) * ROWS + HALF * h + 8 * v, acc[dd][v]);
            }
    }

    for (int r = 0; r < R; r++) {
        const int p = r / G, g = r % G;
        const float inv = 1.0f / l[r];
        float *dst = (float *)a->out + ((size_t)(row0 + p) * a->num_heads + (size_t)(kvh * G + g)) * D;
        for (int d = 0; d < D; d++) dst[d] = ot[d * ROWS + r] * inv;
    }
}
#else
#define ATRIUM_CHUNK_AVX2 0
#endif

#if ATRIUM_AMX
/* The bfloat16 tile on AMX (amx.h): the same tile, masks, online softmax and rounding as
 * above, the two products as tile products over blocks of 32 keys. */
static inline __attribute__((always_inline)) void attend_tile_amx(
    const args_t *a, const int32_t *table, int qo_len, int kv_len, int pos0, int tq, int row0,
    int kvh, const atrium_amx_scratch_t *w, const int D) {
    const int G = a->group;
    const int R = tq * G;
    const int first_lim = kv_len - qo_len + pos0;
    const int kv_end = first_lim + tq;
    /* Row r is position r / G, head r % G of the group; rows past R are zero padding that
     * sees every key. */
    for (int r = 0; r < (R + 15) / 16 * 16; r++) {
        const int p = r / G, g = r % G;
        w->lim[r] = r < R ? first_lim + p : kv_end - 1;
        atrium_amx_set_row(w, r, r < R ? a->q + ((size_t)(row0 + p) * (size_t)a->q_row_stride +
                                                  (size_t)(kvh * G + g) * D) * 2
                                       : NULL, D);
    }
    const atrium_amx_keys_t keys = {a->cache + (size_t)kvh * D * 2, table, a->page_size,
                                    (int64_t)a->num_kv_heads * D * 2};
    atrium_amx_attend(&keys, kv_end, first_lim, R, a->scale, w, D);
    for (int r = 0; r < R; r++) {
        const int p = r / G, g = r % G;
        atrium_amx_write_row(w, r, (uint16_t *)a->out + ((size_t)(row0 + p) * a->num_heads +
                                                         (size_t)(kvh * G + g)) * D, D);
    }
}
#endif

/* Returns 0; -1 when a work buffer could not be allocated, -2 for an unsupported shape
 * (head_dim not a multiple of 16 or above 256, more than 16 query heads per KV head), -3 for
 * a chunk whose lengths are inconsistent (qo_len < 1 or kv_len < qo_len). */
int atrium_chunk_attention(
    const void *q,        /* [tokens, num_heads, head_dim] rows ``q_row_stride`` apart */
    int64_t q_row_stride, /* elements between consecutive tokens' query rows */
    const void *cache,    /* one layer's cache, layout above */
    void *out,            /* [tokens, num_heads, head_dim], contiguous; chunk rows written */
    const int32_t *pages, /* page ids: the step's block tables, one after another */
    const int32_t *q_starts,    /* [num_chunks] each chunk's first row in q and out */
    const int32_t *q_lens,      /* [num_chunks] its number of query tokens (>= 1) */
    const int32_t *page_starts, /* [num_chunks] where its table starts in ``pages`` */
    const int32_t *kv_lens,     /* [num_chunks] tokens it attends over, its own included */
    int num_chunks, int num_heads, int num_kv_heads, int head_dim, int page_size, float scale,
    int dtype, int num_threads) {
    const int G = num_heads / num_kv_heads;
    if (head_dim % 16 || head_dim > ATRIUM_MAX_DIM || G > ATRIUM_MAX_GROUP || G * num_kv_heads != num_heads)
        return -2;
    const int tq = ROWS / G; /* query positions per tile */
    int64_t tiles = 0;
    for (int c = 0; c < num_chunks; c++) {
        if (q_lens[c] < 1 || kv_lens[c] < q_lens[c]) return -3;
        tiles += (q_lens[c] + tq - 1) / tq;
    }
    /* Each chunk's tiles last to first: a chunk's last tiles see the most keys, so the longer
     * items are handed out before the shorter ones and the threads finish closer together. */
    int32_t *tile_chunk = malloc(sizeof(int32_t) * (size_t)(tiles ? tiles : 1));
    int32_t *tile_index = malloc(sizeof(int32_t) * (size_t)(tiles ? tiles : 1));
    int failed = tile_chunk == NULL || tile_index == NULL;
    if (!failed) {
        int64_t n = 0;
        for (int c = 0; c < num_chunks; c++)
            for (int t = (q_lens[c] + tq - 1) / tq - 1; t >= 0; t--) {
                tile_chunk[n] = c;
                tile_index[n++] = t;
            }
    }
    const args_t a = {(const char *)q, q_row_stride, (const char *)cache, (char *)out,
                      num_heads, num_kv_heads, page_size, G, scale};
    const int bf16 = dtype == ATRIUM_DTYPE_BFLOAT16;
    const int64_t items = failed ? 0 : tiles * num_kv_heads;
#if ATRIUM_AMX
    const int amx = bf16 && head_dim % 32 == 0 && atrium_amx_permitted();
#else
    const int amx = 0;
#endif

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *base = NULL;
        size_t floats = scratch_floats(head_dim);
#if ATRIUM_AMX
        if (amx) floats = atrium_amx_scratch_floats(head_dim);
#endif
        if (items > 0) {
            base = malloc(sizeof(float) * floats);
            if (base == NULL) failed = 1;
        }
        scratch_t w = {0};
        if (base != NULL && !amx) scratch_bind(&w, base, head_dim);
#if ATRIUM_AMX
        atrium_amx_scratch_t aw = {0};
        if (base != NULL && amx) {
            atrium_amx_scratch_bind(&aw, base, head_dim);
            atrium_amx_configure();
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (base == NULL) continue;
            const int c = tile_chunk[item / num_kv_heads];
            const int kvh = (int)(item % num_kv_heads);
            const int pos0 = tile_index[item / num_kv_heads] * tq;
            const int n = q_lens[c] - pos0 < tq ? q_lens[c] - pos0 : tq;
            const int32_t *table = pages + page_starts[c];
#if ATRIUM_AMX
            if (amx) {
                if (head_dim == 64)
                    attend_tile_amx(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &aw, 64);
                else if (head_dim == 128)
                    attend_tile_amx(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &aw, 128);
                else
                    attend_tile_amx(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &aw, head_dim);
                continue;
            }
#endif
#define TILE(D, BF, DP) \
    attend_tile(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &w, D, BF, DP)
#if ATRIUM_CHUNK_AVX2
            if (!bf16) {
                if (head_dim == 64)
                    attend_tile_avx2(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &w, 64);
                else if (head_dim == 128)
                    attend_tile_avx2(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &w, 128);
                else
                    attend_tile_avx2(&a, table, q_lens[c], kv_lens[c], pos0, n, q_starts[c] + pos0, kvh, &w, head_dim);
                continue;
            }
#endif
            if (head_dim == 64 && bf16)
                TILE(64, 1, ATRIUM_DPBF16);
            else if (head_dim == 64)
                TILE(64, 0, 0);
            else if (head_dim == 128 && bf16)
                TILE(128, 1, ATRIUM_DPBF16);
            else if (head_dim == 128)
                TILE(128, 0, 0);
            else if (bf16)
                TILE(head_dim, 1, ATRIUM_DPBF16 && head_dim % 32 == 0);
            else
                TILE(head_dim, 0, 0);
#undef TILE
        }
#if ATRIUM_AMX
        if (base != NULL && amx) _tile_release();
#endif
        free(base);
    }
    free(tile_chunk);
    free(tile_index);
    return failed ? -1 : 0;
}
