/* y = x W^T (+ b) on the CPU for the few rows of a decode step, straight from torch's
 * Linear layout (W [N, K] row-major, float32 or bfloat16), no repacking.
 *
 * Why: at 1-64 rows a matmul reads every weight once and does little with it, so it should
 * run at memory bandwidth, yet torch's CPU matmul reaches 3-5 GB/s on float32 and about
 * 2.5 GB/s on bfloat16 (converted on every call) at 16 rows here. This kernel streams each
 * weight row once per call: a tile of 4 weight rows (converted to float32 in registers)
 * against a tile of up to 6 input rows, 24 vector accumulators, reduced at the end of the
 * row. Accumulation is float32 whatever the weights hold (as torch's), the bfloat16 output is
 * rounded to nearest even. The 4-row groups are shared out over torch's OpenMP threads (the
 * library binds to torch's libgomp; see cpu_decode_attention.c).
 *
 * GCC/Clang vector extensions, not intrinsics: with -march=native a 16-float vector is one
 * AVX-512 register, elsewhere the compiler splits it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"
#include "cpu_vec.h"

enum { G_F32 = 0, G_BF16 = 1 };

static inline __attribute__((always_inline)) v16f load16(const void *p, int64_t i, int kind) {
    if (kind == G_F32) return *(const v16f_u *)((const float *)p + i);
    return load_bf16x16((const uint16_t *)p + i);
}

static inline __attribute__((always_inline)) float scalar_at(const void *p, int64_t i,
                                                             int kind) {
    return kind == G_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline __attribute__((always_inline)) void store(void *y, int64_t i, float v, int kind) {
    if (kind == G_F32) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = f32_to_bf16(v);
}

#if defined(__AVX512F__)
/* MT input rows (float32, stride K) against the R weight rows at w (stride K), which are
 * rows n.. of the whole weight (for the output columns and the bias). */
