/* The routed experts of a MoE layer in one call, int4 experts, bf16 activations, on CPU:
 *     out[t] = sum over slots s = 0 .. k-1 of  w[t][s] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
 * with e = ids[t][s], for x [T, H] bf16, ids [T, k] int64, w [T, k] fp32 or bf16; the
 * int4 counterpart of moe_bf16.c, with the same contract.
 *
 * Layout. Every expert's [gate | up] projection [2I, H] (gate rows [0, I), up rows [I, 2I))
 * and down projection [H, I] in the int4 kernel's layout (gemv_int4.c: groups of 32 inputs,
 * packed bytes q[2j] | q[2j + 1] << 4, bf16 scale and zero per group, W = (q - 8) s + z),
 * the experts stacked: w13 is one `struct specmoe_int4_weights` for the [N 2I, H] matrix of
 * all experts' gate/up rows (expert e's rows e 2I .. e 2I + 2I - 1), w2 one for the [N H, I]
 * matrix of their down rows; their biases are ignored. QuantizedRoutedExperts' stacked
 * buffers (w13_packed [N, 2I, H / 2] uint8, w13_scales, w13_zeros [N, 2I, H / 32] bf16,
 * w2_* likewise) are exactly this with row strides H / 2 (I / 2) and H / 32 (I / 32).
 *
 * Steps, all inside one OpenMP parallel region (no return to Python in between):
 * 0. A counting sort of the T k (token, slot) pairs by expert, stable (within an expert,
 *    token order, then slot order), on one thread: each expert's rows are a contiguous
 *    range of the sorted order, split into balanced tiles of at most MAX_T (16) rows (e.g.
 *    17 -> 8 + 9, as gemv_int4.py splits a call).
 * 1. Every sorted row's token x prepared as the int4 kernel prepares x (blocks reordered
 *    to match the unpacked weights, group sums), laid out per tile as one int4 kernel call
 *    of that tile's rows lays it out.
 * 2. For every active expert, each tile of its rows times its gate/up rows, by the int4
 *    kernel's own code (gemv_int4_core.h `rows`, as one call of that tile's rows), rounded
 *    to bf16. An expert with several tiles walks its weight rows in blocks of REUSE_BYTES,
 *    every tile passing over a block before the next, so its weights are read from memory
 *    once for all of its rows and from cache by the later tiles.
 * 3. SiLU-and-mul of every sorted row, with the instructions and roundings of
 *    elementwise_bf16.c's specmoe_silu_and_mul_bf16, bf16(bf16(silu(g)) * u), and the
 *    result prepared for the down projection (as step 1).
 * 4. For every active expert, the down projection of its rows (as step 2), rounded to bf16.
 * 5. Per token, its k down outputs weighted and summed in fp32 in slot order:
 *    acc = w[t][0] * y[t][0]; acc = acc + w[t][s] * y[t][s] for s = 1 .. k-1 (a multiply,
 *    then an add: no FMA); rounded once to bf16 (the order and roundings of
 *    QuantizedRoutedExperts._combine).
 * Steps 2 and 4 give every thread a contiguous share of the (expert, 16-row unit) pairs, the
 * active experts' output rows in expert-major order, so that a decode step (one or two rows
 * per expert) spreads its experts' weights over all threads and a skewed routing (one
 * expert with most rows) is split across threads by output rows. A unit's cost is taken as
 * max(MEM_ROWS, rows of its expert): equal bytes per thread when decoding (memory bound),
 * equal multiply work when many rows meet one expert. Steps 1, 3 and 5 split rows or
 * tokens statically. The thread count only moves work between threads, never an output's
 * order of operations.
 *
 * Summation order (batch invariance). Each expert output is computed by the int4 kernel's
 * code, whose sum over the input is in a fixed order whatever the number of rows, a row's
 * place among them, the K chunking and the thread count (gemv_int4.c); SiLU-and-mul is
 * elementwise; a token's k contributions are summed in slot order. So a token's output
 * bits depend only on its own x row, ids and weights, at any number of tokens and any
 * number of rows per expert: the same decoded alone (T = 1) as among other tokens in a
 * speculative verification or a prefill. They equal the composition, per active expert, of
 * specmoe_linear_int4 on its rows, specmoe_silu_and_mul_bf16 and specmoe_linear_int4
 * again, then the fp32 slot-order sum: QuantizedRoutedExperts.forward_loop's bits wherever
 * that loop runs the int4 kernel for every expert (at most gemv_int4.MAX_SPLIT_ROWS rows
 * per expert, or any number in gemv_int4's batch-invariant mode; beyond that, by default,
 * the loop multiplies bf16 copies of the weights instead). The tests check both.
 *
 * Design sources: moe_bf16.c (the sort, the gather, the split of weight rows across
 * experts and threads; vLLM's fused_moe, SGLang's CPU fused_experts and llama.cpp's
 * mul_mat_id behind it), with each per-expert matmul the int4 kernel of gemv_int4.c. The
 * two share moe_common.h: the sort, the split of units between threads, SiLU-and-mul of a
 * row and the final sum (each kernel keeping its own order there).
 *
 * Built by specmoe/kernels/build.py (gcc -O3 -march=native -std=c11 -fopenmp; ISO C mode
 * keeps a * b + c from contracting into an FMA).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "specmoe moe_int4 needs AVX-512F, AVX-512BW and AVX-512VL"
#endif

#include "gemv_int4_core.h"

#define MIN_BYTES_PER_THREAD (64 << 10) /* less work (weight bytes x 8-row groups) runs on
                                           fewer threads, as in gemv_int4.c */
