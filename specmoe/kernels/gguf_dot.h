/* Dot products of GGUF weight rows with activation rows quantised to int8, for
 * `gguf_gemm.c` (the arithmetic of llama.cpp's AVX2 `ggml_vec_dot_*` kernels, written
 * anew).
 *
 * Activations: per block of B inputs (B = 32 for the 32-weight types, 256 for the K-quants)
 * a float scale dx = max|x| / 127 and q = round-half-even(x / dx) in [-127, 127]; per 16
 * inputs, s16 = the sum of their q (for the weights' offsets).
 *
 * Weights, every type: w[e] = dw[b] sc[g] u[e] - oc[b] mi[g] for input e of block b
 * (B inputs) and group g (16 inputs): u unsigned bytes (Q8_0: |q|, its signs applied to
 * the activations), sc and mi small integers (a K-quant's sub-block scales and minima or
 * Q6_K's scales; 1 otherwise), dw and oc the block's float scale and offset coefficient
 * (Q4_0: d, 8 d; Q4_1: d, -m; Q4_K: d, dmin; Q6_K: d, 32 d; ...). `dot_*` read a weight
 * row's blocks as stored: per block, the integer sum over its 32-input chunks of
 * madd(maddubs(u, q), sc) (exact) is scaled by dw dx and added to 8 float lanes; the
 * offset's integer sum of mi s16 is scaled by oc dx and subtracted from one float, block
 * after block (the 32-weight types: even and odd blocks into two such pairs). The float operations and their order depend on k only, never on the number
 * of rows, so a row's result has the same bits whatever the batch. (Unpacking a weight row
 * once for several activation rows was measured no faster on AVX2: the per-row integer
 * products, not the unpacking, set the cost.)
 */
#ifndef SPECMOE_GGUF_DOT_H
#define SPECMOE_GGUF_DOT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx2_sum.h"

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One activation row, B inputs per scale: q [k], d [k / B], s16 [k / 16]. */
static void quantize_row(const float *x, int64_t k, int B, int8_t *q, float *d,
                         int16_t *s16) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b0 = 0; b0 < k; b0 += B) {
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < B; i += 8)
            mx = _mm256_max_ps(mx, _mm256_and_ps(abs_mask, _mm256_loadu_ps(x + b0 + i)));
        const float dv = hmax_ps(mx) / 127.0f, id = dv > 0.0f ? 1.0f / dv : 0.0f;
        d[b0 / B] = dv;
        const __m256 idv = _mm256_set1_ps(id);
        for (int i = 0; i < B; i += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; j++) {
                const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(x + b0 + i + 8 * j), idv);
                v[j] = _mm256_cvtps_epi32(
                    _mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                                 _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(q + b0 + i), _mm256_permutevar8x32_epi32(p, order));
        }
        for (int g = 0; g < B / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += q[b0 + 16 * g + i];
            s16[b0 / 16 + g] = (int16_t)s;
        }
    }
}

/* One block's float terms, shared by both forms: acc += (dw dx) * sum lanes, and
 * corr -= (oc dx) * isum. */
static inline void block_terms(float dw, float oc, float dx, __m256i sum, int isum,
                               __m256 *acc, float *corr) {
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx), _mm256_cvtepi32_ps(sum), *acc);
    *corr -= oc * dx * (float)isum;
}

static inline __m256i sc_pair(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

static inline __m256i dot32(__m256i u, __m256i x, __m256i sc) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc);
}

static inline __m256i nib_lo_hi(const uint8_t *qs16) {   /* 16 bytes -> 32 values */
    const __m128i v = _mm_loadu_si128((const __m128i *)qs16), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

static inline __m256i bits_to_bytes(uint32_t bits) {  /* bit i -> byte i (0 or 1) */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    const __m256i bit = _mm256_and_si256(v, _mm256_set1_epi64x(0x8040201008040201LL));
    return _mm256_min_epu8(bit, _mm256_set1_epi8(1));
}

/* ---- blocks of 32: d (fp16) [m (fp16)] [qh (4 bytes)] qs -------------------------------
 * One block decoded: its u (and Q8_0's signed q in *q), dw, oc (mi = sc = 1). */
enum { L_Q4_0, L_Q4_1, L_Q5_0, L_Q5_1, L_Q8_0 };

static inline __attribute__((always_inline)) __m256i
legacy_block(const int kind, const uint8_t *w, float *dw, float *oc, __m256i *q) {
    uint32_t qh;
    *dw = half(w);
    switch (kind) {
    case L_Q4_0: *oc = 8.0f * *dw; return nib_lo_hi(w + 2);
    case L_Q4_1: *oc = -half(w + 2); return nib_lo_hi(w + 4);
    case L_Q5_0:
        memcpy(&qh, w + 2, 4);
        *oc = 16.0f * *dw;
        return _mm256_or_si256(nib_lo_hi(w + 6), _mm256_slli_epi16(bits_to_bytes(qh), 4));
    case L_Q5_1:
        memcpy(&qh, w + 4, 4);
        *oc = -half(w + 2);
        return _mm256_or_si256(nib_lo_hi(w + 8), _mm256_slli_epi16(bits_to_bytes(qh), 4));
    default:  /* L_Q8_0 */
        *q = _mm256_loadu_si256((const __m256i *)(w + 2));
        *oc = 0.0f;
        return _mm256_sign_epi8(*q, *q);
    }
}

static inline __attribute__((always_inline)) void
legacy_terms(const int kind, const uint8_t *w, const int8_t *xq, float dx, int isum,
             __m256 *acc, float *corr) {
    const __m256i ones = sc_pair(1, 1);
    float dw, oc;
    __m256i q = _mm256_setzero_si256(), x = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i u = legacy_block(kind, w, &dw, &oc, &q);
    if (kind == L_Q8_0) x = _mm256_sign_epi8(x, q);
    block_terms(dw, oc, dx, dot32(u, x, ones), isum, acc, corr);
}

/* Even blocks add into (acc0, corr0), odd ones into (acc1, corr1): two independent chains,
 * combined once at the end. */
static inline __attribute__((always_inline)) float
dot_legacy(const int kind, const int bytes, const uint8_t *w, const int8_t *xq,
           const float *xd, const int16_t *s16, int64_t k) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float corr0 = 0.0f, corr1 = 0.0f;
    const int64_t nb = k / 32;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        legacy_terms(kind, w + b * bytes, xq + 32 * b, xd[b], s16[2 * b] + s16[2 * b + 1],
                     &acc0, &corr0);
        legacy_terms(kind, w + (b + 1) * bytes, xq + 32 * (b + 1), xd[b + 1],
                     s16[2 * b + 2] + s16[2 * b + 3], &acc1, &corr1);
    }
    if (b < nb)
        legacy_terms(kind, w + b * bytes, xq + 32 * b, xd[b], s16[2 * b] + s16[2 * b + 1],
                     &acc0, &corr0);
    return hsum_ps(_mm256_add_ps(acc0, acc1)) + (corr0 + corr1);
}

