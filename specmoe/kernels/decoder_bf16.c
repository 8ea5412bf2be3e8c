/* A run of pre-norm decoder layers (Llama / Qwen2 / OLMoE / Qwen2-MoE style: RMSNorm, fused
 * QKV with optional bias and optional RMSNorm over the whole query and key projections,
 * RoPE, paged attention, then a SwiGLU MLP or a sparse MoE block) in one call, bf16 on CPU.
 *
 * It calls the same kernels, with the same arguments and in the same order, as the Python
 * modules of specmoe/layers do one call each (specmoe/models/decoder.py DecoderLayer is the
 * reference); the kernels come in as function pointers from their own libraries
 * (gemv_bf16.c or, for int4-quantised projections of up to 16 rows, gemv_int4.c;
 * elementwise_bf16.c, attention_bf16.c; router_bf16.c and moe_bf16.c, or moe_int4.c for
 * int4 routed experts), so the results have the same bits.
 * What it adds is only the glue the modules did with torch ops: copying the new keys and
 * values into their cache slots, the query rows out of the fused QKV rows, and the residual
 * additions, each rounded to bf16 (round to nearest even) as torch's bf16 add does; in a
 * MoE block (specmoe/layers/moe/block.py SparseMoEBlock is the reference) the shared
 * expert's gating product, bf16(sigmoid * shared), and the sum of the routed and shared
 * outputs, rounded likewise.
 * What it saves is the Python dispatch between the kernels, paid for every kernel of every
 * layer at every step.
 *
 * Built by specmoe/kernels/build.py (gcc -O3 -march=native -std=c11 -fopenmp).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx512_math.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "specmoe decoder_bf16 needs AVX-512F and AVX-512BW"
#endif

typedef int (*linear_fn)(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                         uint16_t *y, int64_t T, int64_t K, int64_t N, int num_threads);
typedef int (*linear_int4_fn)(const void *w, const void *x, void *y, int64_t T, int is_bf16,
                              int num_threads);
typedef int (*rms_norm_fn)(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                           uint16_t *out, int64_t out_stride, int64_t T, int64_t H, float eps,
                           int num_threads);
typedef int (*rotary_fn)(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride,
                         const int64_t *positions, const float *cos_table,
                         const float *sin_table, int64_t T, int64_t nq, int64_t nk,
                         int64_t hd, int64_t max_position, int num_threads);
typedef int (*silu_and_mul_fn)(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I,
                               int num_threads);
typedef int (*attention_fn)(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                            uint16_t *out, const int64_t *row_start, const int64_t *num_rows,
                            const int64_t *start_pos, const int64_t *block_tables,
                            int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t window, float scale, int num_threads);
typedef int (*route_fn)(const uint16_t *logits, int64_t T, int64_t N, int64_t k,
                        int norm_topk_prob, int64_t *ids, uint16_t *weights);
typedef int (*moe_fn)(const uint16_t *x, const int64_t *topk_ids, const void *topk_weights,
                      int weights_bf16, const uint16_t *w13, const uint16_t *w2, uint16_t *out,
                      void *scratch, int64_t T, int64_t k, int64_t H, int64_t I, int64_t N,
                      int num_threads);
typedef void (*sigmoid_fn)(const uint16_t *x, uint16_t *out, int64_t n);
/* moe_int4.c specmoe_moe_int4: moe_fn's arguments, w13 and w2 each a
 * `struct specmoe_int4_weights` of all experts' rows */
typedef int (*moe_int4_fn)(const uint16_t *x, const int64_t *topk_ids, const void *topk_weights,
                           int weights_bf16, const void *w13, const void *w2, uint16_t *out,
                           void *scratch, int64_t T, int64_t k, int64_t H, int64_t I, int64_t N,
                           int num_threads);

