/* Matrix products with GGUF-quantised weights, computed from the file's own blocks.
 *
 * y[r, n] = sum_k x[r, k] * W[n, k] for float32 activations x [rows, k] and a weight
 * W [n_out, k] stored as a GGUF tensor of one ggml type: row n is `row_bytes` bytes of
 * consecutive blocks (the file's layout, unchanged). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
 * (blocks of 32 weights) and Q4_K, Q5_K, Q6_K (super-blocks of 256), with the block
 * layouts of ggml (llama.cpp `ggml-common.h`; the `gguf` package's `quants.py` decodes the
 * same blocks in numpy and is the reference in the tests).
 *
 * Products (`specmoe_gguf_gemm`): each activation row is quantised to int8 per block
 * (`gguf_dot.h` gives the method and its rounding), then every (row, weight row) pair is
 * one integer dot product over the file's blocks (a tile of NC weight rows stays in cache
 * for all activation rows). Each output's summation order depends on k only: a row's bits are
 * the same whatever the number of rows or threads (batch invariance).
 *
 * Lookups (`specmoe_gguf_dequant_rows`): rows decoded to float32 with exactly the numpy
 * reference's arithmetic (one float32 product per scale, no fused multiply-add: this file
 * is built with -ffp-contract=off), i.e. the values `gguf.quants.dequantize` gives.
 *
 * Needs x86-64 with AVX2, FMA and F16C (x86-64-v3).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_dot.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };  /* ggml_type values */

#define NC 4           /* weight rows per tile */

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- bytes to floats ------------------------------------------------------------------ */

/* The 32 unsigned bytes of q as 4 vectors of 8 floats (exact: values < 2^24). */
static inline void u8x32_to_ps(__m256i q, __m256 f[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* Nibble `shift / 4` (shift 0 or 4) of each of 32 bytes. */
static inline __m256i nibbles32(const uint8_t *qs, int shift) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(0x0F));
}

/* out[8 i ..] = d * (f[i] - off), d = d_lo for the first 16 values and d_hi for the
 * rest: the reference's d * float(q - off), exactly. */
static inline void store_scaled(const __m256 f[4], float off, float d_lo, float d_hi,
                                float *out) {
    const __m256 o = _mm256_set1_ps(off);
    for (int i = 0; i < 4; i++) {
        const __m256 d = _mm256_set1_ps(i < 2 ? d_lo : d_hi);
        _mm256_store_ps(out + 8 * i, _mm256_mul_ps(d, _mm256_sub_ps(f[i], o)));
    }
}

/* out[8 i ..] = d * f[i] + m (m = -min for the K-quants' d * q - min). */
static inline void store_affine(const __m256 f[4], float d, float m, float *out, int sub) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int i = 0; i < 4; i++) {
        const __m256 p = _mm256_mul_ps(dv, f[i]);
        _mm256_store_ps(out + 8 * i, sub ? _mm256_sub_ps(p, mv) : _mm256_add_ps(p, mv));
    }
}

/* ---- blocks of 32: d (fp16) [m (fp16)] [qh (4 bytes)] qs ------------------------------ */

static void dq_q4_0(const uint8_t *b, float *out) {
    __m256 f[4];
    u8x32_to_ps(nib_lo_hi(b + 2), f);
    const float d = half(b);
    store_scaled(f, 8.0f, d, d, out);
}

static void dq_q4_1(const uint8_t *b, float *out) {
    __m256 f[4];
    u8x32_to_ps(nib_lo_hi(b + 4), f);
    store_affine(f, half(b), half(b + 2), out, 0);
}

static inline __m256i five_bits(const uint8_t *qs, uint32_t qh) {
    return _mm256_or_si256(nib_lo_hi(qs), _mm256_slli_epi16(bits_to_bytes(qh), 4));
}

static void dq_q5_0(const uint8_t *b, float *out) {
    __m256 f[4];
    u8x32_to_ps(five_bits(b + 6, load_u32(b + 2)), f);
    const float d = half(b);
    store_scaled(f, 16.0f, d, d, out);
}

static void dq_q5_1(const uint8_t *b, float *out) {
    __m256 f[4];
    u8x32_to_ps(five_bits(b + 8, load_u32(b + 4)), f);
    store_affine(f, half(b), half(b + 2), out, 0);
}

