/* bfloat16 linear layers on AMX: out [M, N] = x [M, K] @ w [N, K]^T (+ bias), on weights packed once into the tiles
 * TDPBF16PS reads; for a decode step's batch (cpu_linear.py sends up to AMX_ROWS rows: from 256, oneDNN's GEMM,
 * which blocks x for the caches, is the faster).
 *
 * At those rows a linear layer streams its weights once and does little else, and oneDNN's GEMM costs about 24 us a
 * call before it reads anything (a 2-core Xeon with AMX-BF16: 23.6 us for 8 x 128 @ 128 x 384, 24.4 us for 8 x 576 @
 * 576 x 576 with the weights in L2), about 3 ms of a 30-layer model's decode step in its 121 linears. Here a call
 * costs the ctypes call and one fork of the thread pool, and the weights stream from memory in the order they are
 * read.
 *
 * Packed layout (amx_pack_bf16): for each group of up to GN = 4 column blocks of 16 output features, for each chunk
 * of 32 input features, each block's B tile: 16 rows (pairs of input features 2r, 2r + 1) of 64 bytes (16 output
 * features x the pair), 1 KB contiguous. A thread takes whole groups; within one it keeps GN C tiles (16 rows x 16
 * float32) over the K chunks, loads each chunk of x once (the A tile: up to 16 rows x 32 input features) and
 * multiplies it into the group's blocks. Rows past 16 run as a second pass over the group (its weights then in L2).
 * The sums are float32 (TDPBF16PS: each pair's products added into the lane), the bias added and the result rounded
 * to bfloat16 once, as oneDNN does; the order of additions differs from oneDNN's, so the last place may.
 *
 * Linux lends a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); amx_ready() asks once.
 * Built only where the compiler targets AMX-TILE and AMX-BF16 (-march=native on such a CPU); elsewhere every entry
 * point says it cannot run, and the caller keeps oneDNN. */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define GN 4 /* column blocks per group: GN C tiles (0-3), an A tile and two B tiles fit the 8 tile registers */
#define TA 4 /* the tile numbers, as literals: the intrinsics paste them into the instruction */
#define TB 5
#define TB2 6

/* 1 where this process may use AMX's tiles (asked for once), else 0 */
int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* The tile configuration LDTILECFG reads (palette 1): per register its rows and bytes per row. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* Tiles 0..GN-1: C (rows x 16 float32); GN: A (rows x 32 bfloat16); GN+1, GN+2: B (16 pairs x 16 columns). */
static void configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < GN; t++) c.colsb[t] = 64, c.rows[t] = (uint8_t)rows;
    c.colsb[TA] = 64, c.rows[TA] = (uint8_t)rows;
    c.colsb[TB] = c.colsb[TB2] = 64, c.rows[TB] = c.rows[TB2] = 16;
    _tile_loadconfig(&c);
}

/* w [N, K] bfloat16 into packed (N * K elements) in the layout above; N a multiple of 16, K of 32. */
int amx_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
    if (N % 16 || K % 32) return 1;
    const int64_t blocks = N / 16, chunks = K / 32;
    uint16_t *p = packed;
    for (int64_t g0 = 0; g0 < blocks; g0 += GN) {
        const int64_t nb = blocks - g0 < GN ? blocks - g0 : GN;
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t b = g0; b < g0 + nb; b++)
                for (int64_t r = 0; r < 16; r++)
                    for (int64_t col = 0; col < 16; col++, p += 2) {
                        const uint16_t *src = w + (b * 16 + col) * K + c * 32 + 2 * r;
                        p[0] = src[0], p[1] = src[1];
                    }
    }
    return 0;
}

/* The group of column blocks from g0 (nb of them, 1 to GN) for rows m0 .. m0 + rows - 1; its packed tiles from wg.
 * The tile numbers are literals (the intrinsics paste them into the instruction), so the blocks are unrolled, each
 * past the first taken where the group has it: the same for every chunk, so the branches predict. */
static inline __attribute__((always_inline)) void group(const uint16_t *x, const uint16_t *wg, const uint16_t *bias,
                                                        uint16_t *out, int64_t K, int64_t N, int64_t g0, int64_t nb,
                                                        int64_t m0, int rows) {
    const int64_t chunks = K / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *t = wg;
    for (int64_t c = 0; c < chunks; c++, t += nb * 512) {
        _tile_loadd(TA, x + m0 * K + c * 32, K * 2);
        _tile_loadd(TB, t, 64);
        _tile_dpbf16ps(0, TA, TB);
        if (nb > 1) {
            _tile_loadd(TB2, t + 512, 64);
            _tile_dpbf16ps(1, TA, TB2);
        }
        if (nb > 2) {
            _tile_loadd(TB, t + 1024, 64);
            _tile_dpbf16ps(2, TA, TB);
        }
        if (nb > 3) {
            _tile_loadd(TB2, t + 1536, 64);
            _tile_dpbf16ps(3, TA, TB2);
        }
    }
    float acc[GN][16][16] __attribute__((aligned(64)));
    _tile_stored(0, acc[0], 64);
    if (nb > 1) _tile_stored(1, acc[1], 64);
    if (nb > 2) _tile_stored(2, acc[2], 64);
    if (nb > 3) _tile_stored(3, acc[3], 64);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t n0 = (g0 + b) * 16;
        const __m512 bv = bias ? bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + n0))) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(acc[b][r]), bv);
            _mm256_storeu_si256((__m256i *)(out + (m0 + r) * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* 0 done; 1 where it cannot run (no AMX for this process, M below 1, N not a multiple of 16, K of 32). */
int amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t M,
                    int64_t K, int64_t N, int64_t num_threads) {
    if (M < 1 || N % 16 || K % 32 || !amx_ready()) return 1;
    const int64_t blocks = N / 16, groups = (blocks + GN - 1) / GN;
    _Pragma("omp parallel num_threads(num_threads)") {
        int configured = 0;
        /* Dynamic: a thread that the OS descheduled (the API server and the clients share the cores) holds up
         * only the group it is in, not a fixed half of the layer. */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t g = 0; g < groups; g++) {
            const int64_t g0 = g * GN, nb = blocks - g0 < GN ? blocks - g0 : GN;
            const uint16_t *wg = packed + g0 * 16 * K; /* every earlier group is GN whole blocks */
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                if (configured != rows) configure(rows), configured = rows;
                group(x, wg, bias, out, K, N, g0, nb, m0, rows);
            }
        }
        if (configured) _tile_release();
    }
    return 0;
}

#else
int amx_ready(void) { return 0; }
int amx_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
    (void)w, (void)packed, (void)N, (void)K;
    return 1;
}
int amx_linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t M,
                    int64_t K, int64_t N, int64_t num_threads) {
    (void)x, (void)packed, (void)bias, (void)out, (void)M, (void)K, (void)N, (void)num_threads;
    return 1;
}
#endif
