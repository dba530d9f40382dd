/* bfloat16 projections of a few rows (decode steps) through pair dot products, for CPUs with
 * AVX512-BF16 but no AMX: out[M x N] = x[M x K] . W^T (+ residual), rounded once to bfloat16.
 *
 * W is laid out once at load time as pairs: [N / 16][K / 2][16] 32-bit values, value (b, j, c)
 * holding W[16 b + c][2 j] in its low half and W[16 b + c][2 j + 1] in its high half, so one
 * 64-byte load gives sixteen output columns one pair of inputs each, and each row's pair of
 * inputs is broadcast against it (vdpbf16ps: products exact, sums in float32). Thirty-two
 * columns by up to twelve rows stay in registers while K is walked; the threads split the
 * columns, so each weight is read once per call whatever M is.
 *
 * K is summed in blocks of ``k_block`` inputs, each block from zero and then added to the
 * total: the order in which oneDNN's bfloat16 kernels sum, so that the results can equal theirs
 * bit for bit. oneDNN picks its block by shape and batch size (on one CPU seen here: 512 inputs
 * for one row of a 1536-input weight, 1024 for two rows and more); packed_linear.py finds the
 * block for each batch size on the machine, and checks every weight, before it uses this path.
 *
 * float32 weights that are, block by block, an affine image of small integers (as those of a
 * GGUF file in Q4_1 or Q8_0 are once decoded) are also kept as int8 codes, [N / 16][K][16],
 * with a scale and an offset per 32 inputs, [N / 16][K / 32][16] each: W[n][k] = code * scale
 * + offset exactly (the product of a half-precision scale and a code is exact in float32, so
 * one rounding remains, the one that made the weight). ``atrium_small_gemm_codes_f32`` decodes
 * sixteen columns at a time and multiplies in float32: the products of float32 weights, reading
 * under a third of their bytes (1.25 a weight). Built by engine/native/build.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROWS 12      /* rows of x a tile (either product's) keeps in registers */
#define PREFETCH_TILES 1 /* how far ahead (in tiles) the pair product fetches its weights */
/* F(R) for R = n (1 .. 12; more is 12), so that each tile runs with R a compile-time constant;
 * each F(R) ends with a break. */
#define BY_ROWS(n, F)  \
    switch (n) {       \
        case 1: F(1)   \
        case 2: F(2)   \
        case 3: F(3)   \
        case 4: F(4)   \
        case 5: F(5)   \
        case 6: F(6)   \
        case 7: F(7)   \
        case 8: F(8)   \
        case 9: F(9)   \
        case 10: F(10) \
        case 11: F(11) \
        default: F(12) \
    }

#if ATRIUM_DPBF16
/* R rows (a compile-time constant below) by 16 * B columns (B 1 or 2) starting at ``col``. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t pairs, int64_t block_pairs,
    const uint16_t *res, int64_t res_stride, uint16_t *out, int64_t out_stride, int64_t col,
    const int R, const int B) {
    __m512 total[ROWS][2], acc[ROWS][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) total[r][b] = _mm512_setzero_ps(); /* set by the first block */
    for (int64_t j0 = 0; j0 < pairs; j0 += block_pairs) {
        const int64_t j1 = j0 + block_pairs < pairs ? j0 + block_pairs : pairs;
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
        for (int64_t j = j0; j < j1; j++) {
            __m512bh wb[2];
            for (int b = 0; b < B; b++) {
                wb[b] = (__m512bh)_mm512_loadu_si512(w + ((size_t)b * pairs + j) * 16);
                /* The same line a tile on (a thread's tiles lie one after another): without
                 * it a decode step's weights arrive at two thirds of the memory's speed and
                 * the products wait on them. Past the weight's end it fetches nothing useful
                 * and faults never (an address, not a read). */
                __builtin_prefetch(
                    (const void *)((uintptr_t)w +
                                   ((size_t)(PREFETCH_TILES * B + b) * pairs + j) * 64),
                    0, 3);
            }
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, x + r * x_stride + 2 * j, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int b = 0; b < B; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, wb[b]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++)
                total[r][b] = j0 == 0 ? acc[r][b] : _mm512_add_ps(total[r][b], acc[r][b]);
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) {
            __m512 v = total[r][b];
            if (res != NULL)
                v = _mm512_add_ps(v, (__m512)load16(res + r * res_stride + col + 16 * b, 1));
            _mm256_storeu_si256((__m256i *)(out + r * out_stride + col + 16 * b),
                                (__m256i)_mm512_cvtneps_pbh(v));
        }
}
#endif

