/* Paged prefill and append-prefill attention on the CPU: each sequence's new queries against its whole context
 * (the cached tokens and the new ones, causally), read in place through its block table.
 *
 * Layout (one layer): q and out [rows, H, D], sequence b's queries in rows query_start[b] .. query_start[b+1]-1;
 * k_cache and v_cache [num_slots, Hkv, D], slot = block * block_size + offset; block_tables [B, max_blocks] int32;
 * seq_lens [B] int32, the context after this step (the new tokens' K/V are already stored). Query i of n new
 * tokens sits at position seq_len - n + i and attends keys 0 .. that position.
 *
 * A work item is a KV head and a tile of up to 64 / G consecutive queries of one sequence, so its R = queries x G
 * rows (every query head of the group) share each key and value read. It runs flash attention over tiles of 64
 * keys, in float32, with the rows as the vector lanes:
 *   - a key tile is converted to float32 once (K and V rows as they lie, no transpose);
 *   - scores S^T[key][row] = K . Q^T, from a broadcast key element times a vector of Q^T (each FMA does 16 rows);
 *   - the online softmax runs along the lanes (one running max and sum per row), masking keys past a row's
 *     position in the tiles that cross the diagonal;
 *   - acc^T[d][row] += P^T . V, from a broadcast value element times a vector of P^T.
 * No horizontal sums and no transposed copies of K or V; Q is transposed and the output transposed back once per
 * item. The micro-kernels keep a block of accumulators in registers (GCC vector extensions): with AVX-512, 4 keys
 * (or head dimensions) x all R / 16 vectors of rows; with AVX2's 16 registers of 8 floats, 4 x at most 3 vectors,
 * an item's rows in blocks (a 4 x 4 block of 8-float vectors spilled: 4-6x the kernel's time).
 *
 * Built with engine/attention/cpu_decode.c into one library by engine/attention/cpu_kernel.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* A micro-kernel keeps KEY_BLOCK x RV accumulators in registers, for KEY_BLOCK keys (scores) or head dimensions
 * (values) and RV <= ROW_BLOCK vectors of rows, with the RV vectors they share and a broadcast. */
#if defined(__AVX512F__)
#define LANES 16     /* floats in a vector */
#define ROW_BLOCK 4  /* 16 + 4 + 1 of 32 registers: an item's rows (at most 64) in one block */
#else
#define LANES 8      /* AVX2 or narrower */
#define ROW_BLOCK 3  /* 12 + 3 + 1 of 16 registers: an item of 64 rows (8 vectors) in blocks of 3, 3 and 2 */
#endif
#define KEY_BLOCK 4
#define MAX_ROWS 64 /* rows of a work item, at most */
#define KEYS 64 /* keys in a tile */
#define MASKED (-1.0e30f) /* a masked score: exp() of it, less any finite max, is 0 */

typedef float vf __attribute__((vector_size(4 * LANES)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* n elements of a K or V row (float32 or bfloat16) as float32 */
static inline void load_row(float *dst, const void *src, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = src;
        _Pragma("omp simd")
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

/* St[j][r] = sum_d Kf[j][d] * Qt[d][r] for keys j < nk and the RV vectors of rows from Qt and St (RV <= 4, and
 * ROW_BLOCK where it runs; RP floats a line). */
ALWAYS_INLINE void scores(const float *restrict Qt, const float *restrict Kf, float *restrict St, int64_t nk,
                          int64_t D, int64_t RP, const int RV) {
    int64_t j = 0;
    for (; j + KEY_BLOCK <= nk; j += KEY_BLOCK) {
        vf s[KEY_BLOCK][4] = {{0}};
        for (int64_t d = 0; d < D; d++) {
            vf qv[4];
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) qv[v] = *(const vf *)(Qt + d * RP + v * LANES);
#pragma GCC unroll 4
            for (int jj = 0; jj < KEY_BLOCK; jj++) {
                const vf kb = (vf){0} + Kf[(j + jj) * D + d];
#pragma GCC unroll 4
                for (int v = 0; v < RV; v++) s[jj][v] += kb * qv[v];
            }
        }
#pragma GCC unroll 4
        for (int jj = 0; jj < KEY_BLOCK; jj++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) *(vf *)(St + (j + jj) * RP + v * LANES) = s[jj][v];
    }
    for (; j < nk; j++) {
        vf s[4] = {0};
        for (int64_t d = 0; d < D; d++) {
            const vf kb = (vf){0} + Kf[j * D + d];
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) s[v] += kb * *(const vf *)(Qt + d * RP + v * LANES);
        }
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) *(vf *)(St + j * RP + v * LANES) = s[v];
    }
}

