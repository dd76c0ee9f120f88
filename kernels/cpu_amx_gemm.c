/* y = x W^T for bfloat16 weights on the CPU's AMX tiles, for the few rows of a decode step
 * or a mixed step (kernels/cpu_small_gemm.c calls it for bfloat16 weights where AMX is there).
 *
 * Why: widened to float32, a bfloat16 weight costs as much arithmetic as a float32 one; at
 * 8-64 rows that arithmetic, not the memory, set the time, and torch's oneDNN call (which
 * does use the tiles) costs a weight reorder and a thread wake-up per call. One
 * TDPBF16PS multiplies 16 x 32 by 32 x 16 bfloat16 values into 16 x 16 float32 sums.
 *
 * The weight is read as it lies ([N, K] row-major, torch's Linear layout, no repacking): a
 * tile of 16 of its rows and 32 inputs is the A operand, so C = W x^T, C[n][m]. The input rows
 * are the B operand, which the tiles take as pairs of inputs ([K / 2][16 rows][2]): each
 * thread packs them once per call (M x K values, against M x K x N / threads products).
 * Every output is the same chain of tile products in input order whatever the row count, the
 * other rows or the thread split (a row's sums never meet another row's), so a row rounds
 * the same in a batch of 1 or 16. Sums in float32, bias added, then rounded to the output
 * dtype; the tiles flush subnormal inputs and sums to zero, as torch's AMX path does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_N 32 /* weight rows a tile pass covers: two A tiles */

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out the tile state only to a process that asks (once; the answer holds for
 * all its threads). torch asks too when oneDNN first uses the tiles. 1: granted. */
int kvscope_amx_ready(void) {
    static int state; /* 0 unknown, 1 granted, 2 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 2;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

static void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { /* C: 0, 1, 5, 6; A (weight rows): 2, 3; B (inputs): 4, 7 */
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

static inline uint16_t bf16_bits(float v) { /* v holds a bfloat16 value exactly */
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)(u >> 16);
}

/* Input rows m0 .. m0 + 15 (zero past M) as B tiles: pack[c][kk][j][e] = x[m0 + j][32c + 2kk
 * + e], one 1 KiB tile per 32 inputs. */
static void pack_rows(uint16_t *pack, const float *xf, int64_t m0, int64_t M, int64_t K) {
    uint32_t *pairs = (uint32_t *)pack; /* pairs[c][kk][j]: inputs 32c + 2kk, + 1 of row j */
    memset(pack, 0, sizeof(uint16_t) * (size_t)(16 * K));
    for (int64_t j = 0; j < 16 && m0 + j < M; j++) {
        const float *row = xf + (m0 + j) * K;
        for (int64_t k = 0; k < K; k += 2)
            pairs[(k / 2) * 16 + j] = bf16_bits(row[k]) | (uint32_t)bf16_bits(row[k + 1]) << 16;
    }
}

/* The C tile's 16 x 16 sums (weight row i, input row j: c[16 i + j]) into y, plus bias: a
 * column of the tile, gathered, is 16 consecutive outputs of one row. */
static void store_tile(void *y, int y_bf16, int64_t N, const float *c, int64_t n0, int64_t m0,
                       int64_t M, const float *bias) {
    const __m512i down = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t j = 0; j < 16 && m0 + j < M; j++) {
        __m512 v = _mm512_add_ps(_mm512_i32gather_ps(down, c + j, 4), b);
        if (y_bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (m0 + j) * N + n0),
                                (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_storeu_ps((float *)y + (m0 + j) * N + n0, v);
    }
}

/* One pass over weight rows n0 .. n0 + 31 (n0 .. n0 + 15 when two_tiles is 0) for one or
 * two packed blocks of 16 input rows (pack1 NULL: one), each weight tile loaded once for
 * both: the C tiles' sums in out[block][tile][256]. pf: the next pass's rows, or NULL. */
