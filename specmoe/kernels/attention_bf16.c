/* Causal paged attention of a forward's query rows (decode, verification of K drafts and
 * prefill chunks alike) over a bf16 KV cache read through block tables, fp32 softmax and
 * accumulation, bf16 output.
 *
 * The G query heads sharing a KV head times a sequence's R query rows form G*R query vectors
 * (vector i: row i / G, head i % G); one work unit is (sequence, KV head, block of those
 * vectors in whole rows, about 96, `vector_block`). Keys and values are read from the cache
 * through the block table in chunks of 16, once per unit:
 * - Scores (Q K^T): the chunk's keys are transposed so that lane j of vector i holds the
 *   i-th bf16 pair of key j; a query's 16 scores are then `vdpbf16ps` of those vectors with
 *   the query's i-th pair broadcast (bf16_dot.h), pair i summed into partial sum i % 4, the
 *   partial sums added as (0 + 1) + (2 + 3): no horizontal sums.
 * - Online softmax per chunk (running max and sum per query vector; Milakov and Gimelshein
 *   2018, arXiv 1805.02867; the chunked form of FlashAttention, Dao et al. 2022, arXiv
 *   2205.14135). The weights e_j are rounded to bf16, as FlashAttention does before its
 *   P V product, and the running sum adds the rounded weights.
 * - P V: values of adjacent keys are interleaved into bf16 pairs, and `vdpbf16ps` adds
 *   e_j v_j + e_j+1 v_j+1 into a head_dim-across-lanes fp32 accumulator (lanes permuted by
 *   the interleave, put back in order at the end).
 * Row r of a sequence whose first query sits at position P attends keys
 * P + r - window < p <= P + r (window 0: no lower bound). Chunks start at multiples of 16,
 * masked keys add exact zeros and every query vector's sums run in the same order whichever
 * group of 4 it is scored in, so a row's result has the same bits whatever other rows and
 * sequences share the call (batch invariance, as in gemv_bf16.c). That assumes finite keys
 * and values: a non-finite value row makes 0 * v a NaN for every row of its unit, as a model
 * that overflowed would anyway. Units run longest first (dynamic OpenMP schedule), so the
 * threads finish together.
 *
 * The measurements behind these choices: docs/results/2026-12-02-code-comment-history/.
 *
 * The plain-torch reference is the torch path of specmoe/layers/paged_attention.py
 * (`_attend_decode`, `attend_decode_reference`, `_attend_prefill`). Built by
 * specmoe/kernels/build.py (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "avx512_math.h"
#include "bf16_dot.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe attention_bf16 needs AVX-512F and AVX-512BW"
#endif

#define CHUNK 16          /* keys per online-softmax step */
#define MAX_HEAD_DIM 256
#define MAX_PAIRS (MAX_HEAD_DIM / 2)
#define MAX_ROWS 65536    /* query rows per sequence */
#define MIN_VECTOR_BLOCK 96  /* query vectors attended per pass over a unit's keys, in whole
                                rows (the fewest rows with at least this many vectors) ... */
#define MAX_VECTOR_BLOCK 128 /* ... unless that passes this (then the most whole rows within
                                it, at least one) */
#define QK_GROUP 4        /* query vectors scored together (4 partial sums each) */
#define NEG_BIG -1e30f    /* running-max start: finite, so exp(m_old - m_new) is never NaN */
#define FAR_PREFETCH_MAX_ROWS 16 /* sequences of at most this many query rows (decode,
                                    verification) also prefetch 2 chunks ahead into L1 and
                                    FAR_L2_CHUNKS ahead into L2 */
#define FAR_L2_CHUNKS 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size, window;
    float scale;
} Shape;

/* State of one query vector. */
typedef struct {
    __m512i q[MAX_HEAD_DIM / 32];   /* the query's bf16 pairs, unscaled */
    __m512 acc[MAX_HEAD_DIM / 16];  /* sum_p e_p v_p, head_dim across lanes (permuted) */
    __m512 l;                       /* running sums of (bf16-rounded) weights, per lane */
    float m;                        /* running max */
    int64_t first, last;            /* attended key positions [first, last] */
} Query;

/* A chunk's keys and values, laid out for the vector unit. */
typedef struct {
    __m512i kt[MAX_PAIRS];                   /* lane j of kt[i]: pair i of key j */
    __m512i vp[CHUNK / 2][MAX_HEAD_DIM / 16]; /* key pair jp: values of keys 2jp, 2jp+1 interleaved */
} Chunk;

