/* y[T, N] = x[T, K] @ W[N, K]^T (+ b[N]), bf16 in and out, fp32 accumulation, any T >= 1,
 * on W packed in panels (`specmoe_pack_bf16`).
 *
 * Panel layout: W[N, K] as P[ceil(N / 64)][ceil(K / 2)][64][2] bf16: panel p holds output
 * rows 64p .. 64p + 63, and for each pair index j their pairs (W[n][2j], W[n][2j + 1]) side
 * by side, 256 bytes per j; rows past N and the element past an odd K are zeros. One j of a
 * panel fills four 512-bit registers whose 16 fp32 lanes are 16 output rows, so `vdpbf16ps`
 * with x's pair j broadcast to every lane adds that pair's two products to 64 outputs at
 * once (the "outer-product" form oneDNN and llama.cpp use), and the weights of a thread's
 * panels are one forward stream in memory.
 *
 * Decoding is bound by the bandwidth of reading W, so every panel is streamed from memory
 * once for all T input rows: up to 6 rows are multiplied per pass over a panel (4 x 6 = 24
 * accumulators), more rows take several passes over 32-pair slices of the panel (8 KB,
 * from L1) with the accumulators set aside in between, and larger T (prefill, batched
 * verification) runs in blocks of up to 96 input rows, each block through all of a
 * thread's panels. OpenMP threads take contiguous ranges of panels, split inside a panel
 * by row groups where that evens out their work (`thread_share`).
 *
 * Summation order (batch invariance): output (t, n) is one fp32 accumulator, starting at
 * zero, to which pair j = 0, 1, ... ceil(K / 2) - 1 adds its two products W[n][2j] x[t][2j]
 * and W[n][2j + 1] x[t][2j + 1] (one `vdpbf16ps` lane with AVX512-BF16, else two FMAs on
 * the pairs widened to fp32, `dot_pairs`); then + bias, rounded once to bf16. That order is
 * the same for every T, every position of a row in x, every pass and slice, and any thread
 * count, so a token's outputs have the same bits decoded alone (T = 1) as in a (K + 1)-row
 * speculative verification of several requests, a chunked prefill or the tail of a prompt
 * after a prefix-cache hit. Greedy speculative decoding in bf16 needs this to be lossless
 * (the attention kernel is invariant in the same way); the tests check it bit for bit.
 * Unlike per-row dot products (16 lanes along K, then a horizontal sum), no output needs
 * a horizontal sum, and each output's chain of dependent adds is shared out over 64 outputs
 * per j, so even one row runs 4 independent chains.
 *
 * The measurements behind these choices: docs/results/2026-11-30-packed-panels/ and
 * docs/results/2026-12-02-code-comment-history/.
 *
 * Built by specmoe/kernels/build.py with gcc -O3 -march=native -fopenmp.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe gemv_bf16 needs AVX-512F and AVX-512BW"
#endif

#define PANEL 64      /* output rows per panel */
#define PANEL_VECS 4  /* 512-bit registers per pair index of a panel (64 fp32 lanes) */
#define MAX_GROUP 6   /* input rows per pass over a panel: 6 x 4 accumulators */
#define T_BLOCK 96    /* input rows per pass over a thread's panels */
#define J_BLOCK 32    /* pairs per slice of a panel shared by several groups (8 KB) */
#define PREFETCH_PAIRS 16 /* how far ahead (pair indices, 4 KB) a pass prefetches its panel;
                             prefetches go to L2 (_MM_HINT_T1): into L1 they slow 8-16 rows
                             and help no row count; 32 or 64 pairs ahead do no better */
#define MIN_BYTES_PER_THREAD (256 << 10) /* less work (weight bytes x 16-row groups of x)
                                           runs on one thread */

#include "avx512_math.h"
#include "bf16_dot.h"

/* 2: vdpbf16ps, 1: shift + FMA. Lets Python report which path it built. */
int specmoe_gemv_isa(void) { return SPECMOE_ISA; }

