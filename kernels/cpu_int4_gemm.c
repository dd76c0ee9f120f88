/* y = x W^T on the CPU for 4-bit weights (engine/weight_formats.Int4Linear), read from the
 * very tensors torch's `_weight_int4pack_mm_for_cpu` takes, with its math: the input
 * rounded to bfloat16, each weight (code - 8) * scale + zero from a bfloat16 scale and zero
 * per 32 inputs, float32 sums, the output rounded to bfloat16. Every output is the same chain
 * of fused multiply-adds over the inputs in order as torch's, so the two give the same bits
 * (tests/kernels/test_cpu_int4.py) and which one runs is a matter of speed only
 * (kernels/cpu_int4.py measures it).
 *
 * Why: torch's kernel pays the dequantization again for every few input rows; 5 rows (a
 * speculative verify of 4 drafts) cost 2.5-3.5x one row on the SmolLM2 shapes. Here a tile
 * of up to 12 rows shares each dequantized weight from registers.
 *
 * torch's CPU layout (as `_convert_weight_to_int4pack_for_cpu(codes, 1)` writes it, for
 * N a multiple of 64) depends on the vector width torch's kernel was dispatched to: blocks of
 * B outputs, [N / B, K, B / 2] bytes, byte j of input k holding output j in its low nibble
 * and output j + B / 2 in its high one, with B = 64 under AVX-512 and 32 under AVX2
 * (kernels/cpu_int4.py asks torch which, once per process, and passes it in); scale_zero
 * [K / 32, N, 2] bfloat16, (scale, zero) per group and output. A 16-wide vector here is 16
 * outputs at one input, times the input broadcast: for B = 64, bytes 0-15 give outputs 0-15
 * and 32-47, bytes 16-31 outputs 16-31 and 48-63. Without AVX-512 (16 vector registers, where
 * the 16-wide tiles spilled their accumulators and ran 10x slower than torch), and for B = 32,
 * the tiles are 8 outputs wide: bytes 8p..8p+7 give outputs 8p.. and B / 2 + 8p...
 *
 * A row's result does not depend on what else is in the call (its chain is the same for any
 * row count, tile or thread split): a speculative verify's rows round as the plain decodes
 * of the same positions.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"
#include "cpu_vec.h"

typedef uint8_t v16ub __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));

enum { I4_F32 = 0, I4_BF16 = 1 };
#define MT_MAX 12
#define GROUP 32
#define BLOCK 64

/* 16 bytes as 16 int32 lanes. */
static inline __attribute__((always_inline)) v16i u8x16_to_i32(const uint8_t *src) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
#elif defined(__AVX2__)
    __m128i v = _mm_loadu_si128((const __m128i *)src);
    v8i lo = (v8i)_mm256_cvtepu8_epi32(v), hi = (v8i)_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v16ub b;
    memcpy(&b, src, 16);
    return __builtin_convertvector(b, v16i);
#endif
}

/* Scale s and zero - 8 scale of 16 consecutive outputs from their (scale, zero) pairs. */
static inline __attribute__((always_inline)) void group_scales(v16f *s, v16f *z8,
                                                               const uint16_t *pairs) {
    v16u u;
    memcpy(&u, pairs, 64);
    v16u lo = u << 16, hi = u & 0xffff0000u;
    memcpy(s, &lo, 64);
    v16f z;
    memcpy(&z, &hi, 64);
    *z8 = z - 8.0f * *s;
}

static inline __attribute__((always_inline)) void store_out(void *y, int y_kind, int64_t at,
                                                            v16f v) {
    if (y_kind == I4_F32) *(v16f_u *)((float *)y + at) = v;
    else store_bf16x16((uint16_t *)y + at, v);
}

/* Asks for the next group's codes and scales while this one is computed. A decode step
 * reads every layer's weights once, so they come from memory, not cache: the codes stream
 * (the hardware prefetcher follows them within a page), but a group's scales lie N * 4 bytes
 * after the previous group's, one miss each, waited for at the top of every group. After the
 * block's last group the next block's first follows (the blocks of one thread are
 * consecutive). */
static inline __attribute__((always_inline)) void prefetch_group(
        const uint8_t *codes, const uint16_t *sz, int64_t N, int64_t K, int64_t n0, int64_t g,
        int64_t hb) { /* hb: the block's bytes an input, B / 2 */
    const int64_t next = g + 1 < K / GROUP ? g + 1 : 0;
    const int64_t n = g + 1 < K / GROUP ? n0 : n0 + 2 * hb;
    const uint8_t *c = codes + (g + 1) * GROUP * hb;  /* past the block: the next block's */
    for (int64_t i = 0; i < GROUP * hb; i += 64) __builtin_prefetch(c + i, 0, 3);
    if (n >= N) return;
    const uint16_t *pairs = sz + (next * N + n) * 2;
    for (int64_t i = 0; i < 4 * hb; i += 32) __builtin_prefetch(pairs + i, 0, 3);
}

