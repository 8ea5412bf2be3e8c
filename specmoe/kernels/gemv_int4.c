/* y[T, N] = x[T, K] @ W^T (+ b[N]) for int4 weights, T <= 16, fp32 accumulation.
 *
 * Layout (built by specmoe/kernels/gemv_int4.py `pack_int4`), groups of 32 inputs, K % 32 == 0:
 *   packed  uint8 [N, K/2]: byte j of row n = q[n, 2j] | q[n, 2j+1] << 4, q in [0, 15]
 *   scales  bf16  [N, K/32]: s[n, g]
 *   zeros   bf16  [N, K/32]: z[n, g]
 *   W[n, 32g + i] = (q[n, 32g + i] - 8) * s[n, g] + z[n, g]   (as Int4Linear / torch's
 *   `_weight_int4pack_mm_for_cpu`; scale and zero stay the exact bf16 values quantize_int4
 *   made, 4 bytes per group rather than 8 for fp32: the weight stream is 20 bytes per group.)
 *
 * Math. Per group, sum_i x_i W_i = s * sum_i x_i q_i + (z - 8 s) * sum_i x_i, so the weights
 * are multiplied as small integers and each group's scale is applied once to its dot product
 * (the group-quantised GEMV of llama.cpp / GPTQ-style kernels; here with float dots). The
 * integers are made bf16 without a conversion: a 16-bit lane holding 0x4300 | q is the bf16
 * number 128 + q, so the dot runs on `vdpbf16ps` with x (rounded to bf16, as the layer
 * rounds it) and the offset folds into the zero term:
 *     sum_i x_i W_i = s * D + (z - 136 s) * X,   D = sum_i x_i (128 + q_i),  X = sum_i x_i.
 * Products are exact in fp32; the 128 offset costs ~4 of fp32's 24 bits in D, far below the
 * bf16 rounding of x and y. Once per call x is permuted per pair of groups into
 * [evens g, evens g+1 | odds g, odds g+1] (bf16) and its group sums X are taken, so a pair
 * (32 bytes) is unpacked by one zero-extend to 16-bit lanes, an and (low nibbles = even
 * inputs) and a shift (high nibbles = odd inputs), with no shuffles; the 16 fp32 lanes of
 * the dot then hold group g in lanes 0-7 and g+1 in 8-15, scaled by one permuted vector of
 * scales. Each unpacked pair is used for all (up to 8 at a time) rows of x; the zero terms
 * are one vector dot of (z - 136 s) with X per row.
 *
 * Each OpenMP thread takes one contiguous range of output rows (one forward stream of each
 * array); small matrices run on one thread. Without AVX512-BF16 the bf16 pairs are widened
 * by shifts and multiplied with FMA, as in gemv_bf16.c.
 *
 * Measured on 2 Zen 5 cores (bench/bench_int4.py, Qwen2.5-0.5B shapes, weights far beyond
 * L3, 1 thread): see the numbers in that script's docstring.
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
#define MIN_BYTES_PER_THREAD (256 << 10) /* smaller weights run on one thread */
#define BLOCK_BYTES (16 << 10) /* weight rows per block when T > 8: re-read from L1 */
#define MAX_L1_X_BYTES (24 << 10) /* larger x: two weight rows share each x load */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048 /* how far ahead the packed stream is prefetched */
#endif

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

/* 2: vdpbf16ps, 1: shift + FMA. Lets Python report which path it built. */
int specmoe_gemv_int4_isa(void) { return SPECMOE_ISA; }

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* 16 bf16 values (the first `n` of them, zeros after) as fp32. */
static inline __m512 load_bf16x16(const uint16_t *p, int n) {
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

/* 32 inputs of group g of an x row (bf16 or fp32, rounded to bf16) as 32 bf16. */
static inline __m512i load_group(const void *x, int x_is_bf16, int64_t offset) {
    if (x_is_bf16) return _mm512_loadu_si512((const uint16_t *)x + offset);
    const float *p = (const float *)x + offset;
#ifdef __AVX512BF16__
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
#else
    __m512i half[2];
    for (int i = 0; i < 2; i++) { /* round to nearest even; NaN stays NaN */
        const __m512i u = _mm512_loadu_si512(p + 16 * i);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb),
                                                       _mm512_set1_epi32(0x7FFF)), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
        half[i] = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    }
    return _mm512_permutex2var_epi16(half[0], _mm512_set_epi16(
        62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
        30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), half[1]);
#endif
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
            const __m512 sums = _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(h[0], pick, h[1]),
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

