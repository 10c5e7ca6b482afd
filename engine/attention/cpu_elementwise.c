/* The CPU backend's elementwise layers, fused: RMSNorm (with the residual add before it), SiLU-and-multiply and
 * RoPE, one pass over each row, the rows spread over the threads.
 *
 * PyTorch runs each as several ops (engine/ops.py), every one a pass over the activations: in a 2,048-token
 * prefill of issue 23's model they took about 8% of the step. Here each value is rounded where that composition
 * rounds it, so that the results are TorchOps' (the sum of squares aside: its order of additions differs):
 *   add + RMSNorm, bfloat16: s = bf16(x + r); h = s * rsqrt(mean(s^2) + eps) in float32; out = bf16(bf16(h) * w)
 *   SiLU-and-multiply, bfloat16: a = bf16(g / (1 + exp(-g))); out = bf16(a * u)
 *   RoPE, bfloat16: c = bf16(cos), s = bf16(sin); out1 = bf16(bf16(x1 * c) - bf16(x2 * s)),
 *                   out2 = bf16(bf16(x2 * c) + bf16(x1 * s)) (exactly TorchOps.apply_rope's results)
 *   float32: the same without the roundings (RoPE's products not fused into FMAs, which would round once).
 *
 * Built with the other CPU kernels into one library by engine/attention/cpu_kernel.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Rows of up to this many elements in all run on the calling thread: a decode step's norm or SiLU (8 x 576: 5 us)
 * gains nothing from a second thread, and waits for it at the barrier when the OS has lent its core to another
 * process (the API server, a client): in one run on a busy host the norm averaged 1.75 ms a call. */
#define SERIAL_UP_TO 65536

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 widen_bf16x16_masked(const uint16_t *p, __mmask16 m) { /* lanes outside m: 0 */
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, p));
}

static inline __m512 round_bf16x16(__m512 v) { /* each lane rounded to bfloat16 (to nearest even) and back */
    return bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v));
}
#endif

/* out = rms_norm(x + residual) * w over rows of n; residual NULL: no add (sum unused), else sum = x + residual. */
int rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out, uint16_t *sum,
                  int64_t rows, int64_t n, float eps, int64_t num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows * n > SERIAL_UP_TO)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        uint16_t *outr = out + r * n;
        float squares = 0.0f;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        /* 16 at a time (the plain loops below took about 2x the time at 512 rows) */
        __m512 sq = _mm512_setzero_ps();
        const uint16_t *rr = residual ? residual + r * n : NULL;
        uint16_t *sr = residual ? sum + r * n : NULL;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = i + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            __m512 v = widen_bf16x16_masked(xr + i, m);
            if (rr) {
                const __m256i s16 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v, widen_bf16x16_masked(rr + i, m)));
                _mm256_mask_storeu_epi16(sr + i, m, s16);
                v = bf16x16_to_f32(s16);
            }
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        if (rr) xr = sr;
        squares = _mm512_reduce_add_ps(sq);
        const float inv = (float)(1.0 / sqrt((double)(squares / (float)n + eps)));
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = i + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            const __m512 h = round_bf16x16(_mm512_mul_ps(widen_bf16x16_masked(xr + i, m), _mm512_set1_ps(inv)));
            _mm256_mask_storeu_epi16(outr + i, m,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(h, widen_bf16x16_masked(w + i, m))));
        }
#else
        if (residual) {
            const uint16_t *rr = residual + r * n;
            uint16_t *sr = sum + r * n;
            _Pragma("omp simd reduction(+ : squares)")
            for (int64_t i = 0; i < n; i++) {
                const uint16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
                sr[i] = s;
                squares += bf16_to_f32(s) * bf16_to_f32(s);
            }
            xr = sr;
        } else {
            _Pragma("omp simd reduction(+ : squares)")
            for (int64_t i = 0; i < n; i++) squares += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        }
        const float inv = (float)(1.0 / sqrt((double)(squares / (float)n + eps))); /* not -ffast-math's estimate */
        _Pragma("omp simd")
        for (int64_t i = 0; i < n; i++) outr[i] = f32_to_bf16(round_bf16(bf16_to_f32(xr[i]) * inv) * bf16_to_f32(w[i]));
