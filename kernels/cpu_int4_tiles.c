/* y = x W^T for 4-bit weights on the CPU's AMX tiles (engine/weight_formats.Int4Linear and
 * Int8Linear where kernels/cpu_int4.py chose the "tiles" kernels).
 *
 * Why: the FMA kernel (kernels/cpu_int4_gemm.c) turns every weight into a float32 and
 * multiplies it into every row: from a few rows up a step is bound by those multiply-adds
 * (about 0.9 ms a row for SmolLM2 on two cores). One TDPBF16PS multiplies 16 rows by 32
 * inputs by 16 outputs. A code (0..15) is exact in bfloat16 and so is its product with a
 * bfloat16 input, so per group of 32 inputs the tiles give C = sum (128 + code) x (the code
 * biased by 128: 0x4300 | code is its bfloat16, one OR instead of a table lookup), and the
 * weight (code - 8) * scale + zero comes in per group and output:
 *   y += scale * C + (zero - 136 * scale) * sum x.
 * The sums round differently from the FMA chain (the tiles add a group's 32 products before
 * rounding once), so the two kernels' results differ in the last bits: kernels/cpu_int4.py
 * runs one of them for every row count (a speculative verify's rows must round as the
 * plain decodes of the same positions do), and a row's result never depends on the other
 * rows of the call, its tile or the thread split.
 *
 * The layout (kvscope_int4_tiles_pack, from torch's packed codes and scale_zero): per block
 * of 64 outputs and group of 32 inputs, 1280 bytes read front to back: 16 pairs of inputs x
 * 2 halves x 32 bytes (byte 2j + e of half h: inputs 2kk + e of outputs 16h + j in the low
 * nibble and 32 + 16h + j in the high one, as torch pairs them), then the group's 64
 * (scale, zero) bfloat16 pairs. The same bytes as torch's two tensors, streamed in order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"
#include "cpu_vec.h"

#define GROUP 32
#define BLOCK 64
#define BG_BYTES 1280 /* one block-group: 1024 bytes of codes, 256 of (scale, zero) */

/* torch's layout ([N / 64][K][32] code bytes, scale_zero [K / 32][N][2]) -> the tiles'. */
void kvscope_int4_tiles_pack(uint8_t *dst, const uint8_t *codes, const uint16_t *scale_zero,
                             int64_t N, int64_t K) {
    const int64_t groups = K / GROUP;
    for (int64_t b = 0; b < N / BLOCK; b++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *bg = dst + (b * groups + g) * BG_BYTES;
            for (int kk = 0; kk < 16; kk++)
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 16; j++)
                        for (int e = 0; e < 2; e++)
                            bg[kk * 64 + h * 32 + 2 * j + e] =
                                codes[(b * K + g * GROUP + 2 * kk + e) * 32 + 16 * h + j];
            memcpy(bg + 1024, scale_zero + (g * N + b * BLOCK) * 2, 256);
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 0: the input rows (A, rows x 32 inputs); 1-3: weights (B, 16 input pairs x 16 outputs);
 * 4-7: the sums of the block's four 16-output tiles (C, rows x 16). */
static void configure_tiles(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t >= 1 && t <= 3 ? 16 : rows;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* A block-group's codes as the four B tiles (outputs 0-15, 16-31, 32-47, 48-63 of the block),
 * each code as the bfloat16 of 128 + code. */
static inline __attribute__((always_inline)) void weight_tiles(uint16_t *bt, const uint8_t *c) {
    const __m512i low = _mm512_set1_epi16(15), biased = _mm512_set1_epi16(0x4300);
    for (int kk = 0; kk < 16; kk++)
        for (int h = 0; h < 2; h++) {
            __m512i w = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256((const __m256i *)(c + kk * 64 + h * 32)));
            __m512i lo = _mm512_ternarylogic_epi32(w, low, biased, 0xEA); /* (w & low) | b */
            __m512i hi = _mm512_or_si512(_mm512_srli_epi16(w, 4), biased);
            _mm512_store_si512((__m512i *)(bt + h * 512 + kk * 32), lo);
            _mm512_store_si512((__m512i *)(bt + 1024 + h * 512 + kk * 32), hi);
        }
}

/* Input rows as A tiles, [row block of 16][group][16 rows][32] bfloat16 (zero past M), and
 * each row's sum per group (in input order, float32). */
static void pack_inputs(uint16_t *a, float *sums, const float *xf, int64_t M, int64_t K) {
    const int64_t groups = K / GROUP;
    memset(a, 0, sizeof(uint16_t) * (size_t)(((M + 15) / 16) * groups * 512));
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *src = xf + m * K + g * GROUP;
            uint16_t *dst = a + ((m / 16) * groups + g) * 512 + (m % 16) * 32;
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                uint32_t u;
                memcpy(&u, src + i, 4);
                dst[i] = (uint16_t)(u >> 16); /* xf holds bfloat16 values exactly */
                s += src[i];
            }
            sums[m * groups + g] = s;
        }
}

