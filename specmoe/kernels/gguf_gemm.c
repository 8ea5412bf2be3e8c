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
 * one integer dot product over the file's blocks, read once per tile of NC weight rows for
 * all activation rows. Each output's summation order depends on k only: a row's bits are
 * the same whatever the number of rows or threads (batch invariance).
 *
 * Lookups (`specmoe_gguf_dequant_rows`): rows decoded to float32 with exactly the numpy
 * reference's arithmetic (one float32 product per scale, no fused multiply-add: this file
 * is built with -ffp-contract=off), i.e. the values `gguf.quants.dequantize` gives.
 *
 * Needs x86-64 with AVX2, FMA and F16C (x86-64-v3).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_dot.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };  /* ggml_type values */

#define NC 4           /* weight rows per tile */
#define DIRECT_ROWS 2  /* up to this many activation rows, dot products read the blocks */

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

/* 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high ones. */
static inline __m256i nibbles16(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Nibble `shift / 4` (shift 0 or 4) of each of 32 bytes. */
static inline __m256i nibbles32(const uint8_t *qs, int shift) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(0x0F));
}

/* Bit i of `bits` as byte i (0 or 1), i < 32. */
static inline __m256i bits32_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    const __m256i bit = _mm256_and_si256(v, _mm256_set1_epi64x(0x8040201008040201LL));
    return _mm256_min_epu8(bit, _mm256_set1_epi8(1));
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
    u8x32_to_ps(nibbles16(b + 2), f);
    const float d = half(b);
    store_scaled(f, 8.0f, d, d, out);
}

static void dq_q4_1(const uint8_t *b, float *out) {
    __m256 f[4];
    u8x32_to_ps(nibbles16(b + 4), f);
    store_affine(f, half(b), half(b + 2), out, 0);
}

static inline __m256i five_bits(const uint8_t *qs, uint32_t qh) {
    return _mm256_or_si256(nibbles16(qs), _mm256_slli_epi16(bits32_to_bytes(qh), 4));
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
typedef void (*unpack_fn)(const uint8_t *, int64_t, canon *);

typedef struct {
    int block;        /* weights per block */
    int bytes;        /* bytes per block */
    dq_block decode;
    dot_fn dot;
    unpack_fn unpack;
    int is_signed;    /* Q8_0: |q| with signs applied to the activations */
} type_info;

static int type_of(int type, type_info *t) {
    switch (type) {
    case T_Q4_0: *t = (type_info){32, 18, dq_q4_0, dot_q4_0, unpack_q4_0, 0}; return 0;
    case T_Q4_1: *t = (type_info){32, 20, dq_q4_1, dot_q4_1, unpack_q4_1, 0}; return 0;
    case T_Q5_0: *t = (type_info){32, 22, dq_q5_0, dot_q5_0, unpack_q5_0, 0}; return 0;
    case T_Q5_1: *t = (type_info){32, 24, dq_q5_1, dot_q5_1, unpack_q5_1, 0}; return 0;
    case T_Q8_0: *t = (type_info){32, 34, dq_q8_0, dot_q8_0, unpack_q8_0, 1}; return 0;
    case T_Q4_K: *t = (type_info){256, 144, dq_q4_k, dot_q4_k, unpack_q4_k, 0}; return 0;
    case T_Q5_K: *t = (type_info){256, 176, dq_q5_k, dot_q5_k, unpack_q5_k, 0}; return 0;
    case T_Q6_K: *t = (type_info){256, 210, dq_q6_k, dot_q6_k, unpack_q6_k, 0}; return 0;
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

/* NC unpacked weight rows of k inputs in one allocation (NULL when out of memory). */
static void *canons_alloc(canon c[NC], int64_t k, int B, int is_signed) {
    const size_t sc = sizeof(__m256i) * (size_t)(k / 32), u = (size_t)k;
    const size_t blocks = sizeof(float) * (size_t)(k / B), mi = sizeof(int16_t) * (size_t)(k / 16);
    const size_t one = (sc + 2 * u + 2 * blocks + mi + 31) / 32 * 32;
    uint8_t *mem = aligned_alloc(32, one * NC);
    if (mem == NULL) return NULL;
    for (int j = 0; j < NC; j++) {
        uint8_t *p = mem + one * j;
        c[j] = (canon){.sc = (__m256i *)p, .u = p + sc, .sgn = (int8_t *)(p + sc + u),
                       .dw = (float *)(p + sc + 2 * u), .oc = (float *)(p + sc + 2 * u + blocks),
                       .mi = (int16_t *)(p + sc + 2 * u + 2 * blocks), .B = B,
                       .is_signed = is_signed};
    }
    return mem;
}

/* Output rows [n0, n1) of y, each weight row read from its blocks for every activation row
 * (up to DIRECT_ROWS rows), or unpacked once and then dotted with every row: the same
 * bits either way (gguf_dot.h). */
static void gemm_tile(const type_info *t, const uint8_t *w, int64_t row_bytes, int64_t n0,
                      int64_t n1, int64_t k, const acts *a, int64_t rows, float *y,
                      int64_t ldy, canon c[NC]) {
    const int64_t nb = k / a->B;
    if (rows > DIRECT_ROWS)
        for (int64_t n = n0; n < n1; n++) t->unpack(w + n * row_bytes, k, &c[n - n0]);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = n0; n < n1; n++) {
            const int8_t *xq = a->q + r * k;
            const float *xd = a->d + r * nb;
            const int16_t *s16 = a->s16 + r * (k / 16);
            y[r * ldy + n] = rows > DIRECT_ROWS ? dot_canon(&c[n - n0], xq, xd, s16, k)
                                                : t->dot(w + n * row_bytes, xq, xd, s16, k);
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
    const int64_t tiles = (n_out + NC - 1) / NC, nb = k / a.B;
    if (num_threads < 1) num_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        canon c[NC];
        void *mem = rows > DIRECT_ROWS ? canons_alloc(c, k, (int)a.B, t.is_signed) : c;
        if (mem == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * ldx, k, (int)a.B, a.q + r * k, a.d + r * nb, a.s16 + r * (k / 16));
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n0 = tile * NC, n1 = n0 + NC < n_out ? n0 + NC : n_out;
            if (mem != NULL) gemm_tile(&t, w, row_bytes, n0, n1, k, &a, rows, y, ldy, c);
        }
        if (mem != c) free(mem);
    }
    acts_free(&a);
    return failed ? -4 : 0;
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
