/* AMX tiles for the bfloat16 attention kernels in this folder: whether the build has them,
 * asking Linux for the right to use them, the one tile shape the kernels use (16 rows of 64
 * bytes: sixteen bfloat16 pairs or sixteen floats a row), and the attention of up to 48 query
 * rows of one KV head over a run of paged keys that both kernels call (atrium_amx_attend).
 *
 * A tile product C[16 x 16] += A[16 x 32] . B[32 x 16] takes A as 16 rows of 32 bfloat16 values
 * and B as 16 rows of 16 bfloat16 pairs (B's rows 2i and 2i + 1 interleaved): the pair dot
 * products of vdpbf16ps, 16 x 16 of them in one instruction, products exact and sums in float32.
 */
#ifndef ATRIUM_AMX_H
#define ATRIUM_AMX_H

#include "bf16.h"
#include "vec.h"

#if ATRIUM_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ATRIUM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the tiles' register state on request only (arch_prctl ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA); the right is the process's, asked for once. */
static int atrium_amx_permitted(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state > 0;
}

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} atrium_tile_config_t;

/* Every tile register 16 rows x 64 bytes; per thread, before its first tile instruction. */
static inline void atrium_amx_configure(void) {
    atrium_tile_config_t config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

/* e^x for x <= 0 (or -inf) on sixteen lanes: the range reduction and polynomial of
 * vexp_nonpositive, with the power of two applied by vscalefps; below -87 exactly 0. */
static inline vf16 atrium_exp(vf16 x) {
    const __m512 xv = (__m512)x;
    const __mmask16 live = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const vf16 xc = (vf16)_mm512_max_ps(xv, _mm512_set1_ps(-87.0f));
    const vf16 n = (vf16)_mm512_roundscale_ps((__m512)(xc * 1.44269504088896341f),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (vf16)_mm512_maskz_scalef_ps(live, (__m512)vexp_reduced(xc, n), (__m512)n);
}

/* Attention of up to ATRIUM_AMX_ROWS query rows of one KV head over keys 0 .. kv_end - 1 of a
 * sequence in the paged cache, as tile products over blocks of ATRIUM_AMX_KB keys:
 *   scores, per 16 keys and 16 rows: S^T[keys x rows] = K[keys x D] . Q^T, K read as a tile
 *     straight from its page (rows a token apart; copied out where 16 keys span two pages) and
 *     Q^T held as pairs of head dims per row;
 *   output, per 16 rows and 16 head dims: O[rows x D] += P[rows x keys] . V, P the block's
 *     probabilities transposed from pairs of keys per row, V as pairs of keys per head dim.
 * Row r sees keys up to lim[r]; each block's scores are softmaxed online (running max and sum
 * per row, elementwise over rows); exponentials are rounded to bfloat16 before they weight V,
 * their sum is not. O stays in memory ([rows][D] floats, unnormalised), rescaled there by each
 * row's factor before each block's product is added. */
#define ATRIUM_AMX_ROWS 48
#define ATRIUM_AMX_NV (ATRIUM_AMX_ROWS / 16)
#define ATRIUM_AMX_KB 32
#define ATRIUM_AMX_SLACK 8.0f

typedef struct {
    uint32_t *qt2; /* [D/2][ROWS] pairs of Q's head dims, by row */
    float *ot;     /* [ROWS][D] output, unnormalised */
    uint16_t *kb;  /* [16][D] K rows of a block that do not lie one page apart */
    float *s;      /* [KB][ROWS] scores, then probabilities */
    uint32_t *p2;  /* [KB/2][ROWS] pairs of keys' probabilities, by row */
    uint32_t *pt;  /* [NV][16][16] the same, transposed: each row's 32 keys */
    uint32_t *vp;  /* [KB/2][D] pairs of keys' V, by head dim */
    float *m, *l;  /* [ROWS] reference max and running sum */
    int *lim;             /* [ROWS] the last key each row sees */
} atrium_amx_scratch_t;

/* Where a sequence's keys for one KV head lie: ``head`` is that head's K in page 0, pages of
 * ``page_size`` tokens ``tok_bytes`` apart, K then V. */
typedef struct {
    const char *head;
    const int32_t *table;
    int page_size;
    int64_t tok_bytes;
} atrium_amx_keys_t;

static size_t atrium_amx_scratch_floats(int D) {
    const int R = ATRIUM_AMX_ROWS, KB = ATRIUM_AMX_KB;
    return (size_t)D / 2 * R + (size_t)R * D + (size_t)8 * D + (size_t)KB * R +
           (size_t)KB / 2 * R + (size_t)ATRIUM_AMX_NV * 256 + (size_t)KB / 2 * D + 3 * (size_t)R;
}

static void atrium_amx_scratch_bind(atrium_amx_scratch_t *w, float *base, int D) {
    const int R = ATRIUM_AMX_ROWS, KB = ATRIUM_AMX_KB;
    w->qt2 = (uint32_t *)base;
    w->ot = base + (size_t)D / 2 * R;
    w->kb = (uint16_t *)(w->ot + (size_t)R * D);
    w->s = (float *)(w->kb + (size_t)16 * D);
    w->p2 = (uint32_t *)(w->s + (size_t)KB * R);
    w->pt = w->p2 + (size_t)KB / 2 * R;
    w->vp = w->pt + (size_t)ATRIUM_AMX_NV * 256;
    w->m = (float *)(w->vp + (size_t)KB / 2 * D);
    w->l = w->m + R;
    w->lim = (int *)(w->l + R);
}

/* Row r's query (D bfloat16 values; NULL for a padding row of zeros), and a fresh state. The
 * caller sets lim[r]. */
static inline void atrium_amx_set_row(const atrium_amx_scratch_t *w, int r, const char *q,
                                      const int D) {
    for (int i = 0; i < D / 2; i++) {
        uint32_t pair = 0;
        if (q != NULL) memcpy(&pair, q + 4 * (size_t)i, 4);
        w->qt2[i * ATRIUM_AMX_ROWS + r] = pair;
    }
    w->m[r] = -INFINITY;
    w->l[r] = 0.0f;
    memset(w->ot + (size_t)r * D, 0, sizeof(float) * (size_t)D);
}

/* O += P . V for a block whose P (transposed, ``pt``) and V pairs (``vp``) are ready: per row
 * group, four tiles of 16 head dims at a time, so the products overlap. */
static inline __attribute__((always_inline)) void atrium_amx_pv(
    float *ot, const uint32_t *pt, const uint32_t *vp, int nv, const int D) {
    const int64_t ostride = D * 4;
    for (int v = 0; v < nv; v++) {
        _tile_loadd(4, pt + 256 * v, 64);
        for (int d = 0; d < D; d += 64) {
            float *o = ot + (size_t)16 * v * D + d;
            _tile_loadd(0, o, ostride);
            _tile_loadd(5, vp + d, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (d + 16 < D) {
                _tile_loadd(1, o + 16, ostride);
                _tile_loadd(6, vp + d + 16, D * 4);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (d + 32 < D) {
                _tile_loadd(2, o + 32, ostride);
                _tile_loadd(7, vp + d + 32, D * 4);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (d + 48 < D) {
                _tile_loadd(3, o + 48, ostride);
                _tile_loadd(5, vp + d + 48, D * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, o, ostride);
            if (d + 16 < D) _tile_stored(1, o + 16, ostride);
            if (d + 32 < D) _tile_stored(2, o + 32, ostride);
            if (d + 48 < D) _tile_stored(3, o + 48, ostride);
        }
    }
}

/* Rows 0 .. R - 1 (and the padding up to a multiple of 16) over keys 0 .. kv_end - 1; keys up
 * to ``unmasked`` are seen by every row. Per block: V pairs, scores (tiles), softmax (vectors),
 * output product (tiles). */
static inline __attribute__((always_inline)) void atrium_amx_attend(
    const atrium_amx_keys_t *keys, int kv_end, int unmasked, int R, float scale,
    const atrium_amx_scratch_t *w, const int D) {
    const int ROWS = ATRIUM_AMX_ROWS, KB = ATRIUM_AMX_KB;
    const int nv = (R + 15) / 16;
    const int64_t tok_bytes = keys->tok_bytes;
    const int64_t v_bytes = (int64_t)keys->page_size * tok_bytes; /* a page's K to its V */
    uint32_t *qt2 = w->qt2, *p2 = w->p2, *pt = w->pt, *vp = w->vp;
    float *ot = w->ot, *s = w->s, *m = w->m, *l = w->l;
    const int *lim = w->lim;
    /* Lane pairs (2r, 2r + 1) <- (r, 16 + r): two rows of sixteen bfloat16s, interleaved. */
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0);

    for (int k0 = 0; k0 < kv_end; k0 += KB) {
        const int nk = kv_end - k0 < KB ? kv_end - k0 : KB;
        const char *krow[ATRIUM_AMX_KB];
        paged_rows(keys->head, keys->table, k0, nk, keys->page_size, tok_bytes, 2 * v_bytes, krow);
        for (int j = nk; j < KB; j++) krow[j] = (const char *)ATRIUM_ZERO_ROW;
        /* Pages lie scattered and tile loads do not wake the hardware prefetcher: fetch the
         * next block's K and V rows ahead of use. */
        if (k0 + KB < kv_end) {
            const int n_next = kv_end - k0 - KB < KB ? kv_end - k0 - KB : KB;
            const char *next[ATRIUM_AMX_KB];
            paged_rows(keys->head, keys->table, k0 + KB, n_next, keys->page_size, tok_bytes,
                       2 * v_bytes, next);
            for (int j = 0; j < n_next; j++)
                for (int line = 0; line < 2 * D; line += 64) {
                    __builtin_prefetch(next[j] + line, 0, 3);
                    __builtin_prefetch(next[j] + v_bytes + line, 0, 3);
                }
        }

        /* V as pairs of keys (zero past the block). */
        for (int i = 0; i < KB / 2; i++)
            pair_rows(krow[2 * i] + (2 * i < nk ? v_bytes : 0),
                      krow[2 * i + 1] + (2 * i + 1 < nk ? v_bytes : 0), D, vp + (size_t)i * D);

        /* Scores, sixteen keys at a time: one K tile per 32 head dims against each row
         * group's Q^T, every row group accumulating in its own tile. */
        for (int h = 0; h < KB && h < nk; h += 16) {
            const char *kbase = krow[h];
            int64_t kstride = tok_bytes;
            if (nk - h < 16 || krow[h + 15] != krow[h] + 15 * tok_bytes) {
                for (int t = 0; t < 16; t++)
                    memcpy(w->kb + (size_t)t * D, krow[h + t], 2 * (size_t)D);
                kbase = (const char *)w->kb;
                kstride = 2 * D;
            }
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            for (int c = 0; c < D / 32; c++) {
                const uint32_t *qc = qt2 + (size_t)16 * c * ROWS;
                _tile_loadd(0, kbase + 64 * c, kstride);
                _tile_loadd(1, qc, ROWS * 4);
                _tile_dpbf16ps(4, 0, 1);
                if (nv > 1) {
                    _tile_loadd(2, qc + 16, ROWS * 4);
                    _tile_dpbf16ps(5, 0, 2);
                }
                if (nv > 2) {
                    _tile_loadd(3, qc + 32, ROWS * 4);
                    _tile_dpbf16ps(6, 0, 3);
                }
            }
            float *sh = s + (size_t)h * ROWS;
            _tile_stored(4, sh, ROWS * 4);
            if (nv > 1) _tile_stored(5, sh + 16, ROWS * 4);
            if (nv > 2) _tile_stored(6, sh + 32, ROWS * 4);
        }

        /* Keys past a row's last (and past the block) masked out; the block's max per row.
         * Scores stay unscaled until the exponent, e^(scale * s - ref). */
        const int masked = k0 + KB - 1 > unmasked;
        for (int v = 0; v < nv; v++) {
            vi16 last;
            memcpy(&last, lim + 16 * v, sizeof last);
            vf16 peak = splat16(-INFINITY);
            for (int j = 0; j < KB; j++) {
                float *row = s + (size_t)j * ROWS + 16 * v;
                vf16 x = vload16(row);
                if (masked) {
                    x = select16((vi16){0} + (k0 + j) > last, splat16(-INFINITY), x);
                    vstore16(row, x);
                }
                peak = max16(peak, x);
            }
            /* Online softmax against a reference max per row that moves only when a block's
             * max passes it by more than ATRIUM_AMX_SLACK (exponentials up to e^8, exact in
             * float32), so O, which lives in tile-written memory, is rescaled by vectors only
             * rarely. Probabilities are rounded to bfloat16 (relative to the reference: the
             * same rounding), paired by key, transposed to rows of keys. */
            const vf16 old = vload16(m + 16 * v);
            peak = peak * scale;
            const vi16 moves = peak > old + ATRIUM_AMX_SLACK;
            const vf16 ref = select16(moves, peak, old);
            int rescale = 0;
            for (int t = 0; t < 16; t++) rescale |= moves[t] && old[t] != -INFINITY;
            if (rescale) {
                const vf16 factor = atrium_exp(old - ref);
                for (int r = 0; r < 16; r++) {
                    float *o = ot + (size_t)(16 * v + r) * D;
                    for (int d = 0; d < D; d += 16) vstore16(o + d, vload16(o + d) * factor[r]);
                }
                vstore16(l + 16 * v, vload16(l + 16 * v) * factor);
            }
            vf16 total = vload16(l + 16 * v);
            for (int i = 0; i < KB / 2; i++) {
                const vf16 e0 = atrium_exp(vload16(s + 2 * i * ROWS + 16 * v) * scale - ref);
                const vf16 e1 = atrium_exp(vload16(s + (2 * i + 1) * ROWS + 16 * v) * scale - ref);
                total += e0;
                total += e1;
                /* Both rounded to bfloat16 in one instruction (nearest even; every nonzero
                 * e is a normal float, see atrium_exp), then interleaved by row. */
                const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);
                _mm512_storeu_si512(p2 + i * ROWS + 16 * v,
                                    _mm512_permutexvar_epi16(interleave, halves));
            }
            vstore16(m + 16 * v, ref);
            vstore16(l + 16 * v, total);
            atrium_transpose16(p2 + 16 * v, ROWS, pt + 256 * v);
        }
        atrium_amx_pv(ot, pt, vp, nv, D);
    }
}

/* Row r's output, divided by its sum and rounded to bfloat16, into ``dst`` (D values). */
static inline void atrium_amx_write_row(const atrium_amx_scratch_t *w, int r, uint16_t *dst,
                                        const int D) {
    const vf16 inv = splat16(1.0f / w->l[r]);
    for (int d = 0; d < D; d += 16) {
        const vf16 x = vload16(w->ot + (size_t)r * D + d) * inv;
        for (int t = 0; t < 16; t++) dst[d + t] = bf16_from_f32(x[t]);
    }
}
#else
#define ATRIUM_AMX 0
#endif

#endif