/* x [M, K] rows ``x_stride`` apart; w as above; residual [M, N] rows ``res_stride`` apart or
 * NULL; out [M, N] contiguous; K summed in blocks of ``k_block`` inputs (even). Returns 0, or
 * -2 where the shape is not supported (N not a multiple of 16, K or k_block odd) or the build
 * has no pair dot products. */
int atrium_small_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint32_t *w,
                           const uint16_t *res, int64_t res_stride, uint16_t *out, int64_t M,
                           int64_t N, int64_t K, int64_t k_block, int num_threads) {
#if ATRIUM_DPBF16
    if (N % 16 || K % 2 || M < 0 || k_block < 2 || k_block % 2) return -2;
    const int64_t pairs = K / 2, blocks = N / 16, tiles = (blocks + 1) / 2;
    const int64_t block_pairs = k_block / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t b = 2 * t;
        const int two = b + 1 < blocks;
        const uint32_t *wt = w + (size_t)b * pairs * 16;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const uint16_t *xr = x + r0 * x_stride;
            const uint16_t *rr = res != NULL ? res + r0 * res_stride : NULL;
            uint16_t *orow = out + r0 * N;
#define TILE(R)                                                                        \
    if (two)                                                                           \
        tile(xr, x_stride, wt, pairs, block_pairs, rr, res_stride, orow, N, b * 16, R, 2); \
    else                                                                               \
        tile(xr, x_stride, wt, pairs, block_pairs, rr, res_stride, orow, N, b * 16, R, 1); \
    break;
            BY_ROWS(M - r0 < ROWS ? M - r0 : ROWS, TILE)
#undef TILE
        }
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)res, (void)res_stride, (void)out;
    (void)M, (void)N, (void)K, (void)k_block, (void)num_threads;
    return -2;
#endif
}

#define CODE_BLOCK 32 /* inputs that share a scale and an offset */

/* Sixteen int8 codes as floats (compilers scalarise the generic conversion). */
static inline vf16 widen_codes(const int8_t *p) {
    vf16 f;
#if defined(__AVX512F__)
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&f, &v, sizeof f);
#elif defined(__AVX2__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    memcpy(&f, &lo, sizeof lo);
    memcpy((char *)&f + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; i++) f[i] = (float)p[i];
#endif
    return f;
}

/* x[0] in all sixteen lanes, loaded as a broadcast (not a scalar load then a shuffle). */
static inline vf16 broadcast(const float *x) {
    vf16 f;
#if defined(__AVX512F__)
    const __m512 v = _mm512_set1_ps(*x);
    memcpy(&f, &v, sizeof f);
#else
    f = splat16(*x);
#endif
    return f;
}

