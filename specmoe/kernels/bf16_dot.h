/* dot_pairs: acc[i] += w[2i] x[2i] + w[2i+1] x[2i+1] over the 16 bf16 pairs of two
 * 512-bit vectors, in fp32: `vdpbf16ps` with AVX512-BF16, else the pairs widened by shifts
 * and FMAs. SPECMOE_ISA says which (2 or 1). reduce_add16: 16 horizontal sums at once.
 * Shared by gemv_bf16.c, gemv_int4.c and attention_bf16.c; specmoe/kernels/build.py hashes
 * this header into every kernel's cache key. */
#ifndef SPECMOE_BF16_DOT_H
#define SPECMOE_BF16_DOT_H
#include <immintrin.h>

#ifdef __AVX512BF16__
#define SPECMOE_ISA 2
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}
#else
#define SPECMOE_ISA 1
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i w, __m512i x) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
    __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
    return _mm512_fmadd_ps(w_odd, x_odd, _mm512_fmadd_ps(w_even, x_even, acc));
}
#endif

/* Lane j of the result: the sum of the 16 lanes of a[j], bit for bit as
 * _mm512_reduce_add_ps(a[j]) computes it (the same add tree: lane i + lane i+8, then i+4,
 * i+2, i+1), for 16 vectors at once in 46 shuffles and adds instead of 16 x 8. */
static inline __attribute__((always_inline)) __m512 reduce_add16(const __m512 *a) {
    __m512 u[8], w[4], x[2];
    for (int m = 0; m < 8; m++)  /* 256-bit halves added: a[2m] in lanes 0-7, a[2m+1] 8-15 */
        u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; m++)  /* 128-bit halves added: 128-bit lane j holds a[4m + j] */
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++) {  /* 64-bit halves added */
        __m512d p = _mm512_castps_pd(w[2 * m]), q = _mm512_castps_pd(w[2 * m + 1]);
        x[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
    }
    /* the last pair added: lane 4j + s holds the sum of a[4s + j] */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88),
                             _mm512_shuffle_ps(x[0], x[1], 0xDD));
    return _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

#endif /* SPECMOE_BF16_DOT_H */
