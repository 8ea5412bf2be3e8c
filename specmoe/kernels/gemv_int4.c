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

#define MAX_T 16
#define MAX_GROUP 8     /* input rows multiplied per pass over a weight row */
#define GROUP 32        /* inputs per quantisation group */
#define BLOCK_ELEMS 128 /* inputs of a block of 4 groups (64 packed bytes) */
#define MAGIC_HI 0x43   /* high byte of bf16 128.0: 0x43qq is bf16(128 + q) for q < 128 */
#define ZERO_SHIFT 136.0f /* 8 (q's offset) + 128 (MAGIC's) */
#define NEAR_PREFETCH_BYTES 512 /* chunked: the next lines of a row's chunk, from L2 */
#define MIN_BYTES_PER_THREAD (64 << 10) /* less weight per thread runs on fewer threads */
#define BLOCK_BYTES (16 << 10) /* T > 8: rows per block, re-read from cache by the 2nd group */
/* x beyond ~16 KB is evicted from L1 by the weight stream and read again from L2 for each
 * weight row. Measured: up to 32 KB that costs less than walking K in chunks of
 * CHUNK_X_BYTES of x for 16 rows at a time; beyond, more. */
#define MAX_UNCHUNKED_X_BYTES (32 << 10)
#define CHUNK_X_BYTES (16 << 10)
#define PREFETCH_BYTES 6144 /* unchunked: how far ahead the packed stream is prefetched */

#include "avx512_math.h"
#include "bf16_dot.h"

/* 2: vdpbf16ps, 1: shift + FMA. Lets Python report which path it built. */
int specmoe_gemv_int4_isa(void) { return SPECMOE_ISA; }

/* 16 bf16 values (the first `n` of them, zeros after) as fp32. */
static inline __m512 load_first_bf16x16(const uint16_t *p, int n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

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

/* 16 fp32 -> 16 bf16, rounded to nearest even, NaN stays NaN (the AVX512-BF16 instruction
 * also flushes denormals to zero). */
static inline __m256i f32x16_to_bf16(__m512 f) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_cvtepi32_epi16(
        _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
#endif
}

/* The 32 inputs of a group from an x row (bf16, or fp32 rounded to bf16) as 32 bf16. */
static inline __m512i load_group(const void *x, int x_is_bf16, int64_t offset) {
    if (x_is_bf16) return _mm512_loadu_si512((const uint16_t *)x + offset);
    const float *p = (const float *)x + offset;
    return _mm512_inserti64x4(_mm512_castsi256_si512(f32x16_to_bf16(_mm512_loadu_ps(p))),
                              f32x16_to_bf16(_mm512_loadu_ps(p + 16)), 1);
}

/* Block b of x row t: groups 4b..4b+3 (zeros past K) reordered as the unpacked weights are
 * (see unpack_block): element e of group 4b + l goes to vector j = (e % 2) * 2 + e / 16,
 * 16-bit lane l * 8 + (e % 16) / 2, stored at dst [4, 32]. Returns the group sums, group l's
 * in 32-bit lanes 4l..4l+3. */
static inline __m512 prepare_block(const void *x, int x_is_bf16, int64_t row, int64_t NG,
                                   int64_t b, uint16_t *dst) {
    __m512i in[4];
    for (int l = 0; l < 4; l++)
        in[l] = 4 * b + l < NG ? load_group(x, x_is_bf16, row + (4 * b + l) * GROUP)
                               : _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi16(0x3F80);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < 4; j++) { /* lane (l, m) <- in[l][j / 2 + 2m + 16 (j % 2)] */
        const short e0 = (short)(j / 2 + 16 * (j % 2));
        __m512i idx = _mm512_add_epi16(_mm512_set_epi16(
            46, 44, 42, 40, 38, 36, 34, 32, 14, 12, 10, 8, 6, 4, 2, 0,
            46, 44, 42, 40, 38, 36, 34, 32, 14, 12, 10, 8, 6, 4, 2, 0), _mm512_set1_epi16(e0));
        const __m512i v = _mm512_mask_blend_epi16(0xFFFF0000u,
                                                   _mm512_permutex2var_epi16(in[0], idx, in[1]),
                                                   _mm512_permutex2var_epi16(in[2], idx, in[3]));
        _mm512_storeu_si512(dst + j * 32, v);
        sum = dot_pairs(sum, v, ones);
    }
    /* sum of the 4 lanes of each 128-bit lane, in all 4 */
    sum = _mm512_add_ps(sum, _mm512_permute_ps(sum, 0xB1));
    return _mm512_add_ps(sum, _mm512_permute_ps(sum, 0x4E));
}

