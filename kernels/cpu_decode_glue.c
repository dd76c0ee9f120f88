/* The elementwise work between the matmuls of a CPU decode step, fused: what torch runs as
 * five to fifteen small ops per step of a layer (each a dispatch, an allocation and a pass
 * over memory) is one call here. Used by engine/model/fused/decode.py for a float32 residual
 * stream; the matmuls' inputs and outputs ("io" rows) are bfloat16 (io = 1: 4-bit weights,
 * whose kernel takes and gives bfloat16) or float32 (io = 0: dense float32 weights).
 * Built with kernels/cpu_decode_attention.c into one library (kernels/native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_glue.h"
#include "cpu_vec.h"

/* A row of n io values as float32 into dst, and back. */
static inline void io_read(float *dst, const void *src, int64_t n, int io) {
    if (!io) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *b = src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) *(v16f_u *)(dst + i) = load_bf16x16(b + i);
    for (; i < n; i++) dst[i] = bf16_to_f32(b[i]);
}

static inline void io_write(void *dst, const float *src, int64_t n, int io) {
    if (!io) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *b = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store_bf16x16(b + i, *(const v16f_u *)(src + i));
    for (; i < n; i++) b[i] = f32_to_bf16(src[i]);
}

/* The widest row these take (hidden size, intermediate size, and the q|k|v row); the caller,
 * engine/model/fused/decode.py, keeps to it (its ROW_MAX). */
#define ROW_MAX 16384

/* out = w * (h * rsqrt(mean(h^2) + eps)) per row, Hugging Face's RMSNorm order. If y is not
 * NULL, h += y (a matmul output) first, in place: the residual add. */
void kvscope_add_rms_norm(float *h, const void *y, const float *w, float eps, void *out,
                          int64_t rows, int64_t n, int io) {
    float tmp[ROW_MAX];
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n;
        if (y) {
            io_read(tmp, (const char *)y + (size_t)(r * n) * (io ? 2 : 4), n, io);
            for (int64_t i = 0; i < n; i++) x[i] += tmp[i];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) tmp[i] = w[i] * (x[i] * inv);
        io_write((char *)out + (size_t)(r * n) * (io ? 2 : 4), tmp, n, io);
    }
}

/* h += y: the last layer's residual add before the final norm. */
void kvscope_add(float *h, const void *y, int64_t count, int io) {
    float tmp[ROW_MAX];
    for (int64_t at = 0; at < count; at += ROW_MAX) {
        int64_t n = count - at < ROW_MAX ? count - at : ROW_MAX;
        io_read(tmp, (const char *)y + (size_t)at * (io ? 2 : 4), n, io);
        for (int64_t i = 0; i < n; i++) h[at + i] += tmp[i];
    }
}

/* silu(x) = x / (1 + e^-x), with e^-|x| (never above 1) from the vector exp: for x >= 0 that
 * is x / (1 + e^-x); for x < 0, x e^x / (1 + e^x). libm's expf one value at a time cost
 * more than the matmuls at 16 rows. */
static inline __attribute__((always_inline)) v16f silu16(v16f x) {
    v16i neg = x < (v16f){0};
    v16f ax = (v16f)((v16i)x & 0x7fffffff);  /* |x|: the sign bit cleared */
    v16f e = exp_nonpositive16((v16f){0} - ax);
    v16f num = (v16f)(((v16i)x & ~neg) | ((v16i)(x * e) & neg));
    return num / (1.0f + e);
}

static inline float silu1(float x) {
    float e = exp_nonpositive(-fabsf(x));
    return (x >= 0.0f ? x : x * e) / (1.0f + e);
}


/* One head's per-head RMSNorm (qwen3, gemma3's q_norm/k_norm), in place: x = w * (x / rms(x)),
 * as kvscope_add_rms_norm computes it. */
static inline void head_rms_norm(float *x, const float *w, float eps, int64_t d) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) x[i] = w[i] * (x[i] * inv);
}

