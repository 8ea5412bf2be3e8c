/* Causal paged attention of a forward's query rows (decode, verification of K drafts and
 * prefill chunks alike) over a bf16 KV cache read through block tables, fp32 softmax and
 * accumulation, bf16 output.
 *
 * The G query heads sharing a KV head times a sequence's R query rows form G*R query vectors
 * (vector i: row i / G, head i % G); one work unit is (sequence, KV head, block of up to 16
 * of those vectors). Keys are read from the cache through the block table in chunks of 16
 * laid across the 16 fp32 lanes of AVX-512 registers. Each score is a bf16 pair dot product
 * along head_dim (`vdpbf16ps`, or shifts and FMAs without AVX512-BF16: bf16_dot.h), and the
 * 16 keys' partial sums are reduced into one vector of 16 scores by an add tree (reduce_add16).
 * The online softmax (running max and sum per query vector; Milakov and Gimelshein 2018,
 * arXiv 1805.02867; the chunked form of FlashAttention, Dao et al. 2022, arXiv 2205.14135)
 * then runs once per chunk on that vector, and P V adds e_p * v_p with head_dim across the
 * lanes, the accumulator in registers. Row r of a sequence whose first query sits at position
 * P attends keys P + r - window < p <= P + r (window 0: no lower bound). Chunks start at
 * multiples of 16 and masked keys add exact zeros, so a row's result has the same bits
 * whatever other rows and sequences share the call (batch invariance, as in gemv_bf16.c).
 *
 * The plain-torch reference is the torch path of specmoe/layers/paged_attention.py
 * (`_attend_decode`, `attend_decode_reference`, `_attend_prefill`). Built by
 * specmoe/kernels/build.py (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "avx512_math.h"
#include "bf16_dot.h"

#if !defined(__AVX512F__)
#error "specmoe attention_bf16 needs AVX-512F"
#endif

#define CHUNK 16          /* keys per online-softmax step */
#define MAX_HEAD_DIM 256
#define MAX_ROWS 65536    /* query rows per sequence */
#define VECTOR_BLOCK 16   /* query vectors attended per pass over a unit's keys */
#define NEG_BIG -1e30f    /* running-max start: finite, so exp(m_old - m_new) is never NaN */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 32 bf16 from p, the last pair-vector of a head_dim that is an odd multiple of 16 half
 * filled (zeros add nothing to a dot product). */
ALWAYS_INLINE __m512i load_pairs(const uint16_t *p, int64_t c, const int64_t hd) {
    __mmask32 m = 32 * (c + 1) <= hd ? 0xFFFFFFFFu : 0x0000FFFFu;
    return _mm512_maskz_loadu_epi16(m, p + 32 * c);
}

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
} Shape;

/* State of one query vector. */
typedef struct {
    __m512i q[MAX_HEAD_DIM / 32];   /* the query's bf16 pairs, unscaled */
    __m512 acc[MAX_HEAD_DIM / 16];  /* sum_p e_p v_p, head_dim across lanes */
    float m, l;                     /* running max and sum of exponentials */
    int64_t first, last;            /* attended key positions [first, last] */
} Query;

/* Scores of one query against the chunk's n keys (rows kp[j]) at positions p0.., masked,
 * through the online softmax: returns e_j = exp(score_j - m) in lane j (0 past n or outside
 * the mask) and rescales the query's accumulator. */
ALWAYS_INLINE __m512 chunk_scores(Query *qv, const uint16_t *const *kp, int n, int64_t p0,
                                  const int64_t hd, float scale) {
    __m512 a[CHUNK];
    for (int j = 0; j < n; j++) {
        __m512 d = _mm512_setzero_ps();
        for (int64_t c = 0; c < (hd + 31) / 32; c++) d = dot_pairs(d, load_pairs(kp[j], c, hd), qv->q[c]);
        a[j] = d;
    }
    for (int j = n; j < CHUNK; j++) a[j] = _mm512_setzero_ps();
    __m512 sc = _mm512_mul_ps(reduce_add16(a), _mm512_set1_ps(scale));
    __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)p0),
                                   _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    __mmask16 ok = (__mmask16)((1u << n) - 1)
                   & _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int32_t)qv->last), _MM_CMPINT_LE)
                   & _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int32_t)qv->first), _MM_CMPINT_NLT);
    if (!ok) return _mm512_setzero_ps();
    sc = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), sc);
    float m_new = fmaxf(qv->m, _mm512_reduce_max_ps(sc));
    float alpha = expf(qv->m - m_new);
    __m512 e = exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)));  /* masked lanes: 0 */
    qv->l = qv->l * alpha + _mm512_reduce_add_ps(e);
    qv->m = m_new;
    if (alpha != 1.0f)
        for (int64_t c = 0; c < hd / 16; c++) qv->acc[c] = _mm512_mul_ps(qv->acc[c], _mm512_set1_ps(alpha));
    return e;
}

