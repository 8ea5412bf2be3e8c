/* The panel code of the bf16 linear kernel (gemv_bf16.c: layout, passes and summation
 * order are described there), shared with the fused MoE kernel (moe_bf16.c), so that both
 * compute every output with the same instructions in the same order (the same bits).
 * `panels(x, wp, bias, y, T, K, N, p0, p1)` computes output panels [p0, p1) of
 * y[T, N] = x[T, K] @ W^T (+ bias) for T <= T_BLOCK rows of x. Needs AVX-512F and BW;
 * specmoe/kernels/build.py hashes this header into every kernel's cache key. */
#ifndef SPECMOE_GEMV_PANELS_H
#define SPECMOE_GEMV_PANELS_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define PANEL 64      /* output rows per panel */
#define PANEL_VECS 4  /* 512-bit registers per pair index of a panel (64 fp32 lanes) */
#define MAX_GROUP 6   /* input rows per pass over a panel: 6 x 4 accumulators */
#define T_BLOCK 96    /* input rows per pass over a thread's panels */
#define J_BLOCK 32    /* pairs per slice of a panel shared by several groups (8 KB) */
#define PREFETCH_PAIRS 16 /* how far ahead (pair indices, 4 KB) a pass prefetches its panel;
                             prefetches go to L2 (_MM_HINT_T1): into L1 they slow 8-16 rows
                             and help no row count; 32 or 64 pairs ahead do no better */

#include "avx512_math.h"
#include "bf16_dot.h"

/* Whether a one-row pass prefetches its panel in software, as passes of more rows do. The
 * better choice depends on the memory system, so Python measures both on the model's own
 * weights and sets it (specmoe/kernels/panel_prefetch_tune.py): on a 2-core Zen 4 in its fast
 * memory phase, prefetching 4 KB ahead held one row at 74-78 GB/s against 79-83 without
 * (the hardware prefetcher alone keeps up there); on a 2-core Xeon (22-25 GB/s), one row
 * without it read 17 GB/s, with it 25 (the whole probe). One copy per library that
 * includes this header (the linear and fused MoE kernels); each exports its setter. */
static int one_row_prefetch = 0;

void specmoe_set_one_row_prefetch(int on) { one_row_prefetch = on != 0; }
int specmoe_one_row_prefetch(void) { return one_row_prefetch; }

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
                 * row alone does only where `one_row_prefetch` is set */
                const uint16_t *pf = T == 1 && !one_row_prefetch ? NULL
                                     : panel + (i ? j_block : PREFETCH_PAIRS) * (2 * PANEL);
                run_group((int)(T - t0 < G ? T - t0 : G), x + t0 * K, panel, pf, bias,
                          y + t0 * N, K, N, p * PANEL, j0, j1, spill[i]);
            }
        }
    }
}

#endif /* SPECMOE_GEMV_PANELS_H */
