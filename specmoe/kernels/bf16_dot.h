/* dot_pairs: acc[i] += w[2i] x[2i] + w[2i+1] x[2i+1] over the 16 bf16 pairs of two
 * 512-bit vectors, in fp32: `vdpbf16ps` with AVX512-BF16, else the pairs widened by shifts
 * and FMAs. SPECMOE_ISA says which (2 or 1). transpose_sum16: 16 horizontal sums at once.
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

/* Lane j of the result: the sum of the 16 lanes of a[j] (a transposing add tree: 45
 * shuffles and adds for 16 horizontal sums). */
static inline __attribute__((always_inline)) __m512 transpose_sum16(const __m512 *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  /* 128-bit lane: a[2i] x, a[2i+1] x, a[2i] y, a[2i+1] y */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* 128-bit lane: a[4i] .. a[4i+3], one partial each */
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  /* 128-bit lanes: a[8i..8i+3] twice, a[8i+4..8i+7] twice */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

#endif /* SPECMOE_BF16_DOT_H */