static void dq_q8_0(const uint8_t *b, float *out) {
    const __m256 d = _mm256_set1_ps(half(b));
    for (int i = 0; i < 4; i++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        _mm256_store_ps(out + 8 * i, _mm256_mul_ps(v, d));
    }
}

/* ---- super-blocks of 256 --------------------------------------------------------------- */

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (12 packed bytes). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K: d, dmin (fp16), scales[12], qs[128]; sub-block 2g / 2g+1 are the low / high
 * nibbles of qs[32g .. 32g+31]. w = (d * sc) * q - (dmin * m). Q5_K (qh != NULL): qh[32]
 * before qs; the fifth bit of element l of sub-block j is bit j of qh[l]. */
static inline void dq_k_4_5(const uint8_t *b, const uint8_t *qh, const uint8_t *qs,
                            float *out) {
    const float d = half(b), dmin = half(b + 2);
    const __m256i one = _mm256_set1_epi8(1);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(b + 4, j, &sc, &m);
        __m256i q = nibbles32(qs + 32 * (j / 2), 4 * (j & 1));
        if (qh != NULL) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(h, j), one);
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        __m256 f[4];
        u8x32_to_ps(q, f);
        store_affine(f, d * (float)sc, dmin * (float)m, out + 32 * j, 1);
    }
}

static void dq_q4_k(const uint8_t *b, float *out) { dq_k_4_5(b, NULL, b + 16, out); }

static void dq_q5_k(const uint8_t *b, float *out) { dq_k_4_5(b, b + 16, b + 48, out); }

/* Q6_K: ql[128], qh[64], scales[16] (int8), d (fp16); 16 sub-blocks of 16. In half h,
 * element e = 32 s + l (s < 4, l < 32): low 4 bits are nibble s / 2 of
 * ql[64 h + 32 (s % 2) + l], high 2 bits are bits 2 s of qh[32 h + l];
 * w = (d * scale[8 h + e / 16]) * (q - 32). */
static void dq_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half(b + 208);
    const __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        for (int s = 0; s < 4; s++) {
            const __m256i lo = nibbles32(ql + 64 * h + 32 * (s % 2), 4 * (s / 2));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), three);
            __m256 f[4];
            u8x32_to_ps(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), f);
            const int g = 8 * h + 2 * s;
            store_scaled(f, 32.0f, d * (float)scales[g], d * (float)scales[g + 1],
                         out + 128 * h + 32 * s);
        }
    }
}

typedef void (*dq_block)(const uint8_t *, float *);

typedef float (*dot_fn)(const uint8_t *, const int8_t *, const float *, const int16_t *,
                       int64_t);

typedef struct {
    int block;        /* weights per block */
    int bytes;        /* bytes per block */
    dq_block decode;
    dot_fn dot;
} type_info;

static int type_of(int type, type_info *t) {
    switch (type) {
    case T_Q4_0: *t = (type_info){32, 18, dq_q4_0, dot_q4_0}; return 0;
    case T_Q4_1: *t = (type_info){32, 20, dq_q4_1, dot_q4_1}; return 0;
    case T_Q5_0: *t = (type_info){32, 22, dq_q5_0, dot_q5_0}; return 0;
    case T_Q5_1: *t = (type_info){32, 24, dq_q5_1, dot_q5_1}; return 0;
    case T_Q8_0: *t = (type_info){32, 34, dq_q8_0, dot_q8_0}; return 0;
    case T_Q4_K: *t = (type_info){256, 144, dq_q4_k, dot_q4_k}; return 0;
    case T_Q5_K: *t = (type_info){256, 176, dq_q5_k, dot_q5_k}; return 0;
    case T_Q6_K: *t = (type_info){256, 210, dq_q6_k, dot_q6_k}; return 0;
    default: return -1;
    }
}

/* Weights [k0, k0 + len) of one row into out (k0 and len multiples of the block). */
static void decode_span(const type_info *t, const uint8_t *row, int64_t k0, int64_t len,
                        float *out) {
    const uint8_t *b = row + (k0 / t->block) * t->bytes;
    for (int64_t i = 0; i < len; i += t->block, b += t->bytes) t->decode(b, out + i);
}

