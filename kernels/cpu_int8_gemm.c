/* y = x W^T on the CPU for int8 weights (engine/model/weight_formats.Int8Linear): codes in
 * -127..127 with one float32 scale per 32 inputs of an output (GGUF's Q8_0 blocks), read in
 * place, one pass over the weight a call.
 *
 * Why a kernel of its own: int8 had run as two 4-bit halves on the int4 kernel, twice the
 * dequantization work for the same bytes and a bfloat16 sum of the halves, and off the fused
 * decode step altogether. Here a code is widened to float and multiplied into a per-group sum
 * (one fused multiply-add a weight), and the group's sum is scaled into the output once per
 * 32 inputs.
 *
 * Layout (kernels/cpu_int8.py packs it): blocks of 16 outputs, codes [N / 16, K, 16] (the 16
 * outputs' codes of one input side by side, so a vector load reads 8 outputs at one input, for
 * any vector width), scales [N / 16, K / 32, 16].
 *
 * Arithmetic, the same whatever the tile, thread split, row count or vector width: for each
 * output, per group g, p = sum over its 32 inputs in order of x_k * code_k (an FMA chain from
 * 0), then y = y + p * scale_g (an FMA, from y = 0, groups in order). So a row's result does
 * not depend on what else is in the call (a speculative verify's rows round as plain decodes
 * do), and the parallel and serial runs give the same bits. The input rows are float32 (a
 * bfloat16 row is widened exactly); no rounding of the input.
 *
 * Speed: one row is a dot product per output, and an FMA chain waits for the one before
 * (4-5 cycles): a tile keeps 8 chains of 8 outputs in flight (one row: 4 blocks at once, two
 * rows: 2, more rows: 1 block by up to 4 rows), which is what two FMA ports need to stay busy.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"
#include "cpu_vec.h"

#define I8_BLOCK 16
#define I8_GROUP 32
enum { I8_F32 = 0, I8_BF16 = 1 };

typedef int8_t v8sb __attribute__((vector_size(8)));

/* 8 int8 codes as floats (the widening instructions where there are some: GCC 12 lowers
 * the portable conversion from int8 lanes to scalar ones, see cpu_vec.h). */
static inline __attribute__((always_inline)) v8f i8x8_to_f32(const int8_t *src) {
#if defined(__AVX2__)
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
#else
    v8sb b;
    memcpy(&b, src, 8);
    return __builtin_convertvector(b, v8f);
#endif
}

static inline __attribute__((always_inline)) void store8(void *y, int y_kind, int64_t at,
                                                         v8f v) {
    if (y_kind == I8_F32) {
        memcpy((float *)y + at, &v, 32);
        return;
    }
    for (int i = 0; i < 8; i++) ((uint16_t *)y)[at + i] = f32_to_bf16(v[i]);
}

/* MT rows of x (float32, stride K) against NB consecutive blocks starting at block b0
 * (2 NB vectors of 8 outputs). The group sums p stay in registers; the running outputs are
 * touched once a group. */
#define I8_TILE(MT, NB)                                                                      \
    static void i8_tile_##MT##_##NB(void *y, int y_kind, int64_t N, const float *x,          \
                                    int64_t K, const int8_t *codes, const float *scales,    \
                                    int64_t b0) {                                           \
        enum { J = 2 * NB };                                                                \
        const int64_t groups = K / I8_GROUP;                                                \
        v8f tot[MT][J];                                                                     \
        for (int m = 0; m < MT; m++)                                                        \
            for (int j = 0; j < J; j++) tot[m][j] = (v8f){0};                               \
        for (int64_t g = 0; g < groups; g++) {                                              \
            v8f p[MT][J];                                                                   \
            for (int m = 0; m < MT; m++)                                                    \
                for (int j = 0; j < J; j++) p[m][j] = (v8f){0};                             \
            for (int64_t k = g * I8_GROUP; k < (g + 1) * I8_GROUP; k++) {                   \
                for (int j = 0; j < J; j++) {                                               \
                    const v8f w = i8x8_to_f32(codes + ((b0 + j / 2) * K + k) * I8_BLOCK     \
                                              + 8 * (j % 2));                               \
                    for (int m = 0; m < MT; m++) p[m][j] = p[m][j] + x[m * K + k] * w;      \
                }                                                                           \
            }                                                                               \
            for (int j = 0; j < J; j++) {                                                   \
                v8f s;                                                                      \
                memcpy(&s, scales + ((b0 + j / 2) * groups + g) * I8_BLOCK + 8 * (j % 2),   \
                       32);                                                                 \
                for (int m = 0; m < MT; m++) tot[m][j] = tot[m][j] + p[m][j] * s;           \
            }                                                                               \
        }                                                                                   \
        for (int m = 0; m < MT; m++)                                                        \
            for (int j = 0; j < J; j++)                                                     \
                store8(y, y_kind, m * N + (b0 + j / 2) * I8_BLOCK + 8 * (j % 2), tot[m][j]); \
    }
