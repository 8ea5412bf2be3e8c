/* y[T, N] = x[T, K] @ w[N, K]^T (+ b[N]), bf16 in and out, fp32 accumulation, T <= 16.
 *
 * Decoding is bound by the bandwidth of reading w, so every weight row is streamed from
 * memory once for all T input rows: a tile of 4 weight rows is multiplied with groups of
 * up to 6 input rows while it sits in L1/L2; with at most 4 rows whose x fits in L1,
 * weight rows are read one after another instead (one stream, best for the prefetcher).
 * Each (row, token) pair keeps one 16-lane fp32 accumulator over the pairs
 * (w[2i], w[2i+1]) . (x[2i], x[2i+1]) of a 32-element step (`vdpbf16ps` with AVX512-BF16,
 * else the same pairs widened to fp32 by shifts + FMA), steps in ascending k, the K tail
 * read last with masked loads, then one horizontal sum (the tiles do 16 at once with the
 * same add tree as the single ones, `reduce_add16`). Each OpenMP thread takes one
 * contiguous range of output rows.
 *
 * Batch invariance: that summation order is the same in both code paths, for every T, every
 * position of a row in x and any thread count, so a token's outputs have the same bits
 * decoded alone (T = 1) as in a (K + 1)-row speculative verification. Greedy speculative
 * decoding in bf16 needs this to be lossless (the attention kernel is invariant in the same
 * way); the tests check it bit for bit.
 *
 * Measured on 2 Zen 5 cores: 1-3 rows read at ~90-100% of a plain streaming read, 5-9 rows
 * at ~65-85%; past ~9 rows the multiplies (`vdpbf16ps` throughput), not memory, set the
 * pace, and 16 rows cost about twice one row.
 *
 * Built by specmoe/kernels/build.py with gcc -O3 -march=native -fopenmp.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe gemv_bf16 needs AVX-512F and AVX-512BW"
#endif

#define MAX_T 16
#define MAX_GROUP 6   /* input rows multiplied per pass over a weight tile */
#define TILE_ROWS 4   /* weight rows per tile: 4 x 6 accumulators fill 24 registers */
#define MAX_SEQ_ROWS 4 /* up to this many input rows, x small: rows_seq, not tiles */
#define MAX_SEQ_X_BYTES (16 << 10)
#define SEQ_PREFETCH_BYTES 4096 /* how far ahead rows_seq prefetches its weight stream */
#define MAX_TILE_PREFETCH_BYTES (24 << 10) /* larger tiles prefetch TILE_PREFETCH_ELEMS ahead */
#define TILE_PREFETCH_ELEMS 1024
#define ROW_ALIGN TILE_ROWS  /* thread ranges start at multiples of the tile height */
#define MIN_BYTES_PER_THREAD (256 << 10) /* smaller weights run on one thread */

#include "avx512_math.h"
#include "bf16_dot.h"

/* 2: vdpbf16ps, 1: shift + FMA. Lets Python report which path it built. */
int specmoe_gemv_isa(void) { return SPECMOE_ISA; }

/* y[t * N + n + r] = bf16(sum of acc[r][t]'s lanes + bias[n + r]) for the R x G tile: 16
 * horizontal sums at a time in the order (t, r), with the add tree of the single-row path
 * (`reduce_add16`), and the rounding of `f32_to_bf16` on 16 lanes; a row's R outputs are
 * adjacent in y. (One sum at a time, this epilogue took about a third of a 576-column
 * tile's time.) */
static inline __attribute__((always_inline)) void store_tile(
    const int R, const int G, const __m512 acc[][MAX_GROUP], const uint16_t *bias,
    uint16_t *y, int64_t N, int64_t n) {
    float bias_f[TILE_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) bias_f[r] = bias ? bf16_to_f32(bias[n + r]) : 0.0f;
    uint16_t out[32];
#pragma GCC unroll 2
    for (int b = 0; b < (R * G + 15) / 16; b++) {
        __m512 pack[16];
        float bias_v[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const int i = 16 * b + j;  /* i = t * R + r */
            pack[j] = i < R * G ? acc[i % R][i / R] : _mm512_setzero_ps();
            bias_v[j] = bias_f[i % R];
        }
        const __m512 sum = _mm512_add_ps(reduce_add16(pack), _mm512_loadu_ps(bias_v));
        _mm256_storeu_si256((__m256i *)(out + 16 * b),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(sum), 16)));
    }
#pragma GCC unroll 8
    for (int t = 0; t < G; t++) __builtin_memcpy(y + t * N + n, out + t * R, R * 2);
}

/* R weight rows x G input rows, all K columns; results (+ bias) go to y[t * N + n]. The
 * R rows are read side by side and the hardware prefetcher alone falls behind on R short
 * streams while the core is busy, so the next tile is prefetched meanwhile: all of it when
 * it fits in L1 beside x, else each row stream a fixed distance ahead (running into the
 * next tile's rows near the end). */