/* At[d][r] += sum_j Pt[j][r] * Vf[j][d] for keys j < nk and the RV vectors of rows from Pt and At. */
ALWAYS_INLINE void weigh_values(const float *restrict Pt, const float *restrict Vf, float *restrict At, int64_t nk,
                                int64_t D, int64_t RP, const int RV) {
    int64_t d = 0;
    for (; d + KEY_BLOCK <= D; d += KEY_BLOCK) {
        vf a[KEY_BLOCK][4];
#pragma GCC unroll 4
        for (int dd = 0; dd < KEY_BLOCK; dd++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) a[dd][v] = *(const vf *)(At + (d + dd) * RP + v * LANES);
        for (int64_t j = 0; j < nk; j++) {
            vf pv[4];
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) pv[v] = *(const vf *)(Pt + j * RP + v * LANES);
#pragma GCC unroll 4
            for (int dd = 0; dd < KEY_BLOCK; dd++) {
                const vf vb = (vf){0} + Vf[j * D + d + dd];
#pragma GCC unroll 4
                for (int v = 0; v < RV; v++) a[dd][v] += vb * pv[v];
            }
        }
#pragma GCC unroll 4
        for (int dd = 0; dd < KEY_BLOCK; dd++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) *(vf *)(At + (d + dd) * RP + v * LANES) = a[dd][v];
    }
    for (; d < D; d++) {
        vf a[4];
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) a[v] = *(const vf *)(At + d * RP + v * LANES);
        for (int64_t j = 0; j < nk; j++) {
            const vf vb = (vf){0} + Vf[j * D + d];
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) a[v] += vb * *(const vf *)(Pt + j * RP + v * LANES);
        }
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) *(vf *)(At + d * RP + v * LANES) = a[v];
    }
}

/* The micro-kernels over an item's rv vectors of rows: in one block where they fit (always with AVX-512's 16 lanes),
 * its line length a constant, else in blocks of at most ROW_BLOCK vectors, as even as they can be (a block of one
 * vector would keep too few accumulators to hide the FMAs' latency). */