/* sigmoid(z) = 1 / (1 + e^-z) from e^-|z| (never above 1): 1 / (1 + e) for z >= 0, else
 * e / (1 + e), so neither side cancels. */
static inline __attribute__((always_inline)) v16f sigmoid16(v16f z) {
    v16i neg = z < (v16f){0};
    v16f e = exp_nonpositive16((v16f){0} - (v16f)((v16i)z & 0x7fffffff));
    const v16f one = (v16f){0} + 1.0f;
    v16f num = (v16f)(((v16i)one & ~neg) | ((v16i)e & neg));
    return num / (1.0f + e);
}

static inline float sigmoid1(float z) {
    float e = exp_nonpositive(-fabsf(z));
    return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* Hugging Face's gelu_pytorch_tanh (torch's gelu, approximate="tanh"):
 * 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). 0.5 (1 + tanh(u)) is sigmoid(2u)
 * exactly, which keeps its precision where tanh(u) nears -1 (1 + tanh(u) would cancel). */
#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_C 0.044715f

static inline __attribute__((always_inline)) v16f gelu_tanh16(v16f x) {
    return x * sigmoid16(2.0f * GELU_K * (x + GELU_C * (x * x * x)));
}

static inline float gelu_tanh1(float x) {
    return x * sigmoid1(2.0f * GELU_K * (x + GELU_C * (x * x * x)));
}

/* out[r] = act(gate) * up, gate_up[r] = [gate (inter) | up (inter)]; act is SiLU or, for
   gemma's GLU, gelu-tanh (a constant at each call site below, so the loop does not branch). */
static inline void glu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int io,
                           const int gelu) {
    float g[ROW_MAX], u[ROW_MAX];
    const size_t size = io ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)gate_up + (size_t)(r * 2 * inter) * size;
        io_read(g, row, inter, io);
        io_read(u, row + (size_t)inter * size, inter, io);
        int64_t i = 0;
        for (; i + 16 <= inter; i += 16) {
            const v16f x = *(const v16f_u *)(g + i);
            *(v16f_u *)(g + i) = (gelu ? gelu_tanh16(x) : silu16(x)) * *(const v16f_u *)(u + i);
        }
        for (; i < inter; i++) g[i] = (gelu ? gelu_tanh1(g[i]) : silu1(g[i])) * u[i];
        io_write((char *)out + (size_t)(r * inter) * size, g, inter, io);
    }
}

void kvscope_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int io) {
    glu_mul(gate_up, out, rows, inter, io, 0);
}

void kvscope_gelu_tanh_mul(const void *gate_up, void *out, int64_t rows, int64_t inter,
                           int io) {
    glu_mul(gate_up, out, rows, inter, io, 1);
}


/* Gemma's sandwich norm and the residual add in one pass: per row, h += y_w * (y / rms(y))
 * (y: a matmul output, io rows), then, when w is not NULL, out = w * (h / rms(h)), the next
 * norm (as kvscope_add_rms_norm); w NULL (the last layer): out is not written. */
void kvscope_add_normed_rms_norm(float *h, const void *y, const float *y_w, const float *w,
                                 float eps, void *out, int64_t rows, int64_t n, int io) {
    float tmp[ROW_MAX];
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n;
        io_read(tmp, (const char *)y + (size_t)(r * n) * (io ? 2 : 4), n, io);
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += tmp[i] * tmp[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) x[i] += y_w[i] * (tmp[i] * inv);
        if (!w) continue;
        ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) tmp[i] = w[i] * (x[i] * inv);
        io_write((char *)out + (size_t)(r * n) * (io ? 2 : 4), tmp, n, io);
    }
}

/* The pool's own write and rotation (kernels/cpu_kv_write.c, the same library). */
void kvscope_kv_store(const float *x, int64_t h, int64_t d, const float *R,
                      const float *shift, const float *gain, int kind, void *cache,
                      float *scales, int64_t at);
