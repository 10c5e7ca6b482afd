/* Linear layers of a few rows in bfloat16: out [M, N] = x [M, K] @ w [N, K]^T (+ bias), for M up to 8 (a decode
 * step's batch, where the weights' bytes set the time; cpu_linear.py chooses the rows it runs here).
 *
 * Each thread takes whole groups of R adjacent weight rows and keeps R x M float32 accumulators in registers over K,
 * so every weight is read once, in address order within each row, and used for all M rows of x; each output is
 * rounded to bfloat16 once, as torch's linear rounds it, but the additions run in another order than oneDNN's, so
 * results may differ from torch's in the last place. Two bodies:
 *   - with AVX512-BF16: R = 16 / P (P: M rounded up to 1, 2, 4 or 8), K 32 elements at a time (vdpbf16ps: a pair of
 *     products a lane), the 16 accumulators' lanes summed together (reduce16). oneDNN's GEMM on its prepacked
 *     bfloat16 weights is the faster from 3 rows on.
 *   - elsewhere: each weight vector widened to float32 in registers (a shift) and multiplied into the rows of x,
 *     widened once; the bfloat16 weights are read at half float32's bytes, where oneDNN has no native bfloat16 to
 *     run and cpu_linear.py multiplies a float32 copy of each weight.
 *
 * Built with the other CPU kernels into one library by engine/attention/cpu_kernel.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__)
#define WL 16 /* floats in a vector */
#else
#define WL 8
#endif
typedef float vw __attribute__((vector_size(4 * WL)));
typedef uint32_t vu __attribute__((vector_size(4 * WL)));
typedef uint16_t vh __attribute__((vector_size(2 * WL)));

static inline vw widen(const uint16_t *p) { /* WL bfloat16 as float32: each one's bits in the high half */
    vw f;
#if WL == 16
    const __m512 w = widen_bf16x16(p);
#elif defined(__AVX2__)
    const __m256 w = widen_bf16x8(p);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    const vu w = __builtin_convertvector(h, vu) << 16;
#endif
    memcpy(&f, &w, sizeof f);
    return f;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* Rows n0 .. n0 + 16/P - 1 of out (those below N) for the M rows of x. Always inlined with M and P constants. */
static inline __attribute__((always_inline)) void gemv_group(const uint16_t *x, const uint16_t *w,
                                                             const uint16_t *bias, uint16_t *out, int64_t K,
                                                             int64_t N, int64_t n0, const int M, const int P) {
    const int R = 16 / P;
    const uint16_t *wr[16];
    for (int r = 0; r < R; r++) wr[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh xv[8];
        for (int m = 0; m < M; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr[r] + k);
            for (int m = 0; m < M; m++) acc[r * P + m] = _mm512_dpbf16_ps(acc[r * P + m], wv, xv[m]);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, reduce16(acc)); /* sums[r * P + m]: out[m][n0 + r] */
    for (int r = 0; r < R && n0 + r < N; r++) {
        const float b = bias ? bf16_to_f32(bias[n0 + r]) : 0.0f;
        for (int m = 0; m < M; m++) out[m * N + n0 + r] = f32_to_bf16(sums[r * P + m] + b);
    }
}
#else
/* Rows n0 .. n0 + R - 1 of out (those below N) for the M rows of xf (x widened). Always inlined with M and R
 * constants: R x M accumulators, at most 8 (a sixteen-register AVX2 file keeps them with a weight and a row of x). */
static inline __attribute__((always_inline)) void gemv_group(const float *xf, const uint16_t *w, const uint16_t *bias,
                                                             uint16_t *out, int64_t K, int64_t N, int64_t n0,
                                                             const int M, const int R) {
    const uint16_t *wr[8];
    for (int r = 0; r < R; r++) wr[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;
    vw acc[8];
    for (int i = 0; i < R * M; i++) acc[i] = (vw){0};
    /* Each row prefetched at the same place of the row as many groups ahead as make 4 KB or more (a thread's groups
     * lie one after another): from DRAM the hardware prefetchers alone read the weights slower, and a fixed distance
     * within the group's rows lands on the next row of the group, already read, where K is short
     * (bench/results/cpu-2core/isa/README.md). */
    const int64_t ahead = (2048 + R * K - 1) / (R * K) * R * K;
    for (int64_t k = 0; k < K; k += 32) {
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(wr[r] + k + ahead, 0, 3);
            for (int u = 0; u < 32; u += WL) {
                const vw wv = widen(wr[r] + k + u);
                for (int m = 0; m < M; m++) acc[r * M + m] += wv * *(const vw *)(xf + m * K + k + u);
            }
        }
    }
    for (int r = 0; r < R && n0 + r < N; r++) {
        const float b = bias ? bf16_to_f32(bias[n0 + r]) : 0.0f;
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            for (int l = 0; l < WL; l++) s += acc[r * M + m][l];
            out[m * N + n0 + r] = f32_to_bf16(s + b);
        }
    }
}
#endif

