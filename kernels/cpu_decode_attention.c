/* Paged decode attention on the CPU: one query row per sequence, read straight through the
 * block table, one pass over K and one over V, nothing gathered or converted in between.
 *
 * Built and loaded by kernels/cpu_attention.py (plain C, no torch headers: it builds in about
 * a second). The torch reference (kernels/attention_ref.py) is the oracle it is tested
 * against. For each sequence and KV head: the query heads that share the KV head score every
 * cached token (K dequantized in registers for 1-byte pools), an exact softmax over the
 * scores, then the weighted sum of V, reading the head's rows once for K and once for V.
 * Accumulation is in float32 whatever the pool holds.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"
#include "cpu_vec.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_I8 = 3, KV_FP8 = 4 };

static float fp8_table[256];
static float f16_table[65536];
static int tables_ready = 0;

static float fp8_e4m3_to_float(uint8_t b) {
    int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
    float v;
    if (exp == 15 && man == 7) return NAN;
    if (exp == 0) v = ldexpf((float)man / 8.0f, -6);
    else v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -v : v;
}

static float f16_to_float(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
    float v;
    if (exp == 31) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexpf((float)man / 1024.0f, -14);
    else v = ldexpf(1.0f + (float)man / 1024.0f, exp - 15);
    return sign ? -v : v;
}

void kvscope_init_tables(void) {
    if (tables_ready) return;
    for (int i = 0; i < 256; i++) fp8_table[i] = fp8_e4m3_to_float((uint8_t)i);
    for (int i = 0; i < 65536; i++) f16_table[i] = f16_to_float((uint16_t)i);
    tables_ready = 1;
}

/* One cached row of head_dim values as float32. */
static inline __attribute__((always_inline)) void load_row(float *dst, const void *cache, int64_t offset, int64_t d,
                            int kind, float scale) {
    switch (kind) {
    case KV_F32: {
        const float *s = (const float *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = s[i];
        break;
    }
    case KV_BF16: {
        const uint16_t *s = (const uint16_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            dst[i] = f;
        }
        break;
    }
    case KV_F16: {
        const uint16_t *s = (const uint16_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = f16_table[s[i]];
        break;
    }
    case KV_I8: {
        const int8_t *s = (const int8_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = (float)s[i] * scale;
        break;
    }
    default: {
        const uint8_t *s = (const uint8_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = fp8_table[s[i]] * scale;
        break;
    }
    }
}

/* Token `pos` of a head, in slot `at`: its exact anchor row when pos < na (kernels/anchors.py),
 * else the pool's row. */
static inline __attribute__((always_inline)) void load_token(
        float *dst, const void *cache, const float *scales, const float *anchor, int64_t pos,
        int64_t at, int64_t na, int64_t num_kv_heads, int64_t d, int kind) {
    if (pos < na) load_row(dst, anchor, pos * num_kv_heads * d, d, KV_F32, 1.0f);
    else load_row(dst, cache, at * d, d, kind, scales ? scales[at] : 1.0f);
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* tanh without libm, so the loop below vectorizes (tanhf cost about as much as scoring a
 * bfloat16 row of 64): sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) by exp_nonpositive, and
 * below |x| = 1/16, where 1 - e would lose digits, the series x - x^3/3 + 2x^5/15 (next term
 * under 3e-10). Absolute error under 3e-6 over [-30, 30] (measured against double tanh; it
 * is exp_nonpositive's, whose softmax here has the same). */
static inline __attribute__((always_inline)) float tanh_fast(float x) {
    float a = fabsf(x), e = exp_nonpositive(-2.0f * a);
    float big = (1.0f - e) / (1.0f + e), x2 = x * x;
    float small = x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f)));
    return a < 0.0625f ? small : copysignf(big, x);
}

/* Soft-capping (gemma2): every score s of a row becomes cap * tanh(s / cap), before the
 * softmax. */
static void softcap_scores(float *s, int64_t n, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) s[t] = cap * tanh_fast(s[t] * inv);
}

/* head_dim 64 (SmolLM2, Llama-style small models) in explicit 16-float vectors (GCC/Clang
 * vector extensions: one AVX-512 register with -march=native, split by the compiler
 * elsewhere). The generic loops above left GCC one dependent chain of 8 FMAs per dot product
 * and a scalar exp; here a dot is a tree of 4 products, the exp is vectorized, and with the
 * group size a constant the V accumulators stay in registers. */
static inline __attribute__((always_inline)) void load_row64(v16f r[4], const void *cache,
                                                             int64_t offset, int kind,
                                                             float scale) {
    if (kind == KV_F32) {
        const float *src = (const float *)cache + offset;
        for (int i = 0; i < 4; i++) r[i] = *(const v16f_u *)(src + 16 * i);
    } else if (kind == KV_BF16) {
        for (int i = 0; i < 4; i++) {
            v16h h;
            memcpy(&h, (const uint16_t *)cache + offset + 16 * i, 32);
            v16u u = __builtin_convertvector(h, v16u) << 16;
            memcpy(&r[i], &u, 64);
        }
    } else if (kind == KV_I8) {
        for (int i = 0; i < 4; i++)
            r[i] = i8x16_to_f32((const int8_t *)cache + offset + 16 * i) * scale;
#ifdef KVSCOPE_HAVE_F16C
    } else if (kind == KV_FP8) {
#if defined(__AVX512BW__)
        fp8x32_to_f32_div256(r, (const uint8_t *)cache + offset);
        fp8x32_to_f32_div256(r + 2, (const uint8_t *)cache + offset + 32);
        for (int i = 0; i < 4; i++) r[i] *= scale * 256.0f;
#else
        for (int i = 0; i < 4; i++)
            r[i] = fp8x16_to_f32_div256((const uint8_t *)cache + offset + 16 * i)
                   * (scale * 256.0f);
#endif
    } else if (kind == KV_F16) {
        for (int i = 0; i < 4; i++) r[i] = f16x16_to_f32((const uint16_t *)cache + offset + 16 * i);
#endif
    } else {
        float tmp[64];
        load_row(tmp, cache, offset, 64, kind, scale);
        for (int i = 0; i < 4; i++) r[i] = *(const v16f_u *)(tmp + 16 * i);
    }
}


/* The 16 sums of 16 vectors, as one vector (lane i: the sum of v[i]): a transpose folded into
 * the additions, 30 shuffles and 15 adds for 16 dot products where a horizontal sum each
 * costs a dozen instructions. */
static inline __attribute__((always_inline)) v16f sum16x16(const v16f v[16]) {
    v16f w[8], x[4], y[2];
    for (int j = 0; j < 8; j++)
        w[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                       24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        x[j] = __builtin_shufflevector(w[2 * j], w[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                       17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(w[2 * j], w[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        y[j] = __builtin_shufflevector(x[2 * j], x[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16,
                                       17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(x[2 * j], x[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30)
         + __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
}

/* fp8 rows load as their values / 256 where F16C converts them (fp8x16_to_f32_div256): what
 * load_raw64 asks load_row64 to scale an fp8 row by, and what it gives back in the scale. */
#ifdef KVSCOPE_HAVE_F16C
#define FP8_RAW 256.0f
#else
#define FP8_RAW 1.0f
#endif

/* Token `pos` of a head (slot row `at`) as four vectors left unscaled, and the scale that
 * makes them its values: an exact anchor row (scale 1) when pos < na, else the pool's row
 * and its slot's scale (1 for float pools). The scale is applied to the token's score and
 * its softmax weight instead of to the 64 values, once per token and query head. */
static inline __attribute__((always_inline)) float load_raw64(
        v16f r[4], const void *cache, const float *scales, const float *anchor, int64_t pos,
        int64_t at, int64_t na, int64_t num_kv_heads, int kind) {
    if (pos < na) {
        load_row64(r, anchor, pos * num_kv_heads * 64, KV_F32, 1.0f);
        return 1.0f;
    }
    if (kind == KV_I8 || kind == KV_FP8) {
        load_row64(r, cache, at * 64, kind, kind == KV_FP8 ? 1.0f / FP8_RAW : 1.0f);
        return kind == KV_FP8 ? scales[at] * FP8_RAW : scales[at];
    }
    load_row64(r, cache, at * 64, kind, 1.0f);
    return 1.0f;
}

/* The scores s[0..n) of a span, after soft-capping when cap > 0, as e^(s - max) in place;
 * returns their sum, *max the max. */
static inline __attribute__((always_inline)) float exp_scores(float *s, int64_t n, float cap,
                                                              float *max) {
    if (cap > 0.0f) softcap_scores(s, n, cap);
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    int64_t t = 0;
    v16f acc = {0};
    for (; t + 16 <= n; t += 16) {
        v16f v = exp_nonpositive16(*(const v16f_u *)(s + t) - m);
        *(v16f_u *)(s + t) = v;
        acc += v;
    }
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    *max = m;
    return sum + hsum16(acc);
}

#define MAX_GROUP 16

/* What a span of one head's positions gives its `group` query heads: the max score m[g],
 * the sum l[g] of e^(s - m[g]) and acc [group, d] the sum of e^(s - m[g]) v, not yet divided
 * by l (a sequence split over several spans merges them, merge_spans). */
typedef struct {
    float *acc, *m, *l;
} span_out;

/* Bytes of one cached row of 64 values in a pool of this kind. */
static inline __attribute__((always_inline)) int64_t row64_bytes(int kind) {
    return kind == KV_F32 ? 256 : (kind == KV_I8 || kind == KV_FP8) ? 64 : 128;
}

/* Asks for head h's rows of the span's next block while this one is read: a sequence's
 * blocks lie anywhere in the pool, so the hardware prefetcher, which follows a stride within
 * a page, stops at every block edge. */
static inline __attribute__((always_inline)) void prefetch_block(
        const void *cache, const int64_t *table, int64_t b, int64_t h, int64_t num_kv_heads,
        int64_t block_size, int kind) {
    const int64_t bytes = row64_bytes(kind);
    const char *base = (const char *)cache
                     + (table[b] * block_size * num_kv_heads + h) * bytes;
    for (int64_t j = 0; j < block_size; j++)
        for (int64_t o = 0; o < bytes; o += 64)
            __builtin_prefetch(base + j * num_kv_heads * bytes + o, 0, 3);
}

/* One sequence's KV head h, positions c0..c1-1, for the `group` query heads q [group, d]
 * that share it. Walks the block table block by block (no division per token), reading head
 * h's row of each slot (a block is [block_size, kv_heads, d]): once through K for the
 * scores, then once through V for the weighted sum. scores: [group * (c1 - c0)] scratch. */
static inline __attribute__((always_inline)) void span_head64(
        span_out o, const float *q, const int64_t *table, int64_t c0, int64_t c1,
        const void *k_cache, const void *v_cache, const float *k_scale, const float *v_scale,
        int64_t h, int64_t group, int64_t num_kv_heads, int64_t block_size, int kind,
        float sm_scale, float *scores, const float *ak, const float *av, int64_t na,
        float softcap) {
    const int64_t cnt = c1 - c0; /* scores[g * cnt + t]: position c0 + t */
    v16f qv[MAX_GROUP][4], acc[MAX_GROUP][4], r[4], part[MAX_GROUP][16];
    float sc[16];
    for (int64_t g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) qv[g][i] = *(const v16f_u *)(q + g * 64 + 16 * i);
    /* Each token's products stay 16 lanes wide in part[g][c] until 16 tokens are in, then
     * sum16x16 turns them into 16 scores at once, times their 16 scales. */
    int c = 0;
    for (int64_t b = c0 / block_size, start = b * block_size; start < c1;
         start += block_size, b++) {
        int64_t j0 = start < c0 ? c0 - start : 0;
        int64_t n = c1 - start < block_size ? c1 - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        if (start + block_size < c1)
            prefetch_block(k_cache, table, b + 1, h, num_kv_heads, block_size, kind);
        /* this block's V rows too, which the weighted sum reads once the span's scores are
         * in: the K pass computes little per byte, so its loads alone left the memory
         * underused, and the V pass then waited on every block */
        prefetch_block(v_cache, table, b, h, num_kv_heads, block_size, kind);
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            sc[c] = load_raw64(r, k_cache, k_scale, ak, start + j, at, na, num_kv_heads, kind)
                    * sm_scale;
            for (int64_t g = 0; g < group; g++)
                part[g][c] = qv[g][0] * r[0] + qv[g][1] * r[1] + (qv[g][2] * r[2] + qv[g][3] * r[3]);
            if (++c == 16) {
                const v16f scv = *(const v16f_u *)sc;
                for (int64_t g = 0; g < group; g++)
                    *(v16f_u *)(scores + g * cnt + start + j - c0 - 15) =
                        sum16x16(part[g]) * scv;
                c = 0;
            }
        }
    }
    for (int i = 0; i < c; i++)
        for (int64_t g = 0; g < group; g++)
            scores[g * cnt + cnt - c + i] = hsum16(part[g][i]) * sc[i];
    for (int64_t g = 0; g < group; g++) {
        o.l[g] = exp_scores(scores + g * cnt, cnt, softcap, o.m + g);
        for (int i = 0; i < 4; i++) acc[g][i] = (v16f){0};
    }
    for (int64_t b = c0 / block_size, start = b * block_size; start < c1;
         start += block_size, b++) {
        int64_t j0 = start < c0 ? c0 - start : 0;
        int64_t n = c1 - start < block_size ? c1 - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            float s = load_raw64(r, v_cache, v_scale, av, start + j, at, na, num_kv_heads, kind);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * cnt + start + j - c0] * s;
                for (int i = 0; i < 4; i++) acc[g][i] += p * r[i];
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) *(v16f_u *)(o.acc + g * 64 + 16 * i) = acc[g][i];
}

/* span_head64 for any head_dim (and groups over MAX_GROUP), rows dequantized in full into
 * row [d]. */
static inline __attribute__((always_inline)) void span_head(
        span_out o, const float *q, const int64_t *table, int64_t c0, int64_t c1,
        const void *k_cache, const void *v_cache, const float *k_scale, const float *v_scale,
        int64_t h, int64_t group, int64_t num_kv_heads, int64_t d, int64_t block_size,
        int kind, float sm_scale, float *scores, float *row, const float *ak, const float *av,
        int64_t na, float softcap) {
    const int64_t cnt = c1 - c0;
    for (int64_t b = c0 / block_size, start = b * block_size; start < c1;
         start += block_size, b++) {
        int64_t j0 = start < c0 ? c0 - start : 0;
        int64_t n = c1 - start < block_size ? c1 - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            load_token(row, k_cache, k_scale, ak, start + j, at, na, num_kv_heads, d, kind);
            for (int64_t g = 0; g < group; g++)
                scores[g * cnt + start + j - c0] = dot(q + g * d, row, d) * sm_scale;
        }
    }
    for (int64_t g = 0; g < group; g++)
        o.l[g] = exp_scores(scores + g * cnt, cnt, softcap, o.m + g);
    memset(o.acc, 0, sizeof(float) * (size_t)(group * d));
    for (int64_t b = c0 / block_size, start = b * block_size; start < c1;
         start += block_size, b++) {
        int64_t j0 = start < c0 ? c0 - start : 0;
        int64_t n = c1 - start < block_size ? c1 - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            load_token(row, v_cache, v_scale, av, start + j, at, na, num_kv_heads, d, kind);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * cnt + start + j - c0], *a = o.acc + g * d;
#pragma omp simd
                for (int64_t k = 0; k < d; k++) a[k] += p * row[k];
            }
        }
    }
}

/* Per storage kind, and per group size 1-4 as a constant (SmolLM2 has 3, Llama 3 has 4), so
 * that the loops over the group unroll. */
#define SPAN_ARGS                                                                          \
    span_out o, const float *q, const int64_t *table, int64_t c0, int64_t c1,              \
        const void *kc, const void *vc, const float *ks, const float *vs, int64_t h,       \
        int64_t group, int64_t kvh, int64_t d, int64_t bs, float sm, float *scores,        \
        float *row, const float *ak, const float *av, int64_t na, float cap
#define SPECIALISE64(name, KIND, G)                                                        \
    static void name(SPAN_ARGS) {                                                          \
        (void)d; (void)row; (void)group;                                                    \
        span_head64(o, q, table, c0, c1, kc, vc, ks, vs, h, G, kvh, bs, KIND, sm, scores,   \
                    ak, av, na, cap);                                                       \
    }
#define SPECIALISE64_GROUPS(prefix, KIND)                                                  \
    SPECIALISE64(prefix##_g1, KIND, 1) SPECIALISE64(prefix##_g2, KIND, 2)                  \
    SPECIALISE64(prefix##_g3, KIND, 3) SPECIALISE64(prefix##_g4, KIND, 4)                  \
    SPECIALISE64(prefix##_gn, KIND, group)
SPECIALISE64_GROUPS(span64_f32, KV_F32)
SPECIALISE64_GROUPS(span64_bf16, KV_BF16)
SPECIALISE64_GROUPS(span64_f16, KV_F16)
SPECIALISE64_GROUPS(span64_i8, KV_I8)
SPECIALISE64_GROUPS(span64_fp8, KV_FP8)

#define SPECIALISE(name, KIND)                                                             \
    static void name(SPAN_ARGS) {                                                          \
        span_head(o, q, table, c0, c1, kc, vc, ks, vs, h, group, kvh, d, bs, KIND, sm,      \
                  scores, row, ak, av, na, cap);                                            \
    }
SPECIALISE(span_f32, KV_F32)
SPECIALISE(span_bf16, KV_BF16)
SPECIALISE(span_f16, KV_F16)
SPECIALISE(span_i8, KV_I8)
SPECIALISE(span_fp8, KV_FP8)

typedef void (*span_fn)(SPAN_ARGS);

static span_fn pick(int kind, int64_t d, int64_t group) {
    static const span_fn any[] = {span_f32, span_bf16, span_f16, span_i8, span_fp8};
#define ROW(p) {p##_gn, p##_g1, p##_g2, p##_g3, p##_g4}
    static const span_fn d64[][5] = {ROW(span64_f32), ROW(span64_bf16), ROW(span64_f16),
                                     ROW(span64_i8), ROW(span64_fp8)};
#undef ROW
    if (d != 64 || group > MAX_GROUP) return any[kind];
    return d64[kind][group <= 4 ? group : 0];
}

/* Below this many cached rows in a call, a parallel region costs more than it saves: the
 * default when the caller has not measured (kvscope_paged_decode's `parallel` < 0). */
#define PARALLEL_MIN_ROWS 2048
/* A sequence is cut into spans of this many positions (rounded up to a multiple of the block
 * size), so that one long sequence, or a few, keep every thread busy. The cut depends on the
 * sequence's own length alone: never on the thread count, and never on the other rows of
 * the call, so a row's result is the same in any batch (a speculative verify's rows and the
 * plain decode of the same position round alike, tests/kernels/test_cpu_attention.py). */
#define SPAN 256

/* bfloat16 <-> float32 for the query and output rows (round to nearest even, as torch). */
static inline void widen_bf16(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, 4);
    }
}

static inline void narrow_bf16(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) dst[i] = (uint16_t)((u >> 16) | 0x40);
        else dst[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* A row's output [group, d] from its spans' (acc, m, l) laid out as in kvscope_paged_decode's
 * part buffer (span k of the row at part + k * stride): out = sum_k e^(m_k - M) acc_k /
 * sum_k e^(m_k - M) l_k, M the largest m_k (the softmax over all the row's positions). */
static void merge_spans(float *out, const float *part, int64_t spans, int64_t stride,
                        int64_t group, int64_t d) {
    for (int64_t g = 0; g < group; g++) {
        float m = -INFINITY, l = 0.0f, *o = out + g * d;
        for (int64_t k = 0; k < spans; k++) {
            float mk = part[k * stride + group * d + g];
            m = mk > m ? mk : m;
        }
        memset(o, 0, sizeof(float) * (size_t)d);
        for (int64_t k = 0; k < spans; k++) {
            const float *p = part + k * stride;
            float w = exp_nonpositive(p[group * d + g] - m);
            l += w * p[group * d + group + g];
            for (int64_t i = 0; i < d; i++) o[i] += w * p[g * d + i];
        }
        float inv = 1.0f / l;
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
}

/* Rows that read the same positions through the same blocks (a speculative verify's 1 + K
 * rows of one sequence; sequences sharing a cached prefix) need not each load those
 * positions' K and V: a full span that is not the last of any of them is attended once for
 * all their query heads together, as one larger group, up to MAX_GROUP heads at a time. Each
 * query head's arithmetic in span_head64 and span_head does not depend on the group it is in,
 * so every row gets the bits it would get alone (tests/kernels/test_cpu_attention.py). */
/* shared_span: cpu_team.h */

/* Whether rows a and b read their first `blocks` blocks from the same blocks, with the same
 * anchor rows. */
static int same_blocks(const int64_t *tables, int64_t stride, const int64_t *anchor_idx,
                       int64_t a, int64_t b, int64_t blocks) {
    if (anchor_idx && anchor_idx[a] != anchor_idx[b]) return 0;
    return memcmp(tables + a * stride, tables + b * stride, sizeof(int64_t) * (size_t)blocks) == 0;
}

/* The shared spans of rows [first, last): runs of consecutive rows with the same blocks,
 * cut into sets of at most `per` rows, times each span the run's rows all have before their
 * last. covered[i - first]: how many leading spans of row i a shared span computes. Returns
 * the count written to *out (malloc'd; NULL when none), -1 when out of memory. */
static int64_t find_shared_spans(shared_span **out, int64_t *covered, const int64_t *tables,
                                 int64_t stride, const int64_t *lens, const int64_t *anchor_idx,
                                 int64_t first, int64_t last, int64_t span, int64_t block_size,
                                 int64_t per) {
    int64_t n = 0, cap = 0;
    shared_span *got = NULL;
    for (int64_t a = first; a < last;) {
        int64_t b = a + 1, shortest = lens[a];
        for (; b < last; b++) {
            int64_t m = lens[b] < shortest ? lens[b] : shortest;
            /* a shorter row joins a run of two or more only if the run keeps its spans */
            if (m <= span || (b - a >= 2 && (m - 1) / span < (shortest - 1) / span)) break;
            if (!same_blocks(tables, stride, anchor_idx, a, b, (m - 1) / span * span / block_size))
                break;
            shortest = m;
        }
        const int64_t rows = b - a, spans = (shortest - 1) / span;
        covered[a - first] = 0;
        if (rows < 2 || spans < 1 || per < 2) {
            a++;
            continue;
        }
        const int64_t sets = (rows + per - 1) / per;
        if (n + sets * spans > cap) {
            cap = 2 * (n + sets * spans);
            shared_span *grown = realloc(got, sizeof(shared_span) * (size_t)cap);
            if (!grown) {
                free(got);
                return -1;
            }
            got = grown;
        }
        for (int64_t t = 0, row0 = a; t < sets; t++) {
            const int64_t size = rows / sets + (t < rows % sets);
            for (int64_t k = 0; k < spans; k++) got[n++] = (shared_span){row0, size, k};
            row0 += size;
        }
        for (int64_t i = a; i < b; i++) covered[i - first] = spans;
        a = b;
    }
    *out = got;
    return n;
}

/* A shared span's query heads [rows * group, d] gathered (and widened) into q. */
static void gather_queries(float *q, const void *query, const int64_t *rows, int64_t row0,
                           int64_t count, int64_t num_heads, int64_t h, int64_t group,
                           int64_t d, int io_bf16) {
    for (int64_t r = 0; r < count; r++) {
        const int64_t at = (rows[row0 + r] * num_heads + h * group) * d;
        if (io_bf16) widen_bf16(q + r * group * d, (const uint16_t *)query + at, group * d);
        else memcpy(q + r * group * d, (const float *)query + at, sizeof(float) * (size_t)(group * d));
    }
}

/* A shared span's (acc, m, l) [rows * group ...] written to each row's part slot for span k,
 * as the row's own span would have written it. */
static void scatter_span(float *part, const int64_t *first_item, int64_t first, shared_span s,
                         int64_t h, int64_t num_kv_heads, int64_t stride, const float *acc,
                         const float *m, const float *l, int64_t group, int64_t d) {
    for (int64_t r = 0; r < s.rows; r++) {
        float *p = part + ((first_item[s.row0 + r - first] + s.k) * num_kv_heads + h) * stride;
        memcpy(p, acc + r * group * d, sizeof(float) * (size_t)(group * d));
        memcpy(p + group * d, m + r * group, sizeof(float) * (size_t)group);
        memcpy(p + group * d + group, l + r * group, sizeof(float) * (size_t)group);
    }
}

int kvscope_decode_plan_make(decode_plan *p, const decode_call *c) {
    const int64_t *lens = c->lens, *tables = c->tables, *anchor_idx = c->anchor_idx;
    const int64_t first = c->first, last = c->last, window = c->window;
    const int64_t group = c->num_heads / c->num_kv_heads, d = c->head_dim;
    const int64_t seqs = last - first, block_size = c->block_size;
    memset(p, 0, sizeof *p);
    int64_t total = 0;
    for (int64_t i = first; i < last; i++)
        total += window > 0 && lens[i] > window ? window : lens[i];
    const int64_t span = (SPAN + block_size - 1) / block_size * block_size;
    /* spans of sequence i: items first_item[i - first] .. first_item[i - first + 1] - 1 */
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(seqs + 1));
    if (!first_item) return 1;
    int64_t items = 0, cut = 0, widest = 0;  /* widest: the most positions in one span */
    for (int64_t i = first; i < last; i++) {
        int64_t lo = window > 0 && lens[i] > window ? lens[i] - window : 0;
        int64_t n = lens[i] <= lo ? 0 : (lens[i] - 1) / span - lo / span + 1;
        first_item[i - first] = items;
        items += n;
        cut += n > 1 ? n : 0;
        int64_t w = lens[i] - lo < span ? lens[i] - lo : span;
        widest = w > widest ? w : widest;
    }
    first_item[seqs] = items;
    /* per cut span and KV head: acc [group, d], m [group], l [group] */
    const int64_t stride = group * (d + 2);
    float *part = cut ? malloc(sizeof(float) * (size_t)(items * c->num_kv_heads * stride)) : NULL;
    int64_t *covered = calloc((size_t)seqs + 1, sizeof(int64_t));
    shared_span *shared = NULL;
    const int64_t per = MAX_GROUP / group;  /* rows in one shared span */
    int64_t nshared = !covered || window > 0 ? 0
        : find_shared_spans(&shared, covered, tables, c->table_stride, lens, anchor_idx, first,
                            last, span, block_size, per);
    if ((cut && !part) || !covered || nshared < 0) {
        free(part);
        free(covered);
        free(first_item);
        return 1;
    }
    *p = (decode_plan){.items = items, .nshared = nshared, .widest = widest,
                       .widest_group = nshared ? per * group : group, /* query heads in one call */
                       .stride = stride, .span = span, .first_item = first_item,
                       .covered = covered, .part = part, .shared = shared,
                       .parallel = total * c->num_kv_heads >= PARALLEL_MIN_ROWS
                                   && nshared + items > 1};
    return 0;
}

void kvscope_decode_plan_free(decode_plan *p) {
    free(p->shared);
    free(p->covered);
    free(p->part);
    free(p->first_item);
    memset(p, 0, sizeof *p);
}

void kvscope_decode_team(const decode_call *c, const decode_plan *p, int *status) {
    void *out = c->out;
    const void *query = c->query, *k_cache = c->k_cache, *v_cache = c->v_cache;
    const int64_t *rows = c->rows, *tables = c->tables, *lens = c->lens;
    const int64_t *anchor_idx = c->anchor_idx;
    const float *k_scale = c->k_scale, *v_scale = c->v_scale;
    const float *anchor_k = c->anchor_k, *anchor_v = c->anchor_v;
    const int64_t table_stride = c->table_stride, first = c->first, seqs = c->last - c->first;
    const int64_t num_heads = c->num_heads, num_kv_heads = c->num_kv_heads, d = c->head_dim;
    const int64_t block_size = c->block_size, anchor_len = c->anchor_len, window = c->window;
    const int64_t group = num_heads / num_kv_heads, span = p->span, stride = p->stride;
    const int64_t nshared = p->nshared, items = p->items, widest = p->widest;
    const int64_t widest_group = p->widest_group;
    const int64_t *first_item = p->first_item, *covered = p->covered;
    const shared_span *shared = p->shared;
    float *part = p->part;
    const int kind = c->kind, io_bf16 = c->io_bf16;
    const float sm_scale = c->sm_scale, softcap = c->softcap;
    if (!first_item) return;  /* no plan (its scratch failed): every thread leaves */
    span_fn attend = pick(kind, d, group);
    int failed = 0;
    /* scores [heads, widest], row [d], acc, m, l and, for bfloat16 rows (or a shared
     * span's gathered heads), q and out [heads, d] each, heads up to widest_group */
    const int64_t gw = widest_group;
    size_t floats = (size_t)(gw * widest + d + 3 * gw * d + 2 * gw);
    float *scores = malloc(sizeof(float) * floats);
    if (!scores) failed = 1;
    float *row = scores ? scores + gw * widest : NULL;
    float *acc = row ? row + d : NULL, *qf = acc ? acc + gw * d : NULL;
    float *of = qf ? qf + gw * d : NULL, *ml = of ? of + gw * d : NULL;
    int64_t i = first;  /* the sequence of item w: items are in sequence order */
#pragma omp for schedule(dynamic, 1)
    for (int64_t v = 0; v < nshared + items; v++) {
        if (!scores) continue;
        if (v < nshared) {
            const shared_span sh = shared[v];
            const int64_t heads = sh.rows * group, c0 = sh.k * span;
            span_fn attend_all = pick(kind, d, heads);
            for (int64_t h = 0; h < num_kv_heads; h++) {
                gather_queries(qf, query, rows, sh.row0, sh.rows, num_heads, h, group, d,
                               io_bf16);
                const float *ak = NULL, *av = NULL;
                int64_t na = 0;
                if (anchor_idx && anchor_idx[sh.row0] >= 0) {
                    int64_t base = (anchor_idx[sh.row0] * anchor_len * num_kv_heads + h) * d;
                    ak = anchor_k + base;
                    av = anchor_v + base;
                    na = anchor_len;  /* the span ends before every row's length */
                }
                attend_all((span_out){acc, ml, ml + heads}, qf, tables + sh.row0 * table_stride,
                           c0, c0 + span, k_cache, v_cache, k_scale, v_scale, h, heads,
                           num_kv_heads, d, block_size, sm_scale, scores, row, ak, av, na,
                           softcap);
                scatter_span(part, first_item, first, sh, h, num_kv_heads, stride, acc, ml,
                             ml + heads, group, d);
            }
            continue;
        }
        const int64_t w = v - nshared;
        while (first_item[i - first + 1] <= w) i++;
        while (first_item[i - first] > w) i--;
        const int64_t k = w - first_item[i - first];
        if (k < covered[i - first]) continue;  /* a shared span computed it */
        const int64_t spans = first_item[i - first + 1] - first_item[i - first];
        const int64_t lo = window > 0 && lens[i] > window ? lens[i] - window : 0;
        const int64_t c0 = k == 0 ? lo : (lo / span + k) * span;
        const int64_t c1 = (lo / span + k + 1) * span < lens[i]
                           ? (lo / span + k + 1) * span : lens[i];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            int64_t at = (rows[i] * num_heads + h * group) * d;
            const float *q = (const float *)query + at;
            if (io_bf16) {
                widen_bf16(qf, (const uint16_t *)query + at, group * d);
                q = qf;
            }
            const float *ak = NULL, *av = NULL;
            int64_t na = 0;
            if (anchor_idx && anchor_idx[i] >= 0) {
                int64_t base = (anchor_idx[i] * anchor_len * num_kv_heads + h) * d;
                ak = anchor_k + base;
                av = anchor_v + base;
                na = anchor_len < lens[i] ? anchor_len : lens[i];
            }
            span_out o = {acc, ml, ml + group};
            if (spans > 1) {
                float *p = part + (w * num_kv_heads + h) * stride;
                o = (span_out){p, p + group * d, p + group * d + group};
            }
            attend(o, q, tables + i * table_stride, c0, c1, k_cache, v_cache, k_scale,
                   v_scale, h, group, num_kv_heads, d, block_size, sm_scale, scores, row,
                   ak, av, na, softcap);
            if (spans > 1) continue;
            float *dst = io_bf16 ? of : (float *)out + at;
            for (int64_t g = 0; g < group; g++) {
                const float inv = 1.0f / o.l[g];
                for (int64_t x = 0; x < d; x++) dst[g * d + x] = acc[g * d + x] * inv;
            }
            if (io_bf16) narrow_bf16((uint16_t *)out + at, of, group * d);
        }
    }
    /* the cut sequences' spans are all in (the loop's barrier): merge them */
#pragma omp for schedule(static)
    for (int64_t w = 0; w < seqs * num_kv_heads; w++) {
        if (!scores) continue;
        const int64_t s = w / num_kv_heads, h = w % num_kv_heads;
        const int64_t spans = first_item[s + 1] - first_item[s];
        if (spans < 2) continue;
        const int64_t at = (rows[first + s] * num_heads + h * group) * d;
        float *dst = io_bf16 ? of : (float *)out + at;
        merge_spans(dst, part + (first_item[s] * num_kv_heads + h) * stride,
                    spans, num_kv_heads * stride, group, d);
        if (io_bf16) narrow_bf16((uint16_t *)out + at, of, group * d);
    }
    free(scores);
    if (failed) {
#pragma omp atomic write
        *status = 1;
    }
}

/* Sequences [first, last) of the batch. query/out: [*, num_heads, head_dim], float32, or
 * bfloat16 when io_bf16 (converted here, in the work item, rather than by two more torch ops
 * per layer); caches: [num_blocks, block_size, num_kv_heads, head_dim]; scales (1-byte
 * pools): [num_blocks, block_size, num_kv_heads] float32, else NULL. rows[i]: the query row
 * of sequence i; tables[i * table_stride + j]: its j-th block; lens[i]: its context length.
 * Anchors (kernels/anchors.py; NULL when the pool keeps none): anchor_k/anchor_v [entries,
 * anchor_len, num_kv_heads, head_dim] float32 and anchor_idx[i] sequence i's entry (-1: none);
 * positions below anchor_len of a sequence with an entry are read from there.
 * window > 0: sequence i attends to positions lens[i] - window .. lens[i] - 1 only (its
 * table entries for blocks wholly before that are never read: they may be -1); softcap > 0:
 * scores become softcap * tanh(score / softcap) before the softmax.
 *
 * Work items are spans of a sequence's positions (SPAN each; the whole sequence when it is
 * shorter), each for every KV head in turn: the heads' rows interleave in each
 * block, so the head after the first finds them in the cache. A sequence cut into spans is
 * merged once every span is in (merge_spans). Built with -fopenmp, this library binds to the
 * libgomp torch has already loaded (same soname), so these are torch's own worker threads,
 * already awake from the matmul before, and torch.set_num_threads governs them; a second
 * thread pool would fight torch's spinning one for the cores.
 * The call's arguments are a decode_call (cpu_team.h): kvscope_paged_decode shares one out
 * over a parallel region of its own; engine/model/fused/decode.py's whole-step call
 * (kernels/cpu_decode_step.c) runs the same plan and team inside one region for every layer.
 * parallel: 1 shares the call over torch's threads, 0 runs it on the calling thread, < 0
 * leaves it to PARALLEL_MIN_ROWS (kernels/cpu_attention.py measures which, per machine).
 * Returns 1 when the scratch could not be allocated. */
int kvscope_paged_decode(void *out, const void *query, const int64_t *rows,
                         const int64_t *tables, int64_t table_stride, const int64_t *lens,
                         int64_t first, int64_t last, const void *k_cache, const void *v_cache,
                         const float *k_scale, const float *v_scale, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int kind,
                         float sm_scale, int io_bf16, const float *anchor_k,
                         const float *anchor_v, const int64_t *anchor_idx, int64_t anchor_len,
                         int64_t window, float softcap, int parallel) {
    const decode_call c = {out, query, rows, tables, table_stride, lens, first, last, k_cache,
                           v_cache, k_scale, v_scale, num_heads, num_kv_heads, head_dim,
                           block_size, kind, sm_scale, io_bf16, anchor_k, anchor_v, anchor_idx,
                           anchor_len, window, softcap};
    decode_plan p;
    if (kvscope_decode_plan_make(&p, &c)) return 1;
    if (parallel >= 0) p.parallel = parallel && p.nshared + p.items > 1;
    int failed = 0;
#pragma omp parallel if (p.parallel)
    kvscope_decode_team(&c, &p, &failed);
    kvscope_decode_plan_free(&p);
    return failed;
}
