/* Causal paged attention in float32 (decode, verification of K drafts and prefill chunks
 * alike) over a float32 or int8 KV cache read through block tables, for CPUs with AVX2 and
 * FMA: the float32 path's counterpart of attention_bf16.c, chosen for its fixed arithmetic.
 *
 * One work unit is (sequence, query row, KV head): the query heads h of that row sharing
 * the KV head (h / (num_heads / num_kv_heads)), which read each of its key and value rows
 * once together. A query at position p attends the keys at positions
 * max(0, p - window + 1) .. p (window 0: from 0) of its KV head, and nothing else, in three
 * passes, each head's sums its own:
 *   scores s_j = scale * ((q . k_j) * ks_j): 8-lane products over head_dim, lanes summed in
 *   a fixed tree; m = max_j s_j; e_j = exp(s_j - m) (expf), Z = sum of e_j in key order;
 *   out = (sum_j (e_j * vs_j) v_j, in key order, 8 lanes across head_dim) / Z.
 * ks_j, vs_j are the int8 cache's per-(token, KV head) scales (the stored row times its scale
 * is the dequantised row), and exactly 1 for a float32 cache, whose results are therefore
 * the same bits as without scales.
 * Every operation and its order depend only on the unit's own query and keys, never on the
 * other rows, sequences or threads of the call, nor on padding: a row's result has the same
 * bits whatever the batch (batch invariance, so greedy speculation equals plain decoding).
 *
 * The plain-torch reference is the torch path of specmoe/layers/paged_attention.py (int8:
 * specmoe/layers/int8_kv.py). Built by specmoe/kernels/build.py (gcc -O3 -march=native
 * -fopenmp). One unit per query row re-reads its keys: for long prefills torch's fused SDPA
 * is faster, so the caller passes only few-query sequences (max_rows).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_sum.h"

typedef struct {
    const void *k_cache, *v_cache;   /* float or int8 [num_slots, num_kv_heads, head_dim] */
    const float *k_scale, *v_scale;  /* int8 only: [num_slots, num_kv_heads] */
    const int64_t *table;            /* this sequence's block table */
    int64_t block_size, num_kv_heads, head_dim;
} Keys;

/* Index of (position pos, KV head kvh) in [num_slots, num_kv_heads]. */
static inline int64_t slot_head(const Keys *k, int64_t pos, int64_t kvh) {
    const int64_t slot = k->table[pos / k->block_size] * k->block_size + pos % k->block_size;
    return slot * k->num_kv_heads + kvh;
}

/* 8 consecutive cache values from element `at` as float32 lanes. */
static inline __m256 load8(const void *cache, int64_t at, int int8) {
    if (int8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)cache + at))));
    return _mm256_loadu_ps((const float *)cache + at);
}

/* out [g, head_dim] = attention of the g query heads q [g, head_dim] that share KV head kvh
 * over its key positions [first, last]. Each key and value row is read once for the g
 * heads, and each head's arithmetic is that of attending it alone, in the same order:
 * scores in key order, their maximum, e_j and Z in key order, and per 8 lanes of head_dim
 * the weighted values accumulated in key order (in `out`, then divided by Z).
 * `s` is scratch for g * (last - first + 2) floats. int8 is a constant at each call site,
 * so the compiler emits one loop per cache type. */
static inline __attribute__((always_inline)) void
attend_group(const float *q, int64_t g, const Keys *k, int64_t kvh, int64_t first,
             int64_t last, float scale, float *s, float *out, int int8) {
    const int64_t hd = k->head_dim, n = last - first + 1;
    float *z = s + g * n;
    for (int64_t j = 0; j < n; j++) {
        const int64_t at = slot_head(k, first + j, kvh);
        const float ks = int8 ? k->k_scale[at] : 1.0f;
        for (int64_t i = 0; i < g; i++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < hd; d += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * hd + d),
                                      load8(k->k_cache, at * hd + d, int8), acc);
            s[i * n + j] = scale * (hsum_ps(acc) * ks);
        }
    }
    for (int64_t i = 0; i < g; i++) {
        float *si = s + i * n, m = -INFINITY, zi = 0.0f;
        for (int64_t j = 0; j < n; j++) m = si[j] > m ? si[j] : m;
        for (int64_t j = 0; j < n; j++) {
            si[j] = expf(si[j] - m);
            zi += si[j];
        }
        z[i] = zi;
        for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(out + i * hd + d, _mm256_setzero_ps());
    }
    for (int64_t j = 0; j < n; j++) {
        const int64_t at = slot_head(k, first + j, kvh);
        const float vs = int8 ? k->v_scale[at] : 1.0f;
        for (int64_t d = 0; d < hd; d += 8) {
            const __m256 v = load8(k->v_cache, at * hd + d, int8);
            for (int64_t i = 0; i < g; i++) {
                float *o = out + i * hd + d;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(s[i * n + j] * vs), v,
                                                    _mm256_loadu_ps(o)));
            }
        }
    }
    for (int64_t i = 0; i < g; i++)
        for (int64_t d = 0; d < hd; d += 8) {
            float *o = out + i * hd + d;
            _mm256_storeu_ps(o, _mm256_div_ps(_mm256_loadu_ps(o), _mm256_set1_ps(z[i])));
        }
}