#define TILE(MT, R)                                                                         \
    static void tile_##MT##_##R(void *y, int y_kind, int64_t N, const float *x,            \
                                const void *w, int w_kind, const float *bias, int64_t K,    \
                                int64_t n, const char *pf, int64_t pf_row) {                \
        v16f acc[MT][R];                                                                    \
        for (int m = 0; m < MT; m++)                                                        \
            for (int r = 0; r < R; r++) acc[m][r] = (v16f){0};                              \
        const int64_t pf_step = w_kind == G_F32 ? 64 : 32;                                  \
        for (int64_t k = 0; k < K; k += 16) {                                               \
            if (pf)                                                                         \
                for (int r = 0; r < R; r++)                                                 \
                    __builtin_prefetch(pf + r * pf_row + (k / 16) * pf_step, 0, 2);           \
            v16f wv[R];                                                                     \
            for (int r = 0; r < R; r++) wv[r] = load16(w, r * K + k, w_kind);                \
            for (int m = 0; m < MT; m++) {                                                  \
                v16f xv;                                                                    \
                memcpy(&xv, x + m * K + k, 64);                                             \
                for (int r = 0; r < R; r++) acc[m][r] += xv * wv[r];                       \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; r++) {                                                       \
            float b = bias ? bias[n + r] : 0.0f;                                            \
            for (int m = 0; m < MT; m++) store(y, m * N + n + r, hsum16(acc[m][r]) + b, y_kind); \
        }                                                                                   \
    }
#define MT_MAX 6
#else
/* Without AVX-512 a 16-float vector takes two of the 16 vector registers, and the 6 x 4 tile's
 * 24 accumulators spilled to the stack (6 GFLOPS a core on an AVX2 EPYC, where torch's
 * matmul reached 40). So the 16 lanes run as two halves of 8, one after the other, each over
 * the whole K (the second reads the tile's weight rows again, from L1), with at most 2
 * input rows a tile: 8 accumulators, 4 weights and the input row in registers (3 rows
 * measured the same: their input came from memory for every multiply-add). Each lane is the same chain as above (lane
 * i sums the inputs k = i mod 16 in order) and hsum_halves reduces the 16 as hsum16 does, so
 * a row's bits are the 16-wide tile's and do not depend on the tile it fell in. */
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f load8(const void *p, int64_t i, int kind) {
    if (kind == G_F32) return *(const v8f_u *)((const float *)p + i);
    v8h h;
    memcpy(&h, (const uint16_t *)p + i, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, 32);
    return f;
}

/* hsum16 of the 16 lanes lo (0-7) and hi (8-15), in its order. */
static inline __attribute__((always_inline)) float hsum_halves(v8f lo, v8f hi) {
    v8f a = lo + hi;
    v4f c = __builtin_shufflevector(a, a, 0, 1, 2, 3), e = __builtin_shufflevector(a, a, 4, 5, 6, 7);
    c += e;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* One half's sums, the weight's kind a constant: a test of it inside the loop cost the
 * register one accumulator needed (it went to the stack and back every step). */
#define HALF_SUMS(MT, R, KIND)                                                              \
    for (int64_t k = 8 * half; k < K; k += 16) {                                            \
        if (pf && half == 0)                                                                \
            for (int r = 0; r < R; r++)                                                     \
                __builtin_prefetch(pf + r * pf_row + (k / 16) * pf_step, 0, 2);               \
        v8f wv[R];                                                                          \
        for (int r = 0; r < R; r++) wv[r] = load8(w, r * K + k, KIND);                      \
        for (int m = 0; m < MT; m++) {                                                      \
            v8f xv = *(const v8f_u *)(x + m * K + k);                                       \
            for (int r = 0; r < R; r++) acc[m][r] += xv * wv[r];                           \
        }                                                                                   \
    }

#define TILE(MT, R)                                                                         \
    static void tile_##MT##_##R(void *y, int y_kind, int64_t N, const float *x,            \
                                const void *w, int w_kind, const float *bias, int64_t K,    \
                                int64_t n, const char *pf, int64_t pf_row) {                \
        v8f part[2][MT][R];                                                                 \
        const int64_t pf_step = w_kind == G_F32 ? 64 : 32;                                  \
        for (int half = 0; half < 2; half++) {                                              \
            v8f acc[MT][R];                                                                 \
            for (int m = 0; m < MT; m++)                                                    \
                for (int r = 0; r < R; r++) acc[m][r] = (v8f){0};                           \
            if (w_kind == G_F32)                                                            \
                HALF_SUMS(MT, R, G_F32)                                                     \
            else                                                                            \
                HALF_SUMS(MT, R, G_BF16)                                                    \
            for (int m = 0; m < MT; m++)                                                    \
                for (int r = 0; r < R; r++) part[half][m][r] = acc[m][r];                   \
        }                                                                                   \
        for (int r = 0; r < R; r++) {                                                       \
            float b = bias ? bias[n + r] : 0.0f;                                            \
            for (int m = 0; m < MT; m++)                                                    \
                store(y, m * N + n + r, hsum_halves(part[0][m][r], part[1][m][r]) + b,       \
                      y_kind);                                                              \
        }                                                                                   \
    }
#define MT_MAX 2
#endif

#define TILES(MT) TILE(MT, 4) TILE(MT, 1)
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)

typedef void (*tile_fn)(void *, int, int64_t, const float *, const void *, int, const float *,
                        int64_t, int64_t, const char *, int64_t);
static const tile_fn tiles4[] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4};
static const tile_fn tiles1[] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};

#define PF_AHEAD 1

/* y [M, N] (y_kind) = x [M, K] (x_kind) W^T, W [N, K] (w_kind), plus bias [N] (float32)
 * when not NULL. All contiguous; K a multiple of 16. parallel: share the weight groups out
 * over torch's threads, else run on the calling thread (which of the two is faster for a
 * weight is measured per machine: kernels/kernel_choice.py). Returns 1 if scratch could not
 * be had. paths: which hardware paths bfloat16 weights may take (cpu_team.h). */