/* MT rows of x (float32 holding bfloat16 values, stride K) against a block's 64 outputs
 * starting at n0, or against half of them (HALF 0: bytes 0-15, outputs n0 + 0-15 and
 * n0 + 32-47; HALF 1: bytes 16-31, n0 + 16-31 and 48-63; HALF -1: all four tiles), in
 * registers. codes: the block's [K, 32] bytes; sz: scale_zero. */
#define TILES(MT, HALF, NAME)                                                                     \
    static void rows_##MT##_##NAME(void *y, int y_kind, int64_t N, const float *x,         \
                                   int64_t K, const uint8_t *codes, const uint16_t *sz,     \
                                   int64_t n0) {                                            \
        enum { H0 = HALF < 0 ? 0 : HALF, NH = HALF < 0 ? 2 : 1, NT = 2 * NH };              \
        /* tile j of this call: half H0 + j / 2, nibble j % 2 (outputs + 16 half + 32 nib) */ \
        v16f acc[MT][NT];                                                                   \
        for (int m = 0; m < MT; m++)                                                        \
            for (int j = 0; j < NT; j++) acc[m][j] = (v16f){0};                             \
        for (int64_t g = 0; g < K / GROUP; g++) {                                           \
            v16f s[NT], z8[NT];                                                             \
            for (int j = 0; j < NT; j++) {                                                  \
                int64_t n = n0 + 16 * (H0 + j / 2) + 32 * (j % 2);                          \
                group_scales(s + j, z8 + j, sz + (g * N + n) * 2);                          \
            }                                                                               \
            prefetch_group(codes, sz, N, K, n0, g, BLOCK / 2);                              \
            for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {                         \
                for (int h = 0; h < NH; h++) {                                              \
                    v16i b = u8x16_to_i32(codes + k * 32 + 16 * (H0 + h));                  \
                    v16f w0 = __builtin_convertvector(b & 15, v16f) * s[2 * h] + z8[2 * h]; \
                    v16f w1 = __builtin_convertvector(b >> 4, v16f) * s[2 * h + 1]          \
                              + z8[2 * h + 1];                                              \
                    for (int m = 0; m < MT; m++) {                                          \
                        acc[m][2 * h] = acc[m][2 * h] + x[m * K + k] * w0;                  \
                        acc[m][2 * h + 1] = acc[m][2 * h + 1] + x[m * K + k] * w1;          \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int m = 0; m < MT; m++)                                                        \
            for (int j = 0; j < NT; j++)                                                    \
                store_out(y, y_kind, m * N + n0 + 16 * (H0 + j / 2) + 32 * (j % 2),         \
                          acc[m][j]);                                                       \
    }
/* Up to 4 rows take the block's 4 tiles at once; 5 to MT_MAX rows its halves one after the
 * other (2 accumulators a row, plus 2 scales, 2 zeros and 2 weights: within 32 vector
 * registers up to 12 rows; the input is a broadcast memory operand). */
#define HALVES(MT) TILES(MT, 0, lo) TILES(MT, 1, hi)
TILES(1, -1, all) TILES(2, -1, all) TILES(3, -1, all) TILES(4, -1, all)
HALVES(5) HALVES(6) HALVES(7) HALVES(8) HALVES(9) HALVES(10) HALVES(11) HALVES(12)
typedef void (*rows_fn)(void *, int, int64_t, const float *, int64_t, const uint8_t *,
                        const uint16_t *, int64_t);
static const rows_fn whole[] = {0, rows_1_all, rows_2_all, rows_3_all, rows_4_all};
#define PAIR(MT) {rows_##MT##_lo, rows_##MT##_hi}
static const rows_fn halves[][2] = {PAIR(5), PAIR(6), PAIR(7), PAIR(8), PAIR(9), PAIR(10),
                                    PAIR(11), PAIR(12)};

/* -- 8 outputs a tile: any block width, and every CPU without AVX-512 ------------------- */
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint8_t v8ub __attribute__((vector_size(8)));
#define MT8_MAX 4 /* 2 accumulators a row, 2 scales, 2 zeros, 2 weights: 16 registers */

/* 8 bytes as 8 int32 lanes. */
static inline __attribute__((always_inline)) v8i u8x8_to_i32(const uint8_t *src) {
#if defined(__AVX2__)
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
#else
    v8ub b;
    memcpy(&b, src, 8);
    return __builtin_convertvector(b, v8i);
#endif
}

/* group_scales for 8 consecutive outputs. */
static inline __attribute__((always_inline)) void group_scales8(v8f *s, v8f *z8,
                                                                const uint16_t *pairs) {
    v8u u;
    memcpy(&u, pairs, 32);
    v8u lo = u << 16, hi = u & 0xffff0000u;
    memcpy(s, &lo, 32);
    v8f z;
    memcpy(&z, &hi, 32);
    *z8 = z - 8.0f * *s;
}

static inline __attribute__((always_inline)) void store_out8(void *y, int y_kind, int64_t at,
                                                             v8f v) {
    if (y_kind == I4_F32) {
        *(v8f_u *)((float *)y + at) = v;
        return;
    }
    for (int i = 0; i < 8; i++) ((uint16_t *)y)[at + i] = f32_to_bf16(v[i]);
}

/* MT rows against the 16 outputs of byte pair p of a block of 2 hb outputs starting at n0:
 * bytes 8p..8p+7 of each input's hb, outputs n0 + 8p + 0..7 (low nibbles) and
 * n0 + hb + 8p + 0..7 (high). The same chain per output as the 16-wide tiles and torch's. */
#define TILES8(MT)                                                                          \
    static void pair8_##MT(void *y, int y_kind, int64_t N, const float *x, int64_t K,       \
                           const uint8_t *codes, const uint16_t *sz, int64_t n0, int64_t hb, \
                           int64_t p) {                                                     \
        v8f acc[MT][2];                                                                     \
        for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = (v8f){0};                      \
        const int64_t lo = n0 + 8 * p, hi = lo + hb;                                        \
        for (int64_t g = 0; g < K / GROUP; g++) {                                           \
            v8f s[2], z8[2];                                                                \
            group_scales8(s, z8, sz + (g * N + lo) * 2);                                    \
            group_scales8(s + 1, z8 + 1, sz + (g * N + hi) * 2);                            \
            if (p == 0) prefetch_group(codes, sz, N, K, n0, g, hb);                         \
            for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {                         \
                v8i b = u8x8_to_i32(codes + k * hb + 8 * p);                                \
                v8f w0 = __builtin_convertvector(b & 15, v8f) * s[0] + z8[0];               \
                v8f w1 = __builtin_convertvector(b >> 4, v8f) * s[1] + z8[1];               \
                for (int m = 0; m < MT; m++) {                                              \
                    acc[m][0] = acc[m][0] + x[m * K + k] * w0;                              \
                    acc[m][1] = acc[m][1] + x[m * K + k] * w1;                              \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int m = 0; m < MT; m++) {                                                      \
            store_out8(y, y_kind, m * N + lo, acc[m][0]);                                   \
            store_out8(y, y_kind, m * N + hi, acc[m][1]);                                   \
        }                                                                                   \
    }
TILES8(1) TILES8(2) TILES8(3) TILES8(4)
typedef void (*pair8_fn)(void *, int, int64_t, const float *, int64_t, const uint8_t *,
                         const uint16_t *, int64_t, int64_t, int64_t);
static const pair8_fn pairs8[] = {0, pair8_1, pair8_2, pair8_3, pair8_4};

/* -- one row: 8 FMA chains in flight ------------------------------------------------------
 * Every output's sum is a chain of fused multiply-adds, each waiting for the one before (4-5
 * cycles), and a core issues two a cycle: a row against one tile's 2 (8-wide) or 4 (16-wide)
 * outputs kept the FMA units idle most of the time, and a 1-row decode read its weights at a
 * fraction of the memory's pace. A decode's row is therefore run against 8 vectors of
 * outputs at once: two blocks of 32 (8-wide), one of 64 read 8 wide, or two of 64 (16-wide).
 * Each output's chain is the tiles' own (the same expression, the same order), so the bits
 * are the same as theirs and torch's. */
#define ONE_ROW8(NB, NP)                                                                    \
    static void one_row8_##NB##_##NP(void *y, int y_kind, int64_t N, const float *x,        \
                                     int64_t K, const uint8_t *c, const uint16_t *sz,       \
                                     int64_t n0) {                                          \
        enum { HB = 8 * NP, T = NB * NP };                                                  \
        v8f acc[T][2];                                                                      \
        for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = (v8f){0};                       \
        for (int64_t g = 0; g < K / GROUP; g++) {                                           \
            v8f s[T][2], z8[T][2];                                                          \
            for (int t = 0; t < T; t++) {                                                   \
                const int64_t lo = n0 + (t / NP) * 2 * HB + 8 * (t % NP);                   \
                group_scales8(&s[t][0], &z8[t][0], sz + (g * N + lo) * 2);                  \
                group_scales8(&s[t][1], &z8[t][1], sz + (g * N + lo + HB) * 2);             \
            }                                                                               \
            for (int bi = 0; bi < NB; bi++)                                                 \
                prefetch_group(c + bi * K * HB, sz, N, K, n0 + bi * 2 * HB, g, HB);         \
            for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {                         \
                const float xk = x[k];                                                      \
                for (int t = 0; t < T; t++) {                                               \
                    v8i b = u8x8_to_i32(c + (t / NP) * K * HB + k * HB + 8 * (t % NP));     \
                    v8f w0 = __builtin_convertvector(b & 15, v8f) * s[t][0] + z8[t][0];     \
                    v8f w1 = __builtin_convertvector(b >> 4, v8f) * s[t][1] + z8[t][1];     \
                    acc[t][0] = acc[t][0] + xk * w0;                                        \
                    acc[t][1] = acc[t][1] + xk * w1;                                        \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < T; t++) {                                                       \
            const int64_t lo = n0 + (t / NP) * 2 * HB + 8 * (t % NP);                       \
            store_out8(y, y_kind, lo, acc[t][0]);                                           \
            store_out8(y, y_kind, lo + HB, acc[t][1]);                                      \
        }                                                                                   \
    }
ONE_ROW8(2, 2) /* blocks of 32 (torch's packing under AVX2): two blocks */
ONE_ROW8(1, 4) /* a block of 64 read 8 wide */

#if defined(__AVX512F__)
/* Two blocks of 64 outputs at n0, each as rows_1_all takes one. */
static void one_row16_2(void *y, int y_kind, int64_t N, const float *x, int64_t K,
                        const uint8_t *c, const uint16_t *sz, int64_t n0) {
    v16f acc[2][4];
    for (int bi = 0; bi < 2; bi++)
        for (int j = 0; j < 4; j++) acc[bi][j] = (v16f){0};
    for (int64_t g = 0; g < K / GROUP; g++) {
        v16f s[2][4], z8[2][4];
        for (int bi = 0; bi < 2; bi++)
            for (int j = 0; j < 4; j++) {
                const int64_t n = n0 + BLOCK * bi + 16 * (j / 2) + 32 * (j % 2);
                group_scales(&s[bi][j], &z8[bi][j], sz + (g * N + n) * 2);
            }
        for (int bi = 0; bi < 2; bi++)
            prefetch_group(c + bi * K * 32, sz, N, K, n0 + BLOCK * bi, g, BLOCK / 2);
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k++) {
            const float xk = x[k];
            for (int bi = 0; bi < 2; bi++)
                for (int h = 0; h < 2; h++) {
                    v16i b = u8x16_to_i32(c + bi * K * 32 + k * 32 + 16 * h);
                    v16f w0 = __builtin_convertvector(b & 15, v16f) * s[bi][2 * h]
                              + z8[bi][2 * h];
                    v16f w1 = __builtin_convertvector(b >> 4, v16f) * s[bi][2 * h + 1]
                              + z8[bi][2 * h + 1];
                    acc[bi][2 * h] = acc[bi][2 * h] + xk * w0;
                    acc[bi][2 * h + 1] = acc[bi][2 * h + 1] + xk * w1;
                }
        }
    }
    for (int bi = 0; bi < 2; bi++)
        for (int j = 0; j < 4; j++)
            store_out(y, y_kind, n0 + BLOCK * bi + 16 * (j / 2) + 32 * (j % 2), acc[bi][j]);
}
#endif

/* Blocks a one-row unit takes (1 or 2) and its kernel; 0 where the packing has none. */
typedef void (*one_row_fn)(void *, int, int64_t, const float *, int64_t, const uint8_t *,
                           const uint16_t *, int64_t);
static int64_t one_row_unit(int wide, int64_t hb, one_row_fn *fn) {
#if defined(__AVX512F__)
    if (wide) {
        *fn = one_row16_2;
        return 2;
    }
#else
    (void)wide;
#endif
    if (hb == 16) {
        *fn = one_row8_2_2;
        return 2;
    }
    if (hb == 32) {
        *fn = one_row8_1_4;
        return 1;
    }
    return 0;
}
/* Below this many blocks a weight's one-row calls keep the tiles' units of one block: two
 * blocks a unit would share 9 blocks (SmolLM2's 576 outputs) 6 : 4 between two threads. */
#define ONE_ROW_MIN_BLOCKS 32

/* Row tiles of as even a size as `most` allows (16 rows by 12: 8 and 8, not 12 and 4). */
static inline int64_t tile_size(int64_t M, int64_t most) {
    const int64_t tiles = (M + most - 1) / most;
    return (M + tiles - 1) / tiles;
}

/* One block of 2 hb outputs at n0 in 8-wide tiles. */
static void block8(void *y, int y_kind, const float *xf, const uint8_t *c,
                   const uint16_t *scale_zero, int64_t M, int64_t N, int64_t K, int64_t n0,
                   int64_t hb) {
    const size_t y_size = y_kind == I4_F32 ? 4 : 2;
    const int64_t size = tile_size(M, MT8_MAX);
    for (int64_t m = 0; m < M; m += size) {
        const int64_t mt = M - m < size ? M - m : size;
        char *ym = (char *)y + (size_t)(m * N) * y_size;
        for (int64_t p = 0; p < hb / 8; p++)
            pairs8[mt](ym, y_kind, N, xf + m * K, K, c, scale_zero, n0, hb, p);
    }
}

/* One block of 64 outputs at n0 in 16-wide tiles (AVX-512). */
static void block16(void *y, int y_kind, const float *xf, const uint8_t *c,
                    const uint16_t *scale_zero, int64_t M, int64_t N, int64_t K, int64_t n0) {
    const size_t y_size = y_kind == I4_F32 ? 4 : 2;
    const int64_t size = tile_size(M, MT_MAX);
    for (int64_t m = 0; m < M; m += size) {
        const int64_t mt = M - m < size ? M - m : size;
        char *ym = (char *)y + (size_t)(m * N) * y_size;
        if (mt <= 4) {
            whole[mt](ym, y_kind, N, xf + m * K, K, c, scale_zero, n0);
        } else {
            halves[mt - 5][0](ym, y_kind, N, xf + m * K, K, c, scale_zero, n0);
            halves[mt - 5][1](ym, y_kind, N, xf + m * K, K, c, scale_zero, n0);
        }
    }
}

/* y [M, N] (y_kind) = x [M, K] (x_kind, rounded to bfloat16) W^T from torch's packed
 * codes and scale_zero in blocks of `block` outputs; N a multiple of 64, K of 32. parallel:
 * the blocks shared out over torch's threads (the library binds to torch's libgomp,
 * cpu_decode_attention.c), else on the calling thread. Returns 1 if scratch could not be had. */
void kvscope_int4_round_rows(float *xf, const void *x, int x_kind, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        xf[i] = x_kind == I4_F32 ? bf16_to_f32(f32_to_bf16(((const float *)x)[i]))
                                 : bf16_to_f32(((const uint16_t *)x)[i]);
}

/* The blocks of `block` outputs (torch's layout: 64 or 32) shared out over the calling
 * region's threads (cpu_team.h). */
void kvscope_int4_team(void *y, int y_kind, const float *xf, const uint8_t *codes,
                       const uint16_t *scale_zero, int64_t M, int64_t N, int64_t K,
                       int64_t block) {
    const int64_t blocks = N / block, hb = block / 2;
#if defined(__AVX512F__)
    const int wide = block == BLOCK;
#else
    const int wide = 0;
#endif
    one_row_fn one = 0;
    const int64_t per = M == 1 && blocks >= ONE_ROW_MIN_BLOCKS ? one_row_unit(wide, hb, &one)
                                                                : 0;
    if (per) {
        const int64_t units = (blocks + per - 1) / per;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const int64_t b = u * per;
            const uint8_t *c = codes + b * K * hb;
            if (b + per <= blocks)
                one(y, y_kind, N, xf, K, c, scale_zero, b * block);
            else if (wide)
                block16(y, y_kind, xf, c, scale_zero, M, N, K, b * block);
            else
                block8(y, y_kind, xf, c, scale_zero, M, N, K, b * block, hb);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *c = codes + b * K * hb;
        if (wide)
            block16(y, y_kind, xf, c, scale_zero, M, N, K, b * block);
        else
            block8(y, y_kind, xf, c, scale_zero, M, N, K, b * block, hb);
    }
}

int kvscope_int4_gemm(void *y, int y_kind, const void *x, int x_kind, const uint8_t *codes,
                      const uint16_t *scale_zero, int64_t M, int64_t N, int64_t K,
                      int parallel, int64_t block) {
    if (M == 0) return 0;
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return 1;
    kvscope_int4_round_rows(xf, x, x_kind, M * K);
#pragma omp parallel if (parallel)
    kvscope_int4_team(y, y_kind, xf, codes, scale_zero, M, N, K, block);
    free(xf);
    return 0;
}
