/* Causal paged attention in float32 (decode, verification of K drafts and prefill chunks
 * alike) over a float32 KV cache read through block tables, for CPUs with AVX2 and FMA:
 * the float32 path's counterpart of attention_bf16.c, chosen for its fixed arithmetic.
 *
 * One work unit is (sequence, query row, query head); its query at position p attends the
 * keys at positions max(0, p - window + 1) .. p (window 0: from 0) of its KV head
 * (h / (num_heads / num_kv_heads)), and nothing else, in three passes:
 *   scores s_j = scale * (q . k_j): 8-lane products over head_dim, lanes summed in a fixed
 *   tree; m = max_j s_j; e_j = exp(s_j - m) (expf), Z = sum of e_j in key order;
 *   out = (sum_j e_j v_j, in key order, 8 lanes across head_dim) / Z.
 * Every operation and its order depend only on the unit's own query and keys, never on the
 * other rows, sequences or threads of the call, nor on padding: a row's result has the same
 * bits whatever the batch (batch invariance, so greedy speculation equals plain decoding).
 *
 * The plain-torch reference is the torch path of specmoe/layers/paged_attention.py. Built
 * by specmoe/kernels/build.py (gcc -O3 -march=native -fopenmp). One unit per query row
 * re-reads its keys: for long prefills torch's fused SDPA is faster, so the caller passes
 * only few-query sequences (max_rows).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_sum.h"

typedef struct {
    const float *k_cache, *v_cache;
    const int64_t *table;       /* this sequence's block table */
    int64_t block_size, kv_stride, head_dim;
} Keys;

static inline const float *row_at(const Keys *k, const float *cache, int64_t pos, int64_t kvh) {
    const int64_t slot = k->table[pos / k->block_size] * k->block_size + pos % k->block_size;
    return cache + slot * k->kv_stride + kvh * k->head_dim;
}

/* out [head_dim] = attention of query q over key positions [first, last] of KV head kvh.
 * `s` is scratch for last - first + 1 scores. */
static void attend_one(const float *q, const Keys *k, int64_t kvh, int64_t first,
                       int64_t last, float scale, float *s, float *out) {
    const int64_t hd = k->head_dim, n = last - first + 1;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *kr = row_at(k, k->k_cache, first + j, kvh);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kr + d), acc);
        s[j] = scale * hsum_ps(acc);
        m = s[j] > m ? s[j] : m;
    }
    float z = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        z += s[j];
    }
    for (int64_t d = 0; d < hd; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]),
                                  _mm256_loadu_ps(row_at(k, k->v_cache, first + j, kvh) + d), acc);
        _mm256_storeu_ps(out + d, _mm256_div_ps(acc, _mm256_set1_ps(z)));
    }
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
    if (head_dim % 8 || num_kv_heads < 1 || num_heads % num_kv_heads) return -1;
    int64_t units = 0, longest = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (num_rows[i] < 1) return -1;
        if (num_rows[i] <= max_rows) units += num_rows[i] * num_heads;
        if (start_pos[i] + num_rows[i] > longest) longest = start_pos[i] + num_rows[i];
    }
    const int64_t group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        float *s = malloc(sizeof(float) * (size_t)(longest > 0 ? longest : 1));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < units; u++) {
            if (s == NULL) continue;
            int64_t i = 0, rest = u;   /* unit u: sequence i, row r, head h */
            while (num_rows[i] > max_rows || rest >= num_rows[i] * num_heads) {
                if (num_rows[i] <= max_rows) rest -= num_rows[i] * num_heads;
                i++;
            }
            const int64_t r = rest / num_heads, h = rest % num_heads, row = row_start[i] + r;
            const int64_t pos = start_pos[i] + r;
            const int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
            const Keys keys = {k_cache, v_cache, block_tables + i * max_blocks, block_size,
                               num_kv_heads * head_dim, head_dim};
            attend_one(q + (row * num_heads + h) * head_dim, &keys, h / group, first, pos,
                       scale, s, out + (row * num_heads + h) * head_dim);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
