/* What the attention kernels in this folder share: their limits, whether the CPU has bfloat16
 * pair dot products, a vector exp for softmax, sixteen-float vectors, loads that widen bfloat16
 * to float32, the rows of a run of tokens in the paged cache, the pairing of two bfloat16
 * rows for pair dot products, and a 16 x 16 transpose of 32-bit values (bfloat16 pairs). */
#ifndef ATRIUM_VEC_H
#define ATRIUM_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ATRIUM_DPBF16 1 /* bfloat16 pair dot products (vdpbf16ps) */
#else
#define ATRIUM_DPBF16 0
#endif

#define ATRIUM_MAX_DIM 256  /* head_dim limit of the attention kernels (a multiple of 16) */
#define ATRIUM_MAX_GROUP 16 /* query heads per KV head */
#define ATRIUM_DTYPE_BFLOAT16 1 /* the kernels' dtype argument: 0 float32, 1 bfloat16 */

/* Makes ``x`` live in a vector register from here on: operands reused across an unrolled
 * inner loop would otherwise be loaded again from memory for every use, and on CPUs that load
 * one 64-byte vector a cycle those loads, not the multiply-adds, set the pace. */
#if defined(__AVX512F__)
#define ATRIUM_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define ATRIUM_IN_REGISTER(x) ((void)0) /* sixteen floats span two registers or more */
#endif

/* A bfloat16 row of zeros, standing in for a token past the end of a pair. */
static const uint16_t ATRIUM_ZERO_ROW[ATRIUM_MAX_DIM] = {0};

/* Sixteen floats: the compiler maps these onto whatever vector registers the CPU has. */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
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