/* acc += sum_j e[j] * vf[j] over the chunk's n fp32 value rows, the accumulator held in
 * registers (a constant head_dim lets the compiler unroll). */
ALWAYS_INLINE void chunk_values(__m512 *acc_mem, const float *e, const float *vf, int n,
                                const int64_t hd) {
    __m512 acc[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < hd / 16; c++) acc[c] = acc_mem[c];
    for (int j = 0; j < n; j++) {
        __m512 ej = _mm512_set1_ps(e[j]);
        for (int64_t c = 0; c < hd / 16; c++)
            acc[c] = _mm512_fmadd_ps(ej, _mm512_loadu_ps(vf + j * hd + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < hd / 16; c++) acc_mem[c] = acc[c];
}

/* The unit's query vectors v0 .. v0+nv-1 (vector v: row v / G, head kvh * G + v % G). */
ALWAYS_INLINE void load_queries(Query *qs, const uint16_t *q, const Shape *s, int64_t row0,
                                int64_t v0, int64_t nv, int64_t start_pos, int64_t kvh,
                                const int64_t hd) {
    const int64_t G = s->num_heads / s->num_kv_heads;
    for (int64_t i = 0; i < nv; i++) {
        const int64_t v = v0 + i;
        const uint16_t *qrow = q + ((row0 + v / G) * s->num_heads + kvh * G + v % G) * hd;
        for (int64_t c = 0; c < (hd + 31) / 32; c++) qs[i].q[c] = load_pairs(qrow, c, hd);
        for (int64_t c = 0; c < hd / 16; c++) qs[i].acc[c] = _mm512_setzero_ps();
        qs[i].m = NEG_BIG;
        qs[i].l = 0.0f;
        qs[i].last = start_pos + v / G;
        qs[i].first = s->window > 0 && qs[i].last - s->window + 1 > 0 ? qs[i].last - s->window + 1 : 0;
    }
}

static void store_outputs(const Query *qs, uint16_t *out, const Shape *s, int64_t row0,
                          int64_t v0, int64_t nv, int64_t kvh) {
    const int64_t G = s->num_heads / s->num_kv_heads, hd = s->head_dim;
    for (int64_t i = 0; i < nv; i++) {
        const int64_t v = v0 + i;
        uint16_t *orow = out + ((row0 + v / G) * s->num_heads + kvh * G + v % G) * hd;
        for (int64_t c = 0; c < hd / 16; c++)
            store_bf16x16(orow + 16 * c, _mm512_div_ps(qs[i].acc[c], _mm512_set1_ps(qs[i].l)));
    }
}

/* One work unit: query vectors v0 .. v0+nv-1 (nv <= VECTOR_BLOCK) of a sequence's rows
 * against KV head kvh, every key read once through the block table. */
ALWAYS_INLINE void unit_impl(Query *qs, float *vf, const uint16_t *q, const uint16_t *k_cache,
                             const uint16_t *v_cache, uint16_t *out, const Shape *s,
                             int64_t row0, int64_t v0, int64_t nv, int64_t start_pos,
                             const int64_t *table, int64_t kvh, const int64_t hd) {
    const int64_t G = s->num_heads / s->num_kv_heads;
    const int64_t end = start_pos + (v0 + nv - 1) / G + 1;  /* past the block's last row */
    const int64_t pos0 = start_pos + v0 / G;                /* the block's first row */
    /* chunks start at multiples of CHUNK (the window is masked per lane), so a row's sums
     * run in the same order whatever rows share its block: batch invariance */
    const int64_t first = s->window > 0 && pos0 - s->window + 1 > 0 ? pos0 - s->window + 1 : 0;
    const int64_t begin = first / CHUNK * CHUNK;
    float e[VECTOR_BLOCK][CHUNK] __attribute__((aligned(64)));
    load_queries(qs, q, s, row0, v0, nv, start_pos, kvh, hd);
    for (int64_t p0 = begin; p0 < end; p0 += CHUNK) {
        const int n = (int)(end - p0 < CHUNK ? end - p0 : CHUNK);
        const uint16_t *kp[CHUNK];
        for (int j = 0; j < n; j++) {
            const int64_t p = p0 + j;
            const int64_t slot = table[p / s->block_size] * s->block_size + p % s->block_size;
            kp[j] = k_cache + (slot * s->num_kv_heads + kvh) * hd;
            const uint16_t *vrow = v_cache + (slot * s->num_kv_heads + kvh) * hd;
            for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(vf + j * hd + d, load_bf16x16(vrow + d));
        }
        /* the next chunk's rows are scattered over the cache (one head of each slot, slots
         * in table order): fetch them while this chunk computes */
        for (int64_t p = p0 + CHUNK; p < p0 + 2 * CHUNK && p < end; p++) {
            const int64_t slot = table[p / s->block_size] * s->block_size + p % s->block_size;
            const char *kn = (const char *)(k_cache + (slot * s->num_kv_heads + kvh) * hd);
            const char *vn = (const char *)(v_cache + (slot * s->num_kv_heads + kvh) * hd);
            for (int64_t b = 0; b < hd * 2; b += 64) {
                _mm_prefetch(kn + b, _MM_HINT_T0);
                _mm_prefetch(vn + b, _MM_HINT_T0);
            }
        }
        for (int64_t i = 0; i < nv; i++) _mm512_store_ps(e[i], chunk_scores(&qs[i], kp, n, p0, hd, s->scale));
        for (int64_t i = 0; i < nv; i++) chunk_values(qs[i].acc, e[i], vf, n, hd);
    }
    store_outputs(qs, out, s, row0, v0, nv, kvh);
}

/* unit_impl with the common head sizes as constants. */
static void run_unit(Query *qs, float *vf, const uint16_t *q, const uint16_t *k_cache,
                     const uint16_t *v_cache, uint16_t *out, const Shape *s, int64_t row0,
                     int64_t v0, int64_t nv, int64_t start_pos, const int64_t *table,
                     int64_t kvh) {
    if (s->head_dim == 64)
        unit_impl(qs, vf, q, k_cache, v_cache, out, s, row0, v0, nv, start_pos, table, kvh, 64);
    else if (s->head_dim == 128)
        unit_impl(qs, vf, q, k_cache, v_cache, out, s, row0, v0, nv, start_pos, table, kvh, 128);
    else
        unit_impl(qs, vf, q, k_cache, v_cache, out, s, row0, v0, nv, start_pos, table, kvh,
                  s->head_dim);
}

/* Entry point. q [num_tokens, num_heads, head_dim] and out (same shape) are the forward's
 * rows; sequence i has num_rows[i] rows from row row_start[i], its first at position
 * start_pos[i], and block table block_tables[i * max_blocks ...]. k_cache, v_cache:
 * [num_slots, num_kv_heads, head_dim]. Work units are (sequence, KV head, block of up to 16
 * query vectors), shared among num_threads OpenMP threads. Returns 0, or -1 (nothing
 * written) for a shape it does not take: head_dim not a multiple of 16 or above 256, more
 * than 65536 rows in a sequence, or a position past 2^31. */
int specmoe_attention_bf16(const uint16_t *q, const uint16_t *k_cache,
                                  const uint16_t *v_cache, uint16_t *out,
                                  const int64_t *row_start, const int64_t *num_rows,
                                  const int64_t *start_pos, const int64_t *block_tables,
                                  int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t window, float scale, int num_threads) {
    Shape s = {num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, scale};
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads)
        return -1;
    const int64_t G = num_heads / num_kv_heads;
    int64_t *first_unit = malloc(sizeof(int64_t) * (num_seqs + 1));  /* per sequence */
    if (!first_unit) return -1;
    first_unit[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (num_rows[i] < 1 || num_rows[i] > MAX_ROWS || start_pos[i] + num_rows[i] > (int64_t)1 << 31) {
            free(first_unit);
            return -1;
        }
        first_unit[i + 1] = first_unit[i] + (G * num_rows[i] + VECTOR_BLOCK - 1) / VECTOR_BLOCK * num_kv_heads;
    }
    const int64_t num_units = first_unit[num_seqs];
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        Query *qs = aligned_alloc(64, sizeof(Query) * VECTOR_BLOCK);
        float *vf = aligned_alloc(64, sizeof(float) * CHUNK * MAX_HEAD_DIM);
        int64_t i = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < num_units; u++) {
            if (u < first_unit[i]) i = 0;  /* units normally ascend within a thread */
            while (first_unit[i + 1] <= u) i++;
            const int64_t b = (u - first_unit[i]) / num_kv_heads, kvh = (u - first_unit[i]) % num_kv_heads;
            const int64_t v0 = b * VECTOR_BLOCK, nv = G * num_rows[i] - v0;
            run_unit(qs, vf, q, k_cache, v_cache, out, &s, row_start[i], v0,
                     nv < VECTOR_BLOCK ? nv : VECTOR_BLOCK, start_pos[i],
                     block_tables + i * max_blocks, kvh);
        }
        free(qs);
        free(vf);
    }
    free(first_unit);
    return 0;
}