/* R rows by 16 * B columns (B 1 or 2) of the codes product, columns from block ``cb``. */
static inline __attribute__((always_inline)) void codes_tile(
    const float *x, int64_t x_stride, const int8_t *codes, const float *scale,
    const float *offset, int64_t K, const float *res, int64_t res_stride, float *out,
    int64_t out_stride, int64_t cb, const int R, const int B) {
    vf16 acc[ROWS][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = splat16(0.0f);
    const int64_t kblocks = K / CODE_BLOCK;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        vf16 d[2], m[2];
        const int8_t *c[2];
        for (int b = 0; b < B; b++) {
            d[b] = vload16(scale + ((cb + b) * kblocks + kb) * 16);
            m[b] = vload16(offset + ((cb + b) * kblocks + kb) * 16);
            c[b] = codes + ((cb + b) * K + kb * CODE_BLOCK) * 16;
        }
        const float *xk = x + kb * CODE_BLOCK;
        for (int k = 0; k < CODE_BLOCK; k++) {
            vf16 w[2];
            for (int b = 0; b < B; b++) {
                w[b] = widen_codes(c[b] + k * 16) * d[b] + m[b]; /* exact: the weight */
            }
            for (int r = 0; r < R; r++) {
                const vf16 xv = broadcast(xk + r * x_stride + k);
                for (int b = 0; b < B; b++) acc[r][b] += xv * w[b];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) {
            vf16 v = acc[r][b];
            if (res != NULL) v += vload16(res + r * res_stride + (cb + b) * 16);
            vstore16(out + r * out_stride + (cb + b) * 16, v);
        }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ATRIUM_CODES_AVX2 1
/* With AVX2 alone (sixteen 8-lane registers) the sixteen-lane tile above would hold 12 x 4
 * accumulators in registers that are not there, and spill them on every multiply-add. Here
 * the threads split the 16-column blocks, and rows go in groups of up to six (2 R
 * accumulators, the block's two halves and a broadcast input: fifteen registers). Up to
 * DIRECT_ROWS_AVX2 rows each group decodes the block for itself in registers; past that each
 * run of 32 inputs of a block is decoded once into L1 (2 KB) and multiplied into every group,
 * whose sums wait in memory between runs (30 layers' projections at 32 rows ~84 -> ~76 ms on
 * an AMD EPYC of family 25; at 1-8 rows the direct path is the faster). Each lane sums its
 * products in the same order as the tile above (k ascending, one fused multiply-add each),
 * so all give the same bits. */
#define ROWS_AVX2 6
#define DIRECT_ROWS_AVX2 8 /* rows up to which groups decode for themselves */
#define PANEL_MIN_ROWS_AVX2 64 /* rows past which the panel path (below) runs */

/* The direct path: R <= 6 rows by one block, decoding the block in registers. */
static inline __attribute__((always_inline)) void codes_tile_avx2(
    const float *x, int64_t x_stride, const int8_t *codes, const float *scale,
    const float *offset, int64_t K, const float *res, int64_t res_stride, float *out,
    int64_t out_stride, int64_t cb, const int R) {
    __m256 acc[ROWS_AVX2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t kblocks = K / CODE_BLOCK;
    const int8_t *c = codes + cb * K * 16;
    const float *d = scale + cb * kblocks * 16, *m = offset + cb * kblocks * 16;
    for (int64_t kb = 0; kb < kblocks; kb++, d += 16, m += 16) {
        const float *xk = x + kb * CODE_BLOCK;
        for (int k = 0; k < CODE_BLOCK; k++, c += 16) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)c);
            const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                                              _mm256_loadu_ps(d), _mm256_loadu_ps(m));
            const __m256 w1 = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))),
                _mm256_loadu_ps(d + 8), _mm256_loadu_ps(m + 8)); /* exact: the weight */
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(xk + r * x_stride + k);
                acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
            __m256 v = acc[r][h];
            if (res != NULL)
                v = _mm256_add_ps(v, _mm256_loadu_ps(res + r * res_stride + cb * 16 + 8 * h));
            _mm256_storeu_ps(out + r * out_stride + cb * 16 + 8 * h, v);
        }
}

/* a[r] += the products of row r of x (rows x_stride apart) and decoded weights w [n][16] over
 * inputs 0 .. n - 1, ascending, one fused multiply-add each: R rows by one block of 16 columns,
 * the sums in registers. */
static inline __attribute__((always_inline)) void rows_by_block_avx2(const float *x,
                                                                     int64_t x_stride,
                                                                     const float *w, int64_t n,
                                                                     __m256 a[ROWS_AVX2][2],
                                                                     const int R) {
    for (int64_t k = 0; k < n; k++) {
        __m256 w0 = _mm256_loadu_ps(w + 16 * k), w1 = _mm256_loadu_ps(w + 16 * k + 8);
        ATRIUM_PIN8(w0);
        ATRIUM_PIN8(w1);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
    }
}

/* R rows (x, rows x_stride apart, at the run's first input) by the 16 columns of one block
 * over one run of 32 inputs, decoded into w [32][16]; the sums carry over in acc [R][16]. */
static inline __attribute__((always_inline)) void codes_run_avx2(const float *x, int64_t x_stride,
                                                                 const float *w, float *acc,
                                                                 const int R) {
    __m256 a[ROWS_AVX2][2];
    for (int r = 0; r < R; r++) {
        a[r][0] = _mm256_loadu_ps(acc + 16 * r);
        a[r][1] = _mm256_loadu_ps(acc + 16 * r + 8);
    }
    rows_by_block_avx2(x, x_stride, w, CODE_BLOCK, a, R);
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc + 16 * r, a[r][0]);
        _mm256_storeu_ps(acc + 16 * r + 8, a[r][1]);
    }
}

/* One run of 32 inputs of a block, codes c [32][16] with their scales d and offsets m [16],
 * decoded into w [32][16] (exact: the weights). */
static inline void decode_run_avx2(const int8_t *c, const float *d, const float *m, float *w) {
    const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    const __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8);
    for (int k = 0; k < CODE_BLOCK; k++, c += 16, w += 16) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)c);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
        _mm256_store_ps(w, _mm256_fmadd_ps(lo, d0, m0));
        _mm256_store_ps(w + 8, _mm256_fmadd_ps(hi, d1, m1));
    }
}

/* All M rows by the 16 columns of block cb: each run of 32 inputs is decoded once into L1
 * (exact: the weights), then multiplied into every group of up to six rows, whose
 * accumulators wait in ``acc`` [M][16] between runs. */
