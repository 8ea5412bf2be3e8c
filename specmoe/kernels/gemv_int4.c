/* y[T, N] = x[T, K] @ W^T (+ b[N]) for int4 weights, T <= 16, fp32 accumulation; and the
 * pass that dequantises rows of W to bf16, in the bf16 kernel's panel layout, for many rows
 * of x (specmoe_int4_to_bf16_panels, at the end).
 *
 * Layout (specmoe/kernels/gemv_int4.py `pack_int4`), groups of 32 inputs, K % 32 == 0:
 *   packed  uint8 [N, K/2]: byte j of row n = q[n, 2j] | q[n, 2j+1] << 4, q in [0, 15]
 *   scales  bf16  [N, K/32]: s[n, g]        zeros  bf16  [N, K/32]: z[n, g]
 *   W[n, 32g + i] = (q[n, 32g + i] - 8) * s[n, g] + z[n, g]
 * as Int4Linear and torch's `_weight_int4pack_mm_for_cpu` define it. Scale and zero stay the
 * exact bf16 values `quantize_int4` made (no folded zero to round): 20 bytes per group of 32
 * weights, the same as torch's layout (fp32 scales and zeros would be 24).
 *
 * Math. Per group, sum_i x_i W_i = s * sum_i x_i q_i + (z - 8 s) * sum_i x_i: the weights are
 * multiplied as small integers and each group's scale is applied once, to its dot product
 * (the factoring of group-quantised GEMV kernels: llama.cpp's Q4_1 dot, GPTQ/AWQ kernels;
 * here with float dots). The integers become bf16 without a conversion (the "magic number"
 * trick of int4 -> fp16 converters, e.g. FasterTransformer's; Kim et al. 2022, "Who Says
 * Elephants Can't Run", arXiv:2211.10017): the 16-bit lane 0x43qq is the bf16 number 128 + q,
 * so the dot runs on `vdpbf16ps` with x rounded to bf16 (as the layer rounds it) and the
 * offset folds into the zero term:
 *     sum_i x_i W_i = s * D + (z - 136 s) * X,   D = sum_i x_i (128 + q_i),  X = sum_i x_i.
 * Products are exact in fp32; the offset costs ~4 of fp32's 24 bits in D, far below the bf16
 * rounding of x and y (and |x| beyond ~1e36 would overflow D).
 *
 * Per call, x is reordered into blocks of 4 groups (128 inputs) to match the unpacked weights
 * and its group sums X are taken (prepare_x). A block of weights (64 bytes) is unpacked with
 * two ands, a shift and four in-lane byte unpacks against 0x43 (no cross-lane shuffles); the
 * unpacked block is used for all rows of x (up to 8 at a time), its four dots per row go into
 * one vector whose 128-bit lane l belongs to group l, scaled by one vector of the 4 scales.
 * The zero terms are one vector dot of (z - 136 s) with X per weight row; the per-row
 * vectors are summed 16 rows at a time by a permute tree and stored as one vector.
 *
 * The weight rows are walked one after another (one stream for the prefetchers, helped by
 * software prefetch of all three arrays), each with up to 8 rows of x. When x exceeds 32 KB
 * (K = 4864 from 4 rows), K is walked in chunks whose x stays in L1, 16 weight rows at a
 * time.
 *
 * Batch invariance: each output sums its blocks in one order whatever T, its row's place
 * in x, the K chunks and the thread count (even blocks into one accumulator, odd ones into
 * another, the zero terms onto the odd one, then their sum and the same 16-lane tree), so
 * up to 16 rows of speculative verification give each token the bits of decoding it alone
 * (gemv_int4.py splits 17-32 rows into two calls): greedy speculation on an int4 target is
 * lossless while forwards have at most 32 rows (beyond, bf16 slices of the weights run
 * through gemv_bf16.c, in another order). Weight rows are taken one at a time: pairs of
 * them for several rows of x save loads of x, but need a single accumulator to fit the
 * registers (another order) and are no faster overall.
 *
 * Each OpenMP thread takes one contiguous range of output rows; small matrices run on one
 * thread, with no parallel region. Without AVX512-BF16 the bf16 pairs are widened by shifts and multiplied with FMA,
 * as in gemv_bf16.c.
 *
 * The measurements behind these choices: docs/results/2026-12-02-code-comment-history/
 * (bench/bench_int4.py times the kernel against torch's).
 *
 * Built by specmoe/kernels/build.py with gcc -O3 -march=native -fopenmp.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "specmoe gemv_int4 needs AVX-512F, AVX-512BW and AVX-512VL"
#endif

#define MIN_BYTES_PER_THREAD (64 << 10) /* less weight per thread runs on fewer threads */

#include "gemv_int4_core.h"

/* 2: vdpbf16ps, 1: shift + FMA. Lets Python report which path it built. */
int specmoe_gemv_int4_isa(void) { return SPECMOE_ISA; }

/* Per-call work space: permuted x, then group sums. One per calling thread (ctypes drops
 * the GIL, so two Python threads may call at once); grown, never shrunk. */
static __thread void *workspace;
static __thread size_t workspace_bytes;

static void *get_workspace(size_t bytes) {
    if (bytes > workspace_bytes) {
        free(workspace);
        workspace_bytes = (bytes + 4095) & ~(size_t)4095;
        workspace = aligned_alloc(64, workspace_bytes);
        if (!workspace) workspace_bytes = 0;
    }
    return workspace;
}

