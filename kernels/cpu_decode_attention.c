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

/* One sequence and one KV head: the `group` query heads q [group, d] that share KV head h
 * attend to its cached tokens lo..len-1 (lo > 0: a sliding window; the table entries of
 * blocks before lo's are never read); out [group, d]. Walks the block table block by block
 * (no division per token), reading head h's row of each slot (a block is [block_size,
 * kv_heads, d]): once through K for the scores, an exact softmax, once through V for the
 * weighted sum. scores: [group * (len - lo)] scratch, row [d], acc [group * d]. */
static inline __attribute__((always_inline)) void attend_head(
        float *out, const float *q, const int64_t *table, int64_t len, const void *k_cache,
        const void *v_cache, const float *k_scale, const float *v_scale, int64_t h,
        int64_t group, int64_t num_kv_heads, int64_t d, int64_t block_size, int kind,
        float sm_scale, float *scores, float *row, float *acc, const float *ak,
        const float *av, int64_t na, int64_t lo, float softcap) {
    const int64_t cnt = len - lo; /* scores[g * cnt + t]: position lo + t */
    for (int64_t b = lo / block_size, start = b * block_size; start < len;
         start += block_size, b++) {
        int64_t j0 = start < lo ? lo - start : 0;
        int64_t n = len - start < block_size ? len - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            load_token(row, k_cache, k_scale, ak, start + j, at, na, num_kv_heads, d, kind);
            for (int64_t g = 0; g < group; g++)
                scores[g * cnt + start + j - lo] = dot(q + g * d, row, d) * sm_scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * cnt, m = -INFINITY, sum = 0.0f;
        if (softcap > 0.0f) softcap_scores(s, cnt, softcap);
        for (int64_t t = 0; t < cnt; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd
        for (int64_t t = 0; t < cnt; t++) s[t] = exp_nonpositive(s[t] - m);
        for (int64_t t = 0; t < cnt; t++) sum += s[t];
        float inv = 1.0f / sum;
        for (int64_t t = 0; t < cnt; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * d));
    for (int64_t b = lo / block_size, start = b * block_size; start < len;
         start += block_size, b++) {
        int64_t j0 = start < lo ? lo - start : 0;
        int64_t n = len - start < block_size ? len - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            load_token(row, v_cache, v_scale, av, start + j, at, na, num_kv_heads, d, kind);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * cnt + start + j - lo], *a = acc + g * d;
#pragma omp simd
                for (int64_t k = 0; k < d; k++) a[k] += p * row[k];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(group * d));
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
        for (int i = 0; i < 4; i++)
            r[i] = fp8x16_to_f32_div256((const uint8_t *)cache + offset + 16 * i)
                   * (scale * 256.0f);
    } else if (kind == KV_F16) {
        for (int i = 0; i < 4; i++) r[i] = f16x16_to_f32((const uint16_t *)cache + offset + 16 * i);
#endif
    } else {
        float tmp[64];
        load_row(tmp, cache, offset, 64, kind, scale);
        for (int i = 0; i < 4; i++) r[i] = *(const v16f_u *)(tmp + 16 * i);
    }
}

