/* Paged decode attention on the CPU: each sequence's one new query against its whole context, read in place
 * through its block table, each key and value row once per step.
 *
 * Layout (one layer): q and out [B, H, D]; k_cache and v_cache [num_slots, Hkv, D], slot = block * block_size +
 * offset; block_tables [B, max_blocks] int32; seq_lens [B] int32 (keys 0..seq_len-1 are attended). The H query
 * heads share the Hkv key/value heads in groups of G = H / Hkv (GQA). One work item is a sequence (or, when there
 * are fewer than two per thread, a range of its KV heads; in the bfloat16 path a range of its keys, the ranges'
 * results combined after): its heads' scores over the context, reading each key
 * row's heads together (a slot's heads are contiguous: a pass per head ran 8x slower), a softmax, then the
 * values weighted by them, in float32. Three bodies: with AVX512-BF16, the bfloat16 dot products (decode_bf16_dp);
 * with AVX2 or AVX-512, vectors of 8 or 16 floats for head sizes that are multiples of them (decode_vec, float32
 * and bfloat16 widened); the plain loop (DEFINE_DECODE) for the rest. Built with -ffast-math: the softmax's
 * exponentials are vectorized, and nothing here relies on infinities or NaNs (scores of finite K and q are finite).
 *
 * Built by engine/attention/cpu_kernel.py with the host compiler (-O3 -march=native -ffast-math -fopenmp) and loaded with ctypes; it
 * links the OpenMP runtime that PyTorch already loaded, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

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

DEFINE_DECODE(decode_f32_plain, float, f32_load, f32_store)
DEFINE_DECODE(decode_bf16_plain, uint16_t, bf16_to_f32, f32_to_bf16)

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define HAVE_VEC 1

/* The float32 decode, and the bfloat16 one widened, in vectors of VL floats (8 with AVX2, 16 with AVX-512), for
 * head sizes that are multiples of VL. The loop above computes a score as one dot product, a chain of dependent
 * FMAs and a sum of lanes per key and head, and keeps the values' accumulators in memory, so it waits on its FMAs
 * and stores. Here, as in the bfloat16 dot-product path: scores VL keys at a time, each key's partial sums in its
 * own vector, the VL vectors' lanes summed together after (reduce_vl); values a block of up to 8 vectors of a
 * head's accumulators kept in registers across VL keys; the next chunk's rows prefetched into L2 while this one
 * computes (bench/results/cpu-2core/isa/README.md has what each step gained). */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vlf __attribute__((vector_size(4 * VL)));

/* VL elements of a float32 or bfloat16 row, from element i, as float32 */
static inline __attribute__((always_inline)) vlf vload(const void *row, int64_t i, const int bf16) {
    vlf f;
    if (bf16) {
#if VL == 16
        const __m512 w = widen_bf16x16((const uint16_t *)row + i);
#else
        const __m256 w = widen_bf16x8((const uint16_t *)row + i);
#endif
        memcpy(&f, &w, sizeof f);
    } else {
        memcpy(&f, (const float *)row + i, sizeof f);
    }
    return f;
}

/* r[i] = the sum of v[i]'s lanes, for VL vectors */
static inline vlf reduce_vl(const vlf *v) {
    vlf out;
#if VL == 16
    const __m512 r = reduce16((const __m512 *)v);
#else
    const __m256 *x = (const __m256 *)v;
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    /* ab: x0..x3 summed over their low halves (low 128 bits), then over their high halves; cd: x4..x7 */
    const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
#endif
    memcpy(&out, &r, sizeof out);
    return out;
}

static inline void prefetch_chunk(const char *cache, const int32_t *table, int64_t t0, int64_t L, int64_t block_size,
                                  int64_t row_bytes, int64_t from, int64_t bytes) {
    for (int64_t t = t0; t < t0 + VL && t < L; t++) {
        const char *r = cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_bytes + from;
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(r + off, 0, 2);
    }
}

/* One work item: sequence b's query heads of KV heads g0 .. g1-1 over its L keys. NV (vectors of a block of the
 * values' accumulators, dividing D / VL) and bf16 are constants at each call. Returns 1 where its scratch could not
 * be allocated. */