#define UNIT_ROWS 16 /* output rows per work unit (the int4 kernel stores 16 rows at a time) */
#define MEM_ROWS 4   /* a weight row read from memory costs about as much as multiplying
                        this many rows of x into it (an estimate: only the balance between
                        threads depends on it) */
#define REUSE_BYTES (32 << 10) /* several tiles: weight rows per block, kept in cache */

#include "moe_common.h"

/* 2: vdpbf16ps, 1: shift + FMA (as specmoe_gemv_int4_isa). */
int specmoe_moe_int4_isa(void) { return SPECMOE_ISA; }

/* Sizes of one call. */
typedef struct {
    int64_t T, k, H, I, N, R;   /* R = T k sorted rows */
    int64_t NB_H, NS_H, NB_I, NS_I; /* blocks of 4 groups and padded group sums of H and I */
} Sizes;

/* The scratch buffers, carved from one block of specmoe_moe_int4_scratch_bytes bytes. */
typedef struct {
    SortedRows sorted;   /* the (token, slot) pairs sorted by expert (moe_common.h) */
    int32_t *tile_start; /* [R]: the first sorted row of each row's tile */
    int32_t *tile_rows;  /* [R]: the rows of each row's tile */
    uint16_t *xp_h;      /* [R NB_H 128]: prepared x; the tile at row r0 with n rows holds
                            [NB_H, n, 128] from r0 NB_H 128 on (an int4 call's layout) */
    float *xs_h;         /* [R NS_H]: group sums; that tile [NS_H / 16, n, 16] from r0 NS_H */
    uint16_t *gate_up;   /* [R, 2I] */
    uint16_t *act;       /* [R, I] */
    uint16_t *xp_i;      /* [R NB_I 128]: the activations prepared, as xp_h */
    float *xs_i;         /* [R NS_I] */
    uint16_t *ys;        /* [R, H]: down projections */
} Scratch;

static Sizes sizes_of(int64_t T, int64_t k, int64_t H, int64_t I, int64_t N) {
    const int64_t gh = H / GROUP, gi = I / GROUP;
    const Sizes z = {T, k, H, I, N, T * k, (gh + 3) / 4, (gh + 15) / 16 * 16, (gi + 3) / 4,
                     (gi + 15) / 16 * 16};
    return z;
}

/* Places the buffers from base (which may be NULL: sizes only); returns the bytes needed. */
static int64_t carve(char *base, const Sizes *z, Scratch *s) {
    const int64_t R = z->R;
    int64_t at = 0;
    take_sorted_rows(base, &at, R, z->N, &s->sorted);
    s->tile_start = take(base, &at, (int64_t)sizeof(int32_t) * R);
    s->tile_rows = take(base, &at, (int64_t)sizeof(int32_t) * R);
    s->xp_h = take(base, &at, (int64_t)sizeof(uint16_t) * R * z->NB_H * BLOCK_ELEMS);
    s->xs_h = take(base, &at, (int64_t)sizeof(float) * R * z->NS_H);
    s->gate_up = take(base, &at, (int64_t)sizeof(uint16_t) * R * 2 * z->I);
    s->act = take(base, &at, (int64_t)sizeof(uint16_t) * R * z->I);
    s->xp_i = take(base, &at, (int64_t)sizeof(uint16_t) * R * z->NB_I * BLOCK_ELEMS);
    s->xs_i = take(base, &at, (int64_t)sizeof(float) * R * z->NS_I);
    s->ys = take(base, &at, (int64_t)sizeof(uint16_t) * R * z->H);
    return scratch_total(at);
}