/* 0 done; 1 where the shape is not one it takes (K a multiple of 32, M from 1 to 8) or scratch could not be had. */
int linear_few_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t M,
                         int64_t K, int64_t N, int64_t num_threads) {
    if (K % 32 != 0 || M < 1 || M > 8) return 1;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int P = M == 1 ? 1 : M == 2 ? 2 : M <= 4 ? 4 : 8;
    const int64_t R = 16 / P, groups = (N + R - 1) / R;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t g = 0; g < groups; g++) {
        switch (M) {
        case 1: gemv_group(x, w, bias, out, K, N, g * R, 1, 1); break;
        case 2: gemv_group(x, w, bias, out, K, N, g * R, 2, 2); break;
        case 3: gemv_group(x, w, bias, out, K, N, g * R, 3, 4); break;
        case 4: gemv_group(x, w, bias, out, K, N, g * R, 4, 4); break;
        case 5: gemv_group(x, w, bias, out, K, N, g * R, 5, 8); break;
        case 6: gemv_group(x, w, bias, out, K, N, g * R, 6, 8); break;
        case 7: gemv_group(x, w, bias, out, K, N, g * R, 7, 8); break;
        case 8: gemv_group(x, w, bias, out, K, N, g * R, 8, 8); break;
        }
    }
    return 0;
#else
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)(M * K));
    if (!xf) return 1;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    const int64_t R = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1, groups = (N + R - 1) / R;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t g = 0; g < groups; g++) {
        switch (M) {
        case 1: gemv_group(xf, w, bias, out, K, N, g * R, 1, 8); break;
        case 2: gemv_group(xf, w, bias, out, K, N, g * R, 2, 4); break;
        case 3: gemv_group(xf, w, bias, out, K, N, g * R, 3, 2); break;
        case 4: gemv_group(xf, w, bias, out, K, N, g * R, 4, 2); break;
        case 5: gemv_group(xf, w, bias, out, K, N, g * R, 5, 1); break;
        case 6: gemv_group(xf, w, bias, out, K, N, g * R, 6, 1); break;
        case 7: gemv_group(xf, w, bias, out, K, N, g * R, 7, 1); break;
        case 8: gemv_group(xf, w, bias, out, K, N, g * R, 8, 1); break;
        }
    }
    free(xf);
    return 0;
#endif
}

/* Linear layers of up to 32 rows in float32: out [M, N] = x [M, K] @ w [N, K]^T (+ bias), the weights float32 or
 * bfloat16 widened in registers, x float32 (a bfloat16 model's rows widened once by the caller), out float32. A decode
 * step's batch at 8-32 rows, where the weights' bytes and then the FMAs set the time and oneDNN's float32 GEMM reads
 * its prepacked weights at half the copy rate on AVX2 (bench/results/cpu-2core/isa/README.md).
 *
 * Each thread takes a contiguous range of weight rows in blocks of about 96 KB; within a block, MG rows of x at a time
 * (held in registers) against RG weight rows at a time: MG x RG accumulators over K (AVX2: 3 x 4, at 32 rows 0.88-0.95x
 * oneDNN's time where 4 x 2 took 0.99-1.04x and 2 x 6 0.94-1.08x), each weight vector loaded (and
 * widened) once for the MG rows. The block's weights come from DRAM on its first pass of rows and from L2 on the
 * others. Sums in vector lanes, added together at the end: another order than oneDNN's, so results may differ from
 * torch's in the last places. */