/* x [T, K] (bf16 or fp32) -> xp [NB, T, 128] bf16 (blocks of 4 groups as prepare_block
 * orders them) and xs [NS / 16, T, 16] fp32 group sums of the rounded x (zeros past K / 32);
 * input rows innermost, so a block's x for all rows sits together at fixed offsets. */
static void prepare_x(const void *x, int x_is_bf16, int64_t T, int64_t K, int64_t NB,
                      int64_t NS, uint16_t *xp, float *xs) {
    const int64_t NG = K / GROUP;
    const __m512i pick = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0,
                                          28, 24, 20, 16, 12, 8, 4, 0);
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < NS / 16; c++) {
            __m512 h[4];
            for (int i = 0; i < 4; i++)
                h[i] = 4 * c + i < NB ? prepare_block(x, x_is_bf16, t * K, NG, 4 * c + i,
                                                      xp + ((4 * c + i) * T + t) * BLOCK_ELEMS)
                                      : _mm512_setzero_ps();
            const __m512 sums = _mm512_mask_blend_ps(
                0xFF00, _mm512_permutex2var_ps(h[0], pick, h[1]),
                _mm512_permutex2var_ps(h[2], pick, h[3]));
            _mm512_storeu_ps(xs + (c * T + t) * 16, sums);
        }
}

/* One block of 4 groups (64 packed bytes; fewer, zero-filled, at a row's end) as four
 * vectors of 32 bf16 numbers 128 + q. Byte-interleaving the nibbles with 0x43 (in-lane
 * unpacks, no cross-lane shuffle) keeps group l in 128-bit lane l: v[0] = low nibbles of
 * bytes 0-7 of each lane (inputs 0, 2, .., 14 of the group), v[1] those of bytes 8-15
 * (16, .., 30), v[2] and v[3] the high nibbles (the odd inputs). */
static inline __attribute__((always_inline)) void unpack_block(__m512i b, __m512i v[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), magic = _mm512_set1_epi8(MAGIC_HI);
    const __m512i lo = _mm512_and_si512(b, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    v[0] = _mm512_unpacklo_epi8(lo, magic);
    v[1] = _mm512_unpackhi_epi8(lo, magic);
    v[2] = _mm512_unpacklo_epi8(hi, magic);
    v[3] = _mm512_unpackhi_epi8(hi, magic);
}

/* The 4 bf16 scales at s (the first n; zeros after) as fp32, scale l in 32-bit lanes
 * 4l..4l+3: the lanes of a block's dot that belong to group l. */
static inline __m512 block_scales(const uint16_t *s, int n) {
    const __m512i idx = _mm512_set_epi16(3, 0, 3, 0, 3, 0, 3, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                         1, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i v = _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), s);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, v));
}

/* Prefetch for the block of groups g.. at w (packed), s and z (scales, zeros of the row):
 * far = 0, into L1 pf_w / pf_sz bytes ahead; far = 1 (chunked), into L2 at those offsets
 * (16 rows ahead) and into L1 the next lines of this row. A line of scales covers 32 groups
 * but is prefetched every 8 (cheaper than tracking which lines were). */
static inline __attribute__((always_inline)) void prefetch(
    const int far, const uint8_t *w, const uint16_t *s, const uint16_t *z, int64_t pf_w,
    int64_t pf_sz, int64_t g) {
    if (far) {
        _mm_prefetch((const char *)w + pf_w, _MM_HINT_T1);
        _mm_prefetch((const char *)w + NEAR_PREFETCH_BYTES, _MM_HINT_T0);
        if (g % 32 == 0) {
            _mm_prefetch((const char *)s + pf_sz, _MM_HINT_T1);
            _mm_prefetch((const char *)z + pf_sz, _MM_HINT_T1);
        }
    } else {
        _mm_prefetch((const char *)w + pf_w, _MM_HINT_T0);
        if (g % 8 == 0) {
            _mm_prefetch((const char *)s + pf_sz, _MM_HINT_T0);
            _mm_prefetch((const char *)z + pf_sz, _MM_HINT_T0);
        }
    }
}