/* The kernels, from their libraries. */
typedef struct {
    linear_fn linear;
    linear_int4_fn linear_int4;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    silu_and_mul_fn silu_and_mul;
    attention_fn attention;
    route_fn route;     /* router_bf16.c specmoe_route_softmax_bf16 (MoE layers only) */
    moe_fn moe;         /* moe_bf16.c specmoe_moe_bf16 */
    sigmoid_fn sigmoid; /* router_bf16.c specmoe_sigmoid_bf16 */
    moe_int4_fn moe_int4; /* moe_int4.c specmoe_moe_int4 (int4 MoE layers only) */
} Kernels;

/* Sizes shared by every layer, and the RoPE tables [max_position, head_dim / 2] fp32. */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, max_position;
    float eps, scale;
    const float *cos_table, *sin_table;
} Dims;

/* A projection: bf16 weights in the panel layout of gemv_bf16.c with a bf16 bias or NULL,
 * or (int4 != 0) a `struct specmoe_int4_weights` of gemv_int4.c, which holds its bias. */
typedef struct {
    const void *w;
    const uint16_t *bias;
    int64_t int4;
} Lin;

/* A sparse MoE block: the router's gate [N, H] (bf16), every routed expert's gate/up and
 * down projections (bf16 packed in the layout of moe_bf16.c, or with int4 != 0 each a
 * `struct specmoe_int4_weights` of all experts' rows, moe_int4.c's layout), and an
 * optional shared SwiGLU expert (shared_gate_up.w NULL: none; bf16 or int4 projections)
 * with an optional sigmoid gate [1, H] (shared_gate.w NULL: none). */
typedef struct {
    Lin gate;
    const void *w13, *w2;
    int64_t num_experts, top_k, intermediate, norm_topk_prob;
    Lin shared_gate_up, shared_down, shared_gate;
    int64_t shared_intermediate;
    int64_t int4;
} Moe;

/* One layer's norm weights (q_norm and k_norm NULL: none; else RMSNorm over the whole
 * query and key projections, OLMoE's), projections (gate_up and down unused when moe is
 * set), its MoE block or NULL, and its KV cache [num_slots, num_kv_heads, head_dim]. */
typedef struct {
    const uint16_t *input_norm, *post_attn_norm, *q_norm, *k_norm;
    Lin qkv, o, gate_up, down;
    const Moe *moe;
    uint16_t *k_cache, *v_cache;
} Layer;

/* One forward: x [T, hidden] (the residual stream, updated in place), the new tokens'
 * positions and cache slots [T], the sequences as attention_bf16.c takes them, and scratch
 * buffers: h [T, hidden], qkv [T, (num_heads + 2 num_kv_heads) head_dim], q and attn
 * [T, num_heads head_dim], gate_up [T, 2 I] and act [T, I] for I the largest of the dense
 * and shared-expert intermediate sizes; for MoE layers (else unused) logits [T, N], topk_ids
 * [T, k] int64 and topk_weights [T, k] for the largest N and k, moe_out and shared_out
 * [T, hidden], shared_gate and shared_scale [T], and moe_scratch of
 * specmoe_moe_scratch_bytes bytes for the largest layer (at least
 * specmoe_moe_int4_scratch_bytes with int4 MoE layers). */
typedef struct {
    uint16_t *x;
    int64_t T;
    const int64_t *positions, *slots;
    const int64_t *row_start, *num_rows, *start_pos, *block_tables;
    int64_t num_seqs, max_blocks, block_size, window;
    uint16_t *h, *qkv, *q, *attn, *gate_up, *act;
    uint16_t *logits;
    int64_t *topk_ids;
    uint16_t *topk_weights, *moe_out, *shared_out, *shared_gate, *shared_scale;
    void *moe_scratch;
} Step;

#define MIN_PARALLEL_ELEMS (1 << 16) /* smaller additions run on one thread */

/* x += y over n elements (n % 16 == 0: hidden is a multiple of 16), each sum rounded to
 * bf16 (torch's bf16 add). */