#define OVER_BLOCKS(KERNEL, A, B, C)                                                                               \
    do {                                                                                                           \
        if (rv <= ROW_BLOCK) switch (rv) {                                                                         \
            case 1: KERNEL(A, B, C, nk, D, 1 * LANES, 1); return;                                                  \
            case 2: KERNEL(A, B, C, nk, D, 2 * LANES, 2); return;                                                  \
            case 3: KERNEL(A, B, C, nk, D, 3 * LANES, 3); return;                                                  \
            case 4: KERNEL(A, B, C, nk, D, 4 * LANES, 4); return;                                                  \
        }                                                                                                          \
        const int blocks = (rv + ROW_BLOCK - 1) / ROW_BLOCK;                                                       \
        for (int b = 0, v0 = 0, n; b < blocks; b++, v0 += n) {                                                    \
            n = (rv - v0 + blocks - b - 1) / (blocks - b);                                                         \
            switch (n) {                                                                                           \
                case 1: KERNEL(A + v0 * LANES, B, C + v0 * LANES, nk, D, rv * LANES, 1); break;                    \
                case 2: KERNEL(A + v0 * LANES, B, C + v0 * LANES, nk, D, rv * LANES, 2); break;                    \
                case 3: KERNEL(A + v0 * LANES, B, C + v0 * LANES, nk, D, rv * LANES, 3); break;                    \
                default: KERNEL(A + v0 * LANES, B, C + v0 * LANES, nk, D, rv * LANES, 4); break;                   \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)

static void scores_rv(const float *Qt, const float *Kf, float *St, int64_t nk, int64_t D, int rv) {
    OVER_BLOCKS(scores, Qt, Kf, St);
}

static void weigh_values_rv(const float *Pt, const float *Vf, float *At, int64_t nk, int64_t D, int rv) {
    OVER_BLOCKS(weigh_values, Pt, Vf, At);
}

typedef struct {
    float *Qt, *Kf, *Vf, *St, *At, *pos, *m, *l, *alpha;
    uint32_t *Qp, *Pp, *Vp; /* the bfloat16 pairs of the dot-product path */
    const uint16_t *zeros;  /* D bfloat16 zeros */
} Scratch;

/* The online softmax over one tile of scores St[j][r] (keys j < nk from t0): scale them, mask keys past each
 * row's position where the tile crosses the diagonal (first: the lowest position), fold the tile's max into the
 * running max m, rescale the running sums l and the accumulators At by exp(old max - new max), and leave
 * exp(score - max) in St. */
static void softmax_tile(Scratch *w, int64_t RP, int64_t nk, int64_t t0, int64_t first, int64_t D, float scale) {
    const int diagonal = t0 + nk - 1 > first;
#if defined(__AVX512F__)
    /* Vectors of 16 rows: the scores scaled (by log2(e) too: the running max and sum are in base 2) and masked,
     * and their running max, in one pass, then the exponentials (exp2_16) and their sums in a second. */
    for (int64_t r = 0; r < RP; r += LANES) {
        const __m512 pos = _mm512_loadu_ps(w->pos + r), m_old = _mm512_loadu_ps(w->m + r);
        const __m512 sc = _mm512_set1_ps(scale * LOG2E);
        __m512 mx = m_old;
        for (int64_t j = 0; j < nk; j++) {
            float *s = w->St + j * RP + r;
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s), sc);
            if (diagonal)
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps((float)(t0 + j)), pos, _CMP_GT_OQ), x,
                                         _mm512_set1_ps(MASKED));
            _mm512_storeu_ps(s, x);
            mx = _mm512_max_ps(mx, x);
        }
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk; j++) {
            float *s = w->St + j * RP + r;
            const __m512 e = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s), mx));
            _mm512_storeu_ps(s, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 alpha = exp2_16(_mm512_sub_ps(m_old, mx));
        _mm512_storeu_ps(w->m + r, mx);
        _mm512_storeu_ps(w->l + r, _mm512_fmadd_ps(_mm512_loadu_ps(w->l + r), alpha, sum));
        _mm512_storeu_ps(w->alpha + r, alpha);
    }
    float *mx = w->alpha;
#else
    for (int64_t j = 0; j < nk; j++) {
        const float key = (float)(t0 + j);
        float *s = w->St + j * RP;
        if (diagonal) {
            _Pragma("omp simd")
            for (int64_t r = 0; r < RP; r++) s[r] = key > w->pos[r] ? MASKED : s[r] * scale;
        } else {
            _Pragma("omp simd")
            for (int64_t r = 0; r < RP; r++) s[r] *= scale;
        }
    }
    float *mx = w->alpha; /* the tile's new running max, then the factor the old sums are rescaled by */
    for (int64_t r = 0; r < RP; r++) mx[r] = w->m[r];
    for (int64_t j = 0; j < nk; j++) {
        const float *s = w->St + j * RP;
        _Pragma("omp simd")
        for (int64_t r = 0; r < RP; r++) mx[r] = s[r] > mx[r] ? s[r] : mx[r];
    }
    float sum[MAX_ROWS] = {0};
    for (int64_t j = 0; j < nk; j++) {
        float *s = w->St + j * RP;
        _Pragma("omp simd")
        for (int64_t r = 0; r < RP; r++) { s[r] = expf(s[r] - mx[r]); sum[r] += s[r]; }
    }
    _Pragma("omp simd")
    for (int64_t r = 0; r < RP; r++) {
        const float alpha = expf(w->m[r] - mx[r]);
        w->m[r] = mx[r];
        w->l[r] = w->l[r] * alpha + sum[r];
        mx[r] = alpha;
    }