#endif
    }
    return 0;
}

int rms_norm_f32(const float *x, const float *residual, const float *w, float *out, float *sum, int64_t rows,
                 int64_t n, float eps, int64_t num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows * n > SERIAL_UP_TO)")
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *outr = out + r * n, squares = 0.0f;
        if (residual) {
            const float *rr = residual + r * n;
            float *sr = sum + r * n;
            _Pragma("omp simd reduction(+ : squares)")
            for (int64_t i = 0; i < n; i++) { sr[i] = xr[i] + rr[i]; squares += sr[i] * sr[i]; }
            xr = sr;
        } else {
            _Pragma("omp simd reduction(+ : squares)")
            for (int64_t i = 0; i < n; i++) squares += xr[i] * xr[i];
        }
        const float inv = (float)(1.0 / sqrt((double)(squares / (float)n + eps)));
        _Pragma("omp simd")
        for (int64_t i = 0; i < n; i++) outr[i] = w[i] * (xr[i] * inv);
    }
    return 0;
}

/* x [rows, 2n] = [gate | up] -> out [rows, n] = silu(gate) * up */
int silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t n, int64_t num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows * n > SERIAL_UP_TO)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
        int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        /* 16 at a time: e^-g as exp2_16 (relative error about 1e-7, below the bfloat16 rounding that follows), the
         * roundings by vcvtneps2bf16 (to nearest even, as f32_to_bf16). The plain loop below, which GCC does not
         * vectorize through f32_to_bf16's NaN test, took 3-4x the time at 512 rows. */
        for (; i < n; i += 16) {
            const __mmask16 m = i + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
            const __m512 gi = widen_bf16x16_masked(g + i, m), ui = widen_bf16x16_masked(u + i, m);
            const __m512 e = exp2_16(_mm512_mul_ps(gi, _mm512_set1_ps(-LOG2E)));
            const __m512 a = round_bf16x16(_mm512_div_ps(gi, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, ui)));
        }
#endif
        _Pragma("omp simd")
        for (int64_t j = i; j < n; j++) {
            const float gi = bf16_to_f32(g[j]);
            o[j] = f32_to_bf16(round_bf16(gi / (1.0f + expf(-gi))) * bf16_to_f32(u[j]));
        }
    }
    return 0;
}

