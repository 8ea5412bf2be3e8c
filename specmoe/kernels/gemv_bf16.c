/* y[T, N] = x[T, K] @ w[N, K]^T (+ b[N]), bf16 in and out, fp32 accumulation, any T >= 1.
 *
 * Decoding is bound by the bandwidth of reading w, so every weight row is streamed from
 * memory once for all T input rows: a tile of 4 weight rows is multiplied with groups of
 * up to 6 input rows while it sits in L1/L2; with at most 8 rows whose x fits in L1,
 * weight rows are read one after another instead (one stream, best for the prefetcher).
 * Larger T (prefill, batched verification) runs in blocks of up to 96 input rows, each
 * block through all of a thread's weight rows, so the block's x stays in L2.
 * Each (row, token) pair keeps one 16-lane fp32 accumulator over the pairs
 * (w[2i], w[2i+1]) . (x[2i], x[2i+1]) of a 32-element step (`vdpbf16ps` with AVX512-BF16,
 * else the same pairs widened to fp32 by shifts + FMA), steps in ascending k, the K tail
 * read last with masked loads, then one horizontal sum (the tiles do 16 at once with the
 * same add tree as the single ones, `reduce_add16`). Each OpenMP thread takes one
 * contiguous range of output rows.
 *
 * Batch invariance: that summation order is the same in both code paths, for every T, every
 * position of a row in x and any thread count, so a token's outputs have the same bits
 * decoded alone (T = 1) as in a (K + 1)-row speculative verification of several requests,
 * a chunked prefill or the tail of a prompt after a prefix-cache hit. Greedy speculative
 * decoding in bf16 needs this to be lossless (the attention kernel is invariant in the same
 * way); the tests check it bit for bit.
 *
 * Measured on 2 Zen 5 cores (SmolLM2-135M and Qwen2.5-1.5B matrices): 1-4 rows read at
 * ~85-100% of a plain streaming read, 5 rows (a K = 4 verification) of SmolLM2's 576- or
 * Qwen's 1536-column matrices about as fast as 1; from ~9 rows the multiplies (`vdpbf16ps`
 * throughput), not memory, set the pace: 16 rows cost ~1.3-1.5x one row, at ~80% of the
 * vdpbf16ps peak from cache; 17-64 rows run 1.1-2x torch's oneDNN `F.linear`, 256-1024 rows ~10-15% below
 * it (~25-35% on 8960-column rows).
 *
 * Built by specmoe/kernels/build.py with gcc -O3 -march=native -fopenmp.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe gemv_bf16 needs AVX-512F and AVX-512BW"
#endif

#define T_BLOCK 96    /* input rows per pass over a thread's weight rows */
#define K_BLOCK 1024  /* columns per slice of a tile (a multiple of 32) */
#define MAX_GROUP 6   /* input rows multiplied per pass over a weight tile */
#define TILE_ROWS 4   /* weight rows per tile: 4 x 6 accumulators fill 24 registers */
#define MAX_SEQ_ROWS 8 /* up to this many input rows, x small: rows_seq, not tiles */
#define MAX_SEQ_X_BYTES (16 << 10)
#define SEQ_PREFETCH_BYTES 4096 /* how far ahead rows_seq prefetches its weight stream */
#define MAX_TILE_PREFETCH_BYTES (24 << 10) /* larger tiles prefetch TILE_PREFETCH_ELEMS ahead */
#define TILE_PREFETCH_ELEMS 1024
#define ROW_ALIGN TILE_ROWS  /* thread ranges start at multiples of the tile height */
#define MIN_BYTES_PER_THREAD (256 << 10) /* less work (weight bytes x 16-row groups of x)
                                           runs on one thread */

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

/* R weight rows x G input rows over columns [k0, k1); at k1 = K the results (+ bias) go to
 * y[t * N + n], else the accumulators to `spill`, from which a later call with k0 > 0
 * resumes them (fp32 kept exactly: the same sums in the same order as one pass). The
 * R rows are read side by side and the hardware prefetcher alone falls behind on R short
 * streams while the core is busy, so the next tile is prefetched meanwhile: all of it when
 * it fits in L1 beside x, else each row stream a fixed distance ahead (running into the
 * next tile's rows near the end). */
static inline __attribute__((always_inline)) void tile(
    const int R, const int G, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
    uint16_t *y, int64_t K, int64_t N, int64_t n, int64_t k0, int64_t k1, __m512 *spill) {
    __m512 acc[TILE_ROWS][MAX_GROUP];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) acc[r][t] = k0 ? spill[r * MAX_GROUP + t] : _mm512_setzero_ps();
    const uint16_t *wr = w + n * K;
    const int whole_next = R * K * 2 <= MAX_TILE_PREFETCH_BYTES;
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
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
    if (k < k1) { /* tail (k1 = K): masked loads read zeros past K */
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
    if (k1 < K) {
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int t = 0; t < G; t++) spill[r * MAX_GROUP + t] = acc[r][t];
        return;
    }
    store_tile(R, G, acc, bias, y, N, n);
}

/* Weight rows one after another, each with all G input rows, so a thread's range is one
 * forward stream for the hardware prefetcher (best while x is small enough for L1). One
 * accumulator per input row, as `tile` (batch invariance): the dependent vdpbf16ps chain
 * still outpaces memory at 1-4 rows, about keeps up at 5-8. From 5 rows the G sums of a
 * weight row are taken together (`reduce_add16`, same bits as one at a time): on
 * SmolLM2-135M's matrices, read from memory, 5-8 rows ran 1.15-1.25x faster this way than
 * through tiles, whose 4 short row streams per tile the prefetcher follows less well. */