/* aligned_alloc needs sizes that are multiples of the alignment */
_Static_assert(sizeof(Query) % 64 == 0 && sizeof(Chunk) % 64 == 0, "64-byte multiples");

/* 32 bf16 from p, the last pair-vector of a head_dim that is an odd multiple of 16 half
 * filled (zeros add nothing to a dot product). */
ALWAYS_INLINE __m512i load_pairs(const uint16_t *p, int64_t c, const int64_t hd) {
    __mmask32 m = 32 * (c + 1) <= hd ? 0xFFFFFFFFu : 0x0000FFFFu;
    return _mm512_maskz_loadu_epi16(m, p + 32 * c);
}

/* The chunk's n keys (rows kp[j]) transposed and its values paired; rows past n read as
 * zeros. */
ALWAYS_INLINE void load_chunk(Chunk *ch, const uint16_t *const *kp, const uint16_t *const *vp,
                              int n, const int64_t hd) {
    for (int64_t c = 0; c < (hd + 31) / 32; c++) {
        __m512i r[16];
        for (int j = 0; j < CHUNK; j++) r[j] = j < n ? load_pairs(kp[j], c, hd) : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int i = 0; i < 16 && 16 * c + i < hd / 2; i++) ch->kt[16 * c + i] = r[i];
    }
    for (int jp = 0; jp < CHUNK / 2; jp++)
        for (int64_t c = 0; c < (hd + 31) / 32; c++) {
            const __m512i a = 2 * jp < n ? load_pairs(vp[2 * jp], c, hd) : _mm512_setzero_si512();
            const __m512i b = 2 * jp + 1 < n ? load_pairs(vp[2 * jp + 1], c, hd) : _mm512_setzero_si512();
            ch->vp[jp][2 * c] = _mm512_unpacklo_epi16(a, b);
            ch->vp[jp][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
}

/* Scores of query vectors qv[0 .. g-1] against the chunk's keys (lane j: key j), unscaled:
 * pair i adds into partial sum i % 4, the partial sums added as (0 + 1) + (2 + 3). */
ALWAYS_INLINE void chunk_scores(__m512 *sc, Query *const *qv, const int g, const Chunk *ch,
                                const int64_t hd) {
    __m512 a0[QK_GROUP], a1[QK_GROUP], a2[QK_GROUP], a3[QK_GROUP];
    const int32_t *qp[QK_GROUP];
    for (int v = 0; v < g; v++) {
        a0[v] = a1[v] = a2[v] = a3[v] = _mm512_setzero_ps();
        qp[v] = (const int32_t *)qv[v]->q;
    }
    int64_t i = 0;
    for (; i + 4 <= hd / 2; i += 4) {
        const __m512i k0 = ch->kt[i], k1 = ch->kt[i + 1], k2 = ch->kt[i + 2], k3 = ch->kt[i + 3];
        for (int v = 0; v < g; v++) {
            a0[v] = dot_pairs(a0[v], k0, _mm512_set1_epi32(qp[v][i]));
            a1[v] = dot_pairs(a1[v], k1, _mm512_set1_epi32(qp[v][i + 1]));
            a2[v] = dot_pairs(a2[v], k2, _mm512_set1_epi32(qp[v][i + 2]));
            a3[v] = dot_pairs(a3[v], k3, _mm512_set1_epi32(qp[v][i + 3]));
        }
    }
    /* head_dim / 2 is a multiple of 8 */
    for (int v = 0; v < g; v++)
        sc[v] = _mm512_add_ps(_mm512_add_ps(a0[v], a1[v]), _mm512_add_ps(a2[v], a3[v]));
}

/* One query's online-softmax step over the chunk's scores (n keys at positions p0..):
 * returns its weights, rounded to bf16, as 16 bf16 (8 adjacent-key pairs), 0 outside the
 * mask (a chunk wholly outside it then adds exact zeros); rescales the query's accumulator
 * and sums when its running max rises. */
ALWAYS_INLINE __m256i softmax_step(Query *qv, __m512 sc, int n, int64_t p0, float scale,
                                   const int64_t hd) {
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)p0),
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __mmask16 ok = (__mmask16)((1u << n) - 1)
        & _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int32_t)qv->last), _MM_CMPINT_LE)
        & _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int32_t)qv->first), _MM_CMPINT_NLT);
    if (!ok) return _mm256_setzero_si256();
    sc = _mm512_maskz_mul_ps(ok, sc, _mm512_set1_ps(scale));
    if (_mm512_mask_cmp_ps_mask(ok, sc, _mm512_set1_ps(qv->m), _CMP_GT_OQ)) {
        /* the running max rises (seldom after the first chunks): exp(m_old - m_new) in the
         * vector unit (no libm call; m_old = NEG_BIG gives 0) */
        const float m_new = _mm512_mask_reduce_max_ps(ok, sc);
        const __m512 alpha = exp512(_mm512_set1_ps(qv->m - m_new));
        qv->l = _mm512_mul_ps(qv->l, alpha);
        for (int64_t c = 0; c < 2 * ((hd + 31) / 32); c++) qv->acc[c] = _mm512_mul_ps(qv->acc[c], alpha);
        qv->m = m_new;
    }
    const __m512 e = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(qv->m))));
    const __m256i e_bf16 = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(e), 16));
    qv->l = _mm512_add_ps(qv->l, _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(e_bf16), 16)));
    return e_bf16;
}