void kvscope_rotate_row(float *y, const float *a, const float *R, int64_t d);

/* Where a KV row goes and in what form: the cache kind (0 float32, 1 bfloat16, 3 int8,
 * 4 fp8 e4m3, as kernels/cpu_decode_attention.c numbers them), its scales (1-byte kinds:
 * [slots, kv_heads] float32), the rotation R [d, d] (NULL: none) and the K shift/gain and
 * query gain [kv_heads, d] (NULL: no K balance; kernels/k_balance.py). */
typedef struct {
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;
    const float *R, *shift, *gain, *q_gain;
    int kind;
} kv_target;

/* kvscope_rope_write and kvscope_norm_rope_write: q_norm/k_norm NULL for no per-head norm;
 * rot = d for a whole-head rotary. Inlined into each, so the plain one keeps its own code.
 * A plain float pool (t->kind 0 or 1, no transforms) is written in place; any other goes
 * through kvscope_kv_store, and the query takes the transforms the pool's keys carry,
 * (q / g) @ R (kernels.ops.paged_attention's, so the scores are those of the plain keys). */
static inline __attribute__((always_inline)) void norm_rope_write(
    const void *qkv, int64_t rows, const int64_t *positions, const float *cos_table,
    const float *sin_table, int64_t rot, const float *q_norm, const float *k_norm, float eps,
    float *q_out, const int64_t *slots, int64_t heads, int64_t kv_heads, int64_t d,
    const kv_target *t, int io) {
    const int64_t half = rot / 2, width = (heads + 2 * kv_heads) * d, group = heads / kv_heads;
    const int plain = t->kind <= 1 && !t->R && !t->shift;
    const int cache_bf16 = t->kind == 1;
    float row[ROW_MAX], turned[1024], tmp[1024];
    for (int64_t r = 0; r < rows; r++) {
        io_read(row, (const char *)qkv + (size_t)(r * width) * (io ? 2 : 4), width, io);
        const float *c = cos_table + positions[r] * rot, *s = sin_table + positions[r] * rot;
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            float *x = row + hd * d;
            const float *w = hd < heads ? q_norm : k_norm;
            if (w) head_rms_norm(x, w, eps, d);
            for (int64_t i = 0; i < half; i++) turned[i] = x[i] * c[i] + x[i + half] * s[i];
            for (int64_t i = half; i < rot; i++) turned[i] = x[i] * c[i] + x[i - half] * s[i];
            for (int64_t i = rot; i < d; i++) turned[i] = x[i];  /* past the rotary part */
            if (hd < heads) {
                float *q = q_out + (r * heads + hd) * d;
                if (plain) {
                    memcpy(q, turned, sizeof(float) * (size_t)d);
                    continue;
                }
                if (t->q_gain) {
                    const float *g = t->q_gain + (hd / group) * d;
                    for (int64_t i = 0; i < d; i++) turned[i] *= g[i];
                }
                if (t->R) {
                    kvscope_rotate_row(tmp, turned, t->R, d);
                    memcpy(q, tmp, sizeof(float) * (size_t)d);
                } else {
                    memcpy(q, turned, sizeof(float) * (size_t)d);
                }
                continue;
            }
            int64_t at = slots[r] * kv_heads + (hd - heads);
            if (!plain) {
                kvscope_kv_store(turned, hd - heads, d, t->R, t->shift, t->gain, t->kind,
                                 t->k_cache, t->k_scale, at);
                continue;
            }
            io_write(cache_bf16 ? (void *)((uint16_t *)t->k_cache + at * d)
                                : (void *)((float *)t->k_cache + at * d), turned, d, cache_bf16);
        }
        for (int64_t hd = 0; hd < kv_heads; hd++) {
            int64_t at = slots[r] * kv_heads + hd;
            const float *v = row + (heads + kv_heads + hd) * d;
            if (!plain) {
                kvscope_kv_store(v, hd, d, t->R, NULL, NULL, t->kind, t->v_cache, t->v_scale,
                                 at);
                continue;
            }
            io_write(cache_bf16 ? (void *)((uint16_t *)t->v_cache + at * d)
                                : (void *)((float *)t->v_cache + at * d), v, d, cache_bf16);
        }
    }
}

