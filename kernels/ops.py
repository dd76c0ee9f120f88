"""The kernels the engine calls: Triton on CUDA tensors; on the CPU the native decode
attention (kernels.cpu_attention, when it builds) with the torch references for the rest.

`KVSCOPE_KERNELS` overrides the choice: `ref` (the torch references everywhere, no native
code) or `triton` (Triton everywhere; on CPU tensors that works only under TRITON_INTERPRET=1,
the slow interpreter the tests use). Unset, empty or `auto`: by device. Triton is imported on
first use, so a CPU-only install never needs a GPU toolchain to import this module.
"""
from __future__ import annotations

import os

import torch

from kvscope.kernels import cpu_attention, cpu_kv_write, native
from kvscope.kernels.anchors import Anchors, write_anchors
from kvscope.kernels.attention_ref import (
    AttentionMetadata,
    check_window_softcap,
    paged_attention_ref,
)
from kvscope.kernels.k_balance import KBalanceLayer, balance_k, balance_q
from kvscope.kernels.kv_write_ref import write_kv_ref
from kvscope.kernels.rotation import rotate, unrotate

ENV = "KVSCOPE_KERNELS"
BACKENDS = ("ref", "triton")


def backend(device: torch.device | str) -> str:
    """'triton' (CUDA), 'cpu' (the native CPU kernels, when they built) or 'ref' (the torch
    references) for tensors on `device`, honouring KVSCOPE_KERNELS."""
    device = torch.device(device)
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("", "auto"):
        if device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and native.available() else "ref"
    if forced not in BACKENDS:
        raise ValueError(f"{ENV}={forced!r} is invalid: expected one of auto, ref, triton")
    if forced == "triton" and device.type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{ENV}=triton with tensors on {device}: Triton runs there only "
                           "under TRITON_INTERPRET=1 (set before triton is imported)")
    return forced


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             rotation: torch.Tensor | None = None,
             k_balance: KBalanceLayer | None = None, anchors: Anchors | None = None,
             anchor_fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Scatter new K/V rows into their slots (quantizing for int8/fp8 pools); see
    kernels.kv_write_ref.write_kv_ref. With a `rotation` R (kernels.rotation) the pool holds
    key @ R and value @ R; with a `k_balance` (kernels.k_balance) the key is first shifted
    and scaled per channel, ((key - c) * g) @ R. The Triton kernel does both in registers.
    `anchor_fill` (batch rows, anchor rows): those rows also go, unquantized, into
    `anchors` (kernels.anchors) -- a few rows of a step that opens a new sequence, in torch
    on every path."""
    if anchors is not None and anchor_fill is not None and len(anchor_fill[0]):
        rows, slots = anchor_fill
        write_anchors(rotate(balance_k(key[rows], k_balance), rotation),
                      rotate(value[rows], rotation), slots, anchors)
    path = backend(k_cache.device)
    if path == "triton":
        from kvscope.kernels.triton_kv_write import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                        rotation=rotation, k_balance=k_balance)
    elif path == "cpu" and cpu_kv_write.supports(key, k_cache):
        cpu_kv_write.write_quantized(key, value, k_cache, v_cache, slot_mapping, k_scale,
                                     v_scale, rotation, k_balance)
    else:
        write_kv_ref(rotate(balance_k(key, k_balance), rotation), rotate(value, rotation),
                     k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    rotation: torch.Tensor | None = None,
                    k_balance: KBalanceLayer | None = None,
                    anchors: Anchors | None = None, *, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Varlen paged attention (decode rows and prefill chunks); see
    kernels.attention_ref.paged_attention_ref. With a `rotation` R the pool holds rotated K/V:
    the query is rotated the same way and the output rotated back (o = (o R) R^T), so the
    result is attention over the unrotated K/V. With a `k_balance` the pool's keys are
    ((k - c) * g) @ R and the query attends as (q / g) @ R: every score of a query moves by
    the same q.c, which softmax ignores. The Triton kernel does all of it in registers.
    `anchors` (kernels.anchors, with meta.anchor_index): the first positions of sequences
    with an anchor entry are read from it instead of the pool. `window` (sliding window,
    0 = none) and `softcap` (gemma2's attention logit soft-capping, 0 = off) go to every
    backend: a query at position p attends to p - window < j <= p, scores become
    softcap * tanh(score / softcap)."""
    check_window_softcap(window, softcap)
    path = backend(query.device)
    if path == "triton":
        from kvscope.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                      rotation=rotation, k_balance=k_balance, anchors=anchors,
                                      window=window, softcap=softcap)
    attend = paged_attention_ref
    if path == "cpu" and cpu_attention.supports(query, k_cache):
        attend = cpu_attention.paged_attention_cpu
    if rotation is None and k_balance is None:
        return attend(query, k_cache, v_cache, meta, scale, k_scale, v_scale, anchors,
                      window=window, softcap=softcap)
    q = rotate(balance_q(query, k_balance), rotation).to(query.dtype)
    out = attend(q, k_cache, v_cache, meta, scale, k_scale, v_scale, anchors, window=window,
                 softcap=softcap)
    return unrotate(out, rotation).to(query.dtype)