/* One block of 4 groups (g..g+3, the first ng of them) of one weight row (w, sr, zr: its
 * packed bytes, scales and zeros) x G input rows into acc[t]. The row's weights are
 * unpacked once and used for every input row; the four dots go into one vector (two chains,
 * for latency), scaled once. The weight streams are prefetched pf_w bytes ahead (scales and
 * zeros pf_sz), into L1 (far = 0) or L2 (far = 1). */
static inline __attribute__((always_inline)) void block_step(
    const int G, const int far, __m512 acc[MAX_GROUP], const uint8_t *wr, const uint16_t *sr,
    const uint16_t *zr, const uint16_t *xb, int64_t pf_w, int64_t pf_sz, int64_t g, int ng) {
    const __mmask64 m = ng == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * ng)) - 1;
    const uint8_t *w = wr + g * 16;
    prefetch(far, w, sr + g, zr + g, pf_w, pf_sz, g);
    __m512i b = ng == 4 ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(m, w);
    __asm__("" : "+v"(b)); /* one load of b, not one per use (loads are the bottleneck) */
    __m512i v[4];
    unpack_block(b, v);
    const __m512 sv = block_scales(sr + g, ng);
#pragma GCC unroll 8
    for (int t = 0; t < G; t++) {
        __m512 d[2];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i xv = _mm512_loadu_si512(xb + t * BLOCK_ELEMS + i * 32);
            d[i % 2] = dot_pairs(i >= 2 ? d[i % 2] : _mm512_setzero_ps(), v[i], xv);
        }
        acc[t] = _mm512_fmadd_ps(_mm512_add_ps(d[0], d[1]), sv, acc[t]);
    }
}

/* What one call works on: prepared x, the weights (row n of packed, scales and zeros at
 * n * w_stride bytes, n * sz_stride and n * sz_stride elements), bias and y; chunk: groups
 * per pass over x (all K / 32 unless x exceeds MAX_UNCHUNKED_X_BYTES). */
struct call {
    const uint16_t *xp;
    const float *xs;
    const uint8_t *packed;
    const uint16_t *scales, *zeros;
    int64_t w_stride, sz_stride;
    const float *bias;
    void *y;
    int y_is_bf16;
    int64_t T, K, N, chunk;
};

/* acc += groups [g0, g1) (g0 a multiple of 8) of weight row n x G input rows
 * (t0..t0+G-1), blocks alternating between acc[0] and acc[1] (hides the FMA latency): the
 * same blocks in the same accumulators whatever splits K, so every caller sums alike. */
static inline __attribute__((always_inline)) void accumulate(
    const int G, const int far, const struct call *c, int64_t t0, int64_t n, int64_t g0,
    int64_t g1, __m512 acc[2][MAX_GROUP], int64_t pf_w, int64_t pf_sz) {
    const int64_t xstride = c->T * BLOCK_ELEMS;
    const uint16_t *xp = c->xp + t0 * BLOCK_ELEMS;
    const uint8_t *wr = c->packed + n * c->w_stride;
    const uint16_t *sr = c->scales + n * c->sz_stride, *zr = c->zeros + n * c->sz_stride;
    int64_t g = g0;
    for (; g + 8 <= g1; g += 8) {
        block_step(G, far, acc[0], wr, sr, zr, xp + (g / 4) * xstride, pf_w, pf_sz, g, 4);
        block_step(G, far, acc[1], wr, sr, zr, xp + (g / 4 + 1) * xstride, pf_w, pf_sz,
                   g + 4, 4);
    }
    if (g + 4 <= g1) {
        block_step(G, far, acc[0], wr, sr, zr, xp + (g / 4) * xstride, pf_w, pf_sz, g, 4);
        g += 4;
    }
    if (g < g1)
        block_step(G, far, acc[1], wr, sr, zr, xp + (g / 4) * xstride, pf_w, pf_sz, g,
                   (int)(g1 - g));
}

/* The zero terms, (z - 136 s) . X 16 groups a step, added to acc[1]; then each output's
 * vector (lanes still to be added) into sums[t][m]. */
