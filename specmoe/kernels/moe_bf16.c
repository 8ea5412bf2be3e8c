/* The routed experts of a MoE layer in one call, bf16 on CPU:
 *     out[t] = sum over slots s = 0 .. k-1 of  w[t][s] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
 * with e = ids[t][s], for x [T, H] bf16, ids [T, k] int64, w [T, k] fp32 or bf16.
 *
 * Layout. w13 holds every expert's [gate | up] projection [2I, H] (gate rows [0, I), up rows
 * [I, 2I)) and w2 every expert's down projection [H, I], each expert packed in the panel
 * layout of gemv_bf16.c (64 output rows per panel, pair-interleaved along the input) and the
 * experts stacked: expert e's panels start at e * ceil(2I / 64) * ceil(H / 2) * 128 elements
 * of w13 and e * ceil(H / 64) * ceil(I / 2) * 128 of w2 (`specmoe.kernels.gemv.pack_weight`
 * of the [N, 2I, H] and [N, H, I] tensors gives exactly this).
 *
 * Steps, all inside one OpenMP parallel region (no return to Python in between):
 * 0. A counting sort of the T * k (token, slot) pairs by expert, stable (within an expert,
 *    token order, then slot order), on one thread: each expert's rows are a contiguous
 *    range of the sorted order. Each sorted row gets its token's x copied (the gather).
 * 1. For every active expert, its rows times its gate/up panels, each panel streamed from
 *    memory once for all of that expert's rows (`panels` of gemv_panels.h), rounded to bf16.
 * 2. SiLU-and-mul of every sorted row, with the instructions and roundings of
 *    elementwise_bf16.c's specmoe_silu_and_mul_bf16: bf16(bf16(silu(g)) * u).
 * 3. For every active expert, the down projection of its rows (as step 1), rounded to bf16.
 * 4. Per token, its k down outputs weighted and summed in fp32 in slot order:
 *    acc = 0; acc = acc + w[t][s] * y[t][s] for s = 0 .. k-1 (a multiply, then an add: no
 *    FMA); rounded once to bf16.
 * Steps 1 and 3 give every thread a contiguous share of the (expert, panel) units, the
 * active experts' panels in expert-major order, so a thread streams one run of weights, and
 * a skewed routing (one expert with most rows) is split across threads by panels rather than
 * left to one thread. Every unit of one step reads the same bytes; a unit's cost is taken as
 * max(MEM_ROWS, rows of its expert), so shares are equal in bytes when decoding (few rows per
 * expert: memory bound) and equal in multiply work when many rows meet one expert. Steps 0,
 * 2 and 4 split rows or tokens statically. The thread count only moves work between
 * threads, never an output's order of operations.
 *
 * Summation order (batch invariance). Each expert output is computed by the code of the
 * bf16 linear kernel, whose sum over the input is in a fixed order independent of the row
 * count, a row's position and the thread count (gemv_bf16.c); SiLU-and-mul is elementwise;
 * a token's k contributions are summed in slot order. So a token's output bits depend only
 * on its own x row, ids and weights: the same decoded alone (T = 1) as among other tokens
 * in a batched speculative verification or a prefill, and equal to the composition, per
 * active expert, of specmoe_linear_bf16 on its rows, specmoe_silu_and_mul_bf16 and
 * specmoe_linear_bf16 again, then the fp32 slot-order sum (the tests check both bit for
 * bit). Greedy speculative decoding in bf16 needs this to stay lossless.
 *
 * Design sources, in our words: vLLM's fused_moe (its moe_align_block_size sorts the
 * (token, expert) pairs by expert into row blocks, so each program multiplies one expert's
 * block of rows and reads that expert's weights for all of them); SGLang's CPU
 * fused_experts (the same sort, then a 2-D split of (row block, output block) tasks over
 * threads, SiLU-and-mul fused into the first GEMM by pairing each gate output block with
 * its up block, and the weighted sum of a token's k rows at the end); llama.cpp's
 * mul_mat_id (rows grouped by expert id, one matmul per used expert on its gathered rows).
 * Here each per-expert matmul is this repository's panel kernel, whose fixed summation
 * order the layer keeps, and the split is by weight panels across experts, because at
 * decode sizes an expert has one or two rows and the weight bytes are the whole cost.
 * SiLU-and-mul stays a separate pass over the sorted rows (gate and up rows of a row are in
 * different panels, often on different threads); it costs little next to the weights.
 * The sort, the split of units between threads, SiLU-and-mul of a row and the final sum
 * are moe_common.h's, shared with moe_int4.c.
 *
 * Built by specmoe/kernels/build.py (gcc -O3 -march=native -std=c11 -fopenmp; ISO C mode
 * keeps a * b + c from contracting into an FMA).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe moe_bf16 needs AVX-512F and AVX-512BW"
#endif

#include "gemv_panels.h"

#define MIN_BYTES_PER_THREAD (256 << 10) /* less work (weight bytes x 16-row groups) runs on
                                            one thread, as in gemv_bf16.c */
