/* Horizontal sums and maxima of 8 float lanes (AVX), shared by the AVX2 kernels. */
#ifndef SPECMOE_AVX2_SUM_H
#define SPECMOE_AVX2_SUM_H

#include <immintrin.h>

/* The 8 lanes' sum, always in one order: (l0+l4, l1+l5, l2+l6, l3+l7) pairwise. */
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

#endif
