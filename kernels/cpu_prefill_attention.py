"""Prefill chunks on the CPU: a chunk's queries over its sequence's cached K/V in two fused
(flash) attention passes, merged by their log-sum-exp.

The reference (kernels.attention_ref) runs one SDPA over the whole context with a boolean
mask [q_len, context] and enable_gqa, so the mask is read for every score, and each chunk
of a long prompt pays that over all the keys before it, which every query sees anyway. Here:

* the keys before the chunk: one pass with no mask, the query heads that share a KV head
  folded into that head's rows ([kv_heads, group * q_len, d]), so K/V are never expanded and
  each K/V tile is read once for the whole group;
* the chunk's own keys: one causal pass (as many keys as queries, so torch's top-left
  causal mask is the right one);
* out = sum_i exp(lse_i - lse) o_i with lse = logaddexp(lse_1, lse_2): softmax over the
  union of the two key sets, exactly (tests/kernels/test_cpu_prefill_attention.py checks it
  against the reference in float64).

Both passes are torch's fused CPU flash attention, the op SDPA itself dispatches to on the
CPU, called directly for its log-sum-exp. A sliding window that bites and soft-capping keep
the reference, as does a torch without that op.

A bfloat16 pool beside float32 queries (the CPU default with int4 weights, engine/config.py)
may run both passes in bfloat16: K/V are bfloat16 already, the query is rounded to it, and
torch's kernel keeps float32 sums and softmax statistics but multiplies the probabilities by
V in bfloat16. On a CPU with bfloat16 matmul units that is ~3x faster at long context (the
passes are most of an 8k-token prefill's time); elsewhere it may be slower. So it is the
kernel chooser's decision (kernels.kernel_choice), timed once per machine on a prefill
chunk's shape, never a flag.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvscope.kernels import kernel_choice
from kvscope.kernels.anchors import Anchors
from kvscope.kernels.attention_ref import (
    AttentionMetadata,
    LayerPool,
    _overlay,
    _prefill_attention,
    check_window_softcap,
    gather_context,
)

# (q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp [B, H, L])
Flash = Callable[..., tuple[torch.Tensor, torch.Tensor]]
FLASH: Flash | None = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                              None)


def prefill_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          anchors: Anchors | None = None, *, window: int = 0,
                          softcap: float = 0.0) -> torch.Tensor:
    """As kernels.attention_ref.paged_attention_ref for the rows of meta.prefill_seqs; the
    other (decode) rows of the result are left unwritten, for the decode kernel."""
    check_window_softcap(window, softcap)
    pool: LayerPool = (k_cache, v_cache, k_scale, v_scale,
                       anchors if meta.anchor_index is not None else None)
    out = torch.empty_like(query)
    flash = FLASH
    for i in meta.prefill_seqs:
        # A window at least the context long never bites: every query sees every key.
        if flash is None or softcap or (window and meta.context_lens[i] > window):
            _prefill_attention(query, pool, meta, i, scale, out, window, softcap)
        else:
            _two_pass(flash, query, pool, meta, i, scale, out)
    return out


def _two_pass(flash: Flash, query: torch.Tensor, pool: LayerPool, meta: AttentionMetadata,
              i: int, scale: float, out: torch.Tensor) -> None:
    k_cache, v_cache, k_scale, v_scale, anchors = pool
    start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
    q_len, ctx = end - start, meta.context_lens[i]
    past = ctx - q_len
    table = meta.block_tables[i]
    compute = compute_dtype(flash, query, k_cache)
    k = gather_context(k_cache, table, ctx, k_scale, compute)
    v = gather_context(v_cache, table, ctx, v_scale, compute)
    if anchors is not None and meta.anchor_index is not None:
        _overlay(k[None], v[None], meta.anchor_index[i:i + 1].to(k.device), anchors, None)
    q = query[start:end].to(compute).transpose(0, 1)[None]  # [1, heads, q_len, d]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[3]
    group = heads // kv_heads
    own_k, own_v = k[:, :, past:], v[:, :, past:]
    if group > 1:  # q_len rows: expanding them costs less than a second folded layout
        own_k, own_v = own_k.repeat_interleave(group, 1), own_v.repeat_interleave(group, 1)
    o, lse = flash(q, own_k, own_v, 0.0, True, scale=scale)
    if past:
        folded = q.reshape(1, kv_heads, group * q_len, d)  # heads h = kv * group + j
        o_past, lse_past = flash(folded, k[:, :, :past], v[:, :, :past], 0.0, False,
                                 scale=scale)
        o_past = o_past.reshape(1, heads, q_len, d)
        lse_past = lse_past.reshape(1, heads, q_len)
        total = torch.logaddexp(lse, lse_past)
        acc = torch.promote_types(o.dtype, torch.float32)  # bfloat16 rows merge in float32
        o = (o.to(acc) * (lse - total).exp()[..., None].to(acc)
             + o_past.to(acc) * (lse_past - total).exp()[..., None].to(acc))
    out[start:end] = o[0].transpose(0, 1).to(out.dtype)


# The shape the bfloat16 decision is timed on: a prefill chunk deep into a long prompt.
CHOICE_Q_LEN, CHOICE_PAST = 256, 2048
FLOAT32, BFLOAT16 = "float32", "bfloat16"


def compute_dtype(flash: Flash, query: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """bfloat16 for float32 queries over a bfloat16 pool where it measured faster on this
    machine (module docstring), else the query's dtype."""
    if query.dtype != torch.float32 or k_cache.dtype != torch.bfloat16:
        return query.dtype
    heads, kv_heads, d = query.shape[1], k_cache.shape[2], query.shape[2]
    key = ("prefill-attention", heads, kv_heads, d, torch.get_num_threads())
    chooser = kernel_choice.default()
    choice = chooser.fast(key)
    if choice is None:
        info = {"op": "attn", "dtype": "bf16 pool", "shape": f"{heads}x{kv_heads}x{d}",
                "rows": CHOICE_Q_LEN, "threads": torch.get_num_threads()}
        choice = chooser.choose(decision_name(heads, kv_heads, d),
                                _dtype_candidates(flash, heads, kv_heads, d), info, key)
    return torch.bfloat16 if choice == BFLOAT16 else torch.float32