static void add_bf16(uint16_t *x, const uint16_t *y, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(n < MIN_PARALLEL_ELEMS ? 1 : num_threads) schedule(static)
    for (int64_t i = 0; i < n; i += 16)
        store_bf16x16(x + i, _mm512_add_ps(load_bf16x16(x + i), load_bf16x16(y + i)));
}

/* y [T, N] = x [T, K] W^T (+ bias) through the projection's kernel (the int4 one takes at
 * most 16 rows: the caller sends no more). */
static int project(const Kernels *k, const Lin *p, const uint16_t *x, uint16_t *y, int64_t T,
                   int64_t K, int64_t N, int nt) {
    if (p->int4) return k->linear_int4(p->w, x, y, T, 1, nt);
    return k->linear(x, p->w, p->bias, y, T, K, N, nt);
}

/* The new keys and values (after RoPE) into their slots, and the queries into q. */
static void scatter_qkv(const Step *s, const Dims *d, const Layer *L) {
    const int64_t qn = d->num_heads * d->head_dim, kvn = d->num_kv_heads * d->head_dim;
    const int64_t row = qn + 2 * kvn;
    for (int64_t t = 0; t < s->T; t++) {
        const uint16_t *r = s->qkv + t * row;
        memcpy(s->q + t * qn, r, (size_t)qn * 2);
        memcpy(L->k_cache + s->slots[t] * kvn, r + qn, (size_t)kvn * 2);
        memcpy(L->v_cache + s->slots[t] * kvn, r + qn + kvn, (size_t)kvn * 2);
    }
}

/* x + attn(input_norm(x)) into x. */
static int attention_block(const Kernels *k, const Dims *d, const Layer *L, const Step *s,
                           int nt) {
    const int64_t T = s->T, H = d->hidden, hd = d->head_dim;
    const int64_t qn = d->num_heads * hd, row = qn + 2 * d->num_kv_heads * hd;
    if (k->rms_norm(s->x, H, L->input_norm, s->h, H, T, H, d->eps, nt)) return -1;
    if (project(k, &L->qkv, s->h, s->qkv, T, H, row, nt)) return -2;
    if (L->q_norm) { /* in place: the kernel reads a row before writing it */
        const int64_t kvn = d->num_kv_heads * hd;
        if (k->rms_norm(s->qkv, row, L->q_norm, s->qkv, row, T, qn, d->eps, nt)) return -10;
        if (k->rms_norm(s->qkv + qn, row, L->k_norm, s->qkv + qn, row, T, kvn, d->eps, nt))
            return -10;
    }
    if (k->rotary(s->qkv, row, s->qkv + qn, row, s->positions, d->cos_table, d->sin_table, T,
                  d->num_heads, d->num_kv_heads, hd, d->max_position, nt))
        return -3;
    scatter_qkv(s, d, L);
    if (k->attention(s->q, L->k_cache, L->v_cache, s->attn, s->row_start, s->num_rows,
                     s->start_pos, s->block_tables, s->num_seqs, s->max_blocks, s->block_size,
                     d->num_heads, d->num_kv_heads, hd, s->window, d->scale, nt))
        return -4;
    if (project(k, &L->o, s->attn, s->h, T, qn, H, nt)) return -5;
    add_bf16(s->x, s->h, T * H, nt);
    return 0;
}

/* x + mlp(post_attn_norm(x)) into x. */
static int mlp_block(const Kernels *k, const Dims *d, const Layer *L, const Step *s, int nt) {
    const int64_t T = s->T, H = d->hidden, I = d->intermediate;
    if (k->rms_norm(s->x, H, L->post_attn_norm, s->h, H, T, H, d->eps, nt)) return -6;
    if (project(k, &L->gate_up, s->h, s->gate_up, T, H, 2 * I, nt)) return -7;
    if (k->silu_and_mul(s->gate_up, s->act, T, I, nt)) return -8;
    if (project(k, &L->down, s->act, s->h, T, I, H, nt)) return -9;
    add_bf16(s->x, s->h, T * H, nt);
    return 0;
}