/* One block of 4 groups (g..g+3, the first ng of them) of R weight rows (wr, sr: the first
 * row's) x G input rows into acc[r][t]. Each row's weights are unpacked once; for each
 * input row, x is loaded once per vector and used for all R rows (with R = 2, x is read
 * from cache half as often when it does not fit in L1); the four dots go into one vector,
 * scaled once. */
static inline __attribute__((always_inline)) void block_step(
    const int R, const int G, __m512 acc[2][MAX_GROUP], const uint8_t *wr, const uint16_t *sr,
    const uint16_t *zr, const uint16_t *xb, int64_t w_stride, int64_t sz_stride, int64_t g, int ng) {
    const __mmask64 m = ng == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * ng)) - 1;
    __m512i v[2][4];
    __m512 sv[2];
#pragma GCC unroll 2
    for (int r = 0; r < R; r++) {
        const uint8_t *w = wr + r * w_stride + g * 16;
        _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
#ifdef PF_SZ
        _mm_prefetch((const char *)(sr + r * sz_stride + g) + PF_SZ, _MM_HINT_T0);
        _mm_prefetch((const char *)(zr + r * sz_stride + g) + PF_SZ, _MM_HINT_T0);
#endif
        unpack_block(ng == 4 ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(m, w), v[r]);
        sv[r] = block_scales(sr + r * sz_stride + g, ng);
    }
#pragma GCC unroll 8
    for (int t = 0; t < G; t++) {
        __m512 d[2][2];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i xv = _mm512_loadu_si512(xb + t * BLOCK_ELEMS + i * 32);
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
                d[r][i % 2] = dot_pairs(i >= 2 ? d[r][i % 2] : _mm512_setzero_ps(), v[r][i], xv);
        }
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
            acc[r][t] = _mm512_fmadd_ps(_mm512_add_ps(d[r][0], d[r][1]), sv[r], acc[r][t]);
    }
}

/* What one call works on: prepared x, the weights (row n of packed, scales and zeros at
 * n * w_stride bytes, n * sz_stride and n * sz_stride elements), bias and y. */
struct call {
    const uint16_t *xp;
    const float *xs;
    const uint8_t *packed;
    const uint16_t *scales, *zeros;
    int64_t w_stride, sz_stride;
    const float *bias;
    void *y;
    int y_is_bf16;
    int64_t T, K, N;
};

/* R weight rows (n..n+R-1) x G input rows (t0..t0+G-1), all K columns: y[t * N + n + r].
 * Blocks of 4 groups go two at a time into two sets of accumulators (hides FMA latency at
 * few rows), then the zero terms, (z - 136 s) . X, 16 groups a step. */
static inline __attribute__((always_inline)) void tile(const int R, const int G,
                                                       const struct call *c, int64_t t0,
                                                       int64_t n) {
    const int64_t T = c->T, N = c->N, NG = c->K / GROUP, xstride = T * BLOCK_ELEMS;
    const int64_t w_stride = c->w_stride, sz_stride = c->sz_stride;
    const uint16_t *xp = c->xp + t0 * BLOCK_ELEMS;
    const float *xs = c->xs + t0 * 16;
    const uint8_t *wr = c->packed + n * w_stride;
    const uint16_t *sr = c->scales + n * sz_stride, *zr = c->zeros + n * sz_stride;
    __m512 acc[2][2][MAX_GROUP];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) acc[0][r][t] = acc[1][r][t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= NG; g += 8) {
        block_step(R, G, acc[0], wr, sr, zr, xp + (g / 4) * xstride, w_stride, sz_stride, g, 4);
        block_step(R, G, acc[1], wr, sr, zr, xp + (g / 4 + 1) * xstride, w_stride, sz_stride,
                   g + 4, 4);
    }
    if (g + 4 <= NG) {
        block_step(R, G, acc[0], wr, sr, zr, xp + (g / 4) * xstride, w_stride, sz_stride, g, 4);
        g += 4;
    }
    if (g < NG)
        block_step(R, G, acc[1], wr, sr, zr, xp + (g / 4) * xstride, w_stride, sz_stride, g,
                   (int)(NG - g));
    const __m512 shift = _mm512_set1_ps(-ZERO_SHIFT);
    for (int64_t k = 0; k * 16 < NG; k++) {
        const int ng = NG - k * 16 < 16 ? (int)(NG - k * 16) : 16;
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            const __m512 zv = _mm512_fmadd_ps(shift, load_bf16x16(sr + r * sz_stride + k * 16, ng),
                                              load_bf16x16(zr + r * sz_stride + k * 16, ng));
#pragma GCC unroll 8
            for (int t = 0; t < G; t++)
                acc[1][r][t] = _mm512_fmadd_ps(zv, _mm512_loadu_ps(xs + (k * T + t) * 16),
                                               acc[1][r][t]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++) {
        const float b = c->bias ? c->bias[n + r] : 0.0f;
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) {
            const float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r][t], acc[1][r][t])) + b;
            if (c->y_is_bf16) ((uint16_t *)c->y)[(t0 + t) * N + n + r] = f32_to_bf16(v);
            else ((float *)c->y)[(t0 + t) * N + n + r] = v;
        }
    }
}