/* Bytes of scratch a call with these sizes needs (H and I multiples of 32). */
int64_t specmoe_moe_int4_scratch_bytes(int64_t T, int64_t k, int64_t H, int64_t I, int64_t N) {
    const Sizes z = sizes_of(T, k, H, I, N);
    Scratch s;
    return carve(NULL, &z, &s);
}

/* Sorted row r's input (K elements at element offset `from` of src) prepared into its
 * tile's place in xp [.. NB ..] and xs [.. NS ..] (see Scratch). */
static inline void prepare_sorted_row(const Scratch *s, int64_t r, const uint16_t *src,
                                      int64_t from, int64_t K, int64_t NB, int64_t NS,
                                      uint16_t *xp, float *xs) {
    const int64_t r0 = s->tile_start[r], n = s->tile_rows[r], j = r - r0;
    prepare_row(src, 1, from, K, NB, NS, xp + r0 * NB * BLOCK_ELEMS + j * BLOCK_ELEMS,
                n * BLOCK_ELEMS, xs + r0 * NS + j * 16, n * 16);
}

/* One projection of the tile of sorted rows starting at r0 as an int4 kernel call sees it:
 * x prepared in xp, xs (K inputs), expert e's Nout rows of W, y [R, Nout]. */
static inline struct call tile_call(const Scratch *s, const struct specmoe_int4_weights *W,
                                    int64_t e, int64_t r0, const uint16_t *xp, const float *xs,
                                    int64_t NB, int64_t NS, uint16_t *y, int64_t K,
                                    int64_t Nout) {
    const int64_t n = s->tile_rows[r0], first = e * Nout;
    const struct call c = {xp + r0 * NB * BLOCK_ELEMS, xs + r0 * NS,
                           W->packed + first * W->w_stride, W->scales + first * W->sz_stride,
                           W->zeros + first * W->sz_stride, W->w_stride, W->sz_stride, NULL,
                           y + r0 * Nout, 1, n, K, Nout, chunk_groups(n, K)};
    return c;
}

/* Output rows [n0, n1) of expert e for all of its sorted rows: tile after tile, over
 * blocks of weight rows when there are several tiles (each block from memory once). */
static void expert_share(const Scratch *s, const struct specmoe_int4_weights *W, int64_t e,
                         const uint16_t *xp, const float *xs, int64_t NB, int64_t NS,
                         uint16_t *y, int64_t K, int64_t Nout, int64_t n0, int64_t n1) {
    const int64_t r_begin = s->sorted.offsets[e], r_end = s->sorted.offsets[e + 1];
    if (s->tile_rows[r_begin] == r_end - r_begin) {
        const struct call c = tile_call(s, W, e, r_begin, xp, xs, NB, NS, y, K, Nout);
        rows(&c, n0, n1);
        return;
    }
    const int64_t row_bytes = K / 2 + K / GROUP * 4;
    int64_t block = REUSE_BYTES / row_bytes / UNIT_ROWS * UNIT_ROWS;
    if (block < UNIT_ROWS) block = UNIT_ROWS;
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
        const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
        for (int64_t r0 = r_begin; r0 < r_end; r0 += s->tile_rows[r0]) {
            const struct call c = tile_call(s, W, e, r0, xp, xs, NB, NS, y, K, Nout);
            rows(&c, b0, b1);
        }
    }
}

/* Thread i of nt's share of one projection step: units (u = a * P + p: active expert a,
 * output rows [16 p, 16 p + 16)) [u0, u1) of y = in @ W_e^T for every active expert e. */
static void projection_share(const Scratch *s, int64_t num_active,
                             const struct specmoe_int4_weights *W, const uint16_t *xp,
                             const float *xs, int64_t NB, int64_t NS, uint16_t *y, int64_t K,
                             int64_t Nout, int64_t i, int64_t nt) {
    const int64_t P = (Nout + UNIT_ROWS - 1) / UNIT_ROWS;
    int64_t u, u1;
    thread_units(&s->sorted, num_active, P, i, nt, &u, &u1);
    while (u < u1) {
        const int64_t a = u / P, p0 = u % P;
        const int64_t p1 = P < p0 + (u1 - u) ? P : p0 + (u1 - u);
        const int64_t n1 = p1 * UNIT_ROWS < Nout ? p1 * UNIT_ROWS : Nout;
        expert_share(s, W, s->sorted.active[a], xp, xs, NB, NS, y, K, Nout, p0 * UNIT_ROWS,
                     n1);
        u += p1 - p0;
    }
}