/* load_token for head_dim 64, into four vectors. */
static inline __attribute__((always_inline)) void load_token64(
        v16f r[4], const void *cache, const float *scales, const float *anchor, int64_t pos,
        int64_t at, int64_t na, int64_t num_kv_heads, int kind) {
    if (pos < na) load_row64(r, anchor, pos * num_kv_heads * 64, KV_F32, 1.0f);
    else load_row64(r, cache, at * 64, kind, scales ? scales[at] : 1.0f);
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

static inline __attribute__((always_inline)) void softmax_row(float *s, int64_t len) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
    int64_t t = 0;
    v16f acc = {0};
    for (; t + 16 <= len; t += 16) {
        v16f v;
        memcpy(&v, s + t, 64);
        v = exp_nonpositive16(v - m);
        memcpy(s + t, &v, 64);
        acc += v;
    }
    for (; t < len; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    float inv = 1.0f / (sum + hsum16(acc));
    for (t = 0; t < len; t++) s[t] *= inv;
}

#define MAX_GROUP 16

static inline __attribute__((always_inline)) void attend_head64(
        float *out, const float *q, const int64_t *table, int64_t len, const void *k_cache,
        const void *v_cache, const float *k_scale, const float *v_scale, int64_t h,
        int64_t group, int64_t num_kv_heads, int64_t block_size, int kind, float sm_scale,
        float *scores, const float *ak, const float *av, int64_t na, int64_t lo,
        float softcap) {
    const int64_t cnt = len - lo; /* scores[g * cnt + t]: position lo + t */
    v16f qv[MAX_GROUP][4], acc[MAX_GROUP][4], r[4], part[MAX_GROUP][16];
    for (int64_t g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) qv[g][i] = *(const v16f_u *)(q + g * 64 + 16 * i);
    /* Each token's products stay 16 lanes wide in part[g][c] until 16 tokens are in, then
     * sum16x16 turns them into 16 scores at once. */
    int c = 0;
    for (int64_t b = lo / block_size, start = b * block_size; start < len;
         start += block_size, b++) {
        int64_t j0 = start < lo ? lo - start : 0;
        int64_t n = len - start < block_size ? len - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            load_token64(r, k_cache, k_scale, ak, start + j, at, na, num_kv_heads, kind);
            for (int64_t g = 0; g < group; g++)
                part[g][c] = qv[g][0] * r[0] + qv[g][1] * r[1] + (qv[g][2] * r[2] + qv[g][3] * r[3]);
            if (++c == 16) {
                for (int64_t g = 0; g < group; g++)
                    *(v16f_u *)(scores + g * cnt + start + j - lo - 15) =
                        sum16x16(part[g]) * sm_scale;
                c = 0;
            }
        }
    }
    for (int i = 0; i < c; i++)
        for (int64_t g = 0; g < group; g++)
            scores[g * cnt + cnt - c + i] = hsum16(part[g][i]) * sm_scale;
    for (int64_t g = 0; g < group; g++) {
        if (softcap > 0.0f) softcap_scores(scores + g * cnt, cnt, softcap);
        softmax_row(scores + g * cnt, cnt);
        for (int i = 0; i < 4; i++) acc[g][i] = (v16f){0};
    }
    for (int64_t b = lo / block_size, start = b * block_size; start < len;
         start += block_size, b++) {
        int64_t j0 = start < lo ? lo - start : 0;
        int64_t n = len - start < block_size ? len - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h + j0 * num_kv_heads;
        for (int64_t j = j0; j < n; j++, at += num_kv_heads) {
            load_token64(r, v_cache, v_scale, av, start + j, at, na, num_kv_heads, kind);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * cnt + start + j - lo];
                for (int i = 0; i < 4; i++) acc[g][i] += p * r[i];
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) *(v16f_u *)(out + g * 64 + 16 * i) = acc[g][i];
}

/* Per storage kind, and per group size 1-4 as a constant (SmolLM2 has 3, Llama 3 has 4), so
 * that the loops over the group unroll. */
#define SPECIALISE64(name, KIND, G)                                                        \
    static void name(float *out, const float *q, const int64_t *table, int64_t len,        \
                     const void *kc, const void *vc, const float *ks, const float *vs,      \
                     int64_t h, int64_t group, int64_t kvh, int64_t d, int64_t bs,          \
                     float sm, float *scores, float *row, float *acc, const float *ak,      \
                     const float *av, int64_t na, int64_t lo, float cap) {                  \
        (void)d; (void)row; (void)acc; (void)group;                                         \
        attend_head64(out, q, table, len, kc, vc, ks, vs, h, G, kvh, bs, KIND, sm, scores,  \
                      ak, av, na, lo, cap);                                                 \
    }