/* x's pair j of row t as one 32-bit lane (x[2j] low, x[2j + 1] high) in all 16 lanes. */
static inline __attribute__((always_inline)) __m512i pair_x(const uint16_t *p) {
    return _mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss((const float *)p)));
}

/* acc[t][i] += pairs [j0, j1) of the panel `wp` (pair-major, 64 rows) times x row t, for
 * G rows, prefetching pf + j's panel row as it goes (no prefetch if pf is NULL). With an
 * odd K the last pair's x is x[K - 1] alone (its weight partner is 0). */
static inline __attribute__((always_inline)) void panel_pass(
    const int G, const uint16_t *x, int64_t K, const uint16_t *wp, const uint16_t *pf,
    int64_t j0, int64_t j1, __m512 acc[][PANEL_VECS]) {
    const int64_t whole = j1 < K / 2 ? j1 : K / 2; /* pairs with both x elements */
    int64_t j = j0;
    for (; j < whole; j++) {
        const uint16_t *wj = wp + j * (2 * PANEL);
        if (pf)
#pragma GCC unroll 4
            for (int i = 0; i < PANEL_VECS; i++)
                _mm_prefetch((const char *)(pf + j * (2 * PANEL) + 32 * i), _MM_HINT_T1);
        __m512i wv[PANEL_VECS];
#pragma GCC unroll 4
        for (int i = 0; i < PANEL_VECS; i++) wv[i] = _mm512_loadu_si512(wj + 32 * i);
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) {
            const __m512i xv = pair_x(x + t * K + 2 * j);
#pragma GCC unroll 4
            for (int i = 0; i < PANEL_VECS; i++) acc[t][i] = dot_pairs(acc[t][i], wv[i], xv);
        }
    }
    if (j < j1) { /* j = K / 2 with K odd */
        const uint16_t *wj = wp + j * (2 * PANEL);
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) {
            const __m512i xv = _mm512_set1_epi32((int32_t)x[t * K + K - 1]);
#pragma GCC unroll 4
            for (int i = 0; i < PANEL_VECS; i++)
                acc[t][i] = dot_pairs(acc[t][i], _mm512_loadu_si512(wj + 32 * i), xv);
        }
    }
}

/* G input rows x one panel (outputs n0 .. n0 + 63) over pairs [j0, j1): at j1 = ceil(K / 2)
 * the results (+ bias) go to y[t * N + n], else the accumulators to `spill`, from which a
 * later call with j0 > 0 resumes them (fp32 kept exactly: the same sums in the same order
 * as one pass). */
static inline __attribute__((always_inline)) void panel_group(
    const int G, const uint16_t *x, const uint16_t *wp, const uint16_t *pf,
    const uint16_t *bias, uint16_t *y, int64_t K, int64_t N, int64_t n0, int64_t j0,
    int64_t j1, __m512 *spill) {
    __m512 acc[MAX_GROUP][PANEL_VECS];
#pragma GCC unroll 8
    for (int t = 0; t < G; t++)
#pragma GCC unroll 4
        for (int i = 0; i < PANEL_VECS; i++)
            acc[t][i] = j0 ? spill[t * PANEL_VECS + i] : _mm512_setzero_ps();
    panel_pass(G, x, K, wp, pf, j0, j1, acc);
    if (j1 < (K + 1) / 2) {
#pragma GCC unroll 8
        for (int t = 0; t < G; t++)
#pragma GCC unroll 4
            for (int i = 0; i < PANEL_VECS; i++) spill[t * PANEL_VECS + i] = acc[t][i];
        return;
    }
#pragma GCC unroll 4
    for (int i = 0; i < PANEL_VECS; i++) {
        const int64_t n = n0 + 16 * i;
        if (n >= N) break;
        const __mmask16 m = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + n)),
                                    16))
                              : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int t = 0; t < G; t++) {
            const __m512i rounded = bf16_round_bits(_mm512_add_ps(acc[t][i], b));
            _mm256_mask_storeu_epi16(y + t * N + n, m,
                                     _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
        }
    }
}

