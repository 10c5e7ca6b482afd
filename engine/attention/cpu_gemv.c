/* Linear layers of a few rows in bfloat16 on CPUs with AVX512-BF16: out [M, N] = x [M, K] @ w [N, K]^T (+ bias), for
 * M up to 8 (a decode step's batch, where the weights' bytes set the time; cpu_linear.py uses it up to 2 rows).
 *
 * oneDNN's GEMM on its prepacked weights read them at about 20 GB/s in a one-row decode step on a 2-core Zen 4 whose
 * copy bandwidth is 31-36 GB/s; from 3 rows on it is the faster (engine/attention/cpu_linear.py chooses). Here each
 * thread takes whole groups of R = 16 / P adjacent weight rows (P: M rounded up to 1, 2, 4 or 8) and keeps R x P
 * float32 accumulators in registers over K, 32 elements at a time (vdpbf16ps: a pair of products a lane), so
 * every weight is read once, in address order within each row, and used for all M rows of x. The 16 accumulators'
 * lanes are summed together (reduce16), each output rounded to bfloat16 once, as torch's linear rounds it; the
 * additions run in another order than oneDNN's, so results may differ from torch's in the last place.
 *
 * Built with the other CPU kernels into one library by engine/attention/cpu_kernel.py.
 */
#include <stdint.h>

#include "cpu_common.h"

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
#endif

/* 0 done; 1 where this CPU or the shape is not one it takes (K a multiple of 32, M from 1 to 8): use another path. */
int linear_few_rows_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out, int64_t M,
                         int64_t K, int64_t N, int64_t num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (K % 32 != 0 || M < 1 || M > 8) return 1;
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
    (void)x, (void)w, (void)bias, (void)out, (void)M, (void)K, (void)N, (void)num_threads;
    return 1;
#endif
}
