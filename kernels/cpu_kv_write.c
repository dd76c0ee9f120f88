/* A step's new K or V rows into an int8 paged pool on the CPU, with the pool's transforms:
 * the exact K shift and balance ((x - c) * g, kernels/k_balance.py), the rotation (x @ R,
 * kernels/rotation.py), then one absmax scale per (slot, KV head) and int8 codes, as
 * kernels/quant.py computes them. The torch path is a dozen small ops per layer for K and V
 * (12 % of an int8 decode step at 16 sequences); here it is one call each.
 *
 * rows: [T, H, d] float32; slots[t]: the flat slot of row t (block * block_size + offset), a
 * negative slot is skipped; cache: [slots, H, d] int8; scales: [slots, H] float32; R: [d, d]
 * float32 or NULL; shift, gain: [H, d] float32 or NULL (both or neither). d <= 1024.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_vec.h"

#define MAX_D 1024

/* y = a @ R for head_dim 64, the product held in four vector registers. */
static void rotate64(float *y, const float *a, const float *R) {
    v16f acc[4] = {{0}};
    for (int i = 0; i < 64; i++) {
        const float ai = a[i];
        for (int k = 0; k < 4; k++) acc[k] += ai * *(const v16f_u *)(R + i * 64 + 16 * k);
    }
    for (int k = 0; k < 4; k++) *(v16f_u *)(y + 16 * k) = acc[k];
}

void kvscope_int8_write(const float *rows, int64_t num_rows, int64_t num_heads, int64_t d,
                        const int64_t *slots, int8_t *cache, float *scales, const float *R,
                        const float *shift, const float *gain) {
    for (int64_t t = 0; t < num_rows; t++) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *x = rows + (t * num_heads + h) * d;
            float a[MAX_D], y[MAX_D];
            for (int64_t i = 0; i < d; i++)
                a[i] = shift ? (x[i] - shift[h * d + i]) * gain[h * d + i] : x[i];
            if (R && d == 64) {
                rotate64(y, a, R);
            } else if (R) {
                for (int64_t j = 0; j < d; j++) y[j] = 0.0f;
                for (int64_t i = 0; i < d; i++) {
                    const float ai = a[i], *r = R + i * d;
                    for (int64_t j = 0; j < d; j++) y[j] += ai * r[j];
                }
            } else {
                for (int64_t j = 0; j < d; j++) y[j] = a[j];
            }
            float m = 0.0f;  /* plain compares: fmaxf is a libm call per element here */
            for (int64_t j = 0; j < d; j++) {
                float v = y[j] < 0.0f ? -y[j] : y[j];
                m = v > m ? v : m;
            }
            float scale = m / 127.0f > 1e-8f ? m / 127.0f : 1e-8f;
            int64_t at = slots[t] * num_heads + h;
            scales[at] = scale;
            int8_t *out = cache + at * d;
            for (int64_t j = 0; j < d; j++) {
                float q = nearbyintf(y[j] / scale);  /* ties to even, as torch.round */
                out[j] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
            }
        }
    }
}