static inline __attribute__((always_inline)) void finish(
    const int G, const struct call *c, int64_t t0, int64_t n, __m512 acc[2][MAX_GROUP],
    __m512 sums[MAX_GROUP][16], int m) {
    const int64_t T = c->T, NG = c->K / GROUP;
    const float *xs = c->xs + t0 * 16;
    const uint16_t *sr = c->scales + n * c->sz_stride, *zr = c->zeros + n * c->sz_stride;
    const __m512 shift = _mm512_set1_ps(-ZERO_SHIFT);
    for (int64_t k = 0; k * 16 < NG; k++) {
        const int ng = NG - k * 16 < 16 ? (int)(NG - k * 16) : 16;
        const __m512 zv = _mm512_fmadd_ps(shift, load_first_bf16x16(sr + k * 16, ng),
                                          load_first_bf16x16(zr + k * 16, ng));
#pragma GCC unroll 8
        for (int t = 0; t < G; t++)
            acc[1][t] = _mm512_fmadd_ps(zv, _mm512_loadu_ps(xs + (k * T + t) * 16), acc[1][t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < G; t++) sums[t][m] = _mm512_add_ps(acc[0][t], acc[1][t]);
}

/* Lane sums of v[0..15] as one vector (lane i = sum of v[i]): a tree of two-source
 * permutes, each level halving the lanes per vector and doubling the vectors per lane. */
static inline __m512 reduce16(__m512 v[16]) {
    const __m512i lo[4] = {
        _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0),
        _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0),
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0)};
    const int shift[4] = {8, 4, 2, 1};
    for (int level = 0, count = 16; level < 4; level++, count /= 2) {
        const __m512i hi = _mm512_add_epi32(lo[level], _mm512_set1_epi32(shift[level]));
        for (int i = 0; i < count / 2; i++)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], lo[level], v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], hi, v[2 * i + 1]));
    }
    return v[0];
}

/* y[t0 + t, n0 .. n0 + m) = lane sums of sums[t][0 .. m) + bias, for m <= 16 rows. */
static inline __attribute__((always_inline)) void store_rows(
    const int G, const struct call *c, __m512 sums[MAX_GROUP][16], int64_t t0, int64_t n0,
    int m) {
    const __mmask16 mask = (__mmask16)((1u << m) - 1);
    const __m512 b = c->bias ? _mm512_maskz_loadu_ps(mask, c->bias + n0) : _mm512_setzero_ps();
    for (int t = 0; t < G; t++) {
        const __m512 v = _mm512_add_ps(reduce16(sums[t]), b);
        const int64_t at = (t0 + t) * c->N + n0;
        if (c->y_is_bf16) {
            const __m256i h = f32x16_to_bf16(v);
            if (m == 16) _mm256_storeu_si256((__m256i *)((uint16_t *)c->y + at), h);
            else _mm256_mask_storeu_epi16((uint16_t *)c->y + at, mask, h);
        } else {
            if (m == 16) _mm512_storeu_ps((float *)c->y + at, v);
            else _mm512_mask_storeu_ps((float *)c->y + at, mask, v);
        }
    }
}

/* Rows [n0, n1) x input rows t0..t0+G-1, x small enough for L1: one weight row at a time,
 * each over all of K, the weight streams prefetched PREFETCH_BYTES ahead into L1; sums
 * stored 16 rows at a time. */
static inline __attribute__((always_inline)) void tiles(const int G, const struct call *c,
                                                        int64_t t0, int64_t n0, int64_t n1) {
    const int NG = c->K / GROUP;
    __m512 sums[MAX_GROUP][16], acc[2][MAX_GROUP];
    int m = 0;
    for (int64_t n = n0; n < n1; n++) {
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
        accumulate(G, 0, c, t0, n, 0, NG, acc, PREFETCH_BYTES, PREFETCH_BYTES / 8);
        finish(G, c, t0, n, acc, sums, m);
        if (++m == 16 || n + 1 == n1) {
            store_rows(G, c, sums, t0, n + 1 - m, m);
            m = 0;
        }
    }
}