static inline __attribute__((always_inline)) int decode_item_vec(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *table, void *out, int64_t b, int64_t g0,
    int64_t g1, int64_t L, int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size, float scale,
    const int bf16, const int NV) {
    const int64_t G = num_heads / num_kv_heads, HI = (g1 - g0) * G, esize = bf16 ? 2 : 4;
    const int64_t row_bytes = num_kv_heads * D * esize, Lp = (L + VL - 1) / VL * VL;
    float *qf = aligned_alloc(64, sizeof(float) * (size_t)((2 * HI * D + HI * Lp + 15) / 16 * 16));
    if (!qf) return 1;
    float *accs = qf + HI * D, *p = accs + HI * D;
    for (int64_t i = 0; i < HI * D; i++) {
        const int64_t at = (b * num_heads + g0 * G) * D + i;
        qf[i] = (bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at]) * scale;
    }
    const char *kc = k_cache, *vc = v_cache;
    /* Scores, VL keys at a time (past L: the last key again, its scores unused). */
    for (int64_t t0 = 0; t0 < L; t0 += VL) {
        const char *krow[VL];
        for (int64_t i = 0; i < VL; i++) {
            const int64_t t = t0 + i < L ? t0 + i : L - 1;
            krow[i] = kc + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_bytes;
        }
        prefetch_chunk(kc, table, t0 + VL, L, block_size, row_bytes, g0 * D * esize, (g1 - g0) * D * esize);
        for (int64_t g = g0; g < g1; g++)
            for (int64_t h = 0; h < G; h++) {
                const float *qh = qf + ((g - g0) * G + h) * D;
                vlf acc[VL];
                for (int i = 0; i < VL; i++) acc[i] = (vlf){0};
                for (int64_t d = 0; d < D; d += VL) {
                    vlf qv;
                    memcpy(&qv, qh + d, sizeof qv);
                    for (int i = 0; i < VL; i++) acc[i] += qv * vload(krow[i], g * D + d, bf16);
                }
                const vlf sums = reduce_vl(acc);
                memcpy(p + ((g - g0) * G + h) * Lp + t0, &sums, sizeof sums);
            }
    }
    for (int64_t h = 0; h < HI; h++) {
        float *ph = p + h * Lp, m = -3.0e38f, sum = 0.0f;
        for (int64_t t = 0; t < L; t++) m = ph[t] > m ? ph[t] : m;
        _Pragma("omp simd reduction(+ : sum)")
        for (int64_t t = 0; t < L; t++) { ph[t] = expf(ph[t] - m); sum += ph[t]; }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t t = 0; t < L; t++) ph[t] *= inv;
    }
    /* Values: each head's accumulators, NV vectors at a time, in registers across the chunk's keys. */
    for (int64_t i = 0; i < HI * D; i++) accs[i] = 0.0f;
    for (int64_t t0 = 0; t0 < L; t0 += VL) {
        const int64_t n = L - t0 < VL ? L - t0 : VL;
        const char *vrow[VL];
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = t0 + i;
            vrow[i] = vc + ((int64_t)table[t / block_size] * block_size + t % block_size) * row_bytes;
        }
        prefetch_chunk(vc, table, t0 + VL, L, block_size, row_bytes, g0 * D * esize, (g1 - g0) * D * esize);
        for (int64_t g = g0; g < g1; g++)
            for (int64_t h = 0; h < G; h++) {
                const float *w = p + ((g - g0) * G + h) * Lp + t0;
                float *ah = accs + ((g - g0) * G + h) * D;
                for (int64_t d0 = 0; d0 < D; d0 += NV * VL) {
                    vlf a[8];
                    for (int c = 0; c < NV; c++) memcpy(&a[c], ah + d0 + c * VL, sizeof a[c]);
                    for (int64_t i = 0; i < n; i++)
                        for (int c = 0; c < NV; c++) a[c] += w[i] * vload(vrow[i], g * D + d0 + c * VL, bf16);
                    for (int c = 0; c < NV; c++) memcpy(ah + d0 + c * VL, &a[c], sizeof a[c]);
                }
            }
    }
    for (int64_t i = 0; i < HI * D; i++) {
        const int64_t at = (b * num_heads + g0 * G) * D + i;
        if (bf16) ((uint16_t *)out)[at] = f32_to_bf16(accs[i]);
        else ((float *)out)[at] = accs[i];
    }
    free(qf);
    return 0;
}

/* The work items as the loop above splits them: a sequence each where they keep every thread busy, else ranges of
 * a sequence's KV heads. */
