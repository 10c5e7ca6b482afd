/* What the CPU kernels (cpu_decode.c, cpu_prefill.c, cpu_elementwise.c, cpu_gemv.c) share: bfloat16 to and from
 * float32 as torch converts (a vector of them too, with AVX2 or AVX-512), the order that interleaves two vectors'
 * 16-bit elements into pairs, and (with AVX-512) the exponential of 16 lanes and the sums of 16 vectors' lanes at
 * once. */
#ifndef PPD_CPU_COMMON_H
#define PPD_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16-bit elements 0-15 and 16-31 of a vector interleaved: 0, 16, 1, 17, ... (for _mm512_permutexvar_epi16) */
static const short INTERLEAVE[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

/* 8 bfloat16 as float32: a zero-extending load and a shift (GCC's own vector conversion takes four shuffles) */
static inline __m256 widen_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#if defined(__AVX512F__)
static inline __m512 bf16x16_to_f32(__m256i h) { /* 16 bfloat16 as float32: each one's bits in the high half */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 widen_bf16x16(const uint16_t *p) { return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)p)); }

#define LOG2E 1.44269504088896341f /* the kernels scale scores by it once, so that e^(s - m) is exp2_16(s' - m') */

/* 2^x, 16 lanes, for finite x: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor series to the sixth
 * power (relative error about 1e-7, below bfloat16's rounding of the softmax weights by far), times 2^n by vscalefps,
 * which gives 0 where 2^n is below float's range: a masked score (-1e30 less a finite maximum) is exactly 0. Nine
 * instructions where libm's vectorized expf is a call; with the prefill softmax's passes fused, 0.66-0.81x the
 * prefill kernel's time at head size 64 (bench/results/cpu-2core/cpu-kernels/README.md). */
static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);                /* ln2^6 / 6! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f)); /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f)); /* ln2^4 / 4! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f)); /* ln2^3 / 3! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f)); /* ln2^2 / 2! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f)); /* ln2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* r[i] = the sum of v[i]'s 16 lanes. */
static inline __m512 reduce16(const __m512 *v) {
    __m512 w[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *x = v + 4 * g;
        const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
        const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
        /* each 128-bit lane: x[0..3]'s partial sums over that lane's four elements */
        w[g] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    }
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}
#endif

#endif