void kvscope_gemm_widen_rows(float *xf, const void *x, int x_kind, int64_t count) {
    for (int64_t i = 0; i < count; i++) xf[i] = scalar_at(x, i, x_kind);
}

/* The groups of 4 weight rows shared out over the calling region's threads (cpu_team.h). */
void kvscope_gemm_team(void *y, int y_kind, const float *xf, const void *w, int w_kind,
                       const float *bias, int64_t M, int64_t N, int64_t K, int paths,
                       int *status) {
    if (w_kind == G_BF16 && (paths & KVSCOPE_BF16_AMX) && kvscope_amx_fits(N, K)) {
        kvscope_amx_bf16_team(y, y_kind == G_BF16, xf, w, bias, M, N, K, status);
        return;
    }
    if (w_kind == G_BF16 && (paths & KVSCOPE_BF16_DOT) && kvscope_dpbf16_fits(K)) {
        kvscope_dpbf16_team(y, y_kind == G_BF16, xf, w, bias, M, N, K, status);
        return;
    }
    const int64_t groups = (N + 3) / 4;
    const size_t y_size = y_kind == G_F32 ? 4 : 2, w_size = w_kind == G_F32 ? 4 : 2;
    /* With more input rows than one tile, bfloat16 weights are converted once per group
     * into float32 scratch rather than once per tile. */
    const int widen = w_kind != G_F32 && M > MT_MAX;
    float *wide = widen ? malloc(sizeof(float) * (size_t)(4 * K)) : NULL;
    if (widen && !wide) {
#pragma omp atomic write
        *status = 1;
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        if (widen && !wide) continue;
        int64_t n = 4 * g, rows = N - n < 4 ? N - n : 4;
        const void *wg = (const char *)w + (size_t)(n * K) * w_size;
        int wk = w_kind;
        if (widen) {
            for (int64_t i = 0; i < rows * K; i++) wide[i] = scalar_at(wg, i, w_kind);
            wg = wide;
            wk = G_F32;
        }
        /* The first tile of a group prefetches the group PF_AHEAD groups on (into L2): the
         * hardware prefetcher only follows demand loads, so without this the memory stood
         * idle while the later tiles of a group computed from L1, and a call of M rows took
         * the weight's streaming time plus its compute time rather than the larger of the
         * two. */
        const char *pf = g + PF_AHEAD < groups
            ? (const char *)w + (size_t)((n + 4 * PF_AHEAD) * K) * w_size : NULL;
        for (int64_t m = 0; m < M; m += MT_MAX) {
            int64_t mt = M - m < MT_MAX ? M - m : MT_MAX;
            char *ym = (char *)y + (size_t)(m * N) * y_size;
            const char *pf_m = m == 0 ? pf : NULL;
            if (rows == 4) {
                tiles4[mt](ym, y_kind, N, xf + m * K, wg, wk, bias, K, n, pf_m, K * w_size);
            } else {
                for (int64_t r = 0; r < rows; r++)
                    tiles1[mt](ym, y_kind, N, xf + m * K,
                               (const char *)wg + (size_t)(r * K) * (wk == G_F32 ? 4 : 2),
                               wk, bias, K, n + r, NULL, 0);
            }
        }
    }
    free(wide);
}

int kvscope_gemm(void *y, int y_kind, const void *x, int x_kind, const void *w, int w_kind,
                 const float *bias, int64_t M, int64_t N, int64_t K, int parallel, int paths) {
    float *xf = (float *)x, *own = NULL;
    if (x_kind != G_F32) {
        own = malloc(sizeof(float) * (size_t)(M * K));
        if (!own) return 1;
        kvscope_gemm_widen_rows(own, x, x_kind, M * K);
        xf = own;
    }
    int failed = 0;
#pragma omp parallel if (parallel)
    kvscope_gemm_team(y, y_kind, xf, w, w_kind, bias, M, N, K, paths, &failed);
    free(own);
    return failed;
}