static int decode_vec(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                      const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t D, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads,
                      const int bf16) {
    int64_t parts = (2 * num_threads + num_seqs - 1) / num_seqs;
    parts = parts < 1 ? 1 : parts > num_kv_heads ? num_kv_heads : parts;
    int NV = 8; /* the largest divisor of D / VL up to 8 */
    while ((D / VL) % NV) NV--;
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")
    for (int64_t item = 0; item < num_seqs * parts; item++) {
        const int64_t b = item / parts, part = item % parts, L = seq_lens[b];
        const int64_t g0 = part * num_kv_heads / parts, g1 = (part + 1) * num_kv_heads / parts;
        if (L <= 0 || g1 <= g0) continue;
        const int32_t *table = block_tables + b * max_blocks;
#define VITEM(BF16, NVC)                                                                                           \
    decode_item_vec(q, k_cache, v_cache, table, out, b, g0, g1, L, num_heads, num_kv_heads, D, block_size, scale,  \
                    BF16, NVC)
        int bad = 0;
        if (bf16) {
            switch (NV) {
            case 8: bad = VITEM(1, 8); break;
            case 6: bad = VITEM(1, 6); break;
            case 5: bad = VITEM(1, 5); break;
            case 4: bad = VITEM(1, 4); break;
            case 3: bad = VITEM(1, 3); break;
            case 2: bad = VITEM(1, 2); break;
            default: bad = VITEM(1, 1); break;
            }
        } else {
            switch (NV) {
            case 8: bad = VITEM(0, 8); break;
            case 6: bad = VITEM(0, 6); break;
            case 5: bad = VITEM(0, 5); break;
            case 4: bad = VITEM(0, 4); break;
            case 3: bad = VITEM(0, 3); break;
            case 2: bad = VITEM(0, 2); break;
            default: bad = VITEM(0, 1); break;
            }
        }
#undef VITEM
        if (bad) failed = 1;
    }
    return failed;
}
#endif

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     const int32_t *seq_lens, float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
#ifdef HAVE_VEC
    if (head_dim % VL == 0)
        return decode_vec(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                          head_dim, block_size, max_blocks, scale, num_threads, 0);
#endif
    return decode_f32_plain(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                            head_dim, block_size, max_blocks, scale, num_threads);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

/* The bfloat16 decode where the CPU has AVX512-BF16 (vdpbf16ps: a pair of bfloat16 products added into a float32
 * lane), for head sizes that are multiples of 32. Scores: a key row's 32-element chunks against the query head's
 * (two instructions a key and head at D = 64), the 16 lanes of partial sums of 16 keys then reduced together
 * (reduce16: about three instructions a key, where a sum per key costs six). Values: two value rows interleaved
 * (v[k][d], v[k+1][d]) against the pair of their weights, rounded to bfloat16 as flash attention does. */

#define MAX_CHUNKS 8 /* head size up to 256 */

/* The rows t0 .. t0+15's part (from, width elements) of the item, a cache line at a time, in address order. Each row
 * holds every KV head, and reading a head's slice of 16 rows before the next head's is a stride the hardware
 * prefetchers do not follow: with the rows in DRAM the loads stalled for most of the kernel's time (10 GB/s at batch
 * 32, context 1K, against 37 GB/s with the same rows in L3). So before a chunk's passes its rows are read in order
 * into L1 (touch_rows: 10 -> 21 GB/s), and the next chunk's are prefetched into L2 (prefetch_rows) while this one
 * computes: 0.75-0.85x the time again at batch 8-32, context 256-2K, scattered blocks. Prefetching into L1 (T0)
 * instead gained nothing (the next chunk's 16 KB evicts this one's), nor did prefetching alone, without the touch,
 * or further ahead. */
static inline void touch_rows(const uint16_t *cache, const int32_t *table, int64_t t0, int64_t L,
                              int64_t block_size, int64_t row, int64_t from, int64_t width) {
    char seen = 0;
    for (int64_t t = t0; t < t0 + 16 && t < L; t++) {
        const char *r = (const char *)(cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row
                                       + from);
        for (int64_t off = 0; off < width * 2; off += 64) seen ^= *(volatile const char *)(r + off);
    }
    (void)seen;
}

static inline void prefetch_rows(const uint16_t *cache, const int32_t *table, int64_t t0, int64_t L,
                                 int64_t block_size, int64_t row, int64_t from, int64_t width) {
    for (int64_t t = t0; t < t0 + 16 && t < L; t++) {
        const char *r = (const char *)(cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row
                                       + from);
        for (int64_t off = 0; off < width * 2; off += 64) _mm_prefetch(r + off, _MM_HINT_T1);
    }
}

