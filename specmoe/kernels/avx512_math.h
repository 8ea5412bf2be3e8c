/* bf16 <-> fp32 conversions (scalar and 16 lanes, round to nearest even, NaN kept a quiet
 * NaN), exp512, exp(x) in the 16 fp32 lanes of an AVX-512 register, and a 16 x 16 dword
 * transpose: shared by the bf16 and int4 linear, attention and elementwise kernels;
 * specmoe/kernels/build.py hashes this header into their cache keys. */
#ifndef SPECMOE_AVX512_MATH_H
#define SPECMOE_AVX512_MATH_H
#include <immintrin.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((c.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* 16 bf16 from p, widened to fp32. */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* fp32 bit patterns rounded to nearest even at bf16 precision (the bf16 in the upper 16
 * bits), as f32_to_bf16 does per lane. */
static inline __m512i bf16_round_bits(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(
        _mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
}

/* 16 fp32 lanes stored at p as bf16. */
static inline void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16)));
}

/* exp(x) for 16 lanes: 2^n * p(r), x = n ln2 + r, degree-6 polynomial (relative error
 * ~2e-7); x below -87 gives 0, above 88 gives inf. */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(~tiny, p, n);
}

/* Transpose 16 x 16 dwords in place: r[j] lane i becomes r[i] lane j. */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4a + b] now holds, in 128-bit lane L, column 4L + b of rows 4a .. 4a+3: row 4L + b
     * of the result is lane L of r[b], r[4 + b], r[8 + b] and r[12 + b] */
    for (int b = 0; b < 4; b++) {
        __m512i x0 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);
        __m512i x1 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xDD);
        __m512i x2 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
        __m512i x3 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xDD);
        t[b] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        t[8 + b] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        t[4 + b] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        t[12 + b] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

#endif /* SPECMOE_AVX512_MATH_H */