int silu_mul_f32(const float *x, float *out, int64_t rows, int64_t n, int64_t num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (rows * n > SERIAL_UP_TO)")
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        _Pragma("omp simd")
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* RoPE (rotate_half pairs: dimension i with i + D/2) of x [tokens, heads, D], token t's heads from x + t * stride
 * (q or k as views of the QKV projection's output), into out [tokens, heads, D]; cos and sin [positions, D/2]
 * float32 tables. Small steps (a decode step's few tokens) run on the calling thread: forking costs more. ROUND is
 * where TorchOps rounds to the dtype (nothing in float32), and no product is fused into an FMA, which would round
 * once where torch rounds twice (gcc: the optimize attribute; clang: its pragma). */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FP_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#define NO_FP_CONTRACT_HERE
#else
#define NO_FP_CONTRACT_FN
#define NO_FP_CONTRACT_HERE _Pragma("clang fp contract(off)")
#endif

static inline float as_is(float f) { return f; }

#define DEFINE_ROPE(NAME, T, LOAD, STORE, ROUND)                                                                     \
    NO_FP_CONTRACT_FN int NAME(const T *x, int64_t stride, T *out, const int64_t *rows, const int64_t *positions,  \
                               const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t D,       \
                               int64_t num_threads) {                                                               \
        NO_FP_CONTRACT_HERE                                                                                         \
        const int64_t half = D / 2;                                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * D > 65536)")      \
        for (int64_t t = 0; t < tokens; t++) {                                                                      \
            const int64_t r = rows ? rows[t] : t;                                                                   \
            if (r < 0) continue;                                                                                    \
            const float *ct = cos + positions[t] * half, *st = sin + positions[t] * half;                           \
            for (int64_t h = 0; h < heads; h++) {                                                                   \
                const T *xh = x + t * stride + h * D;                                                               \
                T *oh = out + (r * heads + h) * D;                                                                  \
                _Pragma("omp simd")                                                                                 \
                for (int64_t i = 0; i < half; i++) {                                                                \
                    const float c = ROUND(ct[i]), s = ROUND(st[i]);                                                 \
                    const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                                          \
                    oh[i] = STORE(ROUND(x1 * c) - ROUND(x2 * s));                                                   \
                    oh[i + half] = STORE(ROUND(x2 * c) + ROUND(x1 * s));                                            \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        return 0;                                                                                                   \
    }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
DEFINE_ROPE(rope_bf16_plain, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)

/* bfloat16 RoPE 16 pairs at a time where D/2 is a multiple of 16: each product rounded by vcvtneps2bf16 (to nearest
 * even, as f32_to_bf16) before the sum, so that the results are the plain loop's bit for bit (a 512-token prefill
 * of SmolLM2-135M: 0.54x the plain loop's time for its 60 calls). */
int rope_bf16(const uint16_t *x, int64_t stride, uint16_t *out, const int64_t *rows, const int64_t *positions,
              const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t D, int64_t num_threads) {
    const int64_t half = D / 2;
    if (half % 16 != 0)
        return rope_bf16_plain(x, stride, out, rows, positions, cos, sin, tokens, heads, D, num_threads);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * D > 65536)")
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t r = rows ? rows[t] : t;
        if (r < 0) continue;
        const float *ct = cos + positions[t] * half, *st = sin + positions[t] * half;
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 c = round_bf16x16(_mm512_loadu_ps(ct + i)), s = round_bf16x16(_mm512_loadu_ps(st + i));
            for (int64_t h = 0; h < heads; h++) {
                const uint16_t *xh = x + t * stride + h * D;
                uint16_t *oh = out + (r * heads + h) * D;
                const __m512 x1 = widen_bf16x16(xh + i), x2 = widen_bf16x16(xh + i + half);
                const __m512 a = round_bf16x16(_mm512_mul_ps(x1, c)), b = round_bf16x16(_mm512_mul_ps(x2, s));
                const __m512 e = round_bf16x16(_mm512_mul_ps(x2, c)), f = round_bf16x16(_mm512_mul_ps(x1, s));
                _mm256_storeu_si256((__m256i *)(oh + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(a, b)));
                _mm256_storeu_si256((__m256i *)(oh + i + half), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(e, f)));
            }
        }
    }
    return 0;
}
#else
DEFINE_ROPE(rope_bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
#endif
DEFINE_ROPE(rope_f32, float, as_is, as_is, as_is)

/* A layer's RoPE and KV store in one call (a decode step's layer made five calls of it from Python): q [tokens,
 * heads, D] rotated into q_out (contiguous); k rotated and v copied as they are into slot slots[t] of k_cache and
 * v_cache [num_slots, kv_heads, D] (a negative slot: nothing stored). q, k and v may be views of the QKV
 * projection's output, each token's heads from x + t * its stride, as rope_* reads them. */
#define DEFINE_ROPE_STORE(NAME, ROPE, T)                                                                             \
    int NAME(const T *q, int64_t q_stride, const T *k, int64_t k_stride, const T *v, int64_t v_stride, T *q_out,    \
             T *k_cache, T *v_cache, const int64_t *slots, const int64_t *positions, const float *cos,              \
             const float *sin, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t num_threads) {   \
        ROPE(q, q_stride, q_out, NULL, positions, cos, sin, tokens, heads, D, num_threads);                          \
        ROPE(k, k_stride, k_cache, slots, positions, cos, sin, tokens, kv_heads, D, num_threads);                    \
        for (int64_t t = 0; t < tokens; t++)                                                                         \
            if (slots[t] >= 0)                                                                                       \
                memcpy(v_cache + slots[t] * kv_heads * D, v + t * v_stride, sizeof(T) * (size_t)(kv_heads * D));    \
        return 0;                                                                                                    \
    }

DEFINE_ROPE_STORE(rope_store_kv_bf16, rope_bf16, uint16_t)
DEFINE_ROPE_STORE(rope_store_kv_f32, rope_f32, float)
