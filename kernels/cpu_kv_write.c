/* A step's new K or V rows into a paged pool on the CPU, with the pool's transforms: the
 * exact K shift and balance ((x - c) * g, kernels/k_balance.py), the rotation (x @ R,
 * kernels/rotation.py), then, for a 1-byte pool, one absmax scale per (slot, KV head) and
 * int8 or fp8 e4m3 codes, as kernels/quant.py computes them. The torch path is a dozen small
 * ops per layer for K and V (12 % of an int8 decode step at 16 sequences); here it is one
 * call each. kvscope_kv_store is the one-row form the fused decode's RoPE call
 * (kernels/cpu_decode_glue.c) stores through, so both paths write the same bits.
 *
 * rows: [T, H, d] float32; slots[t]: the flat slot of row t (block * block_size + offset), a
 * negative slot is skipped; cache: [slots, H, d] of `kind` (KV_* below); scales: [slots, H]
 * float32 (1-byte kinds; else unused); R: [d, d] float32 or NULL; shift, gain: [H, d]
 * float32 or NULL (both or neither). d <= 1024.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_glue.h"
#include "cpu_vec.h"

#define MAX_D 1024
/* The storage kinds, numbered as kernels/cpu_decode_attention.c and kernels.cpu_attention
 * number them. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 3, KV_FP8 = 4 };

/* y = a @ R for head_dim 64, the product held in four vector registers. */
static void rotate64(float *y, const float *a, const float *R) {
    v16f acc[4] = {{0}};
    for (int i = 0; i < 64; i++) {
        const float ai = a[i];
        for (int k = 0; k < 4; k++) acc[k] += ai * *(const v16f_u *)(R + i * 64 + 16 * k);
    }
    for (int k = 0; k < 4; k++) *(v16f_u *)(y + 16 * k) = acc[k];
}

/* y = a @ R, [d] by [d, d] (y must not be a). */
void kvscope_rotate_row(float *y, const float *a, const float *R, int64_t d) {
    if (d == 64) {
        rotate64(y, a, R);
        return;
    }
    for (int64_t j = 0; j < d; j++) y[j] = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        const float ai = a[i], *r = R + i * d;
        for (int64_t j = 0; j < d; j++) y[j] += ai * r[j];
    }
}

/* out = x @ R per row of d values, n rows, out float32 (io 0) or bfloat16 (io 1): the
 * attention output of a rotated pool turned back (R is then the rotation's transpose), in
 * the matmul's row dtype. */
void kvscope_rotate_rows(const float *x, int64_t n, int64_t d, const float *R, void *out,
                         int io) {
    float y[MAX_D];
    for (int64_t r = 0; r < n; r++) {
        kvscope_rotate_row(y, x + r * d, R, d);
        if (!io) {
            memcpy((float *)out + r * d, y, sizeof(float) * (size_t)d);
            continue;
        }
        uint16_t *b = (uint16_t *)out + r * d;
        for (int64_t i = 0; i < d; i++) b[i] = f32_to_bf16(y[i]);
    }
}

/* |y| <= 448 (the quantizer clamps) as an fp8 e4m3fn code, rounded to nearest even as torch's
 * conversion rounds. Below 2^-6 the code is the value in steps of 2^-9 (the subnormals, and
 * 8 is 2^-6, the first normal); above, the float's exponent and top 3 mantissa bits rounded
 * in place, the bias moved from 127 to 7 (a carry out of the mantissa bumps the exponent). */
static inline uint8_t f32_to_fp8(float y) {
    uint32_t u;
    memcpy(&u, &y, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(y);
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);
    memcpy(&u, &a, 4);
    u += 0x7ffffu + ((u >> 20) & 1u);
    return sign | (uint8_t)((u >> 20) - ((127u - 7u) << 3));
}

/* One row x [d] of KV head h into cache row `at` (slot * H + h): shifted and balanced by
 * the head's shift/gain rows, rotated by R, then stored as `kind`. */
void kvscope_kv_store(const float *x, int64_t h, int64_t d, const float *R,
                      const float *shift, const float *gain, int kind, void *cache,
                      float *scales, int64_t at) {
    float a[MAX_D], r[MAX_D];
    const float *y = x;
    if (shift) {
        for (int64_t i = 0; i < d; i++) a[i] = (x[i] - shift[h * d + i]) * gain[h * d + i];
        y = a;
    }
    if (R) {
        kvscope_rotate_row(r, y, R, d);
        y = r;
    }
    if (kind == KV_F32) {
        memcpy((float *)cache + at * d, y, sizeof(float) * (size_t)d);
        return;
    }
    if (kind == KV_BF16) {
        uint16_t *out = (uint16_t *)cache + at * d;
        for (int64_t j = 0; j < d; j++) out[j] = f32_to_bf16(y[j]);
        return;
    }
    float m = 0.0f;  /* plain compares: fmaxf is a libm call per element here */
    for (int64_t j = 0; j < d; j++) {
        float v = y[j] < 0.0f ? -y[j] : y[j];
        m = v > m ? v : m;
    }
    const float qmax = kind == KV_I8 ? 127.0f : 448.0f;
    float scale = m / qmax > 1e-8f ? m / qmax : 1e-8f;
    scales[at] = scale;
    if (kind == KV_I8) {
        int8_t *out = (int8_t *)cache + at * d;
        for (int64_t j = 0; j < d; j++) {
            float q = nearbyintf(y[j] / scale);  /* ties to even, as torch.round */
            out[j] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        return;
    }
    uint8_t *out = (uint8_t *)cache + at * d;
    for (int64_t j = 0; j < d; j++) {
        float q = y[j] / scale;
        out[j] = f32_to_fp8(q > 448.0f ? 448.0f : q < -448.0f ? -448.0f : q);
    }
}

void kvscope_kv_write(const float *rows, int64_t num_rows, int64_t num_heads, int64_t d,
                      const int64_t *slots, void *cache, float *scales, const float *R,
                      const float *shift, const float *gain, int kind) {
    for (int64_t t = 0; t < num_rows; t++) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < num_heads; h++)
            kvscope_kv_store(rows + (t * num_heads + h) * d, h, d, R, shift, gain, kind, cache,
                             scales, slots[t] * num_heads + h);
    }
}