/* Checks shared by both entry points; 0 when the call can run. */
static int check(int type, type_info *t, int64_t row_bytes, int64_t k) {
    if (type_of(type, t) != 0) return -1;
    if (k <= 0 || k % t->block != 0) return -2;
    if (row_bytes != (k / t->block) * t->bytes) return -3;
    return 0;
}

/* Activation rows quantised for a type of block `block` (gguf_dot.h). */
typedef struct {
    int8_t *q;       /* [rows][k] */
    float *d;        /* [rows][k / B] */
    int16_t *s16;    /* [rows][k / 16] */
    int64_t B;
} acts;

static int acts_alloc(acts *a, int64_t rows, int64_t k, int block) {
    a->B = block == 256 ? 256 : 32;
    const size_t n = (size_t)(rows > 0 ? rows : 1);
    a->q = malloc(n * (size_t)k);
    a->d = malloc(sizeof(float) * n * (size_t)(k / a->B));
    a->s16 = malloc(sizeof(int16_t) * n * (size_t)(k / 16));
    return a->q && a->d && a->s16 ? 0 : -4;
}

static void acts_free(acts *a) {
    free(a->q);
    free(a->d);
    free(a->s16);
}

/* Output rows [n0, n1) of y: each (row, weight row) one dot product over the blocks, the
 * tile's NC weight rows staying in cache for all activation rows. */
static void gemm_tile(const type_info *t, const uint8_t *w, int64_t row_bytes, int64_t n0,
                      int64_t n1, int64_t k, const acts *a, int64_t rows, float *y,
                      int64_t ldy) {
    const int64_t nb = k / a->B;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = n0; n < n1; n++)
            y[r * ldy + n] = t->dot(w + n * row_bytes, a->q + r * k, a->d + r * nb,
                                    a->s16 + r * (k / 16), k);
}

/* Quantise rows [0, rows) of x into a, inside a parallel region (a worksharing loop). */
static void quantize_team(const float *x, int64_t ldx, int64_t rows, int64_t k, const acts *a) {
    const int64_t nb = k / a->B;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * ldx, k, (int)a->B, a->q + r * k, a->d + r * nb, a->s16 + r * (k / 16));
}

/* One product of a group of consecutive quantised rows with one weight. */
typedef struct {
    const uint8_t *w;    /* the weight's blocks [n_out, row_bytes] */
    int64_t first_row;   /* rows [first_row, first_row + rows) of the activations */
    int64_t rows;
    float *y;            /* row r of the group at y + r * ldy */
} gemm_job;

/* The jobs' products with weights of one type and shape, inside a parallel region: one
 * worksharing loop over every (job, tile of NC output rows). */
static void gemm_team(const type_info *t, int64_t row_bytes, int64_t n_out, int64_t k,
                      const acts *a, const gemm_job *jobs, int64_t n_jobs, int64_t ldy) {
    const int64_t tiles = (n_out + NC - 1) / NC, nb = k / a->B;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < n_jobs * tiles; item++) {
        const gemm_job *j = &jobs[item / tiles];
        const int64_t n0 = item % tiles * NC, n1 = n0 + NC < n_out ? n0 + NC : n_out;
        const acts rows = {a->q + j->first_row * k, a->d + j->first_row * nb,
                           a->s16 + j->first_row * (k / 16), a->B};
        gemm_tile(t, j->w, row_bytes, n0, n1, k, &rows, j->rows, j->y, ldy);
    }
}

/* y [rows, ldy] (first n_out columns) = x [rows, ldx] (first k columns) @ W^T.
 * Returns 0, or -1 unknown type, -2 k not a multiple of the block, -3 row_bytes not k's,
 * -4 out of memory. */
int specmoe_gguf_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t n_out,
                      int64_t k, const float *x, int64_t ldx, int64_t rows, float *y,
                      int64_t ldy, int num_threads) {
    type_info t;
    int err = check(type, &t, row_bytes, k);
    if (err) return err;
    acts a;
    if ((err = acts_alloc(&a, rows, k, t.block)) != 0) {
        acts_free(&a);
        return err;
    }
    const gemm_job job = {w, 0, rows, y};
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
        quantize_team(x, ldx, rows, k, &a);
        gemm_team(&t, row_bytes, n_out, k, &a, &job, 1, ldy);
    }
    acts_free(&a);
    return 0;
}

