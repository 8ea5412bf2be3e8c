/* MoE gate scoring for bf16 models on CPU, with the bits of the torch code it replaces:
 *
 * - specmoe_route_softmax_bf16: TopKRouter's routing from the gate's bf16 logits [T, N]:
 *   softmax over N in fp32, the k heaviest experts by a stable descending sort (equal
 *   weights: the lower expert id wins and comes first), optionally renormalised to sum to
 *   one, the weights rounded to bf16 (reference: specmoe/layers/moe/router.py).
 * - specmoe_sigmoid_bf16: torch.sigmoid of a bf16 vector (the Qwen2-MoE shared-expert gate;
 *   reference: specmoe/layers/moe/block.py).
 *
 * Both reproduce the order of operations of torch's CPU kernels built for AVX-512 (ATen's
 * CPU capability "AVX512"), so the results equal torch's bit for bit there (the tests check
 * this against torch itself, and only within a few fp32 ulps elsewhere):
 * - softmax over the last dimension (ATen SoftMaxKernel.cpp, _vec_softmax_lastdim for
 *   float): m = max; e_i = exp(x_i - m) with SLEEF's expf (Sleef_expf16_u10: Cody-Waite
 *   reduction by ln 2 in two parts, a degree-6 polynomial in FMAs, scaling by two powers of
 *   two); the sum of the e_i as ATen's vec::reduce_all (16 lanes accumulated in order, a
 *   tail of fewer than 16 added into the first lanes, then the lanes folded by the 256-,
 *   128-, 64- and 32-bit shuffles; below 16 elements, in order); p_i = e_i * (1 / sum).
 * - the top-k renormalisation `w / w.sum(-1)`: ATen's sum over a contiguous row of fewer
 *   than 16 floats (SumKernel.cpp, row_sum with 4 interleaved accumulators), then an IEEE
 *   division.
 * - sigmoid of bf16 (UnaryOpsKernel.cpp): blocks of 64 elements in vector code,
 *   1 / (1 + Sleef exp(-x)); the remaining elements in scalar code, 1 / (1 + expf(-x)) with
 *   the C library's expf; each rounded to bf16 once.
 *
 * Built by specmoe/kernels/build.py (gcc -O3 -march=native -std=c11 -fopenmp; ISO C mode
 * keeps a * b + c from contracting into an FMA, so the FMAs here are the intrinsics').
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe router_bf16 needs AVX-512F and AVX-512BW"
#endif

#define MAX_EXPERTS 1024 /* N the router takes (a row of probabilities lives on the stack) */
#define MAX_TOP_K 64     /* row_sum below is ATen's up to 511 */

/* 2^q for integer lanes q in [-126, 127]. */
static inline __m512 pow2i(__m512i q) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(127)), 23));
}

/* SLEEF's xexpf (Sleef_expf16_u10, AVX-512F), lane for lane. */
static inline __m512 sleef_exp16(__m512 d) {
    const __m512i q = _mm512_cvt_roundps_epi32(
        _mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i half = _mm512_srai_epi32(q, 1);
    u = _mm512_mul_ps(_mm512_mul_ps(u, pow2i(half)), pow2i(_mm512_sub_epi32(q, half)));
    const __mmask16 tiny = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
    u = _mm512_maskz_mov_ps((__mmask16)~tiny, u);
    const __mmask16 huge = _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ);
    return _mm512_mask_mov_ps(u, huge, _mm512_set1_ps(INFINITY));
}

/* ATen's vec_reduce_all of 16 lanes for +, AVX-512 (the shuffle tree). */
static inline float fold_add16(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
    return _mm512_cvtss_f32(v);
}

static inline __mmask16 first(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* p [N] = softmax(x [N] bf16) in fp32, as torch.softmax(x.float(), -1) (see the top). */
static void softmax_row(const uint16_t *x, float *p, int64_t N) {
    float m = -INFINITY;
    for (int64_t i = 0; i < N; i++) {
        const float v = bf16_to_f32(x[i]);
        m = (v > m || v != v) ? v : m; /* NaN propagates, as vec::maximum */
    }
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t i = 0; i < N; i += 16) {
        const __mmask16 k = first(N - i);
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x + i)), 16));
        _mm512_mask_storeu_ps(p + i, k, sleef_exp16(_mm512_sub_ps(v, mv)));
    }
    float sum;
    if (N < 16) {
        sum = p[0];
        for (int64_t i = 1; i < N; i++) sum += p[i];
    } else {
        __m512 acc = _mm512_loadu_ps(p);
        int64_t d = 16;
        for (; d < N - N % 16; d += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + d));
        if (N - d > 0) {
            const __mmask16 k = first(N - d);
            acc = _mm512_mask_add_ps(acc, k, acc, _mm512_maskz_loadu_ps(k, p + d));
        }
        sum = fold_add16(acc);
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < N; i++) p[i] = p[i] * inv;
}

