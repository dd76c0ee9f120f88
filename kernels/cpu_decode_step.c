/* A whole fused decode step (engine/model/fused/decode.py) in one OpenMP region.
 *
 * Called kernel by kernel from Python, a layer opens five parallel regions (four matmuls and
 * the attention) with serial glue and Python between them; libgomp's threads, told to spin
 * only briefly (GOMP_SPINCOUNT, kvscope/__init__.py) so an idle engine leaves the cores to
 * the window, fall asleep in those gaps and are woken again by a futex: some 150 wake-ups a
 * step, a third of a 1-row step at short context on a 2-core machine. Here the same kernels'
 * team parts (cpu_team.h) run inside one region for every layer: the glue runs on one thread
 * (`omp single`) while the others wait at its barrier, a wait of microseconds that stays
 * inside the spin. The arithmetic is the kernels' own, in the same order: the result equals
 * the kernel-by-kernel step bit for bit (tests/engine/model/fused/test_fused_one_region.py).
 *
 * Every phase is shared by the team: inside one region a split costs a barrier, not a
 * wake-up, so the per-call choice of a serial matmul (kernels/kernel_choice.py) does not
 * apply; engine/model/fused/decode.py takes this path only where no matmul chose torch's kernel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_glue.h"
#include "cpu_team.h"
#include "cpu_vec.h"

/* One matmul: int4 (1: w torch's packed codes in blocks of `block` outputs, scale_zero; 2: w
 * the AMX tiles' layout, kernels/cpu_int4_tiles.c), int8 (3: w the codes, scale_zero the
 * float32 scales, kernels/cpu_int8_gemm.c) or dense (0: w [n, k] in the rows' dtype), no
 * bias. */
typedef struct {
    const void *w;
    const uint16_t *scale_zero;
    int64_t n, k, int4, paths; /* paths: bfloat16's hardware paths (cpu_team.h) */
    int64_t block;
} step_matmul;

/* One layer: its matmuls, RoPE tables and per-head norms, KV pool layer (scales, K balance,
 * anchors: NULL where the pool has none), attention options, and the norms after the
 * attention and the MLP: gemma's sandwich norms (NULL where the family has none), the
 * post-attention norm and the next layer's input norm (NULL after the last layer). The layout
 * is mirrored by engine/model/fused/one_region.py. */
typedef struct {
    step_matmul qkv, o_proj, gate_up, down;
    const float *cos, *sin;
    int64_t rot;
    const float *q_norm, *k_norm;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;
    const float *shift, *gain, *q_gain;
    const float *anchor_k, *anchor_v;
    int64_t anchor_len, window;
    float softcap;
    const float *attn_out_norm, *post_norm, *mlp_out_norm, *next_norm;
} step_layer;

/* The step: shapes, the buffers every layer reuses (h [rows, hidden] float32: the embedding
 * on entry, the residual stream after the last layer on return; x, qkv, att, y, gate_up,
 * act: rows of the matmuls' dtype (io 1: bfloat16, 0: float32); q, o [rows, heads, d]
 * float32; xf: float32 scratch as wide as the widest matmul input), the rows' positions and
 * slots, and the decode attention's rows (att_rows, tables, lens, anchor_idx, as
 * kernels/cpu_attention.py's decode_rows). R: the pool's rotation, R_t its transpose (NULL:
 * none); first_norm: the first layer's input norm. stop: a flag another thread may set while
 * the step runs (engine/model/step_interrupt.py; NULL: never), read before each layer. */
typedef struct {
    int64_t layers, rows, hidden, inter, heads, kv_heads, head_dim, block_size, kind, io, gelu;
    int64_t table_stride, seqs;
    float eps, sm_scale;
    float *h, *q, *o, *xf;
    void *x, *qkv, *att, *y, *gate_up, *act;
    const int64_t *positions, *slots, *att_rows, *tables, *lens, *anchor_idx;
    const float *R, *R_t, *first_norm;
    const volatile int *stop;
} step_plan;

/* The matmul input as float32 in xf, on one thread: int4 rounds it to bfloat16, dense and
 * int8 widen bfloat16 rows; float32 rows are read where they are (the return value). */
static const float *matmul_input(const step_plan *s, const step_matmul *m, const void *x) {
    if (m->int4 == 1 || m->int4 == 2) {
        kvscope_int4_round_rows(s->xf, x, (int)s->io, s->rows * m->k);
        return s->xf;
    }
    if (!s->io) return x;
    kvscope_gemm_widen_rows(s->xf, x, (int)s->io, s->rows * m->k);
    return s->xf;
}

/* The team part of y = x W^T, x from matmul_input. */
static void matmul_team(const step_plan *s, const step_matmul *m, const float *xf, void *y,
                        int *status) {
    if (m->int4 == 2)
        kvscope_int4_tiles_team(y, 1, xf, m->w, s->rows, m->n, m->k, status);
    else if (m->int4 == 3)
        kvscope_int8_team(y, (int)s->io, xf, m->w, (const float *)m->scale_zero, s->rows, m->n,
                          m->k);
    else if (m->int4)
        kvscope_int4_team(y, 1, xf, m->w, m->scale_zero, s->rows, m->n, m->k, m->block);
    else
        kvscope_gemm_team(y, (int)s->io, xf, m->w, (int)s->io, NULL, s->rows, m->n, m->k,
                          (int)m->paths, status);
}