#define MEM_ROWS 8 /* a panel read from memory costs about as much as multiplying this many
                      rows into it (the linear kernel's time is nearly flat up to ~8 rows) */

#include "moe_common.h"

/* 2: vdpbf16ps, 1: shift + FMA (as specmoe_gemv_isa). */
int specmoe_moe_isa(void) { return SPECMOE_ISA; }

/* The scratch buffers, carved from one block of specmoe_moe_scratch_bytes bytes. */
typedef struct {
    SortedRows sorted;  /* the (token, slot) pairs sorted by expert (moe_common.h) */
    uint16_t *xs;       /* [T k, H]: x of each sorted row */
    uint16_t *gate_up;  /* [T k, 2I] */
    uint16_t *act;      /* [T k, I] */
    uint16_t *ys;       /* [T k, H]: down projections */
} Scratch;

/* Places the buffers from base (which may be NULL: sizes only); returns the bytes needed. */
static int64_t carve(char *base, int64_t T, int64_t k, int64_t H, int64_t I, int64_t N,
                     Scratch *s) {
    const int64_t rows = T * k;
    int64_t at = 0;
    take_sorted_rows(base, &at, rows, N, &s->sorted);
    s->xs = take(base, &at, (int64_t)sizeof(uint16_t) * rows * H);
    s->gate_up = take(base, &at, (int64_t)sizeof(uint16_t) * rows * 2 * I);
    s->act = take(base, &at, (int64_t)sizeof(uint16_t) * rows * I);
    s->ys = take(base, &at, (int64_t)sizeof(uint16_t) * rows * H);
    return scratch_total(at);
}

/* Bytes of scratch a call with these sizes needs. */
int64_t specmoe_moe_scratch_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t N) {
    Scratch s;
    return carve(NULL, T, k, H, I, N, &s);
}

/* Thread i of nt's share of one projection step: units (u = a * P + p: active expert a,
 * panel p) [u0, u1) of out_rows = in_rows @ W_e^T for every active expert e, W_e [Nout, K]
 * packed at w + e * P * ceil(K / 2) * 128 (P = ceil(Nout / 64) panels). */
static void projection_share(const SortedRows *s, int64_t num_active, const uint16_t *in,
                             const uint16_t *w, uint16_t *out, int64_t K, int64_t Nout,
                             int64_t i, int64_t nt) {
    const int64_t P = (Nout + PANEL - 1) / PANEL;
    const int64_t expert_elems = P * ((K + 1) / 2) * (2 * PANEL);
    int64_t u, u1;
    thread_units(s, num_active, P, i, nt, &u, &u1);
    while (u < u1) {
        const int64_t a = u / P, p0 = u % P;
        const int64_t p1 = P < p0 + (u1 - u) ? P : p0 + (u1 - u);
        const int32_t e = s->active[a];
        const int64_t r0 = s->offsets[e], rows = s->offsets[e + 1] - r0;
        for (int64_t t0 = 0; t0 < rows; t0 += T_BLOCK)
            panels(in + (r0 + t0) * K, w + e * expert_elems, NULL, out + (r0 + t0) * Nout,
                   rows - t0 < T_BLOCK ? rows - t0 : T_BLOCK, K, Nout, p0, p1);
        u += p1 - p0;
    }
}

/* Entry point. x [T, H] bf16; topk_ids [T, k] int64; topk_weights [T, k] fp32, or bf16 when
 * weights_bf16; w13, w2: every expert's packed projections (see the layout above); out
 * [T, H] bf16; scratch: specmoe_moe_scratch_bytes(T, k, H, I, N) bytes. All contiguous.
 * Returns the number of threads it ran on (>= 1); -1 when a size is out of range (T, k,
 * H, N below 1, I not a positive multiple of 16, T k above 2^31 - 1); -2 when an expert id
 * is outside [0, N). Nothing is written on an error. */
int specmoe_moe_bf16(const uint16_t *x, const int64_t *topk_ids, const void *topk_weights,
                     int weights_bf16, const uint16_t *w13, const uint16_t *w2, uint16_t *out,
                     void *scratch, int64_t T, int64_t k, int64_t H, int64_t I, int64_t N,
                     int num_threads) {
    if (T < 1 || k < 1 || H < 1 || N < 1 || I < 16 || I % 16 || T > INT32_MAX / k) return -1;
    const int64_t rows = T * k;
    if (!ids_in_range(topk_ids, rows, N)) return -2;

    Scratch s;
    carve(scratch_base(scratch), T, k, H, I, N, &s);
    const int64_t num_active = sort_by_expert(topk_ids, rows, k, N, &s.sorted); /* step 0 */

    /* threads: by the weight bytes read times 16-row groups, as the linear kernel */
    const int64_t expert_bytes = (((2 * I + PANEL - 1) / PANEL) * ((H + 1) / 2)
                                  + ((H + PANEL - 1) / PANEL) * ((I + 1) / 2)) * (4 * PANEL);
    int64_t work = 0;
    for (int64_t a = 0; a < num_active; a++)
        work += expert_bytes * ((expert_rows(&s.sorted, a) + 15) / 16);
    const int64_t nt = thread_count(work, MIN_BYTES_PER_THREAD, num_threads,
                                    num_active * ((2 * I + PANEL - 1) / PANEL));

    int used = 1;
#pragma omp parallel num_threads((int)nt)
    {
        const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single nowait
        used = (int)n;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            memcpy(s.xs + r * H, x + (int64_t)s.sorted.row_token[r] * H, sizeof(uint16_t) * H);
        projection_share(&s.sorted, num_active, s.xs, w13, s.gate_up, H, 2 * I, i, n);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            silu_and_mul_row(s.gate_up + r * 2 * I, s.act + r * I, I);
        projection_share(&s.sorted, num_active, s.act, w2, s.ys, I, H, i, n);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            combine_token(&s.sorted, s.ys, topk_weights, weights_bf16, 1, out, t, k, H);
    }
    return used;
}
