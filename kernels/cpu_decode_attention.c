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

/* e^x for x <= 0 (softmax after subtracting the max) in straight-line code the compiler
 * vectorizes, unlike libm's expf: 2^(x log2 e) split into 2^n (built in the exponent bits)
 * times 2^f, f in [0, 1), by a degree-6 polynomial; relative error about 2e-7, a float32
 * rounding or two. Below -87, e^x is under float's smallest normal: 0. */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = floorf(t), f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* One sequence and one KV head: the `group` query heads q [group, d] that share KV head h
 * attend to its `len` cached tokens; out [group, d]. Walks the block table block by block (no
 * division per token), reading head h's row of each slot (a block is [block_size, kv_heads,
 * d]): once through K for the scores, an exact softmax, once through V for the weighted sum.
 * scores: [group * len] scratch, row [d], acc [group * d]. */
static inline __attribute__((always_inline)) void attend_head(
        float *out, const float *q, const int64_t *table, int64_t len, const void *k_cache,
        const void *v_cache, const float *k_scale, const float *v_scale, int64_t h,
        int64_t group, int64_t num_kv_heads, int64_t d, int64_t block_size, int kind,
        float sm_scale, float *scores, float *row, float *acc) {
    for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h;
        for (int64_t j = 0; j < n; j++, at += num_kv_heads) {
            load_row(row, k_cache, at * d, d, kind, k_scale ? k_scale[at] : 1.0f);
            for (int64_t g = 0; g < group; g++)
                scores[g * len + start + j] = dot(q + g * d, row, d) * sm_scale;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len, m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] = exp_nonpositive(s[t] - m);
        for (int64_t t = 0; t < len; t++) sum += s[t];
        float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * d));
    for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
        int64_t n = len - start < block_size ? len - start : block_size;
        int64_t at = table[b] * block_size * num_kv_heads + h;
        for (int64_t j = 0; j < n; j++, at += num_kv_heads) {
            load_row(row, v_cache, at * d, d, kind, v_scale ? v_scale[at] : 1.0f);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * len + start + j], *a = acc + g * d;
#pragma omp simd
                for (int64_t k = 0; k < d; k++) a[k] += p * row[k];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(group * d));
}

/* attend_head compiled once per storage kind, and once more for head_dim 64 (SmolLM2,
 * Llama-style small models): with the kind and the width constant, the conversion and the
 * dot products unroll into straight vector code. */
#define SPECIALISE(name, KIND, D)                                                          \
    static void name(float *out, const float *q, const int64_t *table, int64_t len,        \
                     const void *kc, const void *vc, const float *ks, const float *vs,      \
                     int64_t h, int64_t group, int64_t kvh, int64_t d, int64_t bs,          \
                     float sm, float *scores, float *row, float *acc) {                     \
        (void)d;                                                                            \
        attend_head(out, q, table, len, kc, vc, ks, vs, h, group, kvh, D, bs, KIND, sm,     \
                    scores, row, acc);                                                      \
    }
SPECIALISE(attend_f32, KV_F32, d)
SPECIALISE(attend_bf16, KV_BF16, d)
SPECIALISE(attend_f16, KV_F16, d)
SPECIALISE(attend_i8, KV_I8, d)
SPECIALISE(attend_fp8, KV_FP8, d)
SPECIALISE(attend_f32_64, KV_F32, 64)
SPECIALISE(attend_bf16_64, KV_BF16, 64)
SPECIALISE(attend_f16_64, KV_F16, 64)
SPECIALISE(attend_i8_64, KV_I8, 64)
SPECIALISE(attend_fp8_64, KV_FP8, 64)

typedef void (*attend_fn)(float *, const float *, const int64_t *, int64_t, const void *,
                          const void *, const float *, const float *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, float *, float *, float *);

static attend_fn pick(int kind, int64_t d) {
    static const attend_fn any[] = {attend_f32, attend_bf16, attend_f16, attend_i8, attend_fp8};
    static const attend_fn d64[] = {attend_f32_64, attend_bf16_64, attend_f16_64, attend_i8_64,
                                    attend_fp8_64};
    return d == 64 ? d64[kind] : any[kind];
}

/* Below this many cached rows in a call, a parallel region costs more than it saves. */
#define PARALLEL_MIN_ROWS 2048

/* Sequences [first, last) of the batch. query/out: [*, num_heads, head_dim] float32;
 * caches: [num_blocks, block_size, num_kv_heads, head_dim]; scales (1-byte pools):
 * [num_blocks, block_size, num_kv_heads] float32, else NULL. rows[i]: the query row of
 * sequence i; tables[i * table_stride + j]: its j-th block; lens[i]: its context length.
 *
 * The (sequence, KV head) pairs are shared out over OpenMP threads. Built with -fopenmp, this
 * library binds to the libgomp torch has already loaded (same soname), so these are torch's
 * own worker threads, already awake from the matmul before, and torch.set_num_threads
 * governs them; a second thread pool would fight torch's spinning one for the cores.
 * Returns 1 when a thread could not allocate its scratch. */
int kvscope_paged_decode(float *out, const float *query, const int64_t *rows,
                         const int64_t *tables, int64_t table_stride, const int64_t *lens,
                         int64_t first, int64_t last, const void *k_cache, const void *v_cache,
                         const float *k_scale, const float *v_scale, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int kind,
                         float sm_scale) {
    const int64_t group = num_heads / num_kv_heads, d = head_dim;
    int64_t max_len = 0, total = 0;
    for (int64_t i = first; i < last; i++) {
        max_len = lens[i] > max_len ? lens[i] : max_len;
        total += lens[i] * num_kv_heads;
    }
    const int64_t items = (last - first) * num_kv_heads;
    attend_fn attend = pick(kind, d);
    int failed = 0;
#pragma omp parallel if (total >= PARALLEL_MIN_ROWS && items > 1) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (max_len + d) + d));
        if (!scores) failed = 1;
        float *row = scores ? scores + group * max_len : NULL, *acc = row ? row + d : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (!scores) continue;
            int64_t i = first + w / num_kv_heads, h = w % num_kv_heads;
            int64_t at = (rows[i] * num_heads + h * group) * d;
            attend(out + at, query + at, tables + i * table_stride, lens[i], k_cache, v_cache,
                   k_scale, v_scale, h, group, num_kv_heads, d, block_size, sm_scale, scores,
                   row, acc);
        }
        free(scores);
    }
    return failed;
}