/* Groups [g0, g1) of row n on top of its sums so far in saved (none at g0 = 0). */
static inline __attribute__((always_inline)) void chunk_step(
    const int G, const struct call *c, int64_t t0, int64_t n, int64_t g0, int64_t g1,
    __m512 saved[2][MAX_GROUP], int64_t pf_w, int64_t pf_sz) {
    __m512 acc[2][MAX_GROUP];
#pragma GCC unroll 8
    for (int t = 0; t < G; t++) {
        acc[0][t] = g0 ? saved[0][t] : _mm512_setzero_ps();
        acc[1][t] = g0 ? saved[1][t] : _mm512_setzero_ps();
    }
    accumulate(G, 1, c, t0, n, g0, g1, acc, pf_w, pf_sz);
#pragma GCC unroll 8
    for (int t = 0; t < G; t++) {
        saved[0][t] = acc[0][t];
        saved[1][t] = acc[1][t];
    }
}

/* The same with x too large for L1 (it would be evicted by the weight stream and read from
 * L2): 16 rows at a time, K in chunks of c->chunk groups whose x stays in L1, the
 * accumulators kept in memory between chunks. Each weight line is prefetched into L2 while
 * the same line 16 rows earlier is used. */
static inline __attribute__((always_inline)) void tiles_chunked(const int G,
                                                                const struct call *c,
                                                                int64_t t0, int64_t n0,
                                                                int64_t n1) {
    const int64_t NG = c->K / GROUP, pf_w = 16 * c->w_stride, pf_sz = 32 * c->sz_stride;
    __m512 sums[MAX_GROUP][16], saved[16][2][MAX_GROUP];
    for (int64_t nb = n0; nb < n1; nb += 16) {
        const int num = n1 - nb < 16 ? (int)(n1 - nb) : 16;
        for (int64_t g0 = 0; g0 < NG; g0 += c->chunk) {
            const int64_t g1 = g0 + c->chunk < NG ? g0 + c->chunk : NG;
            for (int i = 0; i < num; i++)
                chunk_step(G, c, t0, nb + i, g0, g1, saved[i], pf_w, pf_sz);
        }
        for (int i = 0; i < num; i++) finish(G, c, t0, nb + i, saved[i], sums, i);
        store_rows(G, c, sums, t0, nb, num);
    }
}

#define CASE(G) case G: \
    if (c->chunk < NG) tiles_chunked(G, c, t0, n0, n1); else tiles(G, c, t0, n0, n1); \
    break
static void run_tiles(int G, const struct call *c, int64_t t0, int64_t n0, int64_t n1) {
    const int64_t NG = c->K / GROUP;
    switch (G) { CASE(1); CASE(2); CASE(3); CASE(4); CASE(5); CASE(6); CASE(7); CASE(8); }
}
#undef CASE

/* Rows [n0, n1) for all T input rows, in blocks of rows that stay in cache while each group
 * of up to 8 input rows passes over them (one block when T <= 8), one weight row after
 * another (one stream, best for the prefetcher). */
static void rows(const struct call *c, int64_t n0, int64_t n1) {
    const int64_t T = c->T, K = c->K;
    const int64_t num_groups = (T + MAX_GROUP - 1) / MAX_GROUP;
    const int64_t G = (T + num_groups - 1) / num_groups; /* balanced, e.g. 9 -> 5 + 4 */
    const int64_t row_bytes = K / 2 + K / 8;
    const int64_t block = num_groups == 1 ? n1 - n0 : 16 * (1 + BLOCK_BYTES / (16 * row_bytes));
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
        for (int64_t t0 = 0; t0 < T; t0 += G)
            run_tiles((int)(T - t0 < G ? T - t0 : G), c, t0, b0, b1);
    }
}

/* The weights of one layer, as the caller keeps them between calls: row n of packed at
 * packed + n * w_stride bytes, of scales and zeros at + n * sz_stride elements (separate
 * arrays or one row-interleaved buffer); bias [N] fp32 or NULL; K inputs, N outputs. */
struct specmoe_int4_weights {
    const uint8_t *packed;
    const uint16_t *scales, *zeros;
    int64_t w_stride, sz_stride;
    const float *bias;
    int64_t K, N;
};

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
    /* x of all T rows for chunk groups: CHUNK_X_BYTES (64 bytes a group and row) */
    const int64_t chunk = T * K * 2 <= MAX_UNCHUNKED_X_BYTES ? NG
                          : (CHUNK_X_BYTES / (64 * T)) / 8 * 8;
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
