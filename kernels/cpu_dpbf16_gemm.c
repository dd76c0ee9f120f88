/* y = x W^T for bfloat16 weights on AVX-512 BF16 dot products (VDPBF16PS), for the few rows
 * of a decode or mixed step on a CPU that has them but no AMX tiles (an AMD EPYC with
 * AVX-512 BF16; kernels/cpu_small_gemm.c calls it where kernels/cpu_amx_gemm.c does not
 * apply).
 *
 * Why: widened to float32 a bfloat16 weight costs a conversion per 16 values and a float32
 * FMA per product; one VDPBF16PS takes 32 bfloat16 products of a weight row and an input row
 * straight from memory into 16 float32 sums. The weight is read as it lies ([N, K], torch's
 * Linear layout); the input rows are the bfloat16 values the caller widened (exact), taken
 * back to bfloat16 once per call. A tile of up to 6 input rows against 4 weight rows, the
 * groups of 4 shared out over the calling region's threads (cpu_team.h), the next group
 * prefetched. Every output is the same chain of dot products in input order and one fixed
 * reduction whatever the row count or thread split, so a row rounds the same in any batch.
 * VDPBF16PS flushes subnormal inputs and sums to zero, as the AMX tiles and torch's bf16 paths
 * do.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"
#include "cpu_vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)

#define MT_MAX 6

#define DTILE(MT, R)                                                                        \
    static void dtile_##MT##_##R(void *y, int y_bf16, int64_t N, const uint16_t *x,         \
                                 const uint16_t *w, const float *bias, int64_t K, int64_t n, \
                                 const char *pf) {                                           \
        __m512 acc[MT][R];                                                                  \
        for (int m = 0; m < MT; m++)                                                        \
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();                    \
        for (int64_t k = 0; k < K; k += 32) {                                               \
            if (pf)                                                                         \
                for (int r = 0; r < R; r++) __builtin_prefetch(pf + (r * K + k) * 2, 0, 2); \
            __m512i wv[R];                                                                  \
            for (int r = 0; r < R; r++) wv[r] = _mm512_loadu_si512(w + r * K + k);          \
            for (int m = 0; m < MT; m++) {                                                  \
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);                  \
                for (int r = 0; r < R; r++)                                                 \
                    acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, (__m512bh)wv[r]);           \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; r++) {                                                       \
            float b = bias ? bias[n + r] : 0.0f;                                            \
            for (int m = 0; m < MT; m++) {                                                  \
                float v = _mm512_reduce_add_ps(acc[m][r]) + b;                              \
                if (y_bf16) ((uint16_t *)y)[m * N + n + r] = f32_to_bf16(v);                \
                else ((float *)y)[m * N + n + r] = v;                                       \
            }                                                                               \
        }                                                                                   \
    }

#define DTILES(MT) DTILE(MT, 4) DTILE(MT, 1)
DTILES(1) DTILES(2) DTILES(3) DTILES(4) DTILES(5) DTILES(6)

typedef void (*dtile_fn)(void *, int, int64_t, const uint16_t *, const uint16_t *,
                         const float *, int64_t, int64_t, const char *);
static const dtile_fn dtiles4[] = {0, dtile_1_4, dtile_2_4, dtile_3_4, dtile_4_4, dtile_5_4,
                                   dtile_6_4};
static const dtile_fn dtiles1[] = {0, dtile_1_1, dtile_2_1, dtile_3_1, dtile_4_1, dtile_5_1,
                                   dtile_6_1};

int kvscope_dpbf16_fits(int64_t K) { return K % 32 == 0; }

void kvscope_dpbf16_team(void *y, int y_bf16, const float *xf, const uint16_t *w,
                         const float *bias, int64_t M, int64_t N, int64_t K, int *status) {
    const int64_t groups = (N + 3) / 4;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (!xb) {
#pragma omp atomic write
        *status = 1;
    } else {
        for (int64_t i = 0; i < M * K; i++) {
            uint32_t u;
            memcpy(&u, xf + i, 4);
            xb[i] = (uint16_t)(u >> 16); /* xf holds bfloat16 values exactly */
        }
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        if (!xb) continue;
        const int64_t n = 4 * g, rows = N - n < 4 ? N - n : 4;
        const uint16_t *wg = w + n * K;
        const char *pf = g + 1 < groups ? (const char *)(wg + 4 * K) : NULL;
        for (int64_t m = 0; m < M; m += MT_MAX) {
            const int64_t mt = M - m < MT_MAX ? M - m : MT_MAX;
            char *ym = (char *)y + (size_t)(m * N) * (y_bf16 ? 2 : 4);
            if (rows == 4) {
                dtiles4[mt](ym, y_bf16, N, xb + m * K, wg, bias, K, n, m == 0 ? pf : NULL);
            } else {
                for (int64_t r = 0; r < rows; r++)
                    dtiles1[mt](ym, y_bf16, N, xb + m * K, wg + r * K, bias, K, n + r, NULL);
            }
        }
    }
    free(xb);
}

#else

int kvscope_dpbf16_fits(int64_t K) {
    (void)K;
    return 0;
}

void kvscope_dpbf16_team(void *y, int y_bf16, const float *xf, const uint16_t *w,
                         const float *bias, int64_t M, int64_t N, int64_t K, int *status) {
    (void)y, (void)y_bf16, (void)xf, (void)w, (void)bias, (void)M, (void)N, (void)K;
    *status = 1; /* never called: kvscope_dpbf16_fits is 0 here */
}

#endif