/* One work item: sequence b's keys k0 .. k1-1 (a multiple of 16 .. at most its length) for its KV heads g0 .. g1-1 and
 * their query heads. With partial NULL it writes the attention to out; otherwise (the sequence split in key ranges
 * over several items) it writes, for each query head, its weighted values (the range's own softmax), then the
 * range's maximum score and its sum of exponentials, PARTIAL_STRIDE floats a head, for combine_partials. Returns 1
 * where its scratch could not be allocated. Always inlined, with C (the head size in 32-element chunks) a constant at
 * each call: the loops over chunks unroll, and the value pass keeps its accumulators in registers. */
#define PARTIAL_STRIDE(D) ((D) + 16)
static inline __attribute__((always_inline)) int decode_item_dp(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, uint16_t *out,
    float *partial, int64_t b, int64_t g0, int64_t g1, int64_t k0, int64_t k1, int64_t num_heads,
    int64_t num_kv_heads, const int64_t C, int64_t block_size, float scale, __m512i order) {
    const int64_t D = 32 * C, G = num_heads / num_kv_heads, row = num_kv_heads * D;
    static const uint16_t zeros[256] = {0};
    const int64_t HI = (g1 - g0) * G;                          /* the item's query heads */
    const int64_t L = k1, n_keys = k1 - k0, Lp = (n_keys + 16) / 16 * 16; /* padded: whole chunks, a pair's end */
    /* scores [HI][Lp] float; the weights in pairs [HI][Lp / 2] and 16 words of slack; accumulators [HI][D],
     * from a multiple of 16 floats (64 bytes), then each head's maximum and sum */
    const int64_t at_accs = (HI * Lp + HI * Lp / 2 + 16 + 15) / 16 * 16;
    float *p = aligned_alloc(64, sizeof(float) * (size_t)(at_accs + (HI * D + 2 * HI + 15) / 16 * 16));
    if (!p) return 1;
    uint32_t *pp = (uint32_t *)(p + HI * Lp);
    float *accs = p + at_accs;
    /* Scores, 16 keys at a time, every head of the item on each key row before the next rows. */
    for (int64_t t0 = k0; t0 < L; t0 += 16) {
        const uint16_t *krow[16];
        for (int64_t i = 0; i < 16; i++) {
            const int64_t t = t0 + i < L ? t0 + i : L - 1;
            krow[i] = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
        }
        const int64_t n = L - t0 < 16 ? L - t0 : 16;
        touch_rows(k_cache, table, t0, L, block_size, row, g0 * D, (g1 - g0) * D);
        prefetch_rows(k_cache, table, t0 + 16, L, block_size, row, g0 * D, (g1 - g0) * D);
        for (int64_t g = g0; g < g1; g++)
            for (int64_t h = 0; h < G; h++) {
                __m512bh qv[MAX_CHUNKS];
                const uint16_t *qh = q + (b * num_heads + g * G + h) * D;
                for (int64_t c = 0; c < C; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
                __m512 part16[16];
                for (int64_t i = 0; i < 16; i++) {
                    __m512 acc = _mm512_setzero_ps();
                    if (i < n)
                        for (int64_t c = 0; c < C; c++)
                            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(krow[i] + g * D + 32 * c),
                                                   qv[c]);
                    part16[i] = acc;
                }
                _mm512_store_ps(p + ((g - g0) * G + h) * Lp + (t0 - k0),
                                _mm512_mul_ps(reduce16(part16), _mm512_set1_ps(scale * LOG2E)));
            }
    }
    /* Softmax over each head's scores, then its weights in pairs of keys as bfloat16 (zeros past L). */
    float *maxes = accs + HI * D, *sums = maxes + HI;
    for (int64_t h = 0; h < HI; h++) {
        float *ph = p + h * Lp;
        const __mmask16 tail = (__mmask16)((1u << (n_keys % 16)) - 1u);
        const int64_t whole = n_keys / 16 * 16;
        __m512 mv = _mm512_set1_ps(-3.0e38f), sv = _mm512_setzero_ps();
        for (int64_t t = 0; t < whole; t += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(ph + t));
        if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_load_ps(ph + whole));
        const float m = _mm512_reduce_max_ps(mv);
        for (int64_t t = 0; t < whole; t += 16) {
            const __m512 e = exp2_16(_mm512_sub_ps(_mm512_load_ps(ph + t), _mm512_set1_ps(m)));
            _mm512_store_ps(ph + t, e);
            sv = _mm512_add_ps(sv, e);
        }
        if (tail) {
            const __m512 x = _mm512_sub_ps(_mm512_load_ps(ph + whole), _mm512_set1_ps(m));
            const __m512 e = _mm512_maskz_mov_ps(tail, exp2_16(x));
            _mm512_mask_store_ps(ph + whole, tail, e);
            sv = _mm512_add_ps(sv, e);
        }
        const float sum = _mm512_reduce_add_ps(sv);
        maxes[h] = m, sums[h] = sum;
        const __m512 inv = _mm512_set1_ps(1.0f / sum);
        for (int64_t t = n_keys; t < Lp; t++) ph[t] = 0.0f;
        for (int64_t t = 0; t < Lp; t += 32) {
            const __m512 lo = _mm512_mul_ps(_mm512_load_ps(ph + t), inv);
            const __m512 hi = t + 16 < Lp ? _mm512_mul_ps(_mm512_load_ps(ph + t + 16), inv) : _mm512_setzero_ps();
            /* bfloat16 elements 0-15: lo, 16-31: hi, so word j is the pair (t + 2j, t + 2j + 1). A last
             * half-full store runs into the next head's row, written after it, or the slack at the end. */
            _mm512_storeu_si512(pp + h * (Lp / 2) + t / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    /* Values, 16 keys at a time: a KV head's 16-element slice of the chunk's 8 pairs of rows, interleaved, then
     * each of its query heads' accumulators for that slice in registers across the 8 pairs (two chains),
     * against the head's pair of weights; rows past L read zeros (their weights are zero too). */
    for (int64_t i = 0; i < HI * D; i++) accs[i] = 0.0f;
    for (int64_t t0 = k0; t0 < L; t0 += 16) {
        const uint16_t *vrow[16];
        for (int64_t i = 0; i < 16; i++) {
            const int64_t t = t0 + i;
            vrow[i] = t < L ? v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row
                            : NULL; /* past L: zeros (its weight is zero too) */
        }
        touch_rows(v_cache, table, t0, L, block_size, row, g0 * D, (g1 - g0) * D);
        prefetch_rows(v_cache, table, t0 + 16, L, block_size, row, g0 * D, (g1 - g0) * D);
        for (int64_t g = g0; g < g1; g++)
            for (int64_t c = 0; c < 2 * C; c++) {
                __m512bh vv[8];
                for (int64_t j = 0; j < 8; j++) {
                    const uint16_t *va = vrow[2 * j] ? vrow[2 * j] + g * D : zeros;
                    const uint16_t *vb = vrow[2 * j + 1] ? vrow[2 * j + 1] + g * D : zeros;
                    vv[j] = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(va + 16 * c))),
                        _mm256_loadu_si256((const void *)(vb + 16 * c)), 1));
                }
                for (int64_t h = 0; h < G; h++) {
                    const uint32_t *w = pp + ((g - g0) * G + h) * (Lp / 2) + (t0 - k0) / 2;
                    float *a = accs + ((g - g0) * G + h) * D + 16 * c;
                    __m512 even = _mm512_load_ps(a), odd = _mm512_setzero_ps();
                    for (int64_t j = 0; j < 8; j += 2) {
                        even = _mm512_dpbf16_ps(even, vv[j], (__m512bh)_mm512_set1_epi32((int)w[j]));
                        odd = _mm512_dpbf16_ps(odd, vv[j + 1], (__m512bh)_mm512_set1_epi32((int)w[j + 1]));
                    }
                    _mm512_store_ps(a, _mm512_add_ps(even, odd));
                }
            }
    }
    for (int64_t h = 0; h < HI; h++) {
        if (partial) {
            float *ph = partial + h * PARTIAL_STRIDE(D);
            memcpy(ph, accs + h * D, sizeof(float) * (size_t)D);
            ph[D] = maxes[h], ph[D + 1] = sums[h];
            continue;
        }
        uint16_t *o = out + (b * num_heads + g0 * G + h) * D;
        for (int64_t c = 0; c < 2 * C; c++)
            _mm256_storeu_si256((void *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(accs + h * D + 16 * c)));
    }
    free(p);
    return 0;
}

