/* AMX tiles for the bfloat16 attention kernels in this folder: whether the build has them,
 * asking Linux for the right to use them, the one tile shape the kernels use (16 rows of 64
 * bytes: sixteen bfloat16 pairs or sixteen floats a row) and a 16 x 16 transpose of 32-bit
 * values (bfloat16 pairs) that turns pairs of keys laid out by row into rows laid out by key.
 *
 * A tile product C[16 x 16] += A[16 x 32] . B[32 x 16] takes A as 16 rows of 32 bfloat16 values
 * and B as 16 rows of 16 bfloat16 pairs (B's rows 2i and 2i + 1 interleaved): the pair dot
 * products of vdpbf16ps, 16 x 16 of them in one instruction, products exact and sums in float32.
 */
#ifndef ATRIUM_AMX_H
#define ATRIUM_AMX_H

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
#else
#define ATRIUM_AMX 0
#endif

#endif
