/* What the fused MoE kernels share whatever their experts' weight format (moe_bf16.c,
 * moe_int4.c): the scratch's carving, the expert id check, the stable counting sort of the
 * (token, slot) pairs by expert, the split of (active expert, unit) work between threads and
 * the thread count, SiLU-and-mul of one sorted row, and the fp32 slot-order combine of a
 * token's k down outputs. Every floating-point operation here is the one each kernel did
 * before it shared this code, in the same order (the combine takes the one place where the
 * two kernels' orders differ as an argument), so the kernels' bits are their own.
 *
 * The includer defines MEM_ROWS (a unit's cost floor, see unit_cost) before including this
 * header; specmoe/kernels/build.py hashes it into every kernel's cache key. Needs AVX-512F,
 * BW and VL. */
#ifndef SPECMOE_MOE_COMMON_H
#define SPECMOE_MOE_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"

#ifndef MEM_ROWS
#error "define MEM_ROWS before including moe_common.h"
#endif

#define SCRATCH_ALIGN 64

/* The (token, slot) pairs sorted by expert: the first buffers of either kernel's scratch. */
typedef struct {
    int32_t *offsets;   /* [N + 1]: expert e's rows are [offsets[e], offsets[e + 1]) */
    int32_t *cursor;    /* [N]: next free row of each expert while sorting */
    int32_t *active;    /* [N]: the experts with rows, ascending */
    int32_t *row_token; /* [T k]: the token of each sorted row */
    int32_t *pos;       /* [T k]: the sorted row of pair t k + s */
} SortedRows;

