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
 * K is summed in blocks of 512 inputs, each block from zero and then added to the total: the
 * order in which oneDNN's bfloat16 kernels sum on these CPUs, so that the results can equal
 * theirs bit for bit. packed_linear.py checks that on the machine, per weight, before it uses
 * this path. Built by engine/native/build.py.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define ROWS 12      /* rows of x a tile keeps in registers */
#define K_BLOCK 512  /* inputs summed from zero before they join the total */

#if ATRIUM_DPBF16
/* R rows (a compile-time constant below) by 16 * B columns (B 1 or 2) starting at ``col``. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, int64_t x_stride, const uint32_t *w, int64_t pairs, const uint16_t *res,
    int64_t res_stride, uint16_t *out, int64_t out_stride, int64_t col, const int R,
    const int B) {
    __m512 total[ROWS][2], acc[ROWS][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) total[r][b] = _mm512_setzero_ps(); /* set by the first block */
    for (int64_t j0 = 0; j0 < pairs; j0 += K_BLOCK / 2) {
        const int64_t j1 = j0 + K_BLOCK / 2 < pairs ? j0 + K_BLOCK / 2 : pairs;
        for (int r = 0; r < R; r++)
            for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
        for (int64_t j = j0; j < j1; j++) {
            __m512bh wb[2];
            for (int b = 0; b < B; b++)
                wb[b] = (__m512bh)_mm512_loadu_si512(w + ((size_t)b * pairs + j) * 16);
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
 * NULL; out [M, N] contiguous. Returns 0, or -2 where the shape is
 * not supported (N not a multiple of 16, K odd) or the build has no pair dot products. */
int atrium_small_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint32_t *w,
                           const uint16_t *res, int64_t res_stride, uint16_t *out, int64_t M,
                           int64_t N, int64_t K, int num_threads) {
#if ATRIUM_DPBF16
    if (N % 16 || K % 2 || M < 0) return -2;
    const int64_t pairs = K / 2, blocks = N / 16, tiles = (blocks + 1) / 2;
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
        tile(xr, x_stride, wt, pairs, rr, res_stride, orow, N, b * 16, R, 2);       \
    else                                                                               \
        tile(xr, x_stride, wt, pairs, rr, res_stride, orow, N, b * 16, R, 1);       \
    break;
            switch (M - r0 < ROWS ? M - r0 : ROWS) {
                case 1: TILE(1)
                case 2: TILE(2)
                case 3: TILE(3)
                case 4: TILE(4)
                case 5: TILE(5)
                case 6: TILE(6)
                case 7: TILE(7)
                case 8: TILE(8)
                case 9: TILE(9)
                case 10: TILE(10)
                case 11: TILE(11)
                default: TILE(12)
            }
#undef TILE
        }
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)res, (void)res_stride, (void)out;
    (void)M, (void)N, (void)K, (void)num_threads;
    return -2;
#endif
}
