/* dot_pairs: acc[i] += w[2i] x[2i] + w[2i+1] x[2i+1] over the 16 bf16 pairs of two
 * 512-bit vectors, in fp32: `vdpbf16ps` with AVX512-BF16, else the pairs widened by shifts
 * and FMAs. SPECMOE_ISA says which (2 or 1).
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

#endif /* SPECMOE_BF16_DOT_H */