def decision_name(heads: int, kv_heads: int, d: int) -> str:
    """The chooser's name for the decision (`kvscope bench --kernels` asks by it)."""
    threads = kernel_choice.threads_name(torch.get_num_threads())
    return (f"prefill-attention bfloat16-pool {heads}x{kv_heads}x{d} q{CHOICE_Q_LEN} "
            f"past{CHOICE_PAST} {threads}")


def decide_for(heads: int, kv_heads: int, d: int) -> str | None:
    """Make (or look up) the decision for this head layout; its name, None without the op."""
    if FLASH is None:
        return None
    compute_dtype(FLASH, torch.empty(1, heads, d),
                  torch.empty(1, 1, kv_heads, d, dtype=torch.bfloat16))
    return decision_name(heads, kv_heads, d)


def _dtype_candidates(flash: Flash, heads: int, kv_heads: int, d: int
                      ) -> dict[str, Callable[[], object]]:
    """Both passes of one chunk, on random inputs of the chosen shape, in each dtype."""
    gen = torch.Generator().manual_seed(0)
    group = heads // kv_heads

    def passes(dtype: torch.dtype) -> Callable[[], object]:
        q = torch.randn(1, heads, CHOICE_Q_LEN, d, generator=gen).to(dtype)
        own = torch.randn(1, heads, CHOICE_Q_LEN, d, generator=gen).to(dtype)
        past = torch.randn(1, kv_heads, CHOICE_PAST, d, generator=gen).to(dtype)
        folded = q.reshape(1, kv_heads, group * CHOICE_Q_LEN, d)
        return lambda: (flash(q, own, own, 0.0, True, scale=d ** -0.5),
                        flash(folded, past, past, 0.0, False, scale=d ** -0.5))

    return {FLOAT32: passes(torch.float32), BFLOAT16: passes(torch.bfloat16)}