#define CASE(G) case G: panel_group(G, x, wp, pf, bias, y, K, N, n0, j0, j1, spill); break
static void run_group(int G, const uint16_t *x, const uint16_t *wp, const uint16_t *pf,
                      const uint16_t *bias, uint16_t *y, int64_t K, int64_t N, int64_t n0,
                      int64_t j0, int64_t j1, __m512 *spill) {
    switch (G) { CASE(1); CASE(2); CASE(3); CASE(4); CASE(5); CASE(6); }
}
#undef CASE

/* Panels [p0, p1) for T <= T_BLOCK input rows, in groups of MAX_GROUP rows and the rest
 * (16 -> 6 + 6 + 4: full groups first, a little faster than balanced groups); with several
 * groups, in J_BLOCK-pair slices, each read from memory by the first group and from L1 by
 * the others, which prefetch the next slice meanwhile, so that memory keeps streaming while
 * they compute (prefetching only in the first group, or slices of 256 KB from L2, ran
 * slower). */
static void panels(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                   int64_t T, int64_t K, int64_t N, int64_t p0, int64_t p1) {
    const int64_t pairs = (K + 1) / 2;
    const int64_t num_groups = (T + MAX_GROUP - 1) / MAX_GROUP;
    const int64_t G = T < MAX_GROUP ? T : MAX_GROUP;
    const int64_t j_block = num_groups > 1 ? J_BLOCK : pairs;
    __m512 spill[(T_BLOCK + MAX_GROUP - 1) / MAX_GROUP][MAX_GROUP * PANEL_VECS];
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *panel = wp + p * pairs * (2 * PANEL);
        for (int64_t j0 = 0; j0 < pairs; j0 += j_block) {
            const int64_t j1 = pairs - j0 < j_block ? pairs : j0 + j_block;
            for (int64_t t0 = 0, i = 0; t0 < T; t0 += G, i++) {
                /* the first pass prefetches a little ahead, later ones the next slice; one
                 * row alone leaves it to the hardware prefetcher (software prefetch on top
                 * slows its single stream when memory is fast) */
                const uint16_t *pf = T == 1 ? NULL
                                     : panel + (i ? j_block : PREFETCH_PAIRS) * (2 * PANEL);
                run_group((int)(T - t0 < G ? T - t0 : G), x + t0 * K, panel, pf, bias,
                          y + t0 * N, K, N, p * PANEL, j0, j1, spill[i]);
            }
        }
    }
}

/* Work of T rows times P panels is indexed panel-major: (panel p, row t) is p * T + t. The
 * row-group start (p, g) nearest to work index w: row g * MAX_GROUP of panel p, or (p + 1, 0)
 * when the end of panel p is nearer; past the last panel: (P, 0). */
static void group_start_near(int64_t w, int64_t T, int64_t num_panels, int64_t *p, int64_t *g) {
    *p = w / T;
    *g = (w - *p * T + MAX_GROUP / 2) / MAX_GROUP;
    if (*g * MAX_GROUP >= T) { ++*p; *g = 0; }
    if (*p >= num_panels) { *p = num_panels; *g = 0; }
}

/* Thread i of nt's share of T <= T_BLOCK rows times all P panels: the row groups from the
 * one starting nearest work index T * P * i / nt to the one starting nearest
 * T * P * (i + 1) / nt, so shares differ by about a row group and a panel is split between
 * threads only at row groups (into more than two shares only when threads outnumber
 * panels). Whole panels per thread would leave one of two threads idle a fifth of the time
 * on 9 panels (SmolLM2's 576 outputs). */