static void codes_block_avx2(const float *x, int64_t x_stride, const int8_t *codes,
                             const float *scale, const float *offset, int64_t K, const float *res,
                             int64_t res_stride, float *out, int64_t M, int64_t N, int64_t cb,
                             float *acc) {
    const int64_t kblocks = K / CODE_BLOCK, groups = (M + ROWS_AVX2 - 1) / ROWS_AVX2;
    const int8_t *c = codes + cb * K * 16;
    const float *d = scale + cb * kblocks * 16, *m = offset + cb * kblocks * 16;
    float w[CODE_BLOCK * 16] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * 16 * (size_t)M);
    for (int64_t kb = 0; kb < kblocks; kb++, d += 16, m += 16, c += CODE_BLOCK * 16) {
        decode_run_avx2(c, d, m, w);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * M / groups, rows = (g + 1) * M / groups - r0;
            const float *xr = x + r0 * x_stride + kb * CODE_BLOCK;
            float *ar = acc + 16 * r0;
            switch (rows) {
                case 1: codes_run_avx2(xr, x_stride, w, ar, 1); break;
                case 2: codes_run_avx2(xr, x_stride, w, ar, 2); break;
                case 3: codes_run_avx2(xr, x_stride, w, ar, 3); break;
                case 4: codes_run_avx2(xr, x_stride, w, ar, 4); break;
                case 5: codes_run_avx2(xr, x_stride, w, ar, 5); break;
                default: codes_run_avx2(xr, x_stride, w, ar, 6); break;
            }
        }
    }
    for (int64_t r = 0; r < M; r++)
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_loadu_ps(acc + 16 * r + 8 * h);
            if (res != NULL)
                v = _mm256_add_ps(v, _mm256_loadu_ps(res + r * res_stride + cb * 16 + 8 * h));
            _mm256_storeu_ps(out + r * N + cb * 16 + 8 * h, v);
        }
}

/* Many rows (a prefill step): oneDNN's float32 GEMM ran at ~60-80% of this CPU's multiply-add
 * rate here, and the path above keeps every row's sums in memory between runs of 32 inputs and
 * reads all of x again for each block of columns. Here each thread decodes a panel of its
 * blocks, every input (PANEL_FLOATS at most: it stays in L2), once; then every group of up to
 * six rows runs each block of the panel over all K inputs with its twelve sums in registers,
 * the group's rows in L1 and the block's weights streaming from L2. The same order of sums
 * (k ascending, one fused multiply-add each, the residual added last), so the same bits as
 * the paths above. */
#define PANEL_FLOATS (48 * 1024) /* 192 KiB of decoded weights a thread */

static inline __attribute__((always_inline)) void panel_tile_avx2(
    const float *x, int64_t x_stride, const float *w, int64_t K, const float *res,
    int64_t res_stride, float *out, int64_t out_stride, const int R) {
    __m256 acc[ROWS_AVX2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    rows_by_block_avx2(x, x_stride, w, K, acc, R);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) {
            __m256 v = acc[r][h];
            if (res != NULL) v = _mm256_add_ps(v, _mm256_loadu_ps(res + r * res_stride + 8 * h));
            _mm256_storeu_ps(out + r * out_stride + 8 * h, v);
        }
}

/* Blocks cb0 .. cb0 + nb - 1 for all M rows, their weights decoded into w [nb][K][16]. */
static void codes_panel_avx2(const float *x, int64_t x_stride, const int8_t *codes,
                             const float *scale, const float *offset, int64_t K, const float *res,
                             int64_t res_stride, float *out, int64_t M, int64_t N, int64_t cb0,
                             int64_t nb, float *w) {
    const int64_t kblocks = K / CODE_BLOCK;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *c = codes + (cb0 + b) * K * 16;
        const float *d = scale + (cb0 + b) * kblocks * 16, *m = offset + (cb0 + b) * kblocks * 16;
        float *wb = w + b * K * 16;
        for (int64_t kb = 0; kb < kblocks; kb++, d += 16, m += 16, c += CODE_BLOCK * 16)
            decode_run_avx2(c, d, m, wb + kb * CODE_BLOCK * 16);
    }
    for (int64_t r0 = 0; r0 < M; r0 += ROWS_AVX2) {
        const int rows = M - r0 < ROWS_AVX2 ? (int)(M - r0) : ROWS_AVX2;
        const float *xr = x + r0 * x_stride;
        for (int64_t b = 0; b < nb; b++) {
            const float *rr = res != NULL ? res + r0 * res_stride + (cb0 + b) * 16 : NULL;
            float *orow = out + r0 * N + (cb0 + b) * 16;
            const float *wb = w + b * K * 16;
#define PTILE(R)                                                          \
    case R:                                                               \
        panel_tile_avx2(xr, x_stride, wb, K, rr, res_stride, orow, N, R); \
        break;
            switch (rows) {
                PTILE(1) PTILE(2) PTILE(3) PTILE(4) PTILE(5) PTILE(6)
                default: break;
            }
#undef PTILE
        }
    }
}