static decode_call attention_call(const step_plan *s, const step_layer *l) {
    return (decode_call){s->o, s->q, s->att_rows, s->tables, s->table_stride, s->lens, 0,
                         s->seqs, l->k_cache, l->v_cache, l->k_scale, l->v_scale, s->heads,
                         s->kv_heads, s->head_dim, s->block_size, (int)s->kind, s->sm_scale, 0,
                         l->anchor_k, l->anchor_v, l->anchor_k ? s->anchor_idx : NULL,
                         l->anchor_len, l->window, l->softcap};
}

/* h += y (through gemma's sandwich norm out_norm when there is one), then x = next_norm(h)
 * (none after the last layer). */
static void residual_add(const step_plan *s, const float *out_norm, const float *next_norm) {
    if (out_norm)
        kvscope_add_normed_rms_norm(s->h, s->y, out_norm, next_norm, s->eps,
                                    next_norm ? s->x : NULL, s->rows, s->hidden, (int)s->io);
    else if (next_norm)
        kvscope_add_rms_norm(s->h, s->y, next_norm, s->eps, s->x, s->rows, s->hidden,
                             (int)s->io);
    else
        kvscope_add(s->h, s->y, s->rows * s->hidden, (int)s->io);
}

/* The attention output o (float32) as o_proj's input rows: turned back by R^T when the pool
 * is rotated, narrowed to the rows' dtype (or read in place: float32 rows, no rotation). */
static const void *attention_rows(const step_plan *s) {
    if (s->R_t) {
        kvscope_rotate_rows(s->o, s->rows * s->heads, s->head_dim, s->R_t, s->att, (int)s->io);
        return s->att;
    }
    if (!s->io) return s->o;
    uint16_t *b = s->att;
    for (int64_t i = 0; i < s->rows * s->heads * s->head_dim; i++) b[i] = f32_to_bf16(s->o[i]);
    return s->att;
}

/* One layer on every thread of the region. plan and xf are shared (the caller's frame): a
 * single thread writes them before the barrier that ends its `single`. */
static void layer_team(const step_plan *s, const step_layer *l, decode_plan *plan,
                       const float **xf, int *status) {
    const decode_call c = attention_call(s, l);
    matmul_team(s, &l->qkv, *xf, s->qkv, status);
#pragma omp single
    {
        kvscope_rope_write_kv(s->qkv, s->rows, s->positions, l->cos, l->sin, l->rot, l->q_norm,
                              l->k_norm, s->eps, s->q, l->k_cache, l->v_cache, l->k_scale,
                              l->v_scale, s->slots, s->heads, s->kv_heads, s->head_dim,
                              (int)s->kind, (int)s->io, s->R, l->shift, l->gain, l->q_gain);
        if (kvscope_decode_plan_make(plan, &c)) *status = 1;
    }
    kvscope_decode_team(&c, plan, status);
#pragma omp single
    {
        kvscope_decode_plan_free(plan);
        *xf = matmul_input(s, &l->o_proj, attention_rows(s));
    }
    matmul_team(s, &l->o_proj, *xf, s->y, status);
#pragma omp single
    {
        residual_add(s, l->attn_out_norm, l->post_norm);
        *xf = matmul_input(s, &l->gate_up, s->x);
    }
    matmul_team(s, &l->gate_up, *xf, s->gate_up, status);
#pragma omp single
    {
        if (s->gelu)
            kvscope_gelu_tanh_mul(s->gate_up, s->act, s->rows, s->inter, (int)s->io);
        else
            kvscope_silu_mul(s->gate_up, s->act, s->rows, s->inter, (int)s->io);
        *xf = matmul_input(s, &l->down, s->act);
    }
    matmul_team(s, &l->down, *xf, s->y, status);
#pragma omp single
    {
        residual_add(s, l->mlp_out_norm, l->next_norm);
        if (l->next_norm) *xf = matmul_input(s, &(l + 1)->qkv, s->x);
    }
}

/* Every layer of a decode step: h (the embedding rows) becomes the residual stream after the
 * last layer, before the final norm. Returns 1 if some scratch could not be had, 2 if the
 * stop flag was set before some layer (the step's result is then not to be used). The flag
 * is read by one thread and its reading shared through the barrier that ends the `single`,
 * so every thread leaves at the same layer. */
int kvscope_decode_step(const step_plan *s, const step_layer *layers) {
    int status = 0, stopped = 0;
    decode_plan plan;
    memset(&plan, 0, sizeof plan);
    kvscope_add_rms_norm(s->h, NULL, s->first_norm, s->eps, s->x, s->rows, s->hidden,
                         (int)s->io);
    const float *xf = matmul_input(s, &layers[0].qkv, s->x);
#pragma omp parallel
    for (int64_t i = 0; i < s->layers; i++) {
#pragma omp single
        stopped = s->stop != NULL && *s->stop != 0;
        if (stopped) break;
        layer_team(s, &layers[i], &plan, &xf, &status);
    }
    return stopped ? 2 : status;
}