I8_TILE(1, 4) I8_TILE(2, 2) I8_TILE(1, 1) I8_TILE(2, 1) I8_TILE(3, 1) I8_TILE(4, 1)
typedef void (*i8_tile_fn)(void *, int, int64_t, const float *, int64_t, const int8_t *,
                           const float *, int64_t);
static const i8_tile_fn one_block[] = {0, i8_tile_1_1, i8_tile_2_1, i8_tile_3_1, i8_tile_4_1};
#define I8_ROWS_MAX 4

#if defined(__AVX512F__)
/* With 32 vector registers of 16 floats: a block's 16 outputs are one vector, and a tile
 * takes up to 8 rows (8 group sums, 8 outputs, the weight and the input in registers), so a
 * batch's rows convert each code once per 8 rows instead of once per 4, at half the
 * instructions a code. One row: 8 blocks, two rows: 4 (8 chains). The same chain per output
 * as the 8-wide tiles: the same bits. */
#define I16_TILE(MT, NB)                                                                     \
    static void i16_tile_##MT##_##NB(void *y, int y_kind, int64_t N, const float *x,         \
                                     int64_t K, const int8_t *codes, const float *scales,   \
                                     int64_t b0) {                                          \
        const int64_t groups = K / I8_GROUP;                                                \
        v16f tot[MT][NB];                                                                   \
        for (int m = 0; m < MT; m++)                                                        \
            for (int j = 0; j < NB; j++) tot[m][j] = (v16f){0};                             \
        for (int64_t g = 0; g < groups; g++) {                                              \
            v16f p[MT][NB];                                                                 \
            for (int m = 0; m < MT; m++)                                                    \
                for (int j = 0; j < NB; j++) p[m][j] = (v16f){0};                           \
            for (int64_t k = g * I8_GROUP; k < (g + 1) * I8_GROUP; k++) {                   \
                for (int j = 0; j < NB; j++) {                                              \
                    const v16f w = i8x16_to_f32(codes + ((b0 + j) * K + k) * I8_BLOCK);     \
                    for (int m = 0; m < MT; m++) p[m][j] = p[m][j] + x[m * K + k] * w;      \
                }                                                                           \
            }                                                                               \
            for (int j = 0; j < NB; j++) {                                                  \
                v16f s;                                                                     \
                memcpy(&s, scales + ((b0 + j) * groups + g) * I8_BLOCK, 64);                \
                for (int m = 0; m < MT; m++) tot[m][j] = tot[m][j] + p[m][j] * s;           \
            }                                                                               \
        }                                                                                   \
        for (int m = 0; m < MT; m++)                                                        \
            for (int j = 0; j < NB; j++) {                                                  \
                const int64_t at = m * N + (b0 + j) * I8_BLOCK;                             \
                if (y_kind == I8_F32) memcpy((float *)y + at, &tot[m][j], 64);              \
                else store_bf16x16((uint16_t *)y + at, tot[m][j]);                          \
            }                                                                               \
    }
I16_TILE(1, 8) I16_TILE(2, 4) I16_TILE(1, 1) I16_TILE(2, 1) I16_TILE(3, 1) I16_TILE(4, 1)
I16_TILE(5, 1) I16_TILE(6, 1) I16_TILE(7, 1) I16_TILE(8, 1)
static const i8_tile_fn wide_block[] = {0, i16_tile_1_1, i16_tile_2_1, i16_tile_3_1,
                                        i16_tile_4_1, i16_tile_5_1, i16_tile_6_1,
                                        i16_tile_7_1, i16_tile_8_1};
#define I16_ROWS_MAX 8