/* out [n_ids, k] float32 = rows ids[i] of W, dequantised (an embedding lookup).
 * Returns 0, or the errors of specmoe_gguf_gemm. */
int specmoe_gguf_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t k,
                              const int64_t *ids, int64_t n_ids, float *out,
                              int num_threads) {
    type_info t;
    int err = check(type, &t, row_bytes, k);
    if (err) return err;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < n_ids; i++) decode_span(&t, w + ids[i] * row_bytes, 0, k, out + i * k);
    return 0;
}

/* ---- a MoE layer's routed experts in one call ------------------------------------------ */

typedef struct {
    int64_t *count, *start, *order, *pos;  /* per expert; pairs sorted by expert; inverse */
    float *xg, *h, *act, *y;               /* [P, H], [P, 2I], [P, I], [P, H] */
    gemm_job *gate_up, *down;              /* one per active expert */
    int64_t active;
} moe_space;

static void moe_free(moe_space *m) {
    void *ptrs[] = {m->count, m->start, m->order, m->pos, m->xg, m->h, m->act, m->y,
                    m->gate_up, m->down};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++) free(ptrs[i]);
}

/* The (token, slot) pairs sorted by expert (stable), and the space of one call. Returns
 * 0, -4 out of memory, -5 an expert id outside [0, N). */
static int moe_plan(moe_space *m, const int64_t *ids, int64_t P, int64_t N, int64_t H,
                    int64_t I) {
    memset(m, 0, sizeof(*m));
    m->count = calloc((size_t)N, sizeof(int64_t));
    m->start = malloc(sizeof(int64_t) * (size_t)(N + 1));
    m->order = malloc(sizeof(int64_t) * (size_t)P);
    m->pos = malloc(sizeof(int64_t) * (size_t)P);
    m->xg = malloc(sizeof(float) * (size_t)(P * H));
    m->h = malloc(sizeof(float) * (size_t)(P * 2 * I));
    m->act = malloc(sizeof(float) * (size_t)(P * I));
    m->y = malloc(sizeof(float) * (size_t)(P * H));
    m->gate_up = malloc(sizeof(gemm_job) * (size_t)N);
    m->down = malloc(sizeof(gemm_job) * (size_t)N);
    if (!m->count || !m->start || !m->order || !m->pos || !m->xg || !m->h || !m->act ||
        !m->y || !m->gate_up || !m->down)
        return -4;
    for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0 || ids[p] >= N) return -5;
        m->count[ids[p]]++;
    }
    m->start[0] = 0;
    for (int64_t e = 0; e < N; e++) {
        m->start[e + 1] = m->start[e] + m->count[e];
    }
    for (int64_t p = 0; p < P; p++) m->order[m->start[ids[p]] + --m->count[ids[p]]] = p;
    for (int64_t e = 0; e < N; e++) {          /* the fill above reversed each group */
        m->count[e] = m->start[e + 1] - m->start[e];
        for (int64_t i = 0, j = m->count[e] - 1; i < j; i++, j--) {
            const int64_t tmp = m->order[m->start[e] + i];
            m->order[m->start[e] + i] = m->order[m->start[e] + j];
            m->order[m->start[e] + j] = tmp;
        }
    }
    for (int64_t i = 0; i < P; i++) m->pos[m->order[i]] = i;
    return 0;
}

static void moe_jobs(moe_space *m, int64_t N, int64_t I, int64_t H, const uint8_t *gu,
                     int64_t gu_stride, const uint8_t *dn, int64_t d_stride) {
    for (int64_t e = 0; e < N; e++) {
        if (m->count[e] == 0) continue;
        const int64_t r0 = m->start[e];
        m->gate_up[m->active] = (gemm_job){gu + e * gu_stride, r0, m->count[e], m->h + r0 * 2 * I};
        m->down[m->active++] = (gemm_job){dn + e * d_stride, r0, m->count[e], m->y + r0 * H};
    }
}

/* out[t] = its experts' tw[t, s] * down_e(SiLU(gate_e x_t) * up_e x_t), added in float32 in
 * ascending expert order (a token's bits depend on its own experts only). */
