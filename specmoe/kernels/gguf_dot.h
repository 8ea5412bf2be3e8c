/* Dot products of one GGUF weight row with one activation row quantised to int8, for
 * `gguf_gemm.c` (the method of llama.cpp's AVX2 `ggml_vec_dot_*` kernels, written anew).
 *
 * Activations: per block of B inputs (B = 32 for the 32-weight types, 256 for the K-quants)
 * a float scale dx = max|x| / 127 and q = round-half-even(x / dx) in [-127, 127], plus the
 * sum of q over every 16 inputs (`s16`) for the weights' offsets and minima. A weight
 * row's blocks are read as the file stores them; products of their small integers with q
 * are summed exactly in int32 (maddubs, then madd, with a K-quant's 6- or 8-bit sub-block
 * scales applied in the integer domain), and each block's (super-block's) integer sum is
 * scaled once in float32 and added to one 8-lane accumulator; offsets and minima are
 * corrected in float32 per block. The order of every sum depends on k only, never on the
 * number of rows, so a row's result has the same bits in any batch.
 */
#ifndef SPECMOE_GGUF_DOT_H
#define SPECMOE_GGUF_DOT_H

#include <immintrin.h>
#include <stdint.h>

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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
    }
    for (int64_t g = 0; g < k / 16; g++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * g + i];
        s16[g] = (int16_t)s;
    }
}

/* Sum of u[i] * s[i] over 32 bytes (u unsigned, s signed) as 8 int32 lanes, each lane
 * weighted by the int16 lanes of `scale` (lane pairs: 2 per int32 lane). */
static inline __m256i dot_u8s8(__m256i u, __m256i s, __m256i scale) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
}

static inline __m256i nibbles_u8(const uint8_t *qs16) {   /* 16 bytes -> 32 values */
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

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---- blocks of 32 (activations with B = 32) ---------------------------------------------
 * w = d * (u - off) (Q4_0 off 8, Q5_0 off 16), w = d * u + m (Q4_1, Q5_1), w = d * q
 * (Q8_0, signed: |q| times sign-adjusted x). */
enum { L_Q4_0, L_Q4_1, L_Q5_0, L_Q5_1, L_Q8_0 };

static inline __attribute__((always_inline)) float
dot_legacy(const int kind, const int bytes, const uint8_t *w, const int8_t *xq,
           const float *xd, const int16_t *xs, int64_t k) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t b = 0; b < k / 32; b++, w += bytes) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
        const float d = half(w) * xd[b];
        const int sum = xs[2 * b] + xs[2 * b + 1];
        __m256i p;
        switch (kind) {
        case L_Q4_0: p = dot_u8s8(nibbles_u8(w + 2), x, ones); corr -= 8.0f * d * (float)sum; break;
        case L_Q4_1: p = dot_u8s8(nibbles_u8(w + 4), x, ones); corr += half(w + 2) * xd[b] * (float)sum; break;
        case L_Q5_0: {
            uint32_t qh; memcpy(&qh, w + 2, 4);
            const __m256i u = _mm256_or_si256(nibbles_u8(w + 6), _mm256_slli_epi16(bits_to_bytes(qh), 4));
            p = dot_u8s8(u, x, ones); corr -= 16.0f * d * (float)sum; break;
        }
        case L_Q5_1: {
            uint32_t qh; memcpy(&qh, w + 4, 4);
            const __m256i u = _mm256_or_si256(nibbles_u8(w + 8), _mm256_slli_epi16(bits_to_bytes(qh), 4));
            p = dot_u8s8(u, x, ones); corr += half(w + 2) * xd[b] * (float)sum; break;
        }
        default: {  /* L_Q8_0 */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
            p = dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q), ones);
        }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(p), acc);
    }
    return hsum_ps(acc) + corr;
}

#define LEGACY_DOT(name, kind, bytes)                                                      \
    static float name(const uint8_t *w, const int8_t *xq, const float *xd,                 \
                      const int16_t *xs, int64_t k) {                                      \
        return dot_legacy(kind, bytes, w, xq, xd, xs, k);                                  \
    }
LEGACY_DOT(dot_q4_0, L_Q4_0, 18)
LEGACY_DOT(dot_q4_1, L_Q4_1, 20)
LEGACY_DOT(dot_q5_0, L_Q5_0, 22)
LEGACY_DOT(dot_q5_1, L_Q5_1, 24)
LEGACY_DOT(dot_q8_0, L_Q8_0, 34)

/* ---- super-blocks of 256 (activations with B = 256) ------------------------------------ */

static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K (qh NULL) and Q5_K: w = d sc_j u - dmin m_j over sub-blocks j of 32. */
static inline __attribute__((always_inline)) float
dot_k45(const int five, const int bytes, const uint8_t *w, const int8_t *xq,
        const float *xd, const int16_t *xs, int64_t k) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < k / 256; i++, w += bytes, xq += 256, xs += 16) {
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        __m256i sum = _mm256_setzero_si256();
        int msum = 0;
        for (int g = 0; g < 4; g++) {
            int sc0, m0, sc1, m1;
            scale_min_k4(w + 4, 2 * g, &sc0, &m0);
            scale_min_k4(w + 4, 2 * g + 1, &sc1, &m1);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            __m256i u0 = _mm256_and_si256(v, low4);
            __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (five) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
                u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), one), 4));
                u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g + 1), one), 4));
            }
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * g));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * g + 32));
            sum = _mm256_add_epi32(sum, dot_u8s8(u0, x0, _mm256_set1_epi16((short)sc0)));
            sum = _mm256_add_epi32(sum, dot_u8s8(u1, x1, _mm256_set1_epi16((short)sc1)));
            msum += m0 * (xs[4 * g] + xs[4 * g + 1]) + m1 * (xs[4 * g + 2] + xs[4 * g + 3]);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(w) * xd[i]), _mm256_cvtepi32_ps(sum), acc);
        corr -= half(w + 2) * xd[i] * (float)msum;
    }
    return hsum_ps(acc) + corr;
}

static float dot_q4_k(const uint8_t *w, const int8_t *xq, const float *xd,
                      const int16_t *xs, int64_t k) {
    return dot_k45(0, 144, w, xq, xd, xs, k);
}

static float dot_q5_k(const uint8_t *w, const int8_t *xq, const float *xd,
                      const int16_t *xs, int64_t k) {
    return dot_k45(1, 176, w, xq, xd, xs, k);
}

/* Q6_K: w = d sc_g (u - 32) over groups g of 16, u = 4 low bits (ql) | 2 high bits (qh). */
static float dot_q6_k(const uint8_t *w, const int8_t *xq, const float *xd,
                      const int16_t *xs, int64_t k) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < k / 256; i++, w += 210, xq += 256, xs += 16) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        __m256i sum = _mm256_setzero_si256();
        int csum = 0;
        for (int h = 0; h < 2; h++) {
            const __m256i hv = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            for (int s = 0; s < 4; s++) {
                const __m256i lv = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (s % 2)));
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(lv, 4 * (s / 2)), low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), three);
                const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                const int g = 8 * h + 2 * s;
                const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * s));
                sum = _mm256_add_epi32(sum, dot_u8s8(u, x, scale));
                csum += sc[g] * xs[g] + sc[g + 1] * xs[g + 1];
            }
        }
        const float d = half(w + 208) * xd[i];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sum), acc);
        corr -= 32.0f * d * (float)csum;
    }
    return hsum_ps(acc) + corr;
}

#endif
