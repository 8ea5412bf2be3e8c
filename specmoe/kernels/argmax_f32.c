/* Index of the largest value of each row of a float32 matrix, as torch.argmax(x, dim=-1)
 * returns it: the first index of the maximum; a row holding NaN gives its first NaN (torch
 * ranks NaN above every number). Greedy sampling takes it from the logits of every request
 * at every step; torch's CPU argmax scans a row far below memory bandwidth, a vector pass
 * for the maximum and one for its first position run ~10x faster.
 *
 * The plain-torch reference is torch.argmax (specmoe/kernels/argmax.py falls back to it).
 * Built by specmoe/kernels/build.py (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#if !defined(__AVX512F__)
#error "specmoe argmax_f32 needs AVX-512F"
#endif

#define MIN_PARALLEL_ELEMS (1 << 16) /* smaller inputs run on one thread */

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* First index in x[0 .. n) whose lanes satisfy cmp against v (NaN test when v is NaN). */
static int64_t first_match(const float *x, int64_t n, float v, int nan) {
    const __m512 vv = _mm512_set1_ps(v);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 a = _mm512_maskz_loadu_ps(m, x + i);
        const __mmask16 hit = m & (nan ? _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)
                                       : _mm512_cmp_ps_mask(a, vv, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    return 0; /* not reached: the value was taken from x */
}

static int64_t row_argmax(const float *x, int64_t n) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-__builtin_inff()), m, x + i);
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, a);
    }
    if (nan) return first_match(x, n, 0.0f, 1);
    return first_match(x, n, _mm512_reduce_max_ps(mx), 0);
}

/* out[r] = argmax of x[r * stride .. r * stride + n), r < rows. Returns 0, or -1 for
 * n < 1 or rows < 0 (nothing written). */
int specmoe_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                       int num_threads) {
    if (n < 1 || rows < 0) return -1;
    int threads = rows * n < MIN_PARALLEL_ELEMS || num_threads < 1 ? 1 : num_threads;
    if (threads > rows) threads = (int)rows;
#pragma omp parallel for if(threads > 1) num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, n);
    return 0;
}
