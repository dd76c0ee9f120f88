/* The elementwise glue of a fused decode step (kernels/cpu_decode_glue.c, the rotation in
 * kernels/cpu_kv_write.c), for kernels/cpu_decode_step.c, which calls them between its
 * shared phases. Arguments as documented at each definition. */
#ifndef KVSCOPE_CPU_GLUE_H
#define KVSCOPE_CPU_GLUE_H

#include <stdint.h>

void kvscope_add_rms_norm(float *, const void *, const float *, float, void *, int64_t,
                          int64_t, int);
void kvscope_add(float *, const void *, int64_t, int);
void kvscope_silu_mul(const void *, void *, int64_t, int64_t, int);
void kvscope_gelu_tanh_mul(const void *, void *, int64_t, int64_t, int);
void kvscope_add_normed_rms_norm(float *, const void *, const float *, const float *, float,
                                 void *, int64_t, int64_t, int);
/* qkv, rows, positions, cos, sin, rot, q_norm, k_norm, eps, q_out, k_cache, v_cache,
 * k_scale, v_scale, slots, heads, kv_heads, d, kind, io, R, shift, gain, q_gain */
void kvscope_rope_write_kv(const void *, int64_t, const int64_t *, const float *,
                           const float *, int64_t, const float *, const float *, float, float *,
                           void *, void *, float *, float *, const int64_t *, int64_t, int64_t,
                           int64_t, int, int, const float *, const float *, const float *,
                           const float *);
void kvscope_rotate_rows(const float *, int64_t, int64_t, const float *, void *, int);

#endif