static void team16(void *y, int y_kind, const float *xf, const int8_t *codes,
                   const float *scales, int64_t M, int64_t N, int64_t K) {
    const size_t y_size = y_kind == I8_F32 ? 4 : 2;
    const int64_t blocks = N / I8_BLOCK;
    const int64_t nb = M == 1 ? 8 : M == 2 ? 4 : 1;
    const int64_t units = (blocks + nb - 1) / nb;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b0 = u * nb;
        if (nb == 8 && b0 + 8 <= blocks) {
            i16_tile_1_8(y, y_kind, N, xf, K, codes, scales, b0);
            continue;
        }
        if (nb == 4 && b0 + 4 <= blocks) {
            i16_tile_2_4(y, y_kind, N, xf, K, codes, scales, b0);
            continue;
        }
        for (int64_t b = b0; b < b0 + nb && b < blocks; b++) {
            const int64_t tiles = (M + I16_ROWS_MAX - 1) / I16_ROWS_MAX;
            const int64_t size = (M + tiles - 1) / tiles;
            for (int64_t m = 0; m < M; m += size) {
                const int64_t mt = M - m < size ? M - m : size;
                wide_block[mt]((char *)y + (size_t)(m * N) * y_size, y_kind, N, xf + m * K, K,
                               codes, scales, b);
            }
        }
    }
}
#endif

/* 8-wide: the blocks of 16 outputs NB at a time (NB: 4 for one row, 2 for two, else 1). */
static __attribute__((unused)) void team8(void *y, int y_kind, const float *xf,
                                          const int8_t *codes, const float *scales, int64_t M,
                                          int64_t N, int64_t K) {
    const size_t y_size = y_kind == I8_F32 ? 4 : 2;
    const int64_t blocks = N / I8_BLOCK;
    const int64_t nb = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int64_t units = (blocks + nb - 1) / nb;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
        const int64_t b0 = u * nb;
        if (nb == 4 && b0 + 4 <= blocks) {
            i8_tile_1_4(y, y_kind, N, xf, K, codes, scales, b0);
            continue;
        }
        if (nb == 2 && b0 + 2 <= blocks) {
            i8_tile_2_2(y, y_kind, N, xf, K, codes, scales, b0);
            continue;
        }
        for (int64_t b = b0; b < b0 + nb && b < blocks; b++) {
            /* row tiles of as even a size as I8_ROWS_MAX allows (6 rows: 3 and 3) */
            const int64_t tiles = (M + I8_ROWS_MAX - 1) / I8_ROWS_MAX;
            const int64_t size = (M + tiles - 1) / tiles;
            for (int64_t m = 0; m < M; m += size) {
                const int64_t mt = M - m < size ? M - m : size;
                one_block[mt]((char *)y + (size_t)(m * N) * y_size, y_kind, N, xf + m * K, K,
                              codes, scales, b);
            }
        }
    }
}

/* The blocks shared out over the calling region's threads (cpu_team.h); xf [M, K] float32. */
void kvscope_int8_team(void *y, int y_kind, const float *xf, const int8_t *codes,
                       const float *scales, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512F__)
    team16(y, y_kind, xf, codes, scales, M, N, K);
#else
    team8(y, y_kind, xf, codes, scales, M, N, K);
#endif
}

/* y [M, N] (y_kind: 0 float32, 1 bfloat16) = x [M, K] (x_kind the same) W^T; N a multiple
 * of 16, K of 32. parallel: the blocks shared out over torch's threads (the library binds
 * to torch's libgomp), else on the calling thread. Returns 1 if scratch could not be had. */
int kvscope_int8_gemm(void *y, int y_kind, const void *x, int x_kind, const int8_t *codes,
                      const float *scales, int64_t M, int64_t N, int64_t K, int parallel) {
    if (M == 0) return 0;
    const float *xf = x;
    float *widened = NULL;
    if (x_kind == I8_BF16) {
        widened = malloc(sizeof(float) * (size_t)(M * K));
        if (!widened) return 1;
        kvscope_gemm_widen_rows(widened, x, x_kind, M * K);
        xf = widened;
    }
#pragma omp parallel if (parallel)
    kvscope_int8_team(y, y_kind, xf, codes, scales, M, N, K);
    free(widened);
    return 0;
}

/* The weight dequantized to bfloat16 rows, out [N, K] = code * scale rounded, for torch's
 * blocked matmul on a prefill chunk (kernels/cpu_int8.py: a measured candidate from 256 rows
 * up, where AMX or AVX-512 BF16 outrun this file's float32 FMAs). One pass over the codes,
 * shared over torch's threads. */
void kvscope_int8_dequant_bf16(uint16_t *out, const int8_t *codes, const float *scales,
                               int64_t N, int64_t K) {
    const int64_t blocks = N / I8_BLOCK, groups = K / I8_GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t k = g * I8_GROUP; k < (g + 1) * I8_GROUP; k++)
                for (int64_t j = 0; j < I8_BLOCK; j++)
                    out[(b * I8_BLOCK + j) * K + k] = f32_to_bf16(
                        (float)codes[(b * K + k) * I8_BLOCK + j]
                        * scales[(b * groups + g) * I8_BLOCK + j]);
}