static void thread_share(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                         uint16_t *y, int64_t T, int64_t K, int64_t N, int64_t i, int64_t nt) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, total = T * num_panels;
    int64_t pa, ga, pb, gb;
    group_start_near(total * i / nt, T, num_panels, &pa, &ga);
    group_start_near(total * (i + 1) / nt, T, num_panels, &pb, &gb);
    const int64_t ra = ga * MAX_GROUP, rb = gb * MAX_GROUP;
    if (pa == pb) { /* within one panel */
        if (rb > ra) panels(x + ra * K, wp, bias, y + ra * N, rb - ra, K, N, pa, pa + 1);
        return;
    }
    if (ra > 0) { /* the end of a shared panel */
        panels(x + ra * K, wp, bias, y + ra * N, T - ra, K, N, pa, pa + 1);
        pa++;
    }
    if (pb > pa) panels(x, wp, bias, y, T, K, N, pa, pb);
    if (rb > 0) panels(x, wp, bias, y, rb, K, N, pb, pb + 1); /* the start of one */
}

static int thread_count(int64_t work_bytes, int64_t units, int num_threads) {
    const int64_t max_threads = work_bytes / MIN_BYTES_PER_THREAD;
    if (num_threads > max_threads) num_threads = (int)max_threads;
    if (num_threads > units) num_threads = (int)units;
    return num_threads < 1 ? 1 : num_threads;
}

/* Entry point: wp from specmoe_pack_bf16(W, wp, N, K). Returns 0, or -1 when T, K or N is
 * below 1 (nothing written). */
int specmoe_linear_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                        uint16_t *y, int64_t T, int64_t K, int64_t N, int num_threads) {
    if (T < 1 || K < 1 || N < 1) return -1;
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t rows = T < T_BLOCK ? T : T_BLOCK;
    num_threads = thread_count(N * K * 2 * ((T + 15) / 16),
                               num_panels * ((rows + MAX_GROUP - 1) / MAX_GROUP), num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), i = omp_get_thread_num();
        for (int64_t t0 = 0; t0 < T; t0 += T_BLOCK)
            thread_share(x + t0 * K, wp, bias, y + t0 * N, T - t0 < T_BLOCK ? T - t0 : T_BLOCK,
                         K, N, i, nt);
    }
    return 0;
}

/* W [N, K] (row-major bf16) into the panel layout above at out (ceil(N / 64) *
 * ceil(K / 2) * 128 elements): per panel, 16 rows x 16 pairs at a time are loaded (64 bytes
 * of each row, masked past K, zeros past N), transposed as 32-bit pairs and stored as 16
 * pair indices x 16 rows, so every load and store is a whole 64-byte line (much faster
 * than gathering the 64 rows' pairs one index at a time). Returns 0, or -1 when K or N is
 * below 1. */
int specmoe_pack_bf16(const uint16_t *w, uint16_t *out, int64_t N, int64_t K, int num_threads) {
    if (K < 1 || N < 1) return -1;
    const int64_t pairs = (K + 1) / 2, num_panels = (N + PANEL - 1) / PANEL;
    num_threads = thread_count(N * K * 2, num_panels, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        uint32_t *o = (uint32_t *)(out + p * pairs * (2 * PANEL));
        for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
            const int64_t left = K - 2 * j0; /* elements of each row from pair j0 on */
            const __mmask32 m = left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << left) - 1);
            const int64_t nj = pairs - j0 < 16 ? pairs - j0 : 16;
            for (int64_t r0 = 0; r0 < PANEL; r0 += 16) {
                __m512i v[16];
                for (int r = 0; r < 16; r++) {
                    const int64_t n = p * PANEL + r0 + r;
                    v[r] = n < N ? _mm512_maskz_loadu_epi16(m, w + n * K + 2 * j0)
                                 : _mm512_setzero_si512();
                }
                transpose16_epi32(v);
                for (int64_t i = 0; i < nj; i++)
                    _mm512_storeu_si512(o + (j0 + i) * PANEL + r0, v[i]);
            }
        }
    }
    return 0;
}
