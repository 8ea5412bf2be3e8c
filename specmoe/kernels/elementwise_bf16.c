/* The elementwise steps of a decoder layer in one pass each, bf16 in and out, fp32 math in
 * the order of their plain-torch references, so results agree to the last bf16 bit but for
 * the order of one sum (RMSNorm) or the exp approximation (SiLU):
 *
 * - RMSNorm (Zhang and Sennrich 2019, arXiv 1910.07467), HuggingFace Llama's order:
 *   y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)));  reference specmoe/layers/norm.py.
 * - RoPE (Su et al. 2021, arXiv 2104.09864), half-split layout, in place on the query and
 *   key rows: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with fp32 cos/sin tables;
 *   reference specmoe/layers/rotary.py.
 * - SwiGLU's gate (Shazeer 2020, arXiv 2002.05202): out = bf16(bf16(silu(g)) * u) for the
 *   fused [gate | up] rows; reference specmoe/layers/mlp.py.
 *
 * In torch each is 3-20 small ops whose dispatch costs more than the arithmetic at decode
 * sizes (one to a few dozen rows). Built by specmoe/kernels/build.py (gcc -O3
 * -march=native -std=c11 -fopenmp; ISO C mode keeps a * b - c * d from contracting into an
 * FMA, as torch computes it).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "avx512_math.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe elementwise_bf16 needs AVX-512F and AVX-512BW"
#endif

#define MIN_PARALLEL_ELEMS (1 << 16) /* smaller tensors run on one thread */

/* The bf16 value nearest v, as fp32 (what a round trip through a bf16 tensor gives). */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_round_bits(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline int threads_for(int64_t elems, int num_threads) {
    return elems < MIN_PARALLEL_ELEMS || num_threads < 1 ? 1 : num_threads;
}

/* x, out: [T, H] (row strides x_stride, out_stride elements); w: [H]. H % 16 == 0. */
int specmoe_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out,
                          int64_t out_stride, int64_t T, int64_t H, float eps, int num_threads) {
    if (H % 16 || H < 16) return -1;
#pragma omp parallel for num_threads(threads_for(T * H, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * x_stride;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __m512 v = load_bf16x16(xr + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16)
            store_bf16x16(out + t * out_stride + i,
                       _mm512_mul_ps(load_bf16x16(w + i), round_bf16(_mm512_mul_ps(load_bf16x16(xr + i), r))));
    }
    return 0;
}

/* Rotate n_heads heads of head_dim at row t of x (row stride x_stride) by position pos. */
static inline void rotate_row(uint16_t *x, int64_t n_heads, int64_t hd, const float *c,
                              const float *s) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < n_heads; h++) {
        uint16_t *a = x + h * hd, *b = a + half;
        for (int64_t i = 0; i < half; i += 16) {
            __m512 x1 = load_bf16x16(a + i), x2 = load_bf16x16(b + i);
            __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
            __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, ci), _mm512_mul_ps(x2, si));
            __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, ci), _mm512_mul_ps(x1, si));
            store_bf16x16(a + i, o1);
            store_bf16x16(b + i, o2);
        }
    }
}

/* q: [T, nq, hd] rows q_stride apart, k: [T, nk, hd] rows k_stride apart, both rotated in
 * place; positions [T]; cos, sin: [max_position, hd / 2] fp32. hd % 32 == 0. */
int specmoe_rotary_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride,
                        const int64_t *positions, const float *cos_table, const float *sin_table,
                        int64_t T, int64_t nq, int64_t nk, int64_t hd, int64_t max_position,
                        int num_threads) {
    if (hd % 32 || hd < 32) return -1;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
#pragma omp parallel for num_threads(threads_for(T * (nq + nk) * hd, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * (hd / 2), *s = sin_table + positions[t] * (hd / 2);
        rotate_row(q + t * q_stride, nq, hd, c, s);
        rotate_row(k + t * k_stride, nk, hd, c, s);
    }
    return 0;
}

/* gate_up: [T, 2I] (gate columns first), out: [T, I]. I % 16 == 0. */
int specmoe_silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I,
                              int num_threads) {
    if (I % 16 || I < 16) return -1;
#pragma omp parallel for num_threads(threads_for(T * I, num_threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            __m512 x = load_bf16x16(g + i);
            __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                          exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            store_bf16x16(out + t * I + i, _mm512_mul_ps(round_bf16(silu), load_bf16x16(u + i)));
        }
    }
    return 0;
}