/* a ranks before b in torch's descending sort (NaN first). */
static inline int heavier(float a, float b) { return a > b || (a != a && b == b); }

/* ATen's sum of a contiguous row of n <= MAX_TOP_K floats (SumKernel.cpp's cascade_sum; torch
 * dispatches its 8-lane AVX2 build for sum on AVX-512 CPUs too). Its row_sum keeps 4
 * interleaved accumulators (fewer than 16 rows each, so no cascade levels): n < 8 sums the
 * scalars that way; from n = 8 (vectorized_inner_sum) it sums the n / 8 whole 8-float vectors
 * that way lane by lane, then adds the scalar tail in order from 0, then the 8 lanes. */
static float row_sum(const float *w, int64_t n) {
    if (n < 8) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int64_t blocks = n / 4;
        for (int64_t b = 0; b < blocks; b++)
            for (int j = 0; j < 4; j++) acc[j] += w[4 * b + j];
        for (int64_t i = blocks * 4; i < n; i++) acc[0] += w[i];
        for (int j = 1; j < 4; j++) acc[0] += acc[j];
        return acc[0];
    }
    float acc[4][8] = {{0.0f}};
    const int64_t vectors = n / 8, blocks = vectors / 4;
    for (int64_t b = 0; b < blocks; b++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) acc[j][l] += w[(4 * b + j) * 8 + l];
    for (int64_t v = blocks * 4; v < vectors; v++)
        for (int l = 0; l < 8; l++) acc[0][l] += w[v * 8 + l];
    for (int j = 1; j < 4; j++)
        for (int l = 0; l < 8; l++) acc[0][l] += acc[j][l];
    float total = 0.0f;
    for (int64_t i = vectors * 8; i < n; i++) total += w[i];
    for (int l = 0; l < 8; l++) total += acc[0][l];
    return total;
}

/* row_sum, exported for the test that holds it to torch.sum's bits. */
float specmoe_router_row_sum(const float *w, int64_t n) { return row_sum(w, n); }

/* logits [T, N] bf16 -> ids [T, k] int64 (heaviest first; ties: the lower id first) and
 * weights [T, k] bf16 (renormalised to sum to one when norm_topk_prob). Returns 0, or -1
 * for sizes out of range (N above MAX_EXPERTS, k outside [1, min(N, MAX_TOP_K)]). */
int specmoe_route_softmax_bf16(const uint16_t *logits, int64_t T, int64_t N, int64_t k,
                               int norm_topk_prob, int64_t *ids, uint16_t *weights) {
    if (N < 1 || N > MAX_EXPERTS || k < 1 || k > N || k > MAX_TOP_K || T < 0) return -1;
    float p[MAX_EXPERTS], w[MAX_TOP_K];
    unsigned char taken[MAX_EXPERTS];
    for (int64_t t = 0; t < T; t++) {
        softmax_row(logits + t * N, p, N);
        memset(taken, 0, (size_t)N);
        for (int64_t j = 0; j < k; j++) { /* selection: first heaviest not yet taken */
            int64_t best = -1;
            for (int64_t e = 0; e < N; e++)
                if (!taken[e] && (best < 0 || heavier(p[e], p[best]))) best = e;
            taken[best] = 1;
            ids[t * k + j] = best;
            w[j] = p[best];
        }
        if (norm_topk_prob) {
            const float s = row_sum(w, k);
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / s;
        }
        for (int64_t j = 0; j < k; j++) weights[t * k + j] = f32_to_bf16(w[j]);
    }
    return 0;
}

/* out [n] = sigmoid(x [n]), bf16, as torch.sigmoid on a contiguous bf16 tensor (one
 * thread's range: n below ATen's grain of 32768 elements). */
void specmoe_sigmoid_bf16(const uint16_t *x, uint16_t *out, int64_t n) {
    const int64_t vector_end = n / 64 * 64; /* ATen's vector loop: two 32-lane bf16 vectors */
    int64_t i = 0;
    for (; i < vector_end; i += 16) {
        const __m512 v = load_bf16x16(x + i);
        const __m512 e = sleef_exp16(_mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u))));
        store_bf16x16(out + i, _mm512_div_ps(_mm512_set1_ps(1.0f),
                                             _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    }
    for (; i < n; i++) {
        const float v = bf16_to_f32(x[i]);
        out[i] = f32_to_bf16(1.0f / (1.0f + expf(-v)));
    }
}
