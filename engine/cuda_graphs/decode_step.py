"""A decode step over the static buffers, written so that recording it once is enough.

Everything a step varies in is a tensor read from the static buffers (engine.cuda_graphs.
static_inputs); nothing on the Python side depends on the step's values, so a graph (or the
CPU stand-in's recording) replays it correctly for any batch of the bucket's size. The layers
are the model's own (PagedLlama.run_layer); only the attention differs from the eager step:

* on CUDA (kernels.ops picks Triton) the same Triton KV write and paged attention, their
  per-step tensors seeded from the buffers and their grid fixed per bucket;
* elsewhere a torch decode attention over the whole static table width (max_model_len
  positions a row, masked by each row's context length), since the eager CPU paths plan
  their gathers from the step's Python lists. Padded rows (slot -1) rewrite row 0's own slot
  with row 0's own K/V, so no slot changes; a padded row attends one slot (context length
  taken as 1) so its output stays finite.
"""
from __future__ import annotations

from functools import partial

import torch

from kvscope.engine.cuda_graphs.static_inputs import BucketInputs
from kvscope.engine.kv_cache.pool import KVPool
from kvscope.engine.model.layer_weights import LayerWeights
from kvscope.engine.model.paged_decoder import LayerKV, PagedLlama, rms_norm
from kvscope.kernels import ops
from kvscope.kernels.attention_ref import attend, gather_blocks
from kvscope.kernels.k_balance import balance_k, balance_q
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.kernels.rotation import rotate, unrotate


def decode_step(model: PagedLlama, pool: KVPool, inputs: BucketInputs) -> torch.Tensor:
    """Hidden states [bucket, hidden] after the final norm, as PagedLlama.forward gives them."""
    triton = ops.backend(inputs.input_ids.device) == "triton"
    if triton:
        inputs.context_lens32.copy_(inputs.context_lens)
    h = model.embed_tokens(inputs.input_ids)
    rope, local = model.rope_rows(inputs.positions)
    attention = _triton_attention if triton else _torch_attention
    for i, layer in enumerate(model.layers):
        cos, sin = local if layer.local_rope else rope
        h = model.run_layer(layer, h, cos, sin,
                            partial(attention, model, pool, layer, pool.layer(i), inputs))
    return rms_norm(h, model.final_norm, model.shape.rms_norm_eps)


def _triton_attention(model: PagedLlama, pool: KVPool, layer: LayerWeights, kv: LayerKV,
                      inputs: BucketInputs, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
    k_cache, v_cache, k_scale, v_scale, k_balance, _ = kv
    ops.write_kv(k, v, k_cache, v_cache, inputs.slot_mapping, k_scale, v_scale, pool.rotation,
                 k_balance)
    return ops.paged_attention(q, k_cache, v_cache, inputs.meta, model.scale, k_scale, v_scale,
                               pool.rotation, k_balance, window=layer.window,
                               softcap=model.family.attn_softcap)


def _torch_attention(model: PagedLlama, pool: KVPool, layer: LayerWeights, kv: LayerKV,
                     inputs: BucketInputs, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
    k_cache, v_cache, k_scale, v_scale, k_balance, _ = kv
    rotation = pool.rotation
    slots = inputs.slot_mapping
    valid = slots >= 0
    # Row 0 is a real row in every step; only the capture's all-padded rows fall back to
    # slot 0, of a pool nothing has used yet (capture runs right after the pool is built).
    own = torch.where(valid[0], slots[0], torch.zeros_like(slots[0]))
    dst = torch.where(valid, slots, own)
    keep = valid[:, None, None]
    k_w = torch.where(keep, k, k[:1])
    v_w = torch.where(keep, v, v[:1])
    write_kv_ref(rotate(balance_k(k_w, k_balance), rotation), rotate(v_w, rotation),
                 k_cache, v_cache, dst, k_scale, v_scale)
    b, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = inputs.block_tables.clamp_min(0)  # -1: a block freed behind a window, masked
    span = tables.shape[1] * block_size
    flat = tables.reshape(-1)
    keys = gather_blocks(k_cache, flat, k_scale, torch.float32).view(b, span, kv_heads, head_dim)
    vals = gather_blocks(v_cache, flat, v_scale, torch.float32).view(b, span, kv_heads, head_dim)
    pos = torch.arange(span, device=q.device)[None, :]
    lens = inputs.context_lens.clamp_min(1)[:, None]
    seen = pos < lens
    if layer.window:
        seen &= pos >= lens - layer.window
    # Slots past a row's length were never written (a fresh pool is uninitialised memory): a
    # NaN there would survive the -inf mask, so they are zeroed as well as masked.
    keep_kv = seen[:, :, None, None]
    keys = torch.where(keep_kv, keys, 0.0)
    vals = torch.where(keep_kv, vals, 0.0)
    mask = torch.zeros(seen.shape, device=q.device).masked_fill_(~seen, float("-inf"))
    query = rotate(balance_q(q, k_balance), rotation).float()
    query = query.view(b, kv_heads, heads // kv_heads, head_dim)
    out = attend(query, keys.transpose(1, 2), vals.transpose(1, 2), mask[:, None, None, :],
                 model.scale, model.family.attn_softcap).reshape(b, heads, head_dim)
    return unrotate(out, rotation).to(q.dtype)
