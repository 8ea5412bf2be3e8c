/* The int4 linear kernel's arithmetic (gemv_int4.c describes the layout, the math and the
 * summation order), shared by gemv_int4.c and the fused int4 MoE kernel (moe_int4.c), so
 * that both compute every output with the same instructions in the same order (the same
 * bits). `rows(c, n0, n1)` computes output rows [n0, n1) of y[T, N] = x[T, K] @ W^T
 * (+ bias) for x prepared by `prepare_x` / `prepare_row`, T <= MAX_T; `chunk_groups`
 * gives the K chunking a call of T rows uses. Needs AVX-512F, BW and VL;
 * specmoe/kernels/build.py hashes this header into every kernel's cache key. */
#ifndef SPECMOE_GEMV_INT4_CORE_H
#define SPECMOE_GEMV_INT4_CORE_H
#include <immintrin.h>
#include <stdint.h>

#define MAX_T 16
#define MAX_GROUP 8     /* input rows multiplied per pass over a weight row */
#define GROUP 32        /* inputs per quantisation group */
#define BLOCK_ELEMS 128 /* inputs of a block of 4 groups (64 packed bytes) */
#define MAGIC_HI 0x43   /* high byte of bf16 128.0: 0x43qq is bf16(128 + q) for q < 128 */
#define ZERO_SHIFT 136.0f /* 8 (q's offset) + 128 (MAGIC's) */
#define NEAR_PREFETCH_BYTES 512 /* chunked: the next lines of a row's chunk, from L2 */
#define BLOCK_BYTES (16 << 10) /* T > 8: rows per block, re-read from cache by the 2nd group */
/* x beyond ~16 KB is evicted from L1 by the weight stream and read again from L2 for each
 * weight row. Measured: up to 32 KB that costs less than walking K in chunks of
 * CHUNK_X_BYTES of x for 16 rows at a time; beyond, more. */
#define MAX_UNCHUNKED_X_BYTES (32 << 10)
#define CHUNK_X_BYTES (16 << 10)
#define PREFETCH_BYTES 6144 /* unchunked: how far ahead the packed stream is prefetched */

#include "avx512_math.h"
#include "bf16_dot.h"

/* 16 bf16 values (the first `n` of them, zeros after) as fp32. */
static inline __m512 load_first_bf16x16(const uint16_t *p, int n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
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

/* One row of x (bf16 or fp32; its K inputs at element offset `row`) prepared: block b
 * (as prepare_block orders it) to xp + b * xp_stride, the 16 group sums of chunk c (zeros
 * past K / 32) to xs + c * xs_stride. */
static inline void prepare_row(const void *x, int x_is_bf16, int64_t row, int64_t K,
                               int64_t NB, int64_t NS, uint16_t *xp, int64_t xp_stride,
                               float *xs, int64_t xs_stride) {
    const int64_t NG = K / GROUP;
    const __m512i pick = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0,
                                          28, 24, 20, 16, 12, 8, 4, 0);
    for (int64_t c = 0; c < NS / 16; c++) {
        __m512 h[4];
        for (int i = 0; i < 4; i++)
            h[i] = 4 * c + i < NB ? prepare_block(x, x_is_bf16, row, NG, 4 * c + i,
                                                  xp + (4 * c + i) * xp_stride)
                                  : _mm512_setzero_ps();
        const __m512 sums = _mm512_mask_blend_ps(
            0xFF00, _mm512_permutex2var_ps(h[0], pick, h[1]),
            _mm512_permutex2var_ps(h[2], pick, h[3]));
        _mm512_storeu_ps(xs + c * xs_stride, sums);
    }
}

/* x [T, K] (bf16 or fp32) -> xp [NB, T, 128] bf16 (blocks of 4 groups as prepare_block
 * orders them) and xs [NS / 16, T, 16] fp32 group sums of the rounded x (zeros past K / 32);
 * input rows innermost, so a block's x for all rows sits together at fixed offsets. */
static inline void prepare_x(const void *x, int x_is_bf16, int64_t T, int64_t K,
                             int64_t NB, int64_t NS, uint16_t *xp, float *xs) {
    for (int64_t t = 0; t < T; t++)
        prepare_row(x, x_is_bf16, t * K, K, NB, NS, xp + t * BLOCK_ELEMS, T * BLOCK_ELEMS,
                    xs + t * 16, T * 16);
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

/* Groups per pass over x for a call of T <= MAX_T rows: all K / 32 while the x of all rows
 * fits MAX_UNCHUNKED_X_BYTES, else chunks of CHUNK_X_BYTES of x (64 bytes a group and
 * row), a multiple of 8 groups (>= 16 for T <= 16). Only speed depends on it: every
 * chunking sums alike (see `accumulate`). */
static inline int64_t chunk_groups(int64_t T, int64_t K) {
    return T * K * 2 <= MAX_UNCHUNKED_X_BYTES ? K / GROUP : (CHUNK_X_BYTES / (64 * T)) / 8 * 8;
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

#endif /* SPECMOE_GEMV_INT4_CORE_H */