/* a [T, H] = bf16(a * scale[t]) row by row (torch's bf16 multiply by a [T, 1] column: the
 * product of two bf16 values is exact in fp32, rounded once). */
static void scale_rows_bf16(uint16_t *a, const uint16_t *scale, int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        const __m512 c = _mm512_set1_ps(bf16_to_f32(scale[t]));
        for (int64_t i = 0; i < H; i += 16)
            store_bf16x16(a + t * H + i, _mm512_mul_ps(load_bf16x16(a + t * H + i), c));
    }
}

/* x + moe(post_attn_norm(x)) into x, as SparseMoEBlock.forward: the router (gate, then
 * softmax top-k), the routed experts in one call, the shared expert and its gate. */
static int moe_block(const Kernels *k, const Dims *d, const Layer *L, const Step *s, int nt) {
    const Moe *m = L->moe;
    const int64_t T = s->T, H = d->hidden, N = m->num_experts, K = m->top_k;
    if (k->rms_norm(s->x, H, L->post_attn_norm, s->h, H, T, H, d->eps, nt)) return -6;
    if (project(k, &m->gate, s->h, s->logits, T, H, N, nt)) return -11;
    if (k->route(s->logits, T, N, K, (int)m->norm_topk_prob, s->topk_ids, s->topk_weights))
        return -12;
    const int used = m->int4
        ? k->moe_int4(s->h, s->topk_ids, s->topk_weights, 1, m->w13, m->w2, s->moe_out,
                      s->moe_scratch, T, K, H, m->intermediate, N, nt)
        : k->moe(s->h, s->topk_ids, s->topk_weights, 1, m->w13, m->w2, s->moe_out,
                 s->moe_scratch, T, K, H, m->intermediate, N, nt);
    if (used < 1) return -13;
    if (m->shared_gate_up.w) {
        const int64_t I = m->shared_intermediate;
        if (project(k, &m->shared_gate_up, s->h, s->gate_up, T, H, 2 * I, nt)) return -14;
        if (k->silu_and_mul(s->gate_up, s->act, T, I, nt)) return -14;
        if (project(k, &m->shared_down, s->act, s->shared_out, T, I, H, nt)) return -14;
        if (m->shared_gate.w) {
            if (project(k, &m->shared_gate, s->h, s->shared_gate, T, H, 1, nt)) return -15;
            k->sigmoid(s->shared_gate, s->shared_scale, T);
            scale_rows_bf16(s->shared_out, s->shared_scale, T, H);
        }
        add_bf16(s->moe_out, s->shared_out, T * H, nt);
    }
    add_bf16(s->x, s->moe_out, T * H, nt);
    return 0;
}

/* Entry point: layers[0 .. num_layers) over s->x in order; d->hidden and the intermediate
 * sizes are multiples of 16, d->head_dim of 32 and at most 256 (the kernels' own limits).
 * Returns 0, or -(32 l + step) for the first kernel that refused its arguments, in layer l
 * at step 1 input norm, 2 QKV, 3 RoPE, 4 attention, 5 output projection, 6 post-attention
 * norm, 7 gate/up, 8 SiLU, 9 down, 10 q/k norm, 11 router gate, 12 routing, 13 routed
 * experts, 14 shared expert or 15 shared-expert gate; the layers before it have run by
 * then. */
int specmoe_decoder_layers_bf16(const Kernels *k, const Dims *d, const Layer *layers,
                                int64_t num_layers, const Step *s, int num_threads) {
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *L = layers + l;
        int rc = attention_block(k, d, L, s, num_threads);
        if (!rc) rc = L->moe ? moe_block(k, d, L, s, num_threads)
                             : mlp_block(k, d, L, s, num_threads);
        if (rc) return (int)(rc - 32 * l);
    }
    return 0;
}
