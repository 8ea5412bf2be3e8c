/* Paged attention of decode / verification rows (1..16 query tokens per sequence) over a
 * bf16 KV cache read through block tables, fp32 softmax and accumulation, bf16 output.
 *
 * One work unit is (sequence, key/value head): the G query heads sharing that KV head times
 * the sequence's R query rows form G*R query vectors, laid out across the 16 fp32 lanes of
 * AVX-512 registers (lane i = row i / G, head i % G). Each key and value row is read from the
 * cache once per unit, widened to fp32 and broadcast dimension by dimension, so a score or
 * an accumulator update costs head_dim FMAs for 16 query vectors with no horizontal sums.
 * Keys are taken in chunks of 16 with an online softmax (running max and sum per lane;
 * Milakov and Gimelshein 2018, arXiv 1805.02867; the chunked form of FlashAttention, Dao et
 * al. 2022, arXiv 2205.14135). Row r of a sequence whose first query sits at position P
 * attends keys P + r - window < p <= P + r (window 0: no lower bound).
 *
 * The plain-torch reference is `_attend_decode` / `attend_decode_reference` in
 * specmoe/layers/paged_attention.py. Built by specmoe/kernels/build.py
 * (gcc -O3 -march=native -fopenmp).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if !defined(__AVX512F__)
#error "specmoe decode_attention_bf16 needs AVX-512F"
#endif

#define CHUNK 16        /* keys per online-softmax step */
#define MAX_HEAD_DIM 256
#define MAX_VECTORS 512 /* G * R query vectors per unit */
#define NEG_BIG -1e30f  /* running-max start: finite, so exp(m_old - m_new) is never NaN */

static inline __m512 load_bf16x16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);  /* round to nearest even */
}

/* exp(x) for 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial
 * (relative error ~2e-7); x below -87 gives 0. */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(~tiny, p, n);
}

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
} Shape;

/* Per-unit state for one group of 16 query vectors. */
typedef struct {
    __m512 q[MAX_HEAD_DIM];    /* q[d] lane i: query vector i, dimension d, pre-scaled */
    __m512 acc[MAX_HEAD_DIM];  /* sum_p e_p v_p[d] */
    __m512 m, l;               /* running max and sum of exponentials */
    __m512i first, last;       /* per lane: attended key positions [first, last] */
} Group;

static void load_queries(Group *g, const uint16_t *q, const Shape *s, int64_t row0,
                         int64_t kvh, int64_t v0, int64_t nv, int64_t start_pos) {
    const int64_t G = s->num_heads / s->num_kv_heads, hd = s->head_dim;
    float buf[16] __attribute__((aligned(64)));
    int32_t first[16], last[16];
    for (int64_t d = 0; d < hd; d++) {
        for (int i = 0; i < 16; i++) {
            int64_t v = v0 + i, r = v / G, h = kvh * G + v % G;
            buf[i] = v < nv ? s->scale * bf16_to_f32(q[((row0 + r) * s->num_heads + h) * hd + d])
                            : 0.0f;
        }
        g->q[d] = _mm512_load_ps(buf);
        g->acc[d] = _mm512_setzero_ps();
    }
    for (int i = 0; i < 16; i++) {
        int64_t v = v0 + i, pos = start_pos + (v < nv ? v / G : 0);
        last[i] = (int32_t)(v < nv ? pos : -1);
        first[i] = (int32_t)(s->window > 0 && pos - s->window + 1 > 0 ? pos - s->window + 1 : 0);
    }
    g->first = _mm512_loadu_si512(first);
    g->last = _mm512_loadu_si512(last);
    g->m = _mm512_set1_ps(NEG_BIG);
    g->l = _mm512_setzero_ps();
}

/* One chunk of n keys/values (fp32 rows kf/vf at positions p0..p0+n-1) into a group. */
static void attend_chunk(Group *g, const float *kf, const float *vf, int64_t p0, int n,
                         int64_t hd) {
    __m512 sc[CHUNK];
    __m512 chunk_max = _mm512_set1_ps(NEG_BIG);
    for (int j = 0; j < n; j++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        const float *k = kf + j * hd;
        for (int64_t d = 0; d < hd; d += 4) {
            a0 = _mm512_fmadd_ps(g->q[d], _mm512_set1_ps(k[d]), a0);
            a1 = _mm512_fmadd_ps(g->q[d + 1], _mm512_set1_ps(k[d + 1]), a1);
            a2 = _mm512_fmadd_ps(g->q[d + 2], _mm512_set1_ps(k[d + 2]), a2);
            a3 = _mm512_fmadd_ps(g->q[d + 3], _mm512_set1_ps(k[d + 3]), a3);
        }
        __m512i p = _mm512_set1_epi32((int32_t)(p0 + j));
        __mmask16 ok = _mm512_cmp_epi32_mask(p, g->last, _MM_CMPINT_LE)
                       & _mm512_cmp_epi32_mask(p, g->first, _MM_CMPINT_NLT);
        sc[j] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY),
                                     _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        chunk_max = _mm512_max_ps(chunk_max, sc[j]);
    }
    __m512 m_new = _mm512_max_ps(g->m, chunk_max);
    __m512 alpha = exp512(_mm512_sub_ps(g->m, m_new));
    g->m = m_new;
    g->l = _mm512_mul_ps(g->l, alpha);
    for (int64_t d = 0; d < hd; d++) g->acc[d] = _mm512_mul_ps(g->acc[d], alpha);
    for (int j = 0; j < n; j++) {
        __m512 e = exp512(_mm512_sub_ps(sc[j], m_new));
        g->l = _mm512_add_ps(g->l, e);
        const float *v = vf + j * hd;
        for (int64_t d = 0; d < hd; d++)
            g->acc[d] = _mm512_fmadd_ps(e, _mm512_set1_ps(v[d]), g->acc[d]);
    }
}