/* The panel path over all blocks: each thread a contiguous share of them, a panel at a time. */
static int codes_panels_avx2(const float *x, int64_t x_stride, const int8_t *codes,
                             const float *scale, const float *offset, const float *res,
                             int64_t res_stride, float *out, int64_t M, int64_t N, int64_t K,
                             int num_threads) {
    const int64_t blocks = N / 16;
    int64_t per_panel = PANEL_FLOATS / (K * 16);
    if (per_panel < 1) per_panel = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = t * blocks / threads, last = (t + 1) * blocks / threads;
        float *w = aligned_alloc(32, sizeof(float) * (size_t)(per_panel * K * 16));
        if (w == NULL) failed = 1;
        for (int64_t cb = first; cb < last && w != NULL; cb += per_panel)
            codes_panel_avx2(x, x_stride, codes, scale, offset, K, res, res_stride, out, M, N, cb,
                             last - cb < per_panel ? last - cb : per_panel, w);
        free(w);
    }
    return failed ? -1 : 0;
}
#else
#define ATRIUM_CODES_AVX2 0
#endif

/* out [M, N] = x [M, K] . W^T (+ residual) for W kept as codes (above). x rows ``x_stride``
 * apart, residual [M, N] rows ``res_stride`` apart or NULL, out contiguous. Returns 0, or -2
 * where N is not a multiple of 16 or K not a multiple of 32, -1 where the AVX2 path could not
 * allocate its sums. */
int atrium_small_gemm_codes_f32(const float *x, int64_t x_stride, const int8_t *codes,
                                const float *scale, const float *offset, const float *res,
                                int64_t res_stride, float *out, int64_t M, int64_t N, int64_t K,
                                int num_threads) {
    if (N % 16 || K % CODE_BLOCK || M < 0) return -2;
#if ATRIUM_CODES_AVX2
    if (M <= DIRECT_ROWS_AVX2) {
        /* Rows in groups of at most six, as even as they go (8 rows: 4 + 4, not 6 + 2). */
        const int64_t groups = (M + ROWS_AVX2 - 1) / ROWS_AVX2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t cb = 0; cb < N / 16; cb++) {
            for (int64_t g = 0; g < groups; g++) {
                const int64_t r0 = g * M / groups, rows = (g + 1) * M / groups - r0;
                const float *xr = x + r0 * x_stride;
                const float *rr = res != NULL ? res + r0 * res_stride : NULL;
                float *orow = out + r0 * N;
#define CTILE2(R)                                                                         \
    case R:                                                                               \
        codes_tile_avx2(xr, x_stride, codes, scale, offset, K, rr, res_stride, orow, N, cb, \
                        R);                                                               \
        break;
                switch (rows) {
                    CTILE2(1) CTILE2(2) CTILE2(3) CTILE2(4) CTILE2(5) CTILE2(6)
                    default: break;
                }
#undef CTILE2
            }
        }
        return 0;
    }
    if (M > PANEL_MIN_ROWS_AVX2)
        return codes_panels_avx2(x, x_stride, codes, scale, offset, res, res_stride, out, M, N, K,
                                 num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *acc = malloc(sizeof(float) * 16 * (size_t)M);
        if (acc == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < N / 16; cb++)
            if (acc != NULL)
                codes_block_avx2(x, x_stride, codes, scale, offset, K, res, res_stride, out, M, N,
                                 cb, acc);
        free(acc);
    }
    return failed ? -1 : 0;
#else
    const int64_t blocks = N / 16, tiles = (blocks + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t cb = 2 * t;
        const int two = cb + 1 < blocks;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const float *xr = x + r0 * x_stride;
            const float *rr = res != NULL ? res + r0 * res_stride : NULL;
            float *orow = out + r0 * N;
#define CTILE(R)                                                                        \
    if (two)                                                                            \
        codes_tile(xr, x_stride, codes, scale, offset, K, rr, res_stride, orow, N, cb, R, 2); \
    else                                                                                \
        codes_tile(xr, x_stride, codes, scale, offset, K, rr, res_stride, orow, N, cb, R, 1); \
    break;
            BY_ROWS(M - r0 < ROWS ? M - r0 : ROWS, CTILE)
#undef CTILE
        }
    }
    return 0;
#endif
}