/* ---- super-blocks of 256 --------------------------------------------------------------- */

static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K (five = 0) and Q5_K, sub-block j of 32 (u, its scale and min): w = d sc_j u -
 * dmin m_j; sub-block 2g / 2g+1 are the low / high nibbles of qs[32 g ..], Q5_K's fifth
 * bit of input l of sub-block j is bit j of qh[l]. */
static inline __attribute__((always_inline)) __m256i
k45_sub(const int five, const uint8_t *w, int j, int *sc, int *m) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *qs = w + (five ? 48 : 16);
    scale_min_k4(w + 4, j, sc, m);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (j & 1)), low4);
    if (five) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(w + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1));
        u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
    }
    return u;
}

static inline __attribute__((always_inline)) float
dot_k45(const int five, const int bytes, const uint8_t *w, const int8_t *xq,
        const float *xd, const int16_t *s16, int64_t k) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < k / 256; i++, w += bytes, xq += 256, s16 += 16) {
        int sc[8], m[8], isum = 0;
        for (int j = 0; j < 8; j++) {
            scale_min_k4(w + 4, j, &sc[j], &m[j]);
            isum += m[j] * (s16[2 * j] + s16[2 * j + 1]);
        }
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : low4;
        __m256i sum = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {   /* sub-blocks 2g (low nibbles) and 2g + 1 (high) */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            __m256i u0 = _mm256_and_si256(v, low4);
            __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (five) {
                u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), one), 4));
                u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g + 1), one), 4));
            }
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * g));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * g + 32));
            sum = _mm256_add_epi32(sum, dot32(u0, x0, _mm256_set1_epi16((short)sc[2 * g])));
            sum = _mm256_add_epi32(sum, dot32(u1, x1, _mm256_set1_epi16((short)sc[2 * g + 1])));
        }
        block_terms(half(w), half(w + 2), xd[i], sum, isum, &acc, &corr);
    }
    return hsum_ps(acc) + corr;
}

/* Q6_K: ql[128], qh[64], scales[16] (int8), d; w = d sc_g (u - 32) over groups g of 16
 * (dw = d, oc = 32 d, mi = sc). In half h, input 32 s + l: low 4 bits are nibble s / 2 of
 * ql[64 h + 32 (s % 2) + l], high 2 bits are bits 2 s of qh[32 h + l]. Chunk c = 4 h + s. */
static inline __m256i q6_chunk(const uint8_t *w, int c) {
    const int h = c / 4, s = c % 4;
    const __m256i lv = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32 * (s % 2)));
    const __m256i hv = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(lv, 4 * (s / 2)), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

static float dot_q6_k(const uint8_t *w, const int8_t *xq, const float *xd,
                      const int16_t *s16, int64_t k) {
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < k / 256; i++, w += 210, xq += 256, s16 += 16) {
        const int8_t *sc = (const int8_t *)(w + 192);
        __m256i sum = _mm256_setzero_si256();
        int isum = 0;
        for (int c = 0; c < 8; c++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * c));
            sum = _mm256_add_epi32(sum, dot32(q6_chunk(w, c), x, sc_pair(sc[2 * c], sc[2 * c + 1])));
            isum += sc[2 * c] * s16[2 * c] + sc[2 * c + 1] * s16[2 * c + 1];
        }
        const float d = half(w + 208);
        block_terms(d, 32.0f * d, xd[i], sum, isum, &acc, &corr);
    }
    return hsum_ps(acc) + corr;
}

#define DOT_ROW(name, call)                                                                \
    static float name(const uint8_t *w, const int8_t *xq, const float *xd,                 \
                      const int16_t *s16, int64_t k) {                                     \
        return call;                                                                       \
    }
DOT_ROW(dot_q4_0, dot_legacy(L_Q4_0, 18, w, xq, xd, s16, k))
DOT_ROW(dot_q4_1, dot_legacy(L_Q4_1, 20, w, xq, xd, s16, k))
DOT_ROW(dot_q5_0, dot_legacy(L_Q5_0, 22, w, xq, xd, s16, k))
DOT_ROW(dot_q5_1, dot_legacy(L_Q5_1, 24, w, xq, xd, s16, k))
DOT_ROW(dot_q8_0, dot_legacy(L_Q8_0, 34, w, xq, xd, s16, k))
DOT_ROW(dot_q4_k, dot_k45(0, 144, w, xq, xd, s16, k))
DOT_ROW(dot_q5_k, dot_k45(1, 176, w, xq, xd, s16, k))

#endif
