/* exp512: exp(x) in the 16 fp32 lanes of an AVX-512 register, shared by the attention and
 * elementwise kernels; specmoe/kernels/build.py hashes this header into their cache keys. */
#ifndef SPECMOE_AVX512_MATH_H
#define SPECMOE_AVX512_MATH_H
#include <immintrin.h>

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

#endif /* SPECMOE_AVX512_MATH_H */