/* For query vectors qv[0 .. g-1]: acc += sum over the chunk's key pairs jp of
 * (e_2jp, e_2jp+1) . (v_2jp, v_2jp+1) (e[v]: the 8 weight pairs of vector v), four
 * accumulator vectors of each query at a time held in registers. */
ALWAYS_INLINE void chunk_values(Query *const *qv, const int g, const int32_t (*e)[8],
                                const Chunk *ch, int n, const int64_t hd) {
    const int64_t nc = 2 * ((hd + 31) / 32);
    for (int64_t c0 = 0; c0 < nc; c0 += 4) {
        const int w = nc - c0 < 4 ? (int)(nc - c0) : 4;
        __m512 acc[QK_GROUP][4];
        for (int v = 0; v < g; v++)
            for (int c = 0; c < w; c++) acc[v][c] = qv[v]->acc[c0 + c];
        for (int jp = 0; jp < (n + 1) / 2; jp++)
            for (int c = 0; c < w; c++) {
                const __m512i vv = ch->vp[jp][c0 + c];
                for (int v = 0; v < g; v++)
                    acc[v][c] = dot_pairs(acc[v][c], _mm512_set1_epi32(e[v][jp]), vv);
            }
        for (int v = 0; v < g; v++)
            for (int c = 0; c < w; c++) qv[v]->acc[c0 + c] = acc[v][c];
    }
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
        for (int64_t c = 0; c < 2 * ((hd + 31) / 32); c++) qs[i].acc[c] = _mm512_setzero_ps();
        qs[i].m = NEG_BIG;
        qs[i].l = _mm512_setzero_ps();
        qs[i].last = start_pos + v / G;
        qs[i].first = s->window > 0 && qs[i].last - s->window + 1 > 0 ? qs[i].last - s->window + 1 : 0;
    }
}

/* acc / l in head_dim order: accumulator 2c holds dims 32c + 8L + (0..3) in lanes 4L..4L+3
 * and accumulator 2c+1 dims 32c + 8L + (4..7) (the order unpacklo/hi_epi16 left them in). */
static void store_outputs(const Query *qs, uint16_t *out, const Shape *s, int64_t row0,
                          int64_t v0, int64_t nv, int64_t kvh) {
    const int64_t G = s->num_heads / s->num_kv_heads, hd = s->head_dim;
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t i = 0; i < nv; i++) {
        const int64_t v = v0 + i;
        uint16_t *orow = out + ((row0 + v / G) * s->num_heads + kvh * G + v % G) * hd;
        const __m512 l = _mm512_set1_ps(_mm512_reduce_add_ps(qs[i].l));
        for (int64_t c = 0; c < (hd + 31) / 32; c++) {
            const __m512 a = qs[i].acc[2 * c], b = qs[i].acc[2 * c + 1];
            store_bf16x16(orow + 32 * c, _mm512_div_ps(_mm512_permutex2var_ps(a, lo, b), l));
            if (32 * c + 16 < hd)
                store_bf16x16(orow + 32 * c + 16, _mm512_div_ps(_mm512_permutex2var_ps(a, hi, b), l));
        }
    }
}

/* The rows of the chunk's keys and values at positions p0 .. p0+n-1 through the block
 * table (one lookup when the chunk lies in one block). */
