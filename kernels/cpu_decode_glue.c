/* The elementwise work between the matmuls of a CPU decode step, fused: what torch runs as
 * five to fifteen small ops per step of a layer (each a dispatch, an allocation and a pass
 * over memory) is one call here. Used by engine/fused_decode.py for 4-bit weights with a
 * float32 residual stream, whose matmuls take and give bfloat16 (stored as uint16 here).
 * Built with kernels/cpu_decode_attention.c into one library (kernels/native.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* out = bf16(w * (h * rsqrt(mean(h^2) + eps))) per row, Hugging Face's RMSNorm order. If
 * y is not NULL, h += y (a bfloat16 matmul output) first, in place: the residual add. */
void kvscope_add_rms_norm_bf16(float *h, const uint16_t *y, const float *w, float eps,
                               uint16_t *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n;
        if (y) {
            const uint16_t *yr = y + r * n;
            for (int64_t i = 0; i < n; i++) x[i] += bf16_to_f32(yr[i]);
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(w[i] * (x[i] * inv));
    }
}

/* h += y: the last layer's residual add before the final norm. */
void kvscope_add_bf16(float *h, const uint16_t *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) h[i] += bf16_to_f32(y[i]);
}

/* out[r] = bf16(silu(gate) * up), gate_up[r] = [gate (inter) | up (inter)]. */
void kvscope_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows,
                           int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(x / (1.0f + expf(-x)) * bf16_to_f32(u[i]));
        }
    }
}

/* For each row (one decoding sequence): q and k of qkv (bfloat16) turned by RoPE at its
 * position, q to q_out [rows, heads, d] float32, k and v into the cache slot (float32 when
 * cache_bf16 is 0, else bfloat16). cos/sin: [positions, d] float32, sin with its first half
 * negated (x * cos + roll(x, d/2) * sin is Hugging Face's rotate_half form). */
void kvscope_rope_write(const uint16_t *qkv, int64_t rows, const int64_t *positions,
                        const float *cos_table, const float *sin_table, float *q_out,
                        void *k_cache, void *v_cache, const int64_t *slots, int64_t heads,
                        int64_t kv_heads, int64_t d, int cache_bf16) {
    const int64_t half = d / 2, width = (heads + 2 * kv_heads) * d;
    float rot[1024];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = qkv + r * width;
        const float *c = cos_table + positions[r] * d, *s = sin_table + positions[r] * d;
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            const uint16_t *x = row + hd * d;
            for (int64_t i = 0; i < d; i++) {
                float xi = bf16_to_f32(x[i]), xr = bf16_to_f32(x[(i + half) % d]);
                rot[i] = xi * c[i] + xr * s[i];
            }
            if (hd < heads) {
                memcpy(q_out + (r * heads + hd) * d, rot, sizeof(float) * (size_t)d);
                continue;
            }
            int64_t at = (slots[r] * kv_heads + (hd - heads)) * d;
            if (cache_bf16) {
                for (int64_t i = 0; i < d; i++) ((uint16_t *)k_cache)[at + i] = f32_to_bf16(rot[i]);
            } else {
                memcpy((float *)k_cache + at, rot, sizeof(float) * (size_t)d);
            }
        }
        for (int64_t hd = 0; hd < kv_heads; hd++) {
            const uint16_t *x = row + (heads + kv_heads + hd) * d;
            int64_t at = (slots[r] * kv_heads + hd) * d;
            for (int64_t i = 0; i < d; i++) {
                if (cache_bf16) ((uint16_t *)v_cache)[at + i] = x[i];
                else ((float *)v_cache)[at + i] = bf16_to_f32(x[i]);
            }
        }
    }
}