static inline int64_t aligned(int64_t bytes) {
    return (bytes + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN;
}

/* The buffer of `bytes` bytes at base + *at (NULL when base is NULL: sizes only); moves *at
 * past it, aligned. */
static inline void *take(char *base, int64_t *at, int64_t bytes) {
    void *p = base ? base + *at : NULL;
    *at += aligned(bytes);
    return p;
}

/* Bytes a carve that took `at` bytes needs: room to align the base (scratch_base). */
static inline int64_t scratch_total(int64_t at) { return at + SCRATCH_ALIGN; }

/* Where the caller's scratch block is carved from: its start, aligned up. */
static inline char *scratch_base(void *scratch) {
    const uintptr_t mask = SCRATCH_ALIGN - 1;
    return (char *)(((uintptr_t)scratch + mask) & ~mask);
}

/* The sort's buffers for R = T k pairs and N experts, taken from base + *at. */
static inline void take_sorted_rows(char *base, int64_t *at, int64_t R, int64_t N,
                                    SortedRows *s) {
    s->offsets = take(base, at, (int64_t)sizeof(int32_t) * (N + 1));
    s->cursor = take(base, at, (int64_t)sizeof(int32_t) * N);
    s->active = take(base, at, (int64_t)sizeof(int32_t) * N);
    s->row_token = take(base, at, (int64_t)sizeof(int32_t) * R);
    s->pos = take(base, at, (int64_t)sizeof(int32_t) * R);
}

/* Whether each of the R ids is in [0, N) (checked before anything is written). */
static inline int ids_in_range(const int64_t *topk_ids, int64_t R, int64_t N) {
    for (int64_t r = 0; r < R; r++)
        if (topk_ids[r] < 0 || topk_ids[r] >= N) return 0;
    return 1;
}

/* The counting sort of the R = T k (token, slot) pairs by expert, stable (within an expert,
 * token order, then slot order), on one thread; returns the number of active experts. */
static inline int64_t sort_by_expert(const int64_t *topk_ids, int64_t R, int64_t k,
                                     int64_t N, SortedRows *s) {
    memset(s->offsets, 0, sizeof(int32_t) * (N + 1));
    for (int64_t r = 0; r < R; r++) s->offsets[topk_ids[r] + 1]++;
    int64_t num_active = 0;
    for (int64_t e = 0; e < N; e++) {
        if (s->offsets[e + 1]) s->active[num_active++] = (int32_t)e;
        s->offsets[e + 1] += s->offsets[e];
        s->cursor[e] = s->offsets[e];
    }
    for (int64_t r = 0; r < R; r++) {
        const int32_t row = s->cursor[topk_ids[r]]++;
        s->row_token[row] = (int32_t)(r / k);
        s->pos[r] = row;
    }
    return num_active;
}

/* Rows of active expert a. */
static inline int64_t expert_rows(const SortedRows *s, int64_t a) {
    const int32_t e = s->active[a];
    return s->offsets[e + 1] - s->offsets[e];
}

/* A unit's cost: max(MEM_ROWS, rows of its expert). */
static inline int64_t unit_cost(const SortedRows *s, int64_t a) {
    const int64_t c = expert_rows(s, a);
    return c > MEM_ROWS ? c : MEM_ROWS;
}

/* The unit boundary (unit u = a * P + p: active expert a, its unit p of P) nearest
 * cumulative cost w; num_active * P past the end. */
static inline int64_t unit_near(const SortedRows *s, int64_t num_active, int64_t P,
                                int64_t w) {
    int64_t cum = 0;
    for (int64_t a = 0; a < num_active; a++) {
        const int64_t c = unit_cost(s, a);
        if (w < cum + c * P) return a * P + (w - cum + c / 2) / c;
        cum += c * P;
    }
    return num_active * P;
}

/* Thread i of nt's units [*u0, *u1) of the num_active * P, a contiguous share of their
 * cost in expert-major order. */
static inline void thread_units(const SortedRows *s, int64_t num_active, int64_t P,
                                int64_t i, int64_t nt, int64_t *u0, int64_t *u1) {
    int64_t total = 0;
    for (int64_t a = 0; a < num_active; a++) total += unit_cost(s, a) * P;
    *u1 = unit_near(s, num_active, P, total * (i + 1) / nt);
    *u0 = unit_near(s, num_active, P, total * i / nt);
}

/* The threads to run on: one per min_bytes of work, at most num_threads and units, at
 * least one. */
static inline int64_t thread_count(int64_t work, int64_t min_bytes, int num_threads,
                                   int64_t units) {
    int64_t nt = work / min_bytes;
    if (nt > num_threads) nt = num_threads;
    if (nt > units) nt = units;
    if (nt < 1) nt = 1;
    return nt;
}

/* The bf16 value nearest v, as fp32 (elementwise_bf16.c's round_bf16). */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_round_bits(v),
                                                _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* One row of SiLU-and-mul: gate_up [2I] -> out [I], exactly as specmoe_silu_and_mul_bf16
 * (I a multiple of 16). */
static inline void silu_and_mul_row(const uint16_t *g, uint16_t *out, int64_t I) {
    const uint16_t *u = g + I;
    for (int64_t i = 0; i < I; i += 16) {
        __m512 x = load_bf16x16(g + i);
        __m512 silu = _mm512_div_ps(
            x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        store_bf16x16(out + i, _mm512_mul_ps(round_bf16(silu), load_bf16x16(u + i)));
    }
}

/* out[t] = its k slots' down outputs (ys [T k, H], sorted rows) weighted and summed in
 * slot order in fp32, rounded once; 16 lanes at a time, the last ones masked. from_zero:
 * acc = 0, then acc = acc + w[t][s] * y[t][s] for s = 0 .. k-1 (moe_bf16.c); else
 * acc = w[t][0] * y[t][0], then the next products added (moe_int4.c,
 * QuantizedRoutedExperts._combine's order). A multiply, then an add: no FMA. The two orders
 * differ in the sign of a zero sum only (0 + -0 is +0). */
static inline void combine_token(const SortedRows *s, const uint16_t *ys,
                                 const void *topk_weights, int weights_bf16, int from_zero,
                                 uint16_t *out, int64_t t, int64_t k, int64_t H) {
    for (int64_t h = 0; h < H; h += 16) {
        const __mmask16 m = H - h >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (H - h)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j++) {
            const int64_t at = t * k + j;
            const float wt = weights_bf16 ? bf16_to_f32(((const uint16_t *)topk_weights)[at])
                                          : ((const float *)topk_weights)[at];
            const uint16_t *y = ys + (int64_t)s->pos[at] * H + h;
            const __m512 yv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y)), 16));
            const __m512 p = _mm512_mul_ps(_mm512_set1_ps(wt), yv);
            acc = j || from_zero ? _mm512_add_ps(acc, p) : p;
        }
        const __m512i rounded = bf16_round_bits(acc);
        _mm256_mask_storeu_epi16(out + t * H + h, m,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    }
}

#endif /* SPECMOE_MOE_COMMON_H */
