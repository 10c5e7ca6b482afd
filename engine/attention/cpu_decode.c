/* Paged decode attention on the CPU: each sequence's one new query against its whole context, read in place
 * through its block table, each key and value row once per step.
 *
 * Layout (one layer): q and out [B, H, D]; k_cache and v_cache [num_slots, Hkv, D], slot = block * block_size +
 * offset; block_tables [B, max_blocks] int32; seq_lens [B] int32 (keys 0..seq_len-1 are attended). The H query
 * heads share the Hkv key/value heads in groups of G = H / Hkv (GQA). One work item is a sequence (or, when there
 * are fewer than two per thread, a range of its KV heads): its heads' scores over the context, reading each key
 * row's heads together (a slot's heads are contiguous: a pass per head ran 8x slower), a softmax, then the
 * values weighted by them, in float32. Built with -ffast-math: the softmax's exponentials are vectorized, and
 * nothing here relies on infinities or NaNs (scores of finite K and q are finite).
 *
 * Built by engine/attention/cpu_kernel.py with the host compiler (-O3 -march=native -ffast-math -fopenmp) and loaded with ctypes; it
 * links the OpenMP runtime that PyTorch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                                         \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables, const int32_t *seq_lens,  \
             T *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                   \
             int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {                            \
        const int64_t G = num_heads / num_kv_heads, D = head_dim, row = num_kv_heads * head_dim;                    \
        /* Parts per sequence: 1 when the sequences keep every thread busy, else the KV heads split in ranges. */   \
        int64_t parts = (2 * num_threads + num_seqs - 1) / num_seqs;                                                \
        parts = parts < 1 ? 1 : parts > num_kv_heads ? num_kv_heads : parts;                                        \
        int failed = 0;                                                                                             \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                                   \
        for (int64_t item = 0; item < num_seqs * parts; item++) {                                                   \
            const int64_t b = item / parts, part = item % parts;                                                    \
            const int64_t h0 = part * num_kv_heads / parts * G, h1 = (part + 1) * num_kv_heads / parts * G;         \
            const int64_t H = h1 - h0, L = seq_lens[b];                                                             \
            const int32_t *table = block_tables + b * max_blocks;                                                   \
            float *qf = malloc(sizeof(float) * (size_t)(2 * H * D + H * (L > 0 ? L : 1)));                          \
            if (!qf) { failed = 1; continue; }                                                                      \
            float *acc = qf + H * D, *p = acc + H * D;                                                              \
            const T *qb = q + (b * num_heads + h0) * D;                                                             \
            for (int64_t i = 0; i < H * D; i++) qf[i] = LOAD(qb[i]) * scale;                                        \
            /* Scores: each key row's heads h0..h1 at once (a slot's heads are contiguous), every query head. */    \
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {                                                        \
                const T *kb = k_cache + (int64_t)table[t0 / block_size] * block_size * row + (h0 / G) * D;          \
                const int64_t n = L - t0 < block_size ? L - t0 : block_size;                                        \
                for (int64_t i = 0; i < n; i++) {                                                                   \
                    for (int64_t h = 0; h < H; h++) {                                                               \
                        const T *k = kb + i * row + (h / G) * D;                                                    \
                        const float *qh = qf + h * D;                                                               \
                        float s = 0.0f;                                                                             \
                        _Pragma("omp simd reduction(+ : s)")                                                        \
                        for (int64_t d = 0; d < D; d++) s += qh[d] * LOAD(k[d]);                                    \
                        p[h * L + t0 + i] = s;                                                                      \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            for (int64_t h = 0; h < H; h++) {                                                                       \
                float *ph = p + h * L, m = -3.0e38f, sum = 0.0f;                                                    \
                for (int64_t t = 0; t < L; t++) m = ph[t] > m ? ph[t] : m;                                          \
                _Pragma("omp simd reduction(+ : sum)")                                                              \
                for (int64_t t = 0; t < L; t++) { ph[t] = expf(ph[t] - m); sum += ph[t]; }                          \
                const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;                                                   \
                for (int64_t t = 0; t < L; t++) ph[t] *= inv;                                                       \
            }                                                                                                       \
            /* Values: each value row once, weighted into every head's output. */                                   \
            memset(acc, 0, sizeof(float) * (size_t)(H * D));                                                        \
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {                                                        \
                const T *vb = v_cache + (int64_t)table[t0 / block_size] * block_size * row + (h0 / G) * D;          \
                const int64_t n = L - t0 < block_size ? L - t0 : block_size;                                        \
                for (int64_t i = 0; i < n; i++) {                                                                   \
                    for (int64_t h = 0; h < H; h++) {                                                               \
                        const T *v = vb + i * row + (h / G) * D;                                                    \
                        const float w = p[h * L + t0 + i];                                                          \
                        float *ah = acc + h * D;                                                                    \
                        _Pragma("omp simd")                                                                         \
                        for (int64_t d = 0; d < D; d++) ah[d] += w * LOAD(v[d]);                                    \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            T *ob = out + (b * num_heads + h0) * D;                                                                 \
            for (int64_t i = 0; i < H * D; i++) ob[i] = STORE(acc[i]);                                              \
            free(qf);                                                                                               \
        }                                                                                                           \
        return failed;                                                                                              \
    }

DEFINE_DECODE(paged_decode_f32, float, f32_load, f32_store)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