/* One 64-output block: acc [M][64] float32 sums over every group, then y. */
static void block(void *y, int y_kind, const uint8_t *tiles, const uint16_t *a,
                  const float *sums, float *acc, uint16_t *bt, float *ct, int64_t b, int64_t M,
                  int64_t N, int64_t K) {
    const int64_t groups = K / GROUP, row_blocks = (M + 15) / 16, n0 = b * BLOCK;
    const uint8_t *bg = tiles + b * groups * BG_BYTES;
    memset(acc, 0, sizeof(float) * (size_t)(M * BLOCK));
    for (int64_t g = 0; g < groups; g++, bg += BG_BYTES) {
        for (int i = 0; i < BG_BYTES; i += 64) __builtin_prefetch(bg + 2 * BG_BYTES + i, 0, 3);
        weight_tiles(bt, bg);
        v16f s[4], z[4];
        for (int t = 0; t < 4; t++) {
            v16u u;
            memcpy(&u, bg + 1024 + t * 64, 64);
            v16u lo = u << 16, hi = u & 0xffff0000u;
            v16f zero;
            memcpy(&s[t], &lo, 64);
            memcpy(&zero, &hi, 64);
            z[t] = zero - 136.0f * s[t]; /* (128 + code - 136) * scale + zero */
        }
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            _tile_loadd(0, a + (rb * groups + g) * 512, 64);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            _tile_loadd(1, bt, 64);
            _tile_dpbf16ps(4, 0, 1);
            _tile_loadd(2, bt + 512, 64);
            _tile_dpbf16ps(5, 0, 2);
            _tile_loadd(3, bt + 1024, 64);
            _tile_dpbf16ps(6, 0, 3);
            _tile_loadd(1, bt + 1536, 64);
            _tile_dpbf16ps(7, 0, 1);
            _tile_stored(4, ct, 64);
            _tile_stored(5, ct + 256, 64);
            _tile_stored(6, ct + 512, 64);
            _tile_stored(7, ct + 768, 64);
            const int64_t rows = M - rb * 16 < 16 ? M - rb * 16 : 16;
            for (int64_t j = 0; j < rows; j++) {
                const float sx = sums[(rb * 16 + j) * groups + g];
                float *out = acc + (rb * 16 + j) * BLOCK;
                for (int t = 0; t < 4; t++) {
                    v16f cv, av;
                    memcpy(&cv, ct + t * 256 + j * 16, 64);
                    memcpy(&av, out + 16 * t, 64);
                    av = av + cv * s[t] + sx * z[t];
                    memcpy(out + 16 * t, &av, 64);
                }
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int t = 0; t < 4; t++) {
            v16f v;
            memcpy(&v, acc + m * BLOCK + 16 * t, 64);
            if (y_kind == 0) memcpy((float *)y + m * N + n0 + 16 * t, &v, 64);
            else store_bf16x16((uint16_t *)y + m * N + n0 + 16 * t, v);
        }
}

int kvscope_int4_tiles_ready(void) { return kvscope_amx_ready(); }

/* The team part (cpu_team.h): every thread packs the input rows for itself, then takes its
 * share of the 64-output blocks. xf: rows rounded to bfloat16 (kvscope_int4_round_rows);
 * y_kind 0 float32, 1 bfloat16. *status = 1 when scratch could not be had. */
void kvscope_int4_tiles_team(void *y, int y_kind, const float *xf, const uint8_t *tiles,
                             int64_t M, int64_t N, int64_t K, int *status) {
    const int64_t row_blocks = (M + 15) / 16, groups = K / GROUP;
    uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * (size_t)(row_blocks * groups * 512));
    float *sums = malloc(sizeof(float) * (size_t)(M * groups));
    float *acc = aligned_alloc(64, sizeof(float) * (size_t)(row_blocks * 16 * BLOCK));
    uint16_t *bt = aligned_alloc(64, 4096);
    float *ct = aligned_alloc(64, 4096);
    const int ok = a && sums && acc && bt && ct;
    if (!ok) {
#pragma omp atomic write
        *status = 1;
    } else {
        pack_inputs(a, sums, xf, M, K);
        configure_tiles(M < 16 ? (int)M : 16);
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < N / BLOCK; b++)
        if (ok) block(y, y_kind, tiles, a, sums, acc, bt, ct, b, M, N, K);
    if (ok) _tile_release();
    free(a);
    free(sums);
    free(acc);
    free(bt);
    free(ct);
}

#else

int kvscope_int4_tiles_ready(void) { return 0; }

void kvscope_int4_tiles_team(void *y, int y_kind, const float *xf, const uint8_t *tiles,
                             int64_t M, int64_t N, int64_t K, int *status) {
    (void)y, (void)y_kind, (void)xf, (void)tiles, (void)M, (void)N, (void)K;
    *status = 1; /* never called: kvscope_int4_tiles_ready is 0 here */
}

#endif

/* y [M, N] (y_kind) = x [M, K] (x_kind 0 float32, 1 bfloat16; rounded to bfloat16) W^T.
 * parallel: the blocks over torch's threads, else the calling thread. Returns 1 when scratch
 * could not be had, 2 when the tiles are not there. */
int kvscope_int4_tiles_gemm(void *y, int y_kind, const void *x, int x_kind,
                            const uint8_t *tiles, int64_t M, int64_t N, int64_t K,
                            int parallel) {
    if (!kvscope_int4_tiles_ready()) return 2;
    if (M == 0) return 0;
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return 1;
    kvscope_int4_round_rows(xf, x, x_kind, M * K);
    int status = 0;
#pragma omp parallel if (parallel)
    kvscope_int4_tiles_team(y, y_kind, xf, tiles, M, N, K, &status);
    free(xf);
    return status;
}
