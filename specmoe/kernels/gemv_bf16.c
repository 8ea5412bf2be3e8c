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
 * The panel code (`panels` and what it calls) is in gemv_panels.h, shared with the fused MoE
 * kernel moe_bf16.c, which thereby sums every output in this order too.
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

#define MIN_BYTES_PER_THREAD (256 << 10) /* less work (weight bytes x 16-row groups of x)
                                           runs on one thread */

#include "gemv_panels.h"

/* 2: vdpbf16ps, 1: shift + FMA. Lets Python report which path it built. */
int specmoe_gemv_isa(void) { return SPECMOE_ISA; }

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