#endif
    if (t0 > 0)
        for (int64_t d = 0; d < D; d++) {
            float *a = w->At + d * RP;
            _Pragma("omp simd")
            for (int64_t r = 0; r < RP; r++) a[r] *= mx[r];
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1

/* The bfloat16 path where the CPU has AVX512-BF16: vdpbf16ps multiplies pairs of bfloat16 and adds both products
 * into a float32 lane, so each instruction does two steps of a dot product. Scores pair up head dimensions:
 * Qp[p][r] = (q[r][2p], q[r][2p+1]) against a broadcast pair of a key row, read from the cache as it lies.
 * Values pair up keys: Pp[i][r] = (p[2i][r], p[2i+1][r]) (the weights rounded to bfloat16, as flash attention
 * does on GPUs and PyTorch's CPU kernel does for bfloat16) against Vp[i][d] = (v[2i][d], v[2i+1][d]), the
 * value tile repacked in pairs. Sums, the softmax and the accumulators stay in float32. */
ALWAYS_INLINE void scores_dp(const uint32_t *restrict Qp, const uint16_t *const *restrict krow,
                             float *restrict St, int64_t nk, int64_t pairs, const int RV) {
    const int64_t RP = RV * LANES;
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        __m512 s[4][4];
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; jj++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) s[jj][v] = _mm512_setzero_ps();
        const uint32_t *k0 = (const uint32_t *)krow[j], *k1 = (const uint32_t *)krow[j + 1];
        const uint32_t *k2 = (const uint32_t *)krow[j + 2], *k3 = (const uint32_t *)krow[j + 3];
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh qv[4];
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) qv[v] = (__m512bh)_mm512_load_si512(Qp + p * RP + v * LANES);
            const __m512bh kb[4] = {(__m512bh)_mm512_set1_epi32((int)k0[p]), (__m512bh)_mm512_set1_epi32((int)k1[p]),
                                    (__m512bh)_mm512_set1_epi32((int)k2[p]), (__m512bh)_mm512_set1_epi32((int)k3[p])};
#pragma GCC unroll 4
            for (int jj = 0; jj < 4; jj++)
#pragma GCC unroll 4
                for (int v = 0; v < RV; v++) s[jj][v] = _mm512_dpbf16_ps(s[jj][v], qv[v], kb[jj]);
        }
#pragma GCC unroll 4
        for (int jj = 0; jj < 4; jj++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) _mm512_store_ps(St + (j + jj) * RP + v * LANES, s[jj][v]);
    }
    for (; j < nk; j++) {
        __m512 s[4];
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) s[v] = _mm512_setzero_ps();
        const uint32_t *k = (const uint32_t *)krow[j];
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)k[p]);
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++)
                s[v] = _mm512_dpbf16_ps(s[v], (__m512bh)_mm512_load_si512(Qp + p * RP + v * LANES), kb);
        }
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) _mm512_store_ps(St + j * RP + v * LANES, s[v]);
    }
}

ALWAYS_INLINE void weigh_values_dp(const uint32_t *restrict Pp, const uint32_t *restrict Vp, float *restrict At,
                                   int64_t npairs, int64_t D, const int RV) {
    const int64_t RP = RV * LANES;
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int dd = 0; dd < 4; dd++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) a[dd][v] = _mm512_load_ps(At + (d + dd) * RP + v * LANES);
        for (int64_t i = 0; i < npairs; i++) {
            __m512bh pv[4];
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) pv[v] = (__m512bh)_mm512_load_si512(Pp + i * RP + v * LANES);
#pragma GCC unroll 4
            for (int dd = 0; dd < 4; dd++) {
                const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)Vp[i * D + d + dd]);
#pragma GCC unroll 4
                for (int v = 0; v < RV; v++) a[dd][v] = _mm512_dpbf16_ps(a[dd][v], pv[v], vb);
            }
        }