static void attend_f32(const float *q, int64_t g, const Keys *k, int64_t kvh, int64_t first,
                       int64_t last, float scale, float *s, float *out) {
    attend_group(q, g, k, kvh, first, last, scale, s, out, 0);
}

static void attend_i8(const float *q, int64_t g, const Keys *k, int64_t kvh, int64_t first,
                      int64_t last, float scale, float *s, float *out) {
    attend_group(q, g, k, kvh, first, last, scale, s, out, 1);
}

typedef void (*AttendFn)(const float *, int64_t, const Keys *, int64_t, int64_t, int64_t,
                         float, float *, float *);

/* The sequences of one call (see specmoe_attention_f32). */
typedef struct {
    const int64_t *row_start, *num_rows, *start_pos, *block_tables;
    int64_t num_seqs, max_blocks, block_size, num_heads, num_kv_heads, head_dim, window;
    float scale;
    int64_t max_rows;
} Batch;

static int run(const Batch *b, const float *q, const void *k_cache, const void *v_cache,
               const float *k_scale, const float *v_scale, float *out, AttendFn attend,
               int num_threads) {
    const int64_t hd = b->head_dim, heads = b->num_heads, kvh = b->num_kv_heads;
    const int64_t max_rows = b->max_rows, *num_rows = b->num_rows;
    if (hd % 8 || kvh < 1 || heads % kvh) return -1;
    int64_t units = 0, longest = 0;
    for (int64_t i = 0; i < b->num_seqs; i++) {
        if (num_rows[i] < 1) return -1;
        if (num_rows[i] <= max_rows) units += num_rows[i] * kvh;
        if (b->start_pos[i] + num_rows[i] > longest) longest = b->start_pos[i] + num_rows[i];
    }
    const int64_t group = heads / kvh;
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        float *s = malloc(sizeof(float) * (size_t)(group * (longest + 1)));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            if (s == NULL) continue;
            int64_t i = 0, rest = u;   /* unit u: sequence i, row r, KV head h */
            while (num_rows[i] > max_rows || rest >= num_rows[i] * kvh) {
                if (num_rows[i] <= max_rows) rest -= num_rows[i] * kvh;
                i++;
            }
            const int64_t r = rest / kvh, h = rest % kvh, row = b->row_start[i] + r;
            const int64_t pos = b->start_pos[i] + r, w = b->window;
            const int64_t first = w > 0 && pos - w + 1 > 0 ? pos - w + 1 : 0;
            const Keys keys = {k_cache, v_cache, k_scale, v_scale,
                               b->block_tables + i * b->max_blocks, b->block_size, kvh, hd};
            const int64_t at = (row * heads + h * group) * hd;  /* the group's first head */
            attend(q + at, group, &keys, h, first, pos, b->scale, s, out + at);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* q [num_tokens, num_heads, head_dim], caches [num_slots, num_kv_heads, head_dim], out
 * [num_tokens, num_heads * head_dim], all float32 contiguous; sequence i has num_rows[i]
 * query rows from row row_start[i], the first at position start_pos[i], and block table
 * block_tables[i] (max_blocks entries). window: attention window in tokens, 0 for none.
 * Only sequences of at most max_rows query rows are attended (the others' rows are left
 * untouched: long prefills run faster through the caller's fused attention).
 * Returns 0, or -1 for a head_dim that is not a multiple of 8, heads that do not group,
 * an empty sequence or no memory. */
int specmoe_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                          float *out, const int64_t *row_start, const int64_t *num_rows,
                          const int64_t *start_pos, const int64_t *block_tables,
                          int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t window, float scale, int64_t max_rows, int num_threads) {
    const Batch b = {row_start, num_rows, start_pos, block_tables, num_seqs, max_blocks,
                     block_size, num_heads, num_kv_heads, head_dim, window, scale, max_rows};
    return run(&b, q, k_cache, v_cache, NULL, NULL, out, attend_f32, num_threads);
}

/* specmoe_attention_f32 over an int8 cache: k_cache, v_cache int8 [num_slots, num_kv_heads,
 * head_dim] with float32 scales k_scale, v_scale [num_slots, num_kv_heads] (a stored row
 * times its scale is the dequantised row); q and out float32 as above. */
int specmoe_attention_f32_i8(const float *q, const int8_t *k_cache, const int8_t *v_cache,
                             float *out, const int64_t *row_start, const int64_t *num_rows,
                             const int64_t *start_pos, const int64_t *block_tables,
                             int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t window, float scale, const float *k_scale,
                             const float *v_scale, int64_t max_rows, int num_threads) {
    const Batch b = {row_start, num_rows, start_pos, block_tables, num_seqs, max_blocks,
                     block_size, num_heads, num_kv_heads, head_dim, window, scale, max_rows};
    return run(&b, q, k_cache, v_cache, k_scale, v_scale, out, attend_i8, num_threads);
}