ALWAYS_INLINE void chunk_rows(const uint16_t **kp, const uint16_t **vp, const uint16_t *k_cache,
                              const uint16_t *v_cache, const Shape *s, const int64_t *table,
                              int64_t p0, int n, int64_t kvh, const int64_t hd) {
    const int64_t stride = s->num_kv_heads * hd;
    if (s->block_size % CHUNK == 0) {
        const int64_t slot = table[p0 / s->block_size] * s->block_size + p0 % s->block_size;
        const uint16_t *k = k_cache + slot * stride + kvh * hd, *v = v_cache + slot * stride + kvh * hd;
        for (int j = 0; j < n; j++) {
            kp[j] = k + j * stride;
            vp[j] = v + j * stride;
        }
        return;
    }
    for (int j = 0; j < n; j++) {
        const int64_t p = p0 + j;
        const int64_t slot = table[p / s->block_size] * s->block_size + p % s->block_size;
        kp[j] = k_cache + slot * stride + kvh * hd;
        vp[j] = v_cache + slot * stride + kvh * hd;
    }
}

/* chunk_rows of the chunk at p1 (keys up to end) into rows (keys, then values), and
 * software prefetches of them: into L1 (`to_l2` 0) or only as far as L2 (`to_l2` 1). */
ALWAYS_INLINE void prefetch_rows(const uint16_t **rows, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const Shape *s, const int64_t *table,
                                 int64_t p1, int64_t end, int64_t kvh, const int64_t hd,
                                 const int to_l2) {
    const int m = (int)(end - p1 < CHUNK ? end - p1 : CHUNK);
    chunk_rows(rows, rows + CHUNK, k_cache, v_cache, s, table, p1, m, kvh, hd);
    for (int j = 0; j < m; j++)
        for (int64_t b = 0; b < hd * 2; b += 64) {
            if (to_l2) {
                _mm_prefetch((const char *)rows[j] + b, _MM_HINT_T1);
                _mm_prefetch((const char *)rows[CHUNK + j] + b, _MM_HINT_T1);
            } else {
                _mm_prefetch((const char *)rows[j] + b, _MM_HINT_T0);
                _mm_prefetch((const char *)rows[CHUNK + j] + b, _MM_HINT_T0);
            }
        }
}

/* Prefetch of the chunk at p1, when it starts before end, rows discarded. */
ALWAYS_INLINE void prefetch_chunk(const uint16_t *k_cache, const uint16_t *v_cache,
                                  const Shape *s, const int64_t *table, int64_t p1, int64_t end,
                                  int64_t kvh, const int64_t hd, const int to_l2) {
    const uint16_t *rows[2 * CHUNK];
    if (p1 < end) prefetch_rows(rows, k_cache, v_cache, s, table, p1, end, kvh, hd, to_l2);
}

/* Scores, softmax step and P V for query vectors qs[0 .. g-1] (g <= QK_GROUP, a constant
 * after inlining). */
ALWAYS_INLINE void attend_group(Query *qs, const int g, const Chunk *ch, int n, int64_t p0,
                                float scale, const int64_t hd) {
    __m512 sc[QK_GROUP];
    Query *qv[QK_GROUP];
    for (int v = 0; v < g; v++) qv[v] = &qs[v];
    chunk_scores(sc, qv, g, ch, hd);
    int32_t e[QK_GROUP][8] __attribute__((aligned(32)));
    for (int v = 0; v < g; v++)
        _mm256_store_si256((__m256i *)e[v], softmax_step(qv[v], sc[v], n, p0, scale, hd));
    chunk_values(qv, g, e, ch, n, hd);
}

/* One work unit: query vectors v0 .. v0+nv-1 (nv <= vector_block(G)) of a sequence's rows
 * against KV head kvh, every key read once through the block table. */