static inline __attribute__((always_inline)) void tile(
    const int R, const int G, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
    uint16_t *y, int64_t K, int64_t N, int64_t n) {
    __m512 acc[TILE_ROWS][MAX_GROUP];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) acc[r][t] = _mm512_setzero_ps();
    const uint16_t *wr = w + n * K;
    const int whole_next = R * K * 2 <= MAX_TILE_PREFETCH_BYTES;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[TILE_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int64_t kp = k + TILE_PREFETCH_ELEMS;
            const uint16_t *p = whole_next ? wr + (R + r) * K + k
                                : kp < K ? wr + r * K + kp : wr + (R + r) * K + (kp - K);
            _mm_prefetch((const char *)p, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_si512(wr + r * K + k);
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) {
            __m512i xv = _mm512_loadu_si512(x + t * K + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = dot_pairs(acc[r][t], wv[r], xv);
        }
    }
    if (k < K) { /* tail: masked loads read zeros past K */
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv[TILE_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_epi16(m, wr + r * K + k);
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) {
            __m512i xv = _mm512_maskz_loadu_epi16(m, x + t * K + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = dot_pairs(acc[r][t], wv[r], xv);
        }
    }
    store_tile(R, G, acc, bias, y, N, n);
}

/* Weight rows one after another, each with all G input rows, so a thread's range is one
 * forward stream for the hardware prefetcher (best while x is small enough for L1). One
 * accumulator per input row, as `tile` (batch invariance): the dependent vdpbf16ps chain
 * still outpaces memory at 1-4 rows. */
static inline __attribute__((always_inline)) void rows_seq(
    const int G, const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
    int64_t K, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        __m512 acc[MAX_SEQ_ROWS];
#pragma GCC unroll 4
        for (int t = 0; t < G; t++) acc[t] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            if (G > 1) /* from 2 rows on, the hardware prefetcher alone falls behind */
                _mm_prefetch((const char *)(wr + k) + SEQ_PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i wv = _mm512_loadu_si512(wr + k);
#pragma GCC unroll 4
            for (int t = 0; t < G; t++)
                acc[t] = dot_pairs(acc[t], wv, _mm512_loadu_si512(x + t * K + k));
        }
        if (k < K) { /* tail: masked loads read zeros past K */
            const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
            const __m512i wv = _mm512_maskz_loadu_epi16(m, wr + k);
#pragma GCC unroll 4
            for (int t = 0; t < G; t++)
                acc[t] = dot_pairs(acc[t], wv, _mm512_maskz_loadu_epi16(m, x + t * K + k));
        }
        const float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
#pragma GCC unroll 4
        for (int t = 0; t < G; t++) y[t * N + n] = f32_to_bf16(_mm512_reduce_add_ps(acc[t]) + b);
    }
}

#define CASE(R, G) case R * 16 + G: tile(R, G, x, w, bias, y, K, N, n); break
#define CASES(R) CASE(R, 1); CASE(R, 2); CASE(R, 3); CASE(R, 4); CASE(R, 5); CASE(R, 6)
static void run_tile(int R, int G, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                     uint16_t *y, int64_t K, int64_t N, int64_t n) {
    switch (R * 16 + G) { CASES(1); CASES(4); }
}
#undef CASES
#undef CASE

/* Rows [n0, n1): one pass for few input rows, else tiles reused from cache per group. */
static void rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int64_t T, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    if (T == 1 || (T <= MAX_SEQ_ROWS && T * K * 2 <= MAX_SEQ_X_BYTES)) {
        switch (T) {
            case 1: rows_seq(1, x, w, bias, y, K, N, n0, n1); return;
            case 2: rows_seq(2, x, w, bias, y, K, N, n0, n1); return;
            case 3: rows_seq(3, x, w, bias, y, K, N, n0, n1); return;
            case 4: rows_seq(4, x, w, bias, y, K, N, n0, n1); return;
        }
    }
    const int64_t num_groups = (T + MAX_GROUP - 1) / MAX_GROUP;
    const int64_t G = (T + num_groups - 1) / num_groups; /* balanced, e.g. 9 -> 5 + 4 */
    const int R = TILE_ROWS;
    for (int64_t n = n0; n < n1;) {
        const int r = n + R <= n1 ? R : 1; /* single rows at the end of the range */
        for (int64_t t0 = 0; t0 < T; t0 += G) {
            const int g = (int)(T - t0 < G ? T - t0 : G);
            run_tile(r, g, x + t0 * K, w, bias, y + t0 * N, K, N, n);
        }
        n += r;
    }
}

/* Entry point. Returns 0, or -1 when T is outside 1..16 (nothing written). Each thread
 * takes one contiguous range of rows, so it reads one forward stream of memory. */
int specmoe_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                        uint16_t *y, int64_t T, int64_t K, int64_t N, int num_threads) {
    if (T < 1 || T > MAX_T || K < 1 || N < 1) return -1;
    const int64_t num_units = (N + ROW_ALIGN - 1) / ROW_ALIGN;
    const int64_t max_threads = N * K * 2 / MIN_BYTES_PER_THREAD;
    if (num_threads > max_threads) num_threads = (int)max_threads;
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t n0 = num_units * i / nt * ROW_ALIGN;
        const int64_t n1 = num_units * (i + 1) / nt * ROW_ALIGN;
        if (n0 < N) rows(x, w, bias, y, T, K, N, n0, n1 < N ? n1 : N);
    }
    return 0;
}
