/* What the CPU kernels (cpu_decode.c, cpu_prefill.c, cpu_elementwise.c, cpu_gemv.c) share: bfloat16 to and from
 * float32 as torch converts, the order that interleaves two vectors' 16-bit elements into pairs, and (with AVX-512)
 * the sums of 16 vectors' lanes at once. */
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

#if defined(__AVX512F__)
#include <immintrin.h>

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
