/* The parallel kernels split into a plan (made on one thread), a team part (run by every
 * thread of an OpenMP region: its loops are orphaned `omp for`s that bind to whichever region
 * calls them) and a free. Each kernel's own entry point opens a region around its team part;
 * kernels/cpu_decode_step.c runs the team parts of a whole decode step inside one region, so
 * the threads wake once a step instead of five times a layer.
 */
#ifndef KVSCOPE_CPU_TEAM_H
#define KVSCOPE_CPU_TEAM_H

#include <stdint.h>

/* The decode attention (kernels/cpu_decode_attention.c, kvscope_paged_decode's arguments). */
typedef struct {
    void *out;
    const void *query;
    const int64_t *rows, *tables;
    int64_t table_stride;
    const int64_t *lens;
    int64_t first, last;
    const void *k_cache, *v_cache;
    const float *k_scale, *v_scale;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    int kind;
    float sm_scale;
    int io_bf16;
    const float *anchor_k, *anchor_v;
    const int64_t *anchor_idx;
    int64_t anchor_len, window;
    float softcap;
} decode_call;

typedef struct {
    int64_t row0, rows, k;  /* rows row0 .. row0 + rows - 1, span k of each */
} shared_span;

/* A call's work items: spans of its sequences' positions, some shared by rows that read the
 * same blocks. parallel: whether the work is worth more than one thread. */
typedef struct {
    int64_t items, nshared, widest, widest_group, stride, span;
    int64_t *first_item, *covered;
    float *part;
    shared_span *shared;
    int parallel;
} decode_plan;

int kvscope_decode_plan_make(decode_plan *p, const decode_call *c);
void kvscope_decode_team(const decode_call *c, const decode_plan *p, int *status);
void kvscope_decode_plan_free(decode_plan *p);

/* The int4 matmul (kernels/cpu_int4_gemm.c): xf [M, K] float32, the input rounded to
 * bfloat16 (kvscope_int4_round_rows); block: torch's packing width, 64 or 32. */
void kvscope_int4_round_rows(float *xf, const void *x, int x_kind, int64_t count);
void kvscope_int4_team(void *y, int y_kind, const float *xf, const uint8_t *codes,
                       const uint16_t *scale_zero, int64_t M, int64_t N, int64_t K,
                       int64_t block);

/* The int8 matmul (kernels/cpu_int8_gemm.c): xf [M, K] float32, codes in blocks of 16
 * outputs [N / 16, K, 16], scales [N / 16, K / 32, 16]; y_kind 0 float32, 1 bfloat16. */
void kvscope_int8_team(void *y, int y_kind, const float *xf, const int8_t *codes,
                       const float *scales, int64_t M, int64_t N, int64_t K);

/* The int4 matmul on AMX tiles (kernels/cpu_int4_tiles.c), on its own layout. */
int kvscope_int4_tiles_ready(void);
void kvscope_int4_tiles_team(void *y, int y_kind, const float *xf, const uint8_t *tiles,
                             int64_t M, int64_t N, int64_t K, int *status);
/* The dense small-row matmul (kernels/cpu_small_gemm.c): xf [M, K] float32
 * (kvscope_gemm_widen_rows). */
void kvscope_gemm_widen_rows(float *xf, const void *x, int x_kind, int64_t count);
/* paths: which hardware paths bfloat16 weights may take, each where the CPU and the shape
 * allow, best first: AMX tiles, AVX-512 BF16 dot products; else widened to float32. Which
 * mask runs a weight is measured per machine and row count (kernels/cpu_linear.py): the tiles
 * win from a few rows up, and lose to the dot products on one row, which is memory-bound. */
enum { KVSCOPE_BF16_AMX = 1, KVSCOPE_BF16_DOT = 2 };
void kvscope_gemm_team(void *y, int y_kind, const float *xf, const void *w, int w_kind,
                       const float *bias, int64_t M, int64_t N, int64_t K, int paths,
                       int *status);

/* bfloat16 weights on AMX tiles (kernels/cpu_amx_gemm.c), which kvscope_gemm_team takes where
 * kvscope_amx_fits(N, K): built with AMX, the kernel granted the tiles, N % 16 == 0 and
 * K % 32 == 0. */
int kvscope_amx_ready(void);
int kvscope_amx_fits(int64_t N, int64_t K);
void kvscope_amx_bf16_team(void *y, int y_bf16, const float *xf, const uint16_t *w,
                           const float *bias, int64_t M, int64_t N, int64_t K, int *status);

/* bfloat16 weights on AVX-512 BF16 dot products (kernels/cpu_dpbf16_gemm.c), where the kernel
 * was built with them and K % 32 == 0. */
int kvscope_dpbf16_fits(int64_t K);
void kvscope_dpbf16_team(void *y, int y_bf16, const float *xf, const uint16_t *w,
                         const float *bias, int64_t M, int64_t N, int64_t K, int *status);

#endif