static void store_outputs(const Group *g, uint16_t *out, const Shape *s, int64_t row0,
                          int64_t kvh, int64_t v0, int64_t nv) {
    const int64_t G = s->num_heads / s->num_kv_heads, hd = s->head_dim;
    float inv[16] __attribute__((aligned(64))), buf[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), g->l));
    for (int64_t d = 0; d < hd; d++) {
        _mm512_store_ps(buf, g->acc[d]);
        for (int i = 0; i < 16 && v0 + i < nv; i++) {
            int64_t v = v0 + i, r = v / G, h = kvh * G + v % G;
            out[((row0 + r) * s->num_heads + h) * hd + d] = f32_to_bf16(buf[i] * inv[i]);
        }
    }
}

/* Widen the KV rows of positions p0..p0+n-1 of one KV head to fp32. */
static void load_kv_chunk(float *kf, float *vf, const uint16_t *k_cache,
                          const uint16_t *v_cache, const int64_t *table, const Shape *s,
                          int64_t kvh, int64_t p0, int n) {
    const int64_t hd = s->head_dim;
    for (int j = 0; j < n; j++) {
        int64_t p = p0 + j;
        int64_t slot = table[p / s->block_size] * s->block_size + p % s->block_size;
        const uint16_t *k = k_cache + (slot * s->num_kv_heads + kvh) * hd;
        const uint16_t *v = v_cache + (slot * s->num_kv_heads + kvh) * hd;
        for (int64_t d = 0; d < hd; d += 16) {
            _mm512_storeu_ps(kf + j * hd + d, load_bf16x16(k + d));
            _mm512_storeu_ps(vf + j * hd + d, load_bf16x16(v + d));
        }
    }
}

static void run_unit(Group *groups, float *kf, float *vf, const uint16_t *q,
                     const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                     const Shape *s, int64_t row0, int64_t num_rows, int64_t start_pos,
                     const int64_t *table, int64_t kvh) {
    const int64_t G = s->num_heads / s->num_kv_heads, nv = G * num_rows;
    const int64_t num_groups = (nv + 15) / 16, end = start_pos + num_rows;
    int64_t begin = s->window > 0 && start_pos - s->window + 1 > 0 ? start_pos - s->window + 1 : 0;
    for (int64_t gi = 0; gi < num_groups; gi++)
        load_queries(&groups[gi], q, s, row0, kvh, gi * 16, nv, start_pos);
    for (int64_t p0 = begin; p0 < end; p0 += CHUNK) {
        int n = (int)(end - p0 < CHUNK ? end - p0 : CHUNK);
        load_kv_chunk(kf, vf, k_cache, v_cache, table, s, kvh, p0, n);
        for (int64_t gi = 0; gi < num_groups; gi++)
            attend_chunk(&groups[gi], kf, vf, p0, n, s->head_dim);
    }
    for (int64_t gi = 0; gi < num_groups; gi++)
        store_outputs(&groups[gi], out, s, row0, kvh, gi * 16, nv);
}

/* Entry point. q [num_tokens, num_heads, head_dim] and out (same shape) are the forward's
 * rows; sequence i has num_rows[i] rows from row row_start[i], its first at position
 * start_pos[i], and block table block_tables[i * max_blocks ...]. k_cache, v_cache:
 * [num_slots, num_kv_heads, head_dim]. Returns 0, or -1 (nothing written) for a shape it
 * does not take: head_dim not a multiple of 16 or above 256, G * rows above 512, or a
 * position past 2^31. */
int specmoe_decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache,
                                  const uint16_t *v_cache, uint16_t *out,
                                  const int64_t *row_start, const int64_t *num_rows,
                                  const int64_t *start_pos, const int64_t *block_tables,
                                  int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t window, float scale, int num_threads) {
    Shape s = {num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, scale};
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads)
        return -1;
    int64_t max_groups = 1;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t nv = num_heads / num_kv_heads * num_rows[i];
        if (num_rows[i] < 1 || nv > MAX_VECTORS || start_pos[i] + num_rows[i] > (int64_t)1 << 31)
            return -1;
        if ((nv + 15) / 16 > max_groups) max_groups = (nv + 15) / 16;
    }
    const int64_t num_units = num_seqs * num_kv_heads;
    if (num_threads > num_units) num_threads = (int)num_units;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        Group *groups = aligned_alloc(64, sizeof(Group) * max_groups);
        float *kf = aligned_alloc(64, sizeof(float) * CHUNK * MAX_HEAD_DIM);
        float *vf = aligned_alloc(64, sizeof(float) * CHUNK * MAX_HEAD_DIM);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < num_units; u++) {
            int64_t i = u / num_kv_heads, kvh = u % num_kv_heads;
            run_unit(groups, kf, vf, q, k_cache, v_cache, out, &s, row_start[i], num_rows[i],
                     start_pos[i], block_tables + i * max_blocks, kvh);
        }
        free(groups);
        free(kf);
        free(vf);
    }
    return 0;
}