static inline vf16 vload16(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore16(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

static inline vf16 splat16(float x) { return (vf16){0} + x; }

/* Lanes of ``a`` where ``mask`` is set (all ones), else of ``b``. */
static inline vf16 select16(vi16 mask, vf16 a, vf16 b) {
    return (vf16)(((vi16)a & mask) | ((vi16)b & ~mask));
}

static inline vf16 max16(vf16 a, vf16 b) {
#if defined(__AVX512F__)
    return (vf16)_mm512_max_ps((__m512)a, (__m512)b); /* a > b ? a : b, as below */
#elif defined(__AVX2__)
    /* Two halves, each a > b ? a : b (vmaxps); the generic select below became a compare
     * and a branch per lane with AVX2. */
    __m256 lo_a, hi_a, lo_b, hi_b;
    memcpy(&lo_a, &a, 32);
    memcpy(&hi_a, (const char *)&a + 32, 32);
    memcpy(&lo_b, &b, 32);
    memcpy(&hi_b, (const char *)&b + 32, 32);
    const __m256 lo = _mm256_max_ps(lo_a, lo_b), hi = _mm256_max_ps(hi_a, hi_b);
    vf16 m;
    memcpy(&m, &lo, 32);
    memcpy((char *)&m + 32, &hi, 32);
    return m;
#else
    return select16(a > b, a, b);
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* Sixteen lanes held as two 8-lane registers, for AVX2 code in hot loops: there GCC keeps a
 * vf16 in memory and goes through the stack for each operation on it (a row's softmax ran ~6x
 * slower than the same steps on __m256 values). */

/* The largest of eight NaN-free lanes (-inf for none). */
static inline float hmax8(__m256 m) {
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    q = _mm_max_ss(q, _mm_movehdup_ps(q));
    const float top = _mm_cvtss_f32(q);
    return top > -INFINITY ? top : -INFINITY;
}

/* hsum16 of the vector whose lanes 0-7 are ``lo`` and 8-15 ``hi``: the same additions in the
 * same order, so the same sum. */
static inline float hsum8x2(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    float f[4];
    _mm_storeu_ps(f, b);
    return (f[0] + f[2]) + (f[1] + f[3]);
}
#endif

static inline float hmax16(vf16 v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    __m256 lo, hi;
    memcpy(&lo, &v, 32);
    memcpy(&hi, (const char *)&v + 32, 32);
    return hmax8(_mm256_max_ps(lo, hi)); /* NaN-free lanes: the largest, as below */
#else
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    vf8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    float m = -INFINITY;
    for (int i = 0; i < 8; i++) {
        m = a[i] > m ? a[i] : m;
        m = b[i] > m ? b[i] : m;
    }
    return m;
#endif
}

/* exp of softmax arguments (x <= 0) on sixteen lanes: Cody-Waite range reduction (x = n ln2 + r,
 * n rounded to nearest) and a degree-6 polynomial, within 2 ulp of expf; arguments below -87
 * (and -inf) give exactly 0. */
static inline vf16 vexp_reduced(vf16 x, vf16 n) {
    /* e^(x - n ln 2), for n the integer nearest x / ln 2: Cody-Waite, then the polynomial. */
    const vf16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf16 p = splat16(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* Keeps an eight-float vector in a register from here on (as ATRIUM_IN_REGISTER does with
 * AVX-512): left alone, the compiler reads a vector that several multiply-adds use from memory
 * again for each of them, and the loads, not the multiply-adds, set the pace. */
#define ATRIUM_PIN8(x) __asm__("" : "+x"(x))

/* Four columns by 24 rows of dot products, the rows in lanes (the AVX2 attention tiles'
 * scores: ``a`` the query transposed, 24 rows per head dim, ``a_stride`` floats apart; b[j] key
 * j's row): acc[j][v] lane l = the sum over i < n, ascending, of b[j][i] * a[i * a_stride + 8 v
 * + l], one fused multiply-add each, from zero. Twelve accumulators, three row vectors and a
 * broadcast: sixteen registers. */
static inline __attribute__((always_inline)) void dots4x24(const float *a, int64_t a_stride,
                                                           const float *const *b, int n,
                                                           __m256 acc[4][3]) {
    for (int j = 0; j < 4; j++)
        for (int v = 0; v < 3; v++) acc[j][v] = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
        __m256 a0 = _mm256_loadu_ps(a + i * a_stride), a1 = _mm256_loadu_ps(a + i * a_stride + 8),
               a2 = _mm256_loadu_ps(a + i * a_stride + 16);
        ATRIUM_PIN8(a0);
        ATRIUM_PIN8(a1);
        ATRIUM_PIN8(a2);
        for (int j = 0; j < 4; j++) {
            const __m256 bj = _mm256_broadcast_ss(b[j] + i);
            acc[j][0] = _mm256_fmadd_ps(bj, a0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(bj, a1, acc[j][1]);
            acc[j][2] = _mm256_fmadd_ps(bj, a2, acc[j][2]);
        }
    }
}

/* The tiles' other product, weights down the lanes: for i < n, ascending, acc[j][v] += row
 * i's value ``offset + j`` times lanes 8 v .. 8 v + 7 of p + i * p_stride (24 rows' weights of
 * token i), one fused multiply-add each: four head dims of the output by 24 rows. */
static inline __attribute__((always_inline)) void weighted4x24(const float *p, int64_t p_stride,
                                                               const float *const *rows,
                                                               int64_t offset, int n,
                                                               __m256 acc[4][3]) {
    for (int i = 0; i < n; i++) {
        __m256 p0 = _mm256_loadu_ps(p + i * p_stride), p1 = _mm256_loadu_ps(p + i * p_stride + 8),
               p2 = _mm256_loadu_ps(p + i * p_stride + 16);
        ATRIUM_PIN8(p0);
        ATRIUM_PIN8(p1);
        ATRIUM_PIN8(p2);
        for (int j = 0; j < 4; j++) {
            const __m256 vj = _mm256_broadcast_ss(rows[i] + offset + j);
            acc[j][0] = _mm256_fmadd_ps(vj, p0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(vj, p1, acc[j][1]);
            acc[j][2] = _mm256_fmadd_ps(vj, p2, acc[j][2]);
        }
    }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* vexp_nonpositive on eight lanes with AVX2 (the generic sixteen-lane compares and selects
 * became a compare and a branch per lane there): the same steps, so the same results. */
static inline __m256 vexp_nonpositive8(__m256 x) {
    const __m256 floor_ = _mm256_set1_ps(-87.0f);
    const __m256 keep = _mm256_cmp_ps(x, floor_, _CMP_NLT_UQ);
    x = _mm256_blendv_ps(floor_, x, keep);
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    /* vexp_reduced's steps, eight lanes wide. */
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep);
}
#endif

static inline vf16 vexp_nonpositive(vf16 x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    __m256 lo, hi;
    memcpy(&lo, &x, 32);
    memcpy(&hi, (const char *)&x + 32, 32);
    lo = vexp_nonpositive8(lo);
    hi = vexp_nonpositive8(hi);
    vf16 e;
    memcpy(&e, &lo, 32);
    memcpy((char *)&e + 32, &hi, 32);
    return e;
#else
#if defined(__AVX512F__)
    /* Lanes below -87 (and -inf) are clamped, then zeroed through a mask register. */
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    x = (vf16)_mm512_mask_mov_ps(_mm512_set1_ps(-87.0f), keep, (__m512)x);
#else
    const vi16 underflow = x < splat16(-87.0f);
    x = select16(underflow, splat16(-87.0f), x);
#endif
    const vf16 magic = splat16(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vf16 n = (x * 1.44269504088896341f + magic) - magic;
    const vf16 p = vexp_reduced(x, n);
#if defined(__AVX512F__)
    return (vf16)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)n); /* p * 2^n, exactly */
#else
    const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return select16(underflow, splat16(0.0f), p * (vf16)bits);
#endif
#endif
}

/* bf16_round on sixteen lanes (round to nearest even; NaN stays NaN). */
static inline vf16 vbf16_round(vf16 x) {
    const vu16 u = (vu16)x;
    const vu16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const vi16 nan = (vi16)((u & 0x7fffffffu) > 0x7f800000u);
    return select16(nan, x, (vf16)rounded);
}

/* The cache rows of tokens pos .. pos + n - 1 of a sequence (none when n <= 0): ``base`` is
 * where a page's first token row starts for the head wanted, rows lie ``tok_bytes`` apart in a
 * page and pages ``page_bytes`` apart; ``table`` lists the sequence's pages. One division,
 * then page by page. */
static inline void paged_rows(const char *base, const int32_t *table, int pos, int n,
                              int page_size, int64_t tok_bytes, int64_t page_bytes,
                              const char **rows) {
    if (n <= 0) return;
    int page = pos / page_size, off = pos % page_size;
    for (int t = 0; t < n; t++) {
        rows[t] = base + (size_t)table[page] * page_bytes + (size_t)off * tok_bytes;
        if (++off == page_size) {
            off = 0;
            page++;
        }
    }
}

typedef uint16_t vh32 __attribute__((vector_size(64)));

/* Two bfloat16 rows of D values (a multiple of 32) as D pairs: out[d] holds x[d] in its low
 * half and y[d] in its high half, the operand layout of pair dot products over two tokens. */
static inline void pair_rows(const void *x, const void *y, int D, uint32_t *out) {
    for (int c = 0; c < D / 32; c++) {
        vh32 a, b;
        memcpy(&a, (const char *)x + 64 * c, sizeof a);
        memcpy(&b, (const char *)y + 64 * c, sizeof b);
        const vh32 lo = __builtin_shufflevector(a, b, 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6,
                                                38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44,
                                                13, 45, 14, 46, 15, 47);
        const vh32 hi = __builtin_shufflevector(a, b, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27,
                                                59, 28, 60, 29, 61, 30, 62, 31, 63);
        memcpy(out + 32 * c, &lo, sizeof lo);
        memcpy(out + 32 * c + 16, &hi, sizeof hi);
    }
}

/* One stage of the transpose: rows i and i + B swap their off-diagonal B-wide blocks. */
#define ATRIUM_TLO(L, B) (((L) & (B)) ? 16 + (L) - (B) : (L))
#define ATRIUM_THI(L, B) (((L) & (B)) ? 16 + (L) : (L) + (B))
#define ATRIUM_TMASK(F, B)                                                                       \
    F(0, B), F(1, B), F(2, B), F(3, B), F(4, B), F(5, B), F(6, B), F(7, B), F(8, B), F(9, B),     \
        F(10, B), F(11, B), F(12, B), F(13, B), F(14, B), F(15, B)
#define ATRIUM_TSTAGE(r, B)                                                                      \
    for (int i = 0; i < 16; i++)                                                                 \
        if (!(i & (B))) {                                                                        \
            const vu16 x = r[i], y = r[i + (B)];                                                 \
            r[i] = __builtin_shufflevector(x, y, ATRIUM_TMASK(ATRIUM_TLO, B));                   \
            r[i + (B)] = __builtin_shufflevector(x, y, ATRIUM_TMASK(ATRIUM_THI, B));             \
        }

/* dst[j][i] = src[i][j] for a 16 x 16 block of 32-bit values; src rows ``stride`` apart. */
static inline void atrium_transpose16(const uint32_t *src, int64_t stride, uint32_t *dst) {
    vu16 r[16];
    for (int i = 0; i < 16; i++) memcpy(&r[i], src + i * stride, sizeof r[i]);
    ATRIUM_TSTAGE(r, 8)
    ATRIUM_TSTAGE(r, 4)
    ATRIUM_TSTAGE(r, 2)
    ATRIUM_TSTAGE(r, 1)
    for (int i = 0; i < 16; i++) memcpy(dst + 16 * i, &r[i], sizeof r[i]);
}

#endif
