/* What the CPU kernels (cpu_decode.c, cpu_prefill.c, cpu_elementwise.c) share: bfloat16 to and from float32 as
 * torch converts, and the order that interleaves two vectors' 16-bit elements into pairs. */
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

#endif