ALWAYS_INLINE void unit_impl(Query *qs, Chunk *ch, const uint16_t *q, const uint16_t *k_cache,
                             const uint16_t *v_cache, uint16_t *out, const Shape *s,
                             int64_t row0, int64_t v0, int64_t nv, int64_t start_pos,
                             const int64_t *table, int64_t kvh, int far, const int64_t hd) {
    const int64_t G = s->num_heads / s->num_kv_heads;
    const int64_t end = start_pos + (v0 + nv - 1) / G + 1;  /* past the block's last row */
    const int64_t pos0 = start_pos + v0 / G;                /* the block's first row */
    /* chunks start at multiples of CHUNK (the window is masked per lane), so a row's sums
     * run in the same order whatever rows share its block: batch invariance */
    const int64_t first = s->window > 0 && pos0 - s->window + 1 > 0 ? pos0 - s->window + 1 : 0;
    const int64_t begin = first / CHUNK * CHUNK;
    const uint16_t *rows[2][2 * CHUNK];  /* key, value rows of this chunk and the next */
    /* With few query rows (`far`: decode, verification) a chunk is little work, and one
     * chunk ahead is too late to cover memory latency: every chunk is also asked into L2
     * FAR_L2_CHUNKS chunks ahead (the unit's first chunks before it starts) and into L1
     * two chunks ahead. */
    if (far)
        for (int64_t p1 = begin; p1 < begin + FAR_L2_CHUNKS * CHUNK; p1 += CHUNK)
            prefetch_chunk(k_cache, v_cache, s, table, p1, end, kvh, hd, 1);
    load_queries(qs, q, s, row0, v0, nv, start_pos, kvh, hd);
    chunk_rows(rows[0], rows[0] + CHUNK, k_cache, v_cache, s, table, begin,
               (int)(end - begin < CHUNK ? end - begin : CHUNK), kvh, hd);
    for (int64_t p0 = begin, r = 0; p0 < end; p0 += CHUNK, r ^= 1) {
        const int n = (int)(end - p0 < CHUNK ? end - p0 : CHUNK);
        const uint16_t **kp = rows[r], **vp = rows[r] + CHUNK;
        /* the next chunk's rows (scattered over the cache: one head of each slot, slots in
         * table order) are fetched while this one computes. Prefill chunks, much work per
         * chunk, keep to one ahead (prefetching further slows them); with `far` the extra
         * distances pay off, and going further than FAR_L2_CHUNKS ahead does not. Each
         * chunk is asked for at every distance rather than once from a ring of prefetched
         * rows, which does worse, as if requests were dropped. */
        if (p0 + CHUNK < end) prefetch_rows(rows[r ^ 1], k_cache, v_cache, s, table, p0 + CHUNK, end, kvh, hd, 0);
        if (far) {
            prefetch_chunk(k_cache, v_cache, s, table, p0 + 2 * CHUNK, end, kvh, hd, 0);
            prefetch_chunk(k_cache, v_cache, s, table, p0 + FAR_L2_CHUNKS * CHUNK, end, kvh, hd, 1);
        }
        load_chunk(ch, kp, vp, n, hd);
        int64_t v = 0;
        for (; v + QK_GROUP <= nv; v += QK_GROUP) attend_group(qs + v, QK_GROUP, ch, n, p0, s->scale, hd);
        switch (nv - v) {
            case 1: attend_group(qs + v, 1, ch, n, p0, s->scale, hd); break;
            case 2: attend_group(qs + v, 2, ch, n, p0, s->scale, hd); break;
            case 3: attend_group(qs + v, 3, ch, n, p0, s->scale, hd); break;
        }
    }
    store_outputs(qs, out, s, row0, v0, nv, kvh);
}

/* unit_impl with the common head sizes as constants. */
static void run_unit(Query *qs, Chunk *ch, const uint16_t *q, const uint16_t *k_cache,
                     const uint16_t *v_cache, uint16_t *out, const Shape *s, int64_t row0,
                     int64_t v0, int64_t nv, int64_t start_pos, const int64_t *table,
                     int64_t kvh, int far) {
    if (s->head_dim == 64)
        unit_impl(qs, ch, q, k_cache, v_cache, out, s, row0, v0, nv, start_pos, table, kvh, far, 64);
    else if (s->head_dim == 128)
        unit_impl(qs, ch, q, k_cache, v_cache, out, s, row0, v0, nv, start_pos, table, kvh, far, 128);
    else
        unit_impl(qs, ch, q, k_cache, v_cache, out, s, row0, v0, nv, start_pos, table, kvh, far,
                  s->head_dim);
}

typedef struct {
    int64_t cost, seq, unit;  /* unit: index within the sequence's units */
} Unit;

static int by_cost_desc(const void *a, const void *b) {
    const int64_t ca = ((const Unit *)a)->cost, cb = ((const Unit *)b)->cost;
    return ca < cb ? 1 : ca > cb ? -1 : 0;
}

/* Query vectors per work unit: whole rows (G vectors each), so a row's heads share one pass
 * over the keys. Each chunk of keys is transposed once per unit (`load_chunk`) and each
 * unit's diagonal chunks are partly masked, so larger units waste less, and a 5-row
 * verification reads each KV head's keys in one unit. */