/* Entry point: y [T, N] = x [T, K] @ W^T (+ bias), x and y both bf16 (is_bf16) or both
 * fp32. Returns 0; -1 when T is outside 1..16 or K is not a positive multiple of 32; -2
 * when the work space cannot be allocated (nothing written). Each thread takes one
 * contiguous range of rows (starting at an even row), so it reads one forward stream. */
int specmoe_linear_int4(const struct specmoe_int4_weights *w, const void *x, void *y,
                        int64_t T, int is_bf16, int num_threads) {
    const int64_t K = w->K, N = w->N;
    if (T < 1 || T > MAX_T || K < GROUP || K % GROUP || N < 1) return -1;
    const int64_t NG = K / GROUP, NB = (NG + 3) / 4, NS = (NG + 15) / 16 * 16;
    const size_t xp_bytes = (size_t)(T * NB * BLOCK_ELEMS * 2);
    uint8_t *ws = get_workspace(xp_bytes + (size_t)(T * NS) * sizeof(float));
    if (!ws) return -2;
    uint16_t *xp = (uint16_t *)ws;
    float *xs = (float *)(ws + xp_bytes);
    prepare_x(x, is_bf16, T, K, NB, NS, xp, xs);
    const int64_t chunk = chunk_groups(T, K);
    const struct call c = {xp, xs, w->packed, w->scales, w->zeros, w->w_stride, w->sz_stride,
                           w->bias, y, is_bf16, T, K, N, chunk};
    const int64_t num_units = (N + 1) / 2;
    const int64_t max_threads = N * (K / 2 + NG * 4) / MIN_BYTES_PER_THREAD;
    if (num_threads > max_threads) num_threads = (int)max_threads;
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads <= 1) { /* no parallel region: it costs about a microsecond */
        rows(&c, 0, N);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t n0 = num_units * i / nt * 2, n1 = num_units * (i + 1) / nt * 2;
        if (n0 < N) rows(&c, n0, n1 < N ? n1 : N);
    }
    return 0;
}

/* Group g of row n of W = (q - 8) * s + z as 32 bf16 in input order: each value in fp32
 * ((q - 8) * s is exact there; + z rounds once), rounded to nearest even. */
static inline __attribute__((always_inline)) __m512i dequant_group(
    const struct specmoe_int4_weights *w, int64_t n, int64_t g) {
    /* bf16 pairs (low nibble's value, high nibble's) back into input order */
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    const uint8_t *pr = w->packed + n * w->w_stride;  /* byte j = input 2j | input 2j+1 << 4 */
    const uint16_t *sr = w->scales + n * w->sz_stride, *zr = w->zeros + n * w->sz_stride;
    const __m512 s = _mm512_set1_ps(bf16_to_f32(sr[g]));
    const __m512 z = _mm512_set1_ps(bf16_to_f32(zr[g]));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pr + g * 16)));
    const __m512 eight = _mm512_set1_ps(8.0f);
    const __m512 q_even = _mm512_sub_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))), eight);
    const __m512 q_odd = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), eight);
    const __m256i even = f32x16_to_bf16(_mm512_add_ps(_mm512_mul_ps(q_even, s), z));
    const __m256i odd = f32x16_to_bf16(_mm512_add_ps(_mm512_mul_ps(q_odd, s), z));
    return _mm512_permutexvar_epi16(order,
                                     _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
}

/* Rows [n0, n1) of W as bf16, each value as `dequant_group` computes it
 * (`int4_dequantize(..., torch.bfloat16)` bit for bit, except that the AVX512-BF16 build
 * flushes denormal results to zero and NaNs may carry another payload), straight into the
 * bf16 kernel's panel layout (gemv_bf16.c: [ceil((n1 - n0) / 64)][K / 2][64][2], rows past
 * n1 zero): for many rows of x (prefill), where a GEMM on bf16 weights beats torch's int4
 * kernel even counting this pass; 16 rows' groups transposed at a time, so
 * that dequantising and packing cost one pass. Returns 0, or -1 for a row range outside
 * [0, N] or K not a positive multiple of 32. */
int specmoe_int4_to_bf16_panels(const struct specmoe_int4_weights *w, uint16_t *out,
                                int64_t n0, int64_t n1, int num_threads) {
    const int64_t K = w->K, NG = K / GROUP, pairs = K / 2, panel = 64;
    if (n0 < 0 || n1 > w->N || n0 > n1 || K < GROUP || K % GROUP) return -1;
    const int64_t num_panels = (n1 - n0 + panel - 1) / panel;
    const int64_t max_threads = (n1 - n0) * K / (MIN_BYTES_PER_THREAD * 2);
    if (num_threads > max_threads) num_threads = (int)max_threads;
    if (num_threads > num_panels) num_threads = (int)num_panels;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        uint32_t *o = (uint32_t *)(out + p * pairs * (2 * panel));
        for (int64_t g = 0; g < NG; g++)  /* a group: 16 pairs */
            for (int64_t r0 = 0; r0 < panel; r0 += 16) {
                __m512i v[16];
                for (int r = 0; r < 16; r++) {
                    const int64_t n = n0 + p * panel + r0 + r;
                    v[r] = n < n1 ? dequant_group(w, n, g) : _mm512_setzero_si512();
                }
                transpose16_epi32(v);
                for (int i = 0; i < 16; i++)
                    _mm512_storeu_si512(o + (16 * g + i) * panel + r0, v[i]);
            }
    }
    return 0;
}