#define SPECIALISE64_GROUPS(prefix, KIND)                                                  \
    SPECIALISE64(prefix##_g1, KIND, 1) SPECIALISE64(prefix##_g2, KIND, 2)                  \
    SPECIALISE64(prefix##_g3, KIND, 3) SPECIALISE64(prefix##_g4, KIND, 4)                  \
    SPECIALISE64(prefix##_gn, KIND, group)
SPECIALISE64_GROUPS(attend64_f32, KV_F32)
SPECIALISE64_GROUPS(attend64_bf16, KV_BF16)
SPECIALISE64_GROUPS(attend64_f16, KV_F16)
SPECIALISE64_GROUPS(attend64_i8, KV_I8)
SPECIALISE64_GROUPS(attend64_fp8, KV_FP8)

/* attend_head compiled once per storage kind, for head dims other than 64 (and groups over
 * MAX_GROUP); head_dim 64 takes attend_head64 above. */
#define SPECIALISE(name, KIND, D)                                                          \
    static void name(float *out, const float *q, const int64_t *table, int64_t len,        \
                     const void *kc, const void *vc, const float *ks, const float *vs,      \
                     int64_t h, int64_t group, int64_t kvh, int64_t d, int64_t bs,          \
                     float sm, float *scores, float *row, float *acc, const float *ak,      \
                     const float *av, int64_t na, int64_t lo, float cap) {                  \
        (void)d;                                                                            \
        attend_head(out, q, table, len, kc, vc, ks, vs, h, group, kvh, D, bs, KIND, sm,     \
                    scores, row, acc, ak, av, na, lo, cap);                                 \
    }
SPECIALISE(attend_f32, KV_F32, d)
SPECIALISE(attend_bf16, KV_BF16, d)
SPECIALISE(attend_f16, KV_F16, d)
SPECIALISE(attend_i8, KV_I8, d)
SPECIALISE(attend_fp8, KV_FP8, d)

typedef void (*attend_fn)(float *, const float *, const int64_t *, int64_t, const void *,
                          const void *, const float *, const float *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, float *, float *, float *,
                          const float *, const float *, int64_t, int64_t, float);

static attend_fn pick(int kind, int64_t d, int64_t group) {
    static const attend_fn any[] = {attend_f32, attend_bf16, attend_f16, attend_i8, attend_fp8};
#define ROW(p) {p##_gn, p##_g1, p##_g2, p##_g3, p##_g4}
    static const attend_fn d64[][5] = {ROW(attend64_f32), ROW(attend64_bf16), ROW(attend64_f16),
                                       ROW(attend64_i8), ROW(attend64_fp8)};
#undef ROW
    if (d != 64 || group > MAX_GROUP) return any[kind];
    return d64[kind][group <= 4 ? group : 0];
}

/* Below this many cached rows in a call, a parallel region costs more than it saves. */
#define PARALLEL_MIN_ROWS 2048

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
 * The (sequence, KV head) pairs are shared out over OpenMP threads a sequence at a time: its
 * heads' rows interleave in each block, so the head after the first finds them in the cache
 * (10 % faster than pairs dealt one by one). Built with -fopenmp, this
 * library binds to the libgomp torch has already loaded (same soname), so these are torch's
 * own worker threads, already awake from the matmul before, and torch.set_num_threads
 * governs them; a second thread pool would fight torch's spinning one for the cores.
 * Returns 1 when a thread could not allocate its scratch. */
int kvscope_paged_decode(void *out, const void *query, const int64_t *rows,
                         const int64_t *tables, int64_t table_stride, const int64_t *lens,
                         int64_t first, int64_t last, const void *k_cache, const void *v_cache,
                         const float *k_scale, const float *v_scale, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int kind,
                         float sm_scale, int io_bf16, const float *anchor_k,
                         const float *anchor_v, const int64_t *anchor_idx, int64_t anchor_len,
                         int64_t window, float softcap) {
    const int64_t group = num_heads / num_kv_heads, d = head_dim;
    int64_t max_len = 0, total = 0; /* max_len: the most positions one row attends to */
    for (int64_t i = first; i < last; i++) {
        int64_t n = window > 0 && lens[i] > window ? window : lens[i];
        max_len = n > max_len ? n : max_len;
        total += n * num_kv_heads;
    }
    const int64_t items = (last - first) * num_kv_heads;
    attend_fn attend = pick(kind, d, group);
    int failed = 0;
#pragma omp parallel if (total >= PARALLEL_MIN_ROWS && items > 1) reduction(| : failed)
    {
        /* scores [group, max_len], row [d], acc and, for bfloat16 rows, q and out
         * [group, d] each */
        size_t floats = (size_t)(group * max_len + d + 3 * group * d);
        float *scores = malloc(sizeof(float) * floats);
        if (!scores) failed = 1;
        float *row = scores ? scores + group * max_len : NULL;
        float *acc = row ? row + d : NULL, *qf = acc ? acc + group * d : NULL;
        float *of = qf ? qf + group * d : NULL;
#pragma omp for schedule(dynamic, num_kv_heads)
        for (int64_t w = 0; w < items; w++) {
            if (!scores) continue;
            int64_t i = first + w / num_kv_heads, h = w % num_kv_heads;
            int64_t at = (rows[i] * num_heads + h * group) * d;
            const float *q = (const float *)query + at;
            float *o = (float *)out + at;
            if (io_bf16) {
                widen_bf16(qf, (const uint16_t *)query + at, group * d);
                q = qf;
                o = of;
            }
            const float *ak = NULL, *av = NULL;
            int64_t na = 0;
            if (anchor_idx && anchor_idx[i] >= 0) {
                int64_t base = (anchor_idx[i] * anchor_len * num_kv_heads + h) * d;
                ak = anchor_k + base;
                av = anchor_v + base;
                na = anchor_len < lens[i] ? anchor_len : lens[i];
            }
            int64_t lo = window > 0 && lens[i] > window ? lens[i] - window : 0;
            attend(o, q, tables + i * table_stride, lens[i], k_cache, v_cache, k_scale,
                   v_scale, h, group, num_kv_heads, d, block_size, sm_scale, scores, row, acc,
                   ak, av, na, lo, softcap);
            if (io_bf16) narrow_bf16((uint16_t *)out + at, of, group * d);
        }
        free(scores);
    }
    return failed;
}