static void tile_pass(float *out, const uint16_t *w, const uint16_t *pack0,
                      const uint16_t *pack1, int64_t n0, int64_t K, int two_tiles,
                      const char *pf) {
    const int64_t stride = K * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t c = 0; c < K / 32; c++) {
        if (pf)
            for (int r = 0; r < TILE_N; r++) __builtin_prefetch(pf + r * stride + c * 64, 0, 2);
        _tile_loadd(2, w + n0 * K + c * 32, stride);
        _tile_loadd(4, pack0 + c * 512, 64);
        _tile_dpbf16ps(0, 2, 4);
        if (pack1) {
            _tile_loadd(7, pack1 + c * 512, 64);
            _tile_dpbf16ps(5, 2, 7);
        }
        if (two_tiles) {
            _tile_loadd(3, w + (n0 + 16) * K + c * 32, stride);
            _tile_dpbf16ps(1, 3, 4);
            if (pack1) _tile_dpbf16ps(6, 3, 7);
        }
    }
    _tile_stored(0, out, 64);
    if (two_tiles) _tile_stored(1, out + 256, 64);
    if (pack1) {
        _tile_stored(5, out + 512, 64);
        if (two_tiles) _tile_stored(6, out + 768, 64);
    }
}

/* Every thread of the calling region packs the input rows for itself, then takes its share
 * of the 32-row weight passes. N a multiple of 16, K of 32 (kvscope_amx_fits). */
void kvscope_amx_bf16_team(void *y, int y_bf16, const float *xf, const uint16_t *w,
                           const float *bias, int64_t M, int64_t N, int64_t K, int *status) {
    const int64_t blocks = (M + 15) / 16, passes = (N + TILE_N - 1) / TILE_N;
    uint16_t *pack = malloc(sizeof(uint16_t) * (size_t)(16 * K * blocks));
    float *out = aligned_alloc(64, sizeof(float) * 1024);
    if (!pack || !out) {
#pragma omp atomic write
        *status = 1;
    } else {
        for (int64_t b = 0; b < blocks; b++) pack_rows(pack + b * 16 * K, xf, 16 * b, M, K);
        configure_tiles();
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < passes; p++) {
        if (!pack || !out) continue;
        const int64_t n0 = p * TILE_N;
        const int two = n0 + 16 < N;
        const char *pf = p + 1 < passes ? (const char *)(w + (n0 + TILE_N) * K) : NULL;
        for (int64_t b = 0; b < blocks; b += 2) {
            const uint16_t *p1 = b + 1 < blocks ? pack + (b + 1) * 16 * K : NULL;
            tile_pass(out, w, pack + b * 16 * K, p1, n0, K, two, b == 0 ? pf : NULL);
            for (int64_t bb = 0; bb < (p1 ? 2 : 1); bb++) {
                store_tile(y, y_bf16, N, out + bb * 512, n0, 16 * (b + bb), M, bias);
                if (two)
                    store_tile(y, y_bf16, N, out + bb * 512 + 256, n0 + 16, 16 * (b + bb), M,
                               bias);
            }
        }
    }
    if (pack && out) _tile_release();
    free(pack);
    free(out);
}

int kvscope_amx_fits(int64_t N, int64_t K) {
    return N % 16 == 0 && K % 32 == 0 && kvscope_amx_ready();
}

#else

int kvscope_amx_ready(void) { return 0; }

int kvscope_amx_fits(int64_t N, int64_t K) {
    (void)N;
    (void)K;
    return 0;
}

void kvscope_amx_bf16_team(void *y, int y_bf16, const float *xf, const uint16_t *w,
                           const float *bias, int64_t M, int64_t N, int64_t K, int *status) {
    (void)y, (void)y_bf16, (void)xf, (void)w, (void)bias, (void)M, (void)N, (void)K;
    *status = 1; /* never called: kvscope_amx_fits is 0 here */
}

#endif