#if WL == 16
#define MG 4 /* 4 x 4 accumulators, 4 rows of x and a weight vector in 32 registers */
#define RG 4
#else
#define MG 3 /* 3 x 4 accumulators (12 FMA chains), 3 rows of x and a weight vector in 16 registers */
#define RG 4
#endif

static inline __attribute__((always_inline)) vw load_w(const void *w, int64_t i, const int wide) {
    if (wide) return widen((const uint16_t *)w + i);
    vw v;
    memcpy(&v, (const float *)w + i, sizeof v);
    return v;
}

/* out[m0 .. m0 + M - 1][n0 .. n0 + R - 1]; always inlined with M, R and wide constants. */
static inline __attribute__((always_inline)) void rows_tile(const float *x, const void *w, const float *bias,
                                                            float *out, int64_t K, int64_t N, int64_t m0, int64_t n0,
                                                            const int M, const int R, const int wide) {
    vw acc[MG * RG];
    for (int i = 0; i < M * R; i++) acc[i] = (vw){0};
    const float *xr = x + m0 * K;
    for (int64_t k = 0; k < K; k += WL) {
        vw xv[MG];
        for (int m = 0; m < M; m++) memcpy(&xv[m], xr + m * K + k, sizeof xv[m]);
        for (int r = 0; r < R; r++) {
            const vw wv = load_w(w, (n0 + r) * K + k, wide);
            for (int m = 0; m < M; m++) acc[r * M + m] += wv * xv[m];
        }
    }
    for (int r = 0; r < R; r++) {
        const float b = bias ? bias[n0 + r] : 0.0f;
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            for (int l = 0; l < WL; l++) s += acc[r * M + m][l];
            out[(m0 + m) * N + n0 + r] = s + b;
        }
    }
}

/* Rows m0 .. m0 + M - 1 of x against weight rows n0 .. n1 - 1 (n1 - n0 a multiple of RG, or the range's tail). */
static inline __attribute__((always_inline)) void rows_pass(const float *x, const void *w, const float *bias,
                                                            float *out, int64_t K, int64_t N, int64_t m0, int64_t n0,
                                                            int64_t n1, const int M, const int wide) {
    int64_t n = n0;
    for (; n + RG <= n1; n += RG) rows_tile(x, w, bias, out, K, N, m0, n, M, RG, wide);
    for (; n < n1; n++) rows_tile(x, w, bias, out, K, N, m0, n, M, 1, wide);
}

static void rows_block(const float *x, const void *w, const float *bias, float *out, int64_t M, int64_t K, int64_t N,
                       int64_t n0, int64_t n1, const int wide) {
    int64_t m = 0;
    for (; m + MG <= M; m += MG) rows_pass(x, w, bias, out, K, N, m, n0, n1, MG, wide);
    switch (M - m) {
    case 1: rows_pass(x, w, bias, out, K, N, m, n0, n1, 1, wide); break;
    case 2: rows_pass(x, w, bias, out, K, N, m, n0, n1, 2, wide); break;
    case 3: rows_pass(x, w, bias, out, K, N, m, n0, n1, 3, wide); break;
#if MG > 4
#error "rows_block handles a remainder of up to 3 rows"
#endif
    }
}

/* 0 done; 1 where the shape is not one it takes (K a multiple of the vector, M from 1 to 32). w_bf16: the weights
 * (and nothing else) are bfloat16. */
int linear_rows_f32(const float *x, const void *w, const float *bias, float *out, int64_t M, int64_t K, int64_t N,
                    int64_t w_bf16, int64_t num_threads) {
    if (K % WL != 0 || M < 1 || M > 32) return 1;
    const int64_t bytes = w_bf16 ? 2 : 4;
    int64_t block = (96 * 1024) / (K * bytes) / RG * RG; /* weight rows a block: about 96 KB, whole tiles */
    if (block < RG) block = RG;
    const int64_t blocks = (N + block - 1) / block;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * block, n1 = n0 + block < N ? n0 + block : N;
        if (w_bf16)
            rows_block(x, w, bias, out, M, K, N, n0, n1, 1);
        else
            rows_block(x, w, bias, out, M, K, N, n0, n1, 0);
    }
    return 0;
}