#define CASE(R, G) case R * 16 + G: tile(R, G, c, t0, n); break
#define CASES(R) CASE(R, 1); CASE(R, 2); CASE(R, 3); CASE(R, 4); CASE(R, 5); CASE(R, 6); \
    CASE(R, 7); CASE(R, 8)
static void run_tile(int R, int G, const struct call *c, int64_t t0, int64_t n) {
    switch (R * 16 + G) { CASES(1); CASES(2); }
}
#undef CASES
#undef CASE

/* Rows [n0, n1) for all T input rows, in blocks of rows that stay in cache while each group
 * of up to 8 input rows passes over them (one block when T <= 8). */
static void rows(const struct call *c, int64_t n0, int64_t n1) {
    const int64_t T = c->T, K = c->K;
    const int64_t num_groups = (T + MAX_GROUP - 1) / MAX_GROUP;
    const int64_t G = (T + num_groups - 1) / num_groups; /* balanced, e.g. 9 -> 5 + 4 */
    const int64_t block = num_groups == 1 ? n1 - n0 : 2 + BLOCK_BYTES / (K / 2 + K / 8);
    const int R = T * K * 2 > MAX_L1_X_BYTES ? 2 : 1;
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
        for (int64_t t0 = 0; t0 < T; t0 += G) {
            const int g = (int)(T - t0 < G ? T - t0 : G);
            for (int64_t n = b0; n < b1;) {
                const int r = n + R <= b1 ? R : 1;
                run_tile(r, g, c, t0, n);
                n += r;
            }
        }
    }
}

/* Entry point. x [T, K] bf16 (x_is_bf16) or fp32; weights as in the header, row n of packed
 * at packed + n * w_stride (bytes), of scales and zeros at + n * sz_stride (elements), so
 * they may be separate arrays or one row-interleaved buffer; bias [N] fp32 or NULL; y [T, N]
 * bf16 (y_is_bf16) or fp32. Returns 0; -1 when T is outside 1..16 or K is not a positive
 * multiple of 32; -2 when the work space cannot be allocated (nothing written). Each thread
 * takes one contiguous range of rows (starting at an even row), so it reads one forward
 * stream. */
int specmoe_linear_int4(const void *x, int x_is_bf16, const uint8_t *packed,
                        const uint16_t *scales, const uint16_t *zeros, int64_t w_stride,
                        int64_t sz_stride, const float *bias, void *y, int y_is_bf16,
                        int64_t T, int64_t K, int64_t N, int num_threads) {
    if (T < 1 || T > MAX_T || K < GROUP || K % GROUP || N < 1) return -1;
    const int64_t NG = K / GROUP, NB = (NG + 3) / 4, NS = (NG + 15) / 16 * 16;
    const size_t xp_bytes = (size_t)(T * NB * BLOCK_ELEMS * 2);
    uint8_t *ws = get_workspace(xp_bytes + (size_t)(T * NS) * sizeof(float));
    if (!ws) return -2;
    uint16_t *xp = (uint16_t *)ws;
    float *xs = (float *)(ws + xp_bytes);
    prepare_x(x, x_is_bf16, T, K, NB, NS, xp, xs);
    const struct call c = {xp, xs, packed, scales, zeros, w_stride, sz_stride, bias, y,
                           y_is_bf16, T, K, N};
    const int64_t num_units = (N + 1) / 2;
    const int64_t max_threads = N * (K / 2 + NG * 4) / MIN_BYTES_PER_THREAD;
    if (num_threads > max_threads) num_threads = (int)max_threads;
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t n0 = num_units * i / nt * 2, n1 = num_units * (i + 1) / nt * 2;
        if (n0 < N) rows(&c, n0, n1 < N ? n1 : N);
    }
    return 0;
}