#pragma GCC unroll 4
        for (int dd = 0; dd < 4; dd++)
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++) _mm512_store_ps(At + (d + dd) * RP + v * LANES, a[dd][v]);
    }
    for (; d < D; d++) {
        __m512 a[4];
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) a[v] = _mm512_load_ps(At + d * RP + v * LANES);
        for (int64_t i = 0; i < npairs; i++) {
            const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)Vp[i * D + d]);
#pragma GCC unroll 4
            for (int v = 0; v < RV; v++)
                a[v] = _mm512_dpbf16_ps(a[v], (__m512bh)_mm512_load_si512(Pp + i * RP + v * LANES), vb);
        }
#pragma GCC unroll 4
        for (int v = 0; v < RV; v++) _mm512_store_ps(At + d * RP + v * LANES, a[v]);
    }
}

static void scores_dp_rv(const uint32_t *Qp, const uint16_t *const *krow, float *St, int64_t nk, int64_t pairs,
                         int rv) {
    switch (rv) {
        case 1: scores_dp(Qp, krow, St, nk, pairs, 1); break;
        case 2: scores_dp(Qp, krow, St, nk, pairs, 2); break;
        case 3: scores_dp(Qp, krow, St, nk, pairs, 3); break;
        default: scores_dp(Qp, krow, St, nk, pairs, 4); break;
    }
}

static void weigh_values_dp_rv(const uint32_t *Pp, const uint32_t *Vp, float *At, int64_t npairs, int64_t D,
                               int rv) {
    switch (rv) {
        case 1: weigh_values_dp(Pp, Vp, At, npairs, D, 1); break;
        case 2: weigh_values_dp(Pp, Vp, At, npairs, D, 2); break;
        case 3: weigh_values_dp(Pp, Vp, At, npairs, D, 3); break;
        default: weigh_values_dp(Pp, Vp, At, npairs, D, 4); break;
    }
}

/* Lane r of the result: (p0[r], p1[r]) as bfloat16, p0 in the low half. */
static inline __m512i pair_rows(__m512 p0, __m512 p1) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* elements 0-15: p0, 16-31: p1 */
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(INTERLEAVE), both);
}

/* Value rows in pairs of keys: Vp[i][d] = (v[2i][d], v[2i + 1][d]), v[2i][d] in the low half. */
static void pair_values(const uint16_t *const *vrow, uint32_t *Vp, int64_t npairs, int64_t D) {
    const __m512i order = _mm512_loadu_si512(INTERLEAVE);
    for (int64_t i = 0; i < npairs; i++) {
        const uint16_t *a = vrow[2 * i], *b = vrow[2 * i + 1];
        uint32_t *dst = Vp + i * D;
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const void *)(a + d))),
                                                    _mm256_loadu_si256((const void *)(b + d)), 1);
            _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(order, both));
        }
        for (; d < D; d++) dst[d] = (uint32_t)a[d] | (uint32_t)b[d] << 16;
    }
}
#endif