/* Sequence b's attention from its key ranges' partial results (splits of them, in order; a range past the
 * sequence's end has no keys and counts for nothing): each range's values weighted by its share of the whole
 * softmax, sum_r * exp(max_r - max) / the sum of those. */
static void combine_partials(const float *partials, uint16_t *out, int64_t b, int64_t h, int64_t splits,
                             int64_t ranges, int64_t num_heads, int64_t D) {
    const float *first = partials + ((b * splits) * num_heads + h) * PARTIAL_STRIDE(D);
    const int64_t step = num_heads * PARTIAL_STRIDE(D);
    float m = -3.0e38f, total = 0.0f, acc[256];
    for (int64_t r = 0; r < ranges; r++) m = first[r * step + D] > m ? first[r * step + D] : m;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (int64_t r = 0; r < ranges; r++) {
        const float *pr = first + r * step, w = pr[D + 1] * exp2f(pr[D] - m); /* maxima in base 2 */
        total += w;
        for (int64_t d = 0; d < D; d++) acc[d] += w * pr[d];
    }
    uint16_t *o = out + (b * num_heads + h) * D;
    for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(acc[d] / total);
}

static int decode_bf16_dp(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          int64_t max_blocks, float scale, int64_t num_threads) {
    /* Work items: a whole sequence, all its heads, where the sequences keep every thread busy (two or more a
     * thread); otherwise each sequence's keys in `splits` ranges of whole 16-key chunks (at least 64 keys each),
     * about four items a thread, every range reading whole rows (all KV heads) in address order, and a second pass
     * combining the ranges. Splitting the KV heads instead read a quarter of each row, a stride in memory: 10 GB/s
     * at batch 1, context 2K. */
    int64_t splits = 1, span = 0, longest = 0;
    for (int64_t b = 0; b < num_seqs; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    if (num_seqs < 2 * num_threads) {
        const int64_t want = (4 * num_threads + num_seqs - 1) / num_seqs;
        span = ((longest + want - 1) / want + 15) / 16 * 16;
        span = span < 64 ? 64 : span;
        splits = (longest + span - 1) / span;
    }
    float *partials = NULL;
    if (splits > 1) {
        partials = malloc(sizeof(float) * (size_t)(num_seqs * splits * num_heads * PARTIAL_STRIDE(head_dim)));
        if (!partials) return 1;
    } else {
        span = longest;
    }
    const __m512i order = _mm512_loadu_si512(INTERLEAVE);
    int failed = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")
    for (int64_t item = 0; item < num_seqs * splits; item++) {
        const int64_t b = item / splits, k0 = item % splits * span, L = seq_lens[b];
        if (k0 >= L) continue;
        const int64_t k1 = k0 + span < L ? k0 + span : L;
        float *partial = partials ? partials + item * num_heads * PARTIAL_STRIDE(head_dim) : NULL;
#define ITEM(C)                                                                                                    \
    decode_item_dp(q, k_cache, v_cache, block_tables + b * max_blocks, out, partial, b, 0, num_kv_heads, k0, k1,    \
                   num_heads, num_kv_heads, C, block_size, scale, order)
        int bad = 0;
        switch (head_dim / 32) { /* with a variable chunk count its accumulators went through memory: 0.6x the speed */
        case 1: bad = ITEM(1); break;
        case 2: bad = ITEM(2); break;
        case 3: bad = ITEM(3); break;
        case 4: bad = ITEM(4); break;
        case 5: bad = ITEM(5); break;
        case 6: bad = ITEM(6); break;
        case 7: bad = ITEM(7); break;
        case 8: bad = ITEM(8); break;
        }
#undef ITEM
        if (bad) failed = 1;
    }
    if (partials && !failed) {
        _Pragma("omp parallel for num_threads(num_threads)")
        for (int64_t bh = 0; bh < num_seqs * num_heads; bh++) {
            const int64_t b = bh / num_heads, ranges = (seq_lens[b] + span - 1) / span;
            combine_partials(partials, out, b, bh % num_heads, splits, ranges, num_heads, head_dim);
        }
    }
    free(partials);
    return failed;
}
#endif

int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *block_tables, const int32_t *seq_lens, uint16_t *out, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, float scale, int64_t num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (head_dim % 32 == 0 && head_dim <= 32 * MAX_CHUNKS)
        return decode_bf16_dp(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                              head_dim, block_size, max_blocks, scale, num_threads);
#endif
#ifdef HAVE_VEC
    if (head_dim % VL == 0)
        return decode_vec(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                          head_dim, block_size, max_blocks, scale, num_threads, 1);
#endif
    return decode_bf16_plain(q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads,
                             head_dim, block_size, max_blocks, scale, num_threads);
}
