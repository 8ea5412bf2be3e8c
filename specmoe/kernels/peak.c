/* The multiply-add peak of this CPU's vector unit, as the matmul kernels issue their
 * multiply-adds: `dot_pairs` (bf16_dot.h: `vdpbf16ps`, 64 flops per 512-bit instruction,
 * or its FMA fallback) for bf16, `vfmadd` (32 flops) for fp32. Each thread runs ACCS
 * independent accumulator chains, enough to cover the instruction's latency at full
 * throughput, with no memory traffic. `specmoe bench throughput` divides a run's matmul
 * flops by this rate for the run's compute floor (specmoe/bench/throughput_floor.py).
 *
 * Built by specmoe/kernels/build.py (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include "bf16_dot.h"

#if !defined(__AVX512F__)
#error "specmoe peak needs AVX-512F"
#endif

#define ACCS 12

static volatile float sink;

/* One thread's iters rounds of ACCS multiply-adds. */
static void run_chains(int64_t iters, int bf16) {
    __m512 acc[ACCS];
    for (int i = 0; i < ACCS; i++) acc[i] = _mm512_set1_ps((float)i);
    __m512i w = _mm512_set1_epi32(0x3f803f80), x = _mm512_set1_epi32(0x3f803f81);
    const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
    for (int64_t k = 0; k < iters; k++) {
        if (bf16) {
#pragma GCC unroll 12
            for (int i = 0; i < ACCS; i++) acc[i] = dot_pairs(acc[i], w, x);
        } else {
#pragma GCC unroll 12
            for (int i = 0; i < ACCS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        }
        __asm__ volatile("" : "+v"(w), "+v"(x)); /* keep the inputs opaque to the compiler */
    }
    float s = 0.0f;
    for (int i = 0; i < ACCS; i++) s += _mm512_reduce_add_ps(acc[i]);
    sink = s;
}

/* Best of `repeats` flop/s over num_threads threads, each running `iters` rounds; bf16 1:
 * dot_pairs, 0: fp32 FMA. Returns -1 for arguments below 1. */
double specmoe_vector_peak(int64_t iters, int bf16, int num_threads, int repeats) {
    if (iters < 1 || num_threads < 1 || repeats < 1) return -1.0;
    const double flops = (double)iters * ACCS * (bf16 ? 64.0 : 32.0) * num_threads;
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(num_threads)
        run_chains(iters, bf16);
        const double rate = flops / (omp_get_wtime() - t0);
        if (rate > best) best = rate;
    }
    return best;
}