/* Step 0: the counting sort by expert (moe_common.h) and the tiles of each expert's rows;
 * returns the number of active experts. */
static int64_t sort_rows(const int64_t *topk_ids, const Sizes *z, Scratch *s) {
    const int64_t num_active = sort_by_expert(topk_ids, z->R, z->k, z->N, &s->sorted);
    for (int64_t a = 0; a < num_active; a++) {
        const int64_t e = s->sorted.active[a], o = s->sorted.offsets[e];
        const int64_t n = s->sorted.offsets[e + 1] - o, m = (n + MAX_T - 1) / MAX_T;
        for (int64_t i = 0, start = 0; i < m; i++) {
            const int64_t end = start + (n - start) / (m - i);
            for (int64_t r = o + start; r < o + end; r++) {
                s->tile_start[r] = (int32_t)(o + start);
                s->tile_rows[r] = (int32_t)(end - start);
            }
            start = end;
        }
    }
    return num_active;
}

/* Entry point. x [T, H] bf16; topk_ids [T, k] int64; topk_weights [T, k] fp32, or bf16 when
 * weights_bf16; w13, w2: every expert's int4 projections (see the layout above: w13->K = H,
 * w13->N = N 2I, w2->K = I, w2->N = N H); out [T, H] bf16; scratch:
 * specmoe_moe_int4_scratch_bytes(T, k, H, I, N) bytes. x, ids, weights and out contiguous.
 * Returns the number of threads it ran on (>= 1); -1 when a size is out of range (T, k, N
 * below 1, H or I not a positive multiple of 32, T k above 2^31 - 1, w13 or w2 not of
 * those sizes or with row strides below K / 2 bytes and K / 32 groups); -2 when an expert
 * id is outside [0, N). Nothing is written on an error. */
int specmoe_moe_int4(const uint16_t *x, const int64_t *topk_ids, const void *topk_weights,
                     int weights_bf16, const struct specmoe_int4_weights *w13,
                     const struct specmoe_int4_weights *w2, uint16_t *out, void *scratch,
                     int64_t T, int64_t k, int64_t H, int64_t I, int64_t N, int num_threads) {
    if (T < 1 || k < 1 || N < 1 || H < GROUP || H % GROUP || I < GROUP || I % GROUP
        || T > INT32_MAX / k)
        return -1;
    if (w13->K != H || w13->N != N * 2 * I || w2->K != I || w2->N != N * H
        || w13->w_stride < H / 2 || w13->sz_stride < H / GROUP || w2->w_stride < I / 2
        || w2->sz_stride < I / GROUP)
        return -1;
    const Sizes z = sizes_of(T, k, H, I, N);
    const int64_t R = z.R;
    if (!ids_in_range(topk_ids, R, N)) return -2;

    Scratch s;
    carve(scratch_base(scratch), &z, &s);
    const int64_t num_active = sort_rows(topk_ids, &z, &s);

    /* threads: by the weight bytes read times 8-row groups, as the int4 linear kernel */
    const int64_t expert_bytes = 2 * I * (H / 2 + H / GROUP * 4) + H * (I / 2 + I / GROUP * 4);
    int64_t work = 0;
    for (int64_t a = 0; a < num_active; a++)
        work += expert_bytes * ((expert_rows(&s.sorted, a) + MAX_GROUP - 1) / MAX_GROUP);
    const int64_t nt = thread_count(work, MIN_BYTES_PER_THREAD, num_threads,
                                    num_active * (((H < 2 * I ? H : 2 * I) + UNIT_ROWS - 1)
                                                  / UNIT_ROWS));

    int used = 1;
#pragma omp parallel num_threads((int)nt)
    {
        const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single nowait
        used = (int)n;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            prepare_sorted_row(&s, r, x, (int64_t)s.sorted.row_token[r] * H, H, z.NB_H, z.NS_H,
                               s.xp_h, s.xs_h);
        projection_share(&s, num_active, w13, s.xp_h, s.xs_h, z.NB_H, z.NS_H, s.gate_up, H,
                         2 * I, i, n);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            silu_and_mul_row(s.gate_up + r * 2 * I, s.act + r * I, I);
            prepare_sorted_row(&s, r, s.act, r * I, I, z.NB_I, z.NS_I, s.xp_i, s.xs_i);
        }
        projection_share(&s, num_active, w2, s.xp_i, s.xs_i, z.NB_I, z.NS_I, s.ys, I, H, i, n);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            combine_token(&s.sorted, s.ys, topk_weights, weights_bf16, 0, out, t, k, H);
    }
    return used;
}