static void moe_combine(const moe_space *m, const int64_t *ids, const float *tw, int64_t T,
                        int64_t top_k, int64_t H, float *out) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t slots[64];
        const int64_t k = top_k < 64 ? top_k : 64;
        for (int64_t s = 0; s < k; s++) {    /* insertion sort of the slots by expert */
            int64_t i = s;
            for (; i > 0 && ids[t * top_k + slots[i - 1]] > ids[t * top_k + s]; i--)
                slots[i] = slots[i - 1];
            slots[i] = s;
        }
        float *o = out + t * H;
        for (int64_t i = 0; i < H; i++) o[i] = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            const float w = tw[t * top_k + slots[s]];
            const float *y = m->y + m->pos[t * top_k + slots[s]] * H;
            for (int64_t i = 0; i < H; i++) o[i] = o[i] + y[i] * w;
        }
    }
}

/* One call of specmoe_gguf_moe (its arguments, see there). */
typedef struct {
    const float *x;
    const int64_t *ids;
    const float *tw;
    int64_t T, top_k, H, I, N;
    type_info tg, td;
    const uint8_t *gu, *dn;
    int64_t gu_stride, gu_row_bytes, d_stride, d_row_bytes;
    float *out;
} moe_call;

/* The steps of specmoe_gguf_moe in one parallel region. */
static void moe_team(const moe_call *c, const moe_space *m, const acts *a1, const acts *a2,
                     int num_threads) {
    const int64_t P = c->T * c->top_k, H = c->H, I = c->I;
#pragma omp parallel num_threads(num_threads < 1 ? 1 : num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++)
            memcpy(m->xg + i * H, c->x + m->order[i] / c->top_k * H, sizeof(float) * (size_t)H);
        quantize_team(m->xg, H, P, H, a1);
        gemm_team(&c->tg, c->gu_row_bytes, 2 * I, H, a1, m->gate_up, m->active, 2 * I);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++)
            for (int64_t j = 0; j < I; j++) {
                const float g = m->h[i * 2 * I + j];
                m->act[i * I + j] = g / (1.0f + expf(-g)) * m->h[i * 2 * I + I + j];
            }
        quantize_team(m->act, I, P, I, a2);
        gemm_team(&c->td, c->d_row_bytes, H, I, a2, m->down, m->active, H);
        moe_combine(m, c->ids, c->tw, c->T, c->top_k, H, c->out);
    }
}

/* A MoE layer's routed SwiGLU experts: x [T, H] float32, ids and tw [T, top_k] (int64
 * expert ids, float32 weights), gate and up joined per expert as one stack (`gu`: expert e
 * at gu + e * gu_stride, [2I, H] blocks of gu_type, gate rows first), down likewise
 * [H, I] of d_type; out [T, H] float32. Each expert's rows are multiplied as by
 * specmoe_gguf_gemm (same bits), SiLU(gate) * up in float32 (g / (1 + e^-g) * u).
 * Returns 0, the errors of specmoe_gguf_gemm, -5 an expert id outside [0, N), -6 top_k
 * above 64. */
int specmoe_gguf_moe(const float *x, int64_t T, int64_t H, const int64_t *ids,
                     const float *tw, int64_t top_k, int gu_type, const uint8_t *gu,
                     int64_t gu_stride, int64_t gu_row_bytes, int d_type, const uint8_t *dn,
                     int64_t d_stride, int64_t d_row_bytes, int64_t N, int64_t I, float *out,
                     int num_threads) {
    moe_call c = {x, ids, tw, T, top_k, H, I, N, {0}, {0}, gu, dn, gu_stride, gu_row_bytes,
                  d_stride, d_row_bytes, out};
    int err = check(gu_type, &c.tg, gu_row_bytes, H);
    if (!err) err = check(d_type, &c.td, d_row_bytes, I);
    if (err) return err;
    if (top_k > 64) return -6;
    moe_space m;
    acts a1 = {0}, a2 = {0};
    err = moe_plan(&m, ids, T * top_k, N, H, I);
    if (!err) err = acts_alloc(&a1, T * top_k, H, c.tg.block);
    if (!err) err = acts_alloc(&a2, T * top_k, I, c.td.block);
    if (!err) {
        moe_jobs(&m, N, I, H, gu, gu_stride, dn, d_stride);
        moe_team(&c, &m, &a1, &a2, num_threads);
    }
    moe_free(&m);
    acts_free(&a1);
    acts_free(&a2);
    return err;
}