static inline __attribute__((always_inline)) void rows_seq(
    const int G, const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
    int64_t K, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * K;
        __m512 acc[MAX_SEQ_ROWS];
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) acc[t] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            if (G > 1) /* from 2 rows on, the hardware prefetcher alone falls behind */
                _mm_prefetch((const char *)(wr + k) + SEQ_PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i wv = _mm512_loadu_si512(wr + k);
#pragma GCC unroll 8
            for (int t = 0; t < G; t++)
                acc[t] = dot_pairs(acc[t], wv, _mm512_loadu_si512(x + t * K + k));
        }
        if (k < K) { /* tail: masked loads read zeros past K */
            const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
            const __m512i wv = _mm512_maskz_loadu_epi16(m, wr + k);
#pragma GCC unroll 8
            for (int t = 0; t < G; t++)
                acc[t] = dot_pairs(acc[t], wv, _mm512_maskz_loadu_epi16(m, x + t * K + k));
        }
        const float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
        if (G > 4) {
            __m512 pack[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) pack[t] = t < G ? acc[t] : _mm512_setzero_ps();
            uint16_t out[16];
            store_bf16x16(out, _mm512_add_ps(reduce_add16(pack), _mm512_set1_ps(b)));
#pragma GCC unroll 8
            for (int t = 0; t < G; t++) y[t * N + n] = out[t];
            continue;
        }
#pragma GCC unroll 4
        for (int t = 0; t < G; t++) y[t * N + n] = f32_to_bf16(_mm512_reduce_add_ps(acc[t]) + b);
    }
}

#define CASE(R, G) case R * 16 + G: tile(R, G, x, w, bias, y, K, N, n, k0, k1, spill); break
#define CASES(R) CASE(R, 1); CASE(R, 2); CASE(R, 3); CASE(R, 4); CASE(R, 5); CASE(R, 6)
static void run_tile(int R, int G, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                     uint16_t *y, int64_t K, int64_t N, int64_t n, int64_t k0, int64_t k1,
                     __m512 *spill) {
    switch (R * 16 + G) { CASES(1); CASES(4); }
}
#undef CASES
#undef CASE

/* Rows [n0, n1): one pass for few input rows, else tiles reused from cache per group; with
 * several groups and long rows, in K_BLOCK-column slices so a tile's slice stays in L1 for
 * all groups (each group's accumulators set aside in between). */
static void rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int64_t T, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    if (T == 1 || (T <= MAX_SEQ_ROWS && T * K * 2 <= MAX_SEQ_X_BYTES)) {
        switch (T) {
            case 1: rows_seq(1, x, w, bias, y, K, N, n0, n1); return;
            case 2: rows_seq(2, x, w, bias, y, K, N, n0, n1); return;
            case 3: rows_seq(3, x, w, bias, y, K, N, n0, n1); return;
            case 4: rows_seq(4, x, w, bias, y, K, N, n0, n1); return;
            case 5: rows_seq(5, x, w, bias, y, K, N, n0, n1); return;
            case 6: rows_seq(6, x, w, bias, y, K, N, n0, n1); return;
            case 7: rows_seq(7, x, w, bias, y, K, N, n0, n1); return;
            case 8: rows_seq(8, x, w, bias, y, K, N, n0, n1); return;
        }
    }
    const int64_t num_groups = (T + MAX_GROUP - 1) / MAX_GROUP;
    const int64_t G = (T + num_groups - 1) / num_groups; /* balanced, e.g. 9 -> 5 + 4 */
    const int R = TILE_ROWS;
    const int64_t k_block = num_groups > 1 ? K_BLOCK : K;
    __m512 spill[(T_BLOCK + MAX_GROUP - 1) / MAX_GROUP][TILE_ROWS * MAX_GROUP];
    for (int64_t n = n0; n < n1;) {
        const int r = n + R <= n1 ? R : 1; /* single rows at the end of the range */
        for (int64_t k0 = 0; k0 < K; k0 += k_block) {
            const int64_t k1 = K - k0 < k_block ? K : k0 + k_block;
            for (int64_t t0 = 0, i = 0; t0 < T; t0 += G, i++) {
                const int g = (int)(T - t0 < G ? T - t0 : G);
                run_tile(r, g, x + t0 * K, w, bias, y + t0 * N, K, N, n, k0, k1, spill[i]);
            }
        }
        n += r;
    }
}

/* Entry point. Returns 0, or -1 when T, K or N is below 1 (nothing written). Each thread
 * takes one contiguous range of rows, so it reads one forward stream of memory, once per
 * block of T_BLOCK input rows. */
int specmoe_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                        uint16_t *y, int64_t T, int64_t K, int64_t N, int num_threads) {
    if (T < 1 || K < 1 || N < 1) return -1;
    const int64_t num_units = (N + ROW_ALIGN - 1) / ROW_ALIGN;
    const int64_t max_threads = N * K * 2 * ((T + 15) / 16) / MIN_BYTES_PER_THREAD;
    if (num_threads > max_threads) num_threads = (int)max_threads;
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t n0 = num_units * i / nt * ROW_ALIGN;
        const int64_t n1 = num_units * (i + 1) / nt * ROW_ALIGN;
        if (n0 < N)
            for (int64_t t0 = 0; t0 < T; t0 += T_BLOCK)
                rows(x + t0 * K, w, bias, y + t0 * N, T - t0 < T_BLOCK ? T - t0 : T_BLOCK, K, N,
                     n0, n1 < N ? n1 : N);
    }
    return 0;
}