static int64_t vector_block(int64_t G) {
    int64_t rows = (MIN_VECTOR_BLOCK + G - 1) / G;
    if (rows * G > MAX_VECTOR_BLOCK) rows = MAX_VECTOR_BLOCK / G > 0 ? MAX_VECTOR_BLOCK / G : 1;
    return rows * G;
}

/* Every (sequence, KV head, block of vb query vectors) unit with its cost (keys read x
 * query vectors), longest first, so that the threads taking them in turn finish together.
 * NULL when out of memory. */
static Unit *plan_units(const int64_t *num_rows, const int64_t *start_pos, int64_t num_seqs,
                        int64_t G, int64_t vb, int64_t num_kv_heads, int64_t window,
                        int64_t *num_units) {
    int64_t total = 0;
    for (int64_t i = 0; i < num_seqs; i++)
        total += (G * num_rows[i] + vb - 1) / vb * num_kv_heads;
    Unit *units = malloc(sizeof(Unit) * (total ? total : 1));
    if (!units) return NULL;
    int64_t k = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t blocks = (G * num_rows[i] + vb - 1) / vb;
        for (int64_t u = 0; u < blocks * num_kv_heads; u++) {
            const int64_t v0 = u / num_kv_heads * vb;
            const int64_t nv = G * num_rows[i] - v0 < vb ? G * num_rows[i] - v0 : vb;
            const int64_t keys = start_pos[i] + (v0 + nv - 1) / G + 1;
            units[k++] = (Unit){(window > 0 && keys > window ? window + vb / G : keys) * nv, i, u};
        }
    }
    qsort(units, total, sizeof(Unit), by_cost_desc);
    *num_units = total;
    return units;
}

/* Entry point. q [num_tokens, num_heads, head_dim] and out (same shape) are the forward's
 * rows; sequence i has num_rows[i] rows from row row_start[i], its first at position
 * start_pos[i], and block table block_tables[i * max_blocks ...]. k_cache, v_cache:
 * [num_slots, num_kv_heads, head_dim]. Work units are (sequence, KV head, block of query
 * vectors), shared among num_threads OpenMP threads. Returns 0, or -1 (nothing
 * written) for a shape it does not take: head_dim not a multiple of 16 or above 256, more
 * than 65536 rows in a sequence, or a position past 2^31. */
int specmoe_attention_bf16(const uint16_t *q, const uint16_t *k_cache,
                                  const uint16_t *v_cache, uint16_t *out,
                                  const int64_t *row_start, const int64_t *num_rows,
                                  const int64_t *start_pos, const int64_t *block_tables,
                                  int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t window, float scale, int num_threads) {
    Shape s = {num_heads, num_kv_heads, head_dim, block_size, window, scale};
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads)
        return -1;
    for (int64_t i = 0; i < num_seqs; i++)
        if (num_rows[i] < 1 || num_rows[i] > MAX_ROWS || start_pos[i] + num_rows[i] > (int64_t)1 << 31)
            return -1;
    const int64_t G = num_heads / num_kv_heads, vb = vector_block(G);
    int64_t num_units;
    Unit *units = plan_units(num_rows, start_pos, num_seqs, G, vb, num_kv_heads, window,
                              &num_units);
    if (!units) return -1;
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads < 1) num_threads = 1;
    /* each thread's query states and chunk buffer, allocated up front so that running out
     * of memory returns -1 */
    Query *qs_all = aligned_alloc(64, sizeof(Query) * vb * num_threads);
    Chunk *ch_all = aligned_alloc(64, sizeof(Chunk) * num_threads);
    if (!qs_all || !ch_all) {
        free(qs_all);
        free(ch_all);
        free(units);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
        Query *qs = qs_all + vb * omp_get_thread_num();
        Chunk *ch = ch_all + omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_units; k++) {
            const int64_t i = units[k].seq;
            const int64_t v0 = units[k].unit / num_kv_heads * vb;
            const int64_t kvh = units[k].unit % num_kv_heads, nv = G * num_rows[i] - v0;
            run_unit(qs, ch, q, k_cache, v_cache, out, &s, row_start[i], v0,
                     nv < vb ? nv : vb, start_pos[i],
                     block_tables + i * max_blocks, kvh, num_rows[i] <= FAR_PREFETCH_MAX_ROWS);
        }
    }
    free(qs_all);
    free(ch_all);
    free(units);
    return 0;
}