/* One work item: KV head g of sequence b, its queries q0 .. q0 + nq - 1 (of n new ones) and their G heads each. */
static void item(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t seq_len,
                 int64_t row0, int64_t n, int64_t q0, int64_t nq, int64_t g, void *out, int64_t H, int64_t Hkv,
                 int64_t D, int64_t block_size, float scale, int bf16, Scratch *w) {
    const int64_t G = H / Hkv, R = nq * G, rv = (R + LANES - 1) / LANES, RP = rv * LANES, row = Hkv * D;
    const int64_t first = seq_len - n + q0;   /* position of the item's first query */
    const int64_t kend = first + nq;          /* keys 0 .. kend - 1 are attended by some row */
    const size_t esize = bf16 ? 2 : 4;
#ifdef HAVE_DPBF16
    const int pairs = bf16 && D % 2 == 0;     /* the dot-product path: bfloat16 with whole pairs in a row */
#else
    const int pairs = 0;
#endif
    /* Rows r = query * G + head-in-group; padded rows are zero and see every key. */
    for (int64_t r = 0; r < RP; r++) w->pos[r] = (float)(r < R ? first + r / G : kend);
    if (pairs) {
        memset(w->Qp, 0, sizeof(uint32_t) * (size_t)(D / 2 * RP));
        for (int64_t r = 0; r < R; r++) {
            const uint32_t *src = (const uint32_t *)q + ((row0 + q0 + r / G) * H + g * G + r % G) * D / 2;
            for (int64_t p = 0; p < D / 2; p++) w->Qp[p * RP + r] = src[p];
        }
    } else {
        memset(w->Qt, 0, sizeof(float) * (size_t)(D * RP));
        for (int64_t r = 0; r < R; r++) {
            const char *src = (const char *)q + (size_t)(((row0 + q0 + r / G) * H + g * G + r % G) * D) * esize;
            float line[D];
            load_row(line, src, D, bf16);
            for (int64_t d = 0; d < D; d++) w->Qt[d * RP + r] = line[d];
        }
    }
    memset(w->At, 0, sizeof(float) * (size_t)(D * RP));
    for (int64_t r = 0; r < RP; r++) { w->m[r] = MASKED; w->l[r] = 0.0f; }
    for (int64_t t0 = 0; t0 < kend; t0 += KEYS) {
        const int64_t nk = kend - t0 < KEYS ? kend - t0 : KEYS;
        if (pairs) {
#ifdef HAVE_DPBF16
            const uint16_t *krow[KEYS + 1], *vrow[KEYS + 1];
            for (int64_t j = 0; j < nk; j++) {
                const int64_t t = t0 + j, slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                krow[j] = (const uint16_t *)k_cache + slot * row + g * D;
                vrow[j] = (const uint16_t *)v_cache + slot * row + g * D;
            }
            vrow[nk] = w->zeros; /* an odd tile's last pair: a zero second key, so its weight (also zero) meets no NaN */
            /* The next tile's key and value rows of this head, prefetched into L2 while this one computes: a head's
             * rows lie a whole cache row (every KV head) apart, which the hardware prefetchers do not follow, and
             * read on demand they stalled the broadcasts of the scores (a sampling profile's hottest instructions):
             * 0.84-0.89x the kernel's time at 2.5K cached tokens, 0.93-0.98x at 1K and a 2K prompt (abp.py in
             * bench/results/cpu-2core/cpu-kernels/). */
            for (int64_t j = 0, next = t0 + KEYS; j < KEYS && next + j < kend; j++) {
                const int64_t t = next + j, slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const char *kr = (const char *)((const uint16_t *)k_cache + slot * row + g * D);
                const char *vr = (const char *)((const uint16_t *)v_cache + slot * row + g * D);
                for (int64_t off = 0; off < D * 2; off += 64) {
                    _mm_prefetch(kr + off, _MM_HINT_T1);
                    _mm_prefetch(vr + off, _MM_HINT_T1);
                }
            }
            pair_values(vrow, w->Vp, (nk + 1) / 2, D);
            scores_dp_rv(w->Qp, krow, w->St, nk, D / 2, (int)rv);
            softmax_tile(w, RP, nk, t0, first, D, scale);
            if (nk % 2) memset(w->St + nk * RP, 0, sizeof(float) * (size_t)RP);
            for (int64_t i = 0; i < (nk + 1) / 2; i++)
                for (int64_t v = 0; v < rv; v++)
                    _mm512_store_si512(w->Pp + i * RP + v * LANES,
                                       pair_rows(_mm512_load_ps(w->St + 2 * i * RP + v * LANES),
                                                 _mm512_load_ps(w->St + (2 * i + 1) * RP + v * LANES)));
            weigh_values_dp_rv(w->Pp, w->Vp, w->At, (nk + 1) / 2, D, (int)rv);
#endif
        } else {
            for (int64_t j = 0; j < nk; j++) {
                const int64_t t = t0 + j, slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const size_t at = (size_t)(slot * row + g * D) * esize;
                load_row(w->Kf + j * D, (const char *)k_cache + at, D, bf16);
                load_row(w->Vf + j * D, (const char *)v_cache + at, D, bf16);
            }
            scores_rv(w->Qt, w->Kf, w->St, nk, D, (int)rv);
            softmax_tile(w, RP, nk, t0, first, D, scale);
            weigh_values_rv(w->St, w->Vf, w->At, nk, D, (int)rv);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = 1.0f / w->l[r]; /* > 0: key 0 is in every row's first tile */
        const size_t at = (size_t)(((row0 + q0 + r / G) * H + g * G + r % G) * D);
        if (bf16) {
            uint16_t *o = (uint16_t *)out + at;
            for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(w->At[d * RP + r] * inv);
        } else {
            float *o = (float *)out + at;
            for (int64_t d = 0; d < D; d++) o[d] = w->At[d * RP + r] * inv;
        }
    }
}

static int paged_prefill(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         const int32_t *seq_lens, const int32_t *query_start, void *out, int64_t num_seqs,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         int64_t max_blocks, float scale, int64_t num_threads, int bf16) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    if (G > MAX_ROWS) return 2;
    const int64_t tile = MAX_ROWS / G; /* queries of an item */
    /* Items, each sequence's last query tile first: the longest come first, the shortest fill the end. */
    int64_t count = 0;
    for (int64_t b = 0; b < num_seqs; b++) count += (query_start[b + 1] - query_start[b] + tile - 1) / tile;
    int64_t *items = malloc(sizeof(int64_t) * (size_t)(2 * (count > 0 ? count : 1)));
    if (!items) return 1;
    int64_t k = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t n = query_start[b + 1] - query_start[b];
        for (int64_t q0 = (n - 1) / tile * tile; q0 >= 0 && n > 0; q0 -= tile) { items[2 * k] = b; items[2 * k + 1] = q0; k++; }
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        /* floats: Qt, At, St (+ a zero row), Kf, Vf, pos, m, l, alpha; then 32-bit pairs: Qp, Pp, Vp */
        const size_t floats = (size_t)(2 * D * MAX_ROWS + (KEYS + 1) * MAX_ROWS + 2 * KEYS * D + 4 * MAX_ROWS),
                     words = (size_t)((D + 1) / 2 * MAX_ROWS + KEYS / 2 * MAX_ROWS + (KEYS / 2 + 1) * D);
        float *buf = aligned_alloc(64, (4 * (floats + words) + 63) / 64 * 64);
        Scratch w = {0};
        if (buf) {
            w.Qt = buf; w.At = w.Qt + D * MAX_ROWS; w.St = w.At + D * MAX_ROWS; w.Kf = w.St + (KEYS + 1) * MAX_ROWS;
            w.Vf = w.Kf + KEYS * D; w.pos = w.Vf + KEYS * D; w.m = w.pos + MAX_ROWS; w.l = w.m + MAX_ROWS;
            w.alpha = w.l + MAX_ROWS;
            w.Qp = (uint32_t *)(buf + floats); w.Pp = w.Qp + (D + 1) / 2 * MAX_ROWS; w.Vp = w.Pp + KEYS / 2 * MAX_ROWS;
            w.zeros = (const uint16_t *)(w.Vp + KEYS / 2 * D);
            memset(w.Vp + KEYS / 2 * D, 0, sizeof(uint16_t) * (size_t)D);
        } else {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t i = 0; i < count * num_kv_heads; i++) {
            if (!buf) continue;
            const int64_t b = items[2 * (i / num_kv_heads)], q0 = items[2 * (i / num_kv_heads) + 1];
            const int64_t g = i % num_kv_heads, n = query_start[b + 1] - query_start[b];
            item(q, k_cache, v_cache, block_tables + b * max_blocks, seq_lens[b], query_start[b], n, q0,
                 n - q0 < tile ? n - q0 : tile, g, out, num_heads, num_kv_heads, D, block_size, scale, bf16, &w);
        }
        free(buf);
    }
    free(items);
    return failed;
}

int paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                      const int32_t *seq_lens, const int32_t *query_start, float *out, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, float scale, int64_t num_threads) {
    return paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, num_seqs, num_heads,
                         num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads, 0);
}

int paged_prefill_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *block_tables, const int32_t *seq_lens, const int32_t *query_start,
                       uint16_t *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
    return paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, num_seqs, num_heads,
                         num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads, 1);
}