/* For each row (one decoding sequence): q and k of qkv (io rows) turned by RoPE at its
 * position, q to q_out [rows, heads, d] float32, k and v into the cache slot (float32 when
 * cache_bf16 is 0, else bfloat16). cos/sin: [positions, d] float32, sin with its first half
 * negated (x * cos + roll(x, d/2) * sin is Hugging Face's rotate_half form). */
void kvscope_rope_write(const void *qkv, int64_t rows, const int64_t *positions,
                        const float *cos_table, const float *sin_table, float *q_out,
                        void *k_cache, void *v_cache, const int64_t *slots, int64_t heads,
                        int64_t kv_heads, int64_t d, int cache_bf16, int io) {
    const kv_target t = {k_cache, v_cache, NULL, NULL, NULL, NULL, NULL, NULL, cache_bf16};
    norm_rope_write(qkv, rows, positions, cos_table, sin_table, d, NULL, NULL, 0.0f, q_out,
                    slots, heads, kv_heads, d, &t, io);
}

/* kvscope_rope_write with two family options. q_norm, k_norm: [d] float32 weights of a
 * per-head RMSNorm (eps) of every q and k head before RoPE (qwen3, gemma3), or NULL for none.
 * rot (even, <= d): only the first rot dims of a head turn, by Hugging Face's rotate_half over
 * that part, and the rest pass through (phi3's partial rotary); cos/sin are [positions, rot]. */
void kvscope_norm_rope_write(const void *qkv, int64_t rows, const int64_t *positions,
                             const float *cos_table, const float *sin_table, int64_t rot,
                             const float *q_norm, const float *k_norm, float eps, float *q_out,
                             void *k_cache, void *v_cache, const int64_t *slots, int64_t heads,
                             int64_t kv_heads, int64_t d, int cache_bf16, int io) {
    const kv_target t = {k_cache, v_cache, NULL, NULL, NULL, NULL, NULL, NULL, cache_bf16};
    norm_rope_write(qkv, rows, positions, cos_table, sin_table, rot, q_norm, k_norm, eps,
                    q_out, slots, heads, kv_heads, d, &t, io);
}

/* kvscope_norm_rope_write into any pool the fused decode takes (engine/model/fused/decode.py):
 * kind 0 float32, 1 bfloat16, 3 int8, 4 fp8 e4m3 (k_scale, v_scale: the pool's [slots,
 * kv_heads] float32 scales, NULL for the float kinds); R [d, d]: the pool's rotation (NULL:
 * none); shift, gain, q_gain [kv_heads, d]: its K balance (all NULL: none). K is stored as
 * ((k - shift) * gain) @ R, V as v @ R, and q_out holds (q * q_gain) @ R. */
void kvscope_rope_write_kv(const void *qkv, int64_t rows, const int64_t *positions,
                           const float *cos_table, const float *sin_table, int64_t rot,
                           const float *q_norm, const float *k_norm, float eps, float *q_out,
                           void *k_cache, void *v_cache, float *k_scale, float *v_scale,
                           const int64_t *slots, int64_t heads, int64_t kv_heads, int64_t d,
                           int kind, int io, const float *R, const float *shift,
                           const float *gain, const float *q_gain) {
    const kv_target t = {k_cache, v_cache, k_scale, v_scale, R, shift, gain, q_gain, kind};
    norm_rope_write(qkv, rows, positions, cos_table, sin_table, rot, q_norm, k_norm, eps,
                    q_out, slots, heads, kv_heads, d, &t, io);
}
