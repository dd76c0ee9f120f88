"""Triton paged attention for a varlen batch of decode rows and prefill chunks.

With a rotation R (pool holding K @ R, V @ R; kernels/rotation.py) a program multiplies its
query tile by R after loading it and its accumulator by R^T before storing it: two small
float32 dots per program, no pass over the cache and no extra kernel. With a K balance
(kernels/k_balance.py; the pool holds ((k - c) * g) @ R) the query tile is multiplied by its
KV head's 1 / g before the rotation: one elementwise op (c needs nothing: it moves every
score of a query by the same amount).

Same contract as `kernels.attention_ref.paged_attention_ref` (the CPU path and the oracle):
sequence i's queries are rows query_start_loc[i]:query_start_loc[i+1], the last q_len of
its context_lens[i] tokens, whose K/V are already in the pool; each attends causally (within
its sliding window, when one is given).

Design
* Grid (query tile, kv head, KV split). A query tile is BLOCK_Q consecutive query positions
  of one sequence times the GROUP query heads that share the kv head (GQA), so a program
  computes a [BLOCK_M = BLOCK_Q * GROUP_PAD, head_dim] output tile and every K/V element it
  reads serves all heads of its group. Decode rows and prefill chunks are the same thing:
  a decode row is a tile with one valid query position. The host builds the tile list
  (sequence, first query) from the metadata's lists, once per step (cached on the metadata
  object, so the layers of a step share one small host-to-device copy).
* The program walks the sequence's context in KV tiles of BLOCK_N positions with an online
  softmax (float32 running max / sum / accumulator, exp2 with log2(e) folded into the scale),
  stopping at the last position its queries can see; the causal mask compares absolute
  positions (key position <= ctx - q_len + query index).
* Paging: each key position p maps to block_table[seq, p // block_size] * block_size +
  p % block_size. When block_size >= BLOCK_N a KV tile lies in one block (one table read
  per tile); smaller blocks (down to 1) are gathered per position, so one KV tile spans
  BLOCK_N / block_size blocks. Any power of two 1..256 works with the same kernel.
* Dequantization is fused: int8/fp8 codes go into the dot products unscaled (exactly
  representable in fp16/bf16/fp32); the per-(slot, kv head) K scale multiplies the scores
  column-wise (q . k_code * k_scale) and the V scale multiplies the probabilities
  (p * v_scale) before the P.V product. The softmax sum uses the unscaled p.
  fp8 e4m3 is read as bytes; on sm_89+ it is converted by the hardware, elsewhere (older
  GPUs, the interpreter) with an exact bit trick: the byte's sign/exponent/mantissa moved
  into float16 bits is the value times 2**-8, and the 2**8 goes into the scale.
* Anchor tokens (kernels/anchors.py): for a sequence with an anchor entry, split 0 first
  attends its positions below ANCHOR_LEN from the exact float32 rows (one [ANCHOR_PAD,
  head_dim] tile, unit scale), and the main loop masks those positions out of the pool's
  tiles: nothing is added inside the loop (offline compile for sm_80/sm_90: same registers
  and spill as without anchors).
* Sliding window W (WINDOWED): a query tile's loop starts at the KV tile holding its first
  query's window start and masks positions before it out of the loads (block-table entries
  of blocks wholly before the window may be -1: never read); each query's mask adds
  key position > q_pos - W. Soft-capping (SOFTCAP): the scores, in log2 units, go through
  c' * tanh(s / c') with c' = softcap * log2(e), tanh written through exp2, before masking.
  Both are constexpr switches, so the kernel without them is unchanged.
* Long contexts with few tiles (decode) split the context into NUM_SPLITS ranges (flash-
  decoding): each split writes its unnormalised accumulator, max and sum, and a second
  small kernel merges them. On the CPU interpreter the default is one split.
* Dot products run in the query's dtype (bf16/fp16 tensor cores, float32 accumulation).
  float32 queries use 3xTF32 on the GPU (about float32 accuracy on tensor cores; plain TF32
  would lose ~3 decimal digits) and IEEE float32 in the interpreter. Under the interpreter
  bf16 dots run in float32 (it multiplies bf16 bit patterns as integers).
* Tiles: BLOCK_M = 16 query rows (decode-only steps) or 64 (32 for float32); BLOCK_N = 64
  keys for head_dim <= 64 (32 for float32 or larger heads); 8 warps from 64 x 128 output
  tiles (32 x 128 for float32) and whenever the rotation is on, else 4 (register use checked
  by compiling for sm_80 and sm_90 offline, benchmarks/device/triton_registers.py: no spills in the
  KV loop; the rotated tiles spilled in it at 4 warps).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from kvscope.kernels.anchors import Anchors
from kvscope.kernels.attention_ref import AttentionMetadata, check_window_softcap
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.quant import is_quantized
from kvscope.kernels.triton_kv_write import _bf16_rne, check_k_balance, check_rotation

_LOG2E = 1.4426950408889634

KV_FLOAT, KV_INT8, KV_FP8_NATIVE, KV_FP8_BITS = 0, 1, 2, 3


@triton.jit
def _codes_to(x, KV_KIND: tl.constexpr, DOT: tl.constexpr):
    """Cache elements -> dot operand dtype (exact for int8/fp8 codes)."""
    if KV_KIND == 2:
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif KV_KIND == 3:
        # e4m3fn byte -> float16 bits of (value * 2**-8), subnormals included.
        i = x.to(tl.int16)
        x = (((i & 0x80) << 8) | ((i & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return x.to(DOT)


@triton.jit
def _softcap(s, cap2):
    """cap2 * tanh(s / cap2), with tanh written through exp2 (the interpreter's tl has no
    tanh): 1 - 2 / (e^(2x) + 1), which saturates to +-1 when e^(2x) overflows or vanishes.
    Scores here are in log2 units (scale * log2(e) folded in), so cap2 = softcap * log2(e)."""
    e = tl.exp2(s * (2.0 * 1.4426950408889634 / cap2))
    return cap2 * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _store_out(ptr, x, mask, BF16_OUT: tl.constexpr):
    if BF16_OUT:
        tl.store(ptr, _bf16_rne(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
    qsl_ptr, ctx_ptr, tile_seq_ptr, tile_q_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    rot_ptr,                          # R [HEAD_DIM, HEAD_DIM] float32 when ROTATE
    qgain_ptr,                        # K balance 1 / g [kv_heads, HEAD_DIM] when BALANCE
    anchor_k_ptr, anchor_v_ptr,       # anchor rows [entries, ANCHOR_LEN, kv_heads, HEAD_DIM]
    anchor_idx_ptr,                   # [B] int32 anchor entry per sequence (-1: none)
    sae, sas, sah,                    # anchor row strides (entry, position, head)
    sqt, sqh, sqd,                    # query strides
    scb, scs, sch, scd,               # cache strides (K and V share them)
    ssb, sss, ssh,                    # scale cache strides
    sbt,                              # block table row stride
    sot, soh, sod,                    # output strides
    num_tokens, num_heads,
    qk_scale,                         # softmax scale * log2(e) (* 2**8 for fp8 bit decode)
    v_fix,                            # 1, or 2**8 for fp8 bit decode
    window,                           # sliding window W when WINDOWED
    softcap2,                         # softcap * log2(e) when SOFTCAP
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_KIND: tl.constexpr,
    QUANT: tl.constexpr, DOT: tl.constexpr, F32_PRECISION: tl.constexpr,
    BF16_OUT: tl.constexpr, ROTATE: tl.constexpr, BALANCE: tl.constexpr,
    ANCHOR_LEN: tl.constexpr, ANCHOR_PAD: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    q_first = tl.load(tile_q_ptr + tile)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)

    m = tl.arange(0, BLOCK_M)
    q_local = q_first + m // GROUP_PAD
    hg = m % GROUP_PAD
    row_ok = (q_local < q_len) & (hg < GROUP)
    token = (q_start + q_local).to(tl.int64)
    head = kvh * GROUP + hg
    q_pos = ctx - q_len + q_local                       # absolute position of each query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + token[:, None] * sqt + head[:, None] * sqh + d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if BALANCE:
        qg = tl.load(qgain_ptr + kvh * HEAD_DIM + d, mask=d_ok, other=0.0)
        q = q.to(tl.float32) * qg[None, :]
    if ROTATE:
        # The pool holds K @ R: attend with q @ R (same scores), in registers.
        r = tl.load(rot_ptr + d[:, None] * HEAD_DIM + d[None, :],
                    mask=d_ok[:, None] & d_ok[None, :], other=0.0)
        q = tl.dot(q.to(tl.float32), r, input_precision="ieee")
    q = q.to(DOT)

    # Keys this tile can see: up to its last query's position, and with a window from its
    # first query's window start (w_lo) on. The loop starts at the KV tile holding w_lo;
    # positions before w_lo are never loaded (their block-table entries may be -1).
    kv_end = ctx - q_len + tl.minimum(q_first + BLOCK_Q, q_len)
    w_lo = 0
    if WINDOWED:
        w_lo = tl.maximum(ctx - q_len + q_first - window + 1, 0)
    kv_lo = (w_lo // BLOCK_N) * BLOCK_N
    split_len = tl.cdiv(tl.cdiv(kv_end - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, kv_end)

    # The running max starts finite so exp2(m_old - m_new) is never inf - inf = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq * sbt
    n = tl.arange(0, BLOCK_N)
    if ANCHOR_LEN > 0:
        # A sequence with an anchor entry: its positions below ANCHOR_LEN are attended here,
        # once (split 0), from the exact float32 rows; the loop below skips them in the pool.
        # Kept out of the loop so that the loop's tiles carry no extra loads or registers.
        a_entry = tl.load(anchor_idx_ptr + seq).to(tl.int64)
        a_len = tl.where(a_entry >= 0, ANCHOR_LEN, 0)
        if (split == 0) & (a_entry >= 0):
            ap = tl.arange(0, ANCHOR_PAD)
            a_ok = ap < ANCHOR_LEN
            a_off = a_entry * sae + ap.to(tl.int64) * sas + kvh * sah
            a_mask = a_ok[:, None] & d_ok[None, :]
            ak = tl.load(anchor_k_ptr + a_off[:, None] + d[None, :], mask=a_mask, other=0.0)
            if F32_PRECISION == "":
                s = tl.dot(q, tl.trans(ak.to(DOT)))
            else:
                s = tl.dot(q, tl.trans(ak.to(DOT)), input_precision=F32_PRECISION)
            s = s * (qk_scale / v_fix)  # exact rows: no code scale, no fp8 bit-decode factor
            if SOFTCAP:
                s = _softcap(s, softcap2)
            visible = a_ok[None, :] & (ap[None, :] <= q_pos[:, None])
            if WINDOWED:
                visible = visible & (ap[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_i = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_i[:, None])
            l_i = tl.sum(p, axis=1)
            av = tl.load(anchor_v_ptr + a_off[:, None] + d[None, :], mask=a_mask, other=0.0)
            if F32_PRECISION == "":
                acc = tl.dot(p.to(DOT), av.to(DOT))
            else:
                acc = tl.dot(p.to(DOT), av.to(DOT), input_precision=F32_PRECISION)

    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        n_ok = pos < hi
        if WINDOWED:
            n_ok = n_ok & (pos >= w_lo)
        if BLOCK_SIZE >= BLOCK_N:
            # The whole KV tile sits in one block.
            phys = tl.load(bt_row + start // BLOCK_SIZE).to(tl.int64)
            slot_off = phys * scb + (pos % BLOCK_SIZE) * scs
            sc_off = phys * ssb + (pos % BLOCK_SIZE) * sss
        else:
            phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot_off = phys * scb + (pos % BLOCK_SIZE) * scs
            sc_off = phys * ssb + (pos % BLOCK_SIZE) * sss
        kv_off = slot_off[:, None] + kvh * sch + d[None, :] * scd
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = _codes_to(tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0), KV_KIND, DOT)
        if F32_PRECISION == "":
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k), input_precision=F32_PRECISION)
        if QUANT:
            ks = tl.load(k_scale_ptr + sc_off + kvh * ssh, mask=n_ok, other=0.0)
            s = s * (ks * qk_scale)[None, :]
        else:
            s = s * qk_scale
        if SOFTCAP:
            s = _softcap(s, softcap2)
        visible = n_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if ANCHOR_LEN > 0:
            visible = visible & (pos >= a_len)[None, :]  # attended from the anchor rows
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = _codes_to(tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0), KV_KIND, DOT)
        if QUANT:
            vs = tl.load(v_scale_ptr + sc_off + kvh * ssh, mask=n_ok, other=0.0)
            p = p * (vs * v_fix)[None, :]
        if F32_PRECISION == "":
            acc += tl.dot(p.to(DOT), v)
        else:
            acc += tl.dot(p.to(DOT), v, input_precision=F32_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if ROTATE:
        # The pool holds V @ R, so acc is (P V) R: turn it back with R^T before it leaves the
        # registers (linear, so partial results of split KV merge unchanged).
        rt = tl.load(rot_ptr + d[None, :] * HEAD_DIM + d[:, None],
                     mask=d_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(acc, rt, input_precision="ieee")
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        _store_out(out_ptr + token[:, None] * sot + head[:, None] * soh + d[None, :] * sod,
                   o, out_mask, BF16_OUT)
    else:
        row = (split * num_tokens + token) * num_heads + head          # [S, T, H] index
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, sot, soh, sod, num_tokens, num_heads,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr, BF16_OUT: tl.constexpr,
):
    """One program per (token, head): combine the splits' partial softmax results."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row = (s * num_tokens + token) * num_heads + head
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=-1.0e30)
    l_ = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    total = tl.sum(l_ * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    _store_out(out_ptr + token * sot + head * soh + d * sod, o, d_ok, BF16_OUT)


# -- host side -----------------------------------------------------------------------------
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _fp8_native(device: torch.device) -> bool:
    """Hardware e4m3 conversion: NVIDIA sm_89+ (Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _step_tensors(meta: AttentionMetadata, device: torch.device, block_q: int
                  ) -> dict[str, Any]:
    """Device copies of the per-step lists and the tile list, built once per step.

    The metadata of a step is not changed after it is built and every layer passes the same
    object, so the result is cached on it.
    """
    key = (str(device), block_q)
    cache = meta.__dict__.setdefault("_triton_step_tensors", {})
    hit = cache.get(key)
    if hit is not None:
        return hit
    qsl, ctx = meta.query_start_loc, meta.context_lens
    tile_seq, tile_q = [], []
    for i in range(len(ctx)):
        q_len = qsl[i + 1] - qsl[i]
        if q_len > ctx[i]:
            raise ValueError(f"sequence {i} has {q_len} queries but only {ctx[i]} tokens")
        for j in range(0, q_len, block_q):
            tile_seq.append(i)
            tile_q.append(j)
    b, n = len(ctx), len(tile_seq)
    packed = torch.tensor(list(qsl) + list(ctx) + tile_seq + tile_q, dtype=torch.int32)
    packed = packed.to(device, non_blocking=True)
    tables = meta.block_tables
    if tables.device != device:
        tables = tables.to(device, non_blocking=True)
    hit = {
        "qsl": packed[:b + 1], "ctx": packed[b + 1:2 * b + 1],
        "tile_seq": packed[2 * b + 1:2 * b + 1 + n], "tile_q": packed[2 * b + 1 + n:],
        "num_tiles": n, "block_tables": tables, "max_ctx": max(ctx, default=0),
        "anchor_index": None if meta.anchor_index is None
        else meta.anchor_index.to(device=device, dtype=torch.int32),
    }
    cache[key] = hit
    return hit


def _choose_splits(device: torch.device, programs: int, max_ctx: int) -> int:
    """Flash-decoding split count: enough programs to fill the GPU, each split >= 512 keys."""
    if device.type != "cuda" or programs == 0:
        return 1
    target = 4 * _sm_count(device)
    if programs >= target // 2:
        return 1
    return max(1, min(math.ceil(target / programs), max_ctx // 512, 64))


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, *,
                           rotation: torch.Tensor | None = None,
                           k_balance: KBalanceLayer | None = None,
                           anchors: Anchors | None = None,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           block_n: int | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """query: [T, heads, head_dim] -> [T, heads, head_dim] in query's dtype.

    Keyword-only extras: `rotation` (R [head_dim, head_dim] float32: the pool holds K @ R and
    V @ R; the kernel rotates q by R after loading it and the output by R^T before storing
    it, so the result is attention over the unrotated K/V), `k_balance` (kernels.k_balance:
    the pool's keys were shifted and scaled per channel; the query is scaled by 1 / g of its
    KV head before the rotation), `anchors` (kernels.anchors, with meta.anchor_index: the
    first positions of a sequence with an entry are read from those float32 rows instead
    of the pool), `out` (written in place and
    returned), `num_splits` (KV splits per
    tile; default: chosen from the GPU's size, 1 on the interpreter), `block_n` (KV tile),
    `window` (sliding window W: a query at p attends p - W < j <= p; KV tiles before a query
    tile's window are skipped, 0 = none), `softcap` (scores -> c * tanh(s / c), 0 = off).
    """
    check_window_softcap(window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError("K and V caches must share shape, strides and dtype")
    if cache_dim != head_dim or num_heads % kv_heads:
        raise ValueError(f"query [{num_tokens}, {num_heads}, {head_dim}] does not fit a cache "
                         f"of {kv_heads} kv heads x {cache_dim}")
    if block_size & (block_size - 1) or not 1 <= block_size <= 256:
        raise ValueError(f"block size {block_size} is not a power of two from 1 to 256")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype {query.dtype} is not supported")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError("out must have the query's shape and dtype")
    if num_tokens == 0:
        return out
    if meta.query_start_loc[-1] != num_tokens:
        raise ValueError(f"query_start_loc ends at {meta.query_start_loc[-1]}, "
                         f"query has {num_tokens} rows")
    device = query.device
    interpret = device.type != "cuda"
    rot = check_rotation(rotation, head_dim, device)
    kb = check_k_balance(k_balance, kv_heads, head_dim, device)

    quant = is_quantized(k_cache.dtype)
    kc, vc = k_cache, v_cache
    fix = 1.0
    if quant:
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_cache.dtype} KV cache needs its scale caches")
        if k_scale.stride() != v_scale.stride():
            raise ValueError("K and V scale caches must share strides")
        if k_cache.dtype == torch.int8:
            kind = KV_INT8
        else:
            kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            kind = KV_FP8_NATIVE if _fp8_native(device) else KV_FP8_BITS
            fix = 256.0 if kind == KV_FP8_BITS else 1.0
        ks, vs = k_scale, v_scale
        scale_strides = k_scale.stride()
    else:
        kind = KV_FLOAT
        ks = vs = query  # placeholders, never read
        scale_strides = (0, 0, 0)

    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    max_q = max(b - a for a, b in itertools.pairwise(meta.query_start_loc))
    dot = query.dtype
    if dot == torch.bfloat16 and interpret:
        dot = torch.float32
    # Tensor-core dots need M, N, K >= 16; decode-only steps take the smallest query tile.
    # float32 dots (3xTF32) hold more registers: smaller tiles.
    f32 = dot == torch.float32
    block_m = max(16 if max_q == 1 else (32 if f32 else 64), group_pad)
    block_q = block_m // group_pad
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        block_n = 32 if interpret or f32 or block_d > 64 else 64
    if not 16 <= block_n <= 256 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} is not a power of two from 16 to 256")
    # A rotation holds R and a float32 dot in registers: at 4 warps the KV loop spills
    # (benchmarks/device/triton_registers.py: 2-5 local loads/stores a tile on sm_80/sm_90), at 8
    # it does not.
    big = block_m * block_d * (2 if f32 else 1) >= 64 * 128
    num_warps = 8 if big or rot is not None else 4
    step = _step_tensors(meta, device, block_q)
    n_tiles = step["num_tiles"]
    if num_splits is None:
        span = min(step["max_ctx"], window) if window else step["max_ctx"]
        num_splits = _choose_splits(device, n_tiles * kv_heads, span)
    num_splits = max(1, int(num_splits))

    dot_tl = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if num_splits > 1:
        part_acc = torch.empty((num_splits, num_tokens, num_heads, head_dim),
                               dtype=torch.float32, device=device)
        part_ml = torch.empty((num_splits, num_tokens, num_heads, 2), dtype=torch.float32,
                              device=device)
    else:
        part_acc = part_ml = out  # placeholders, never written
    tables = step["block_tables"]
    bf16_out = query.dtype == torch.bfloat16
    ak, av, a_idx, a_len = _anchor_args(anchors, step["anchor_index"], kv_heads, head_dim,
                                        device, query)
    _paged_attention_kernel[(n_tiles, kv_heads, num_splits)](
        query, kc, vc, ks, vs, tables,
        step["qsl"], step["ctx"], step["tile_seq"], step["tile_q"],
        out, part_acc, part_ml, query if rot is None else rot,
        query if kb is None else kb.q_gain,
        ak, av, a_idx, *(ak.stride()[:3] if a_len else (0, 0, 0)),
        *query.stride(), *k_cache.stride(), *scale_strides, tables.stride(0), *out.stride(),
        num_tokens, num_heads,
        float(scale) * _LOG2E * fix, fix, min(window, 2**31 - 1), float(softcap) * _LOG2E,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        KV_KIND=kind, QUANT=quant, DOT=dot_tl[dot],
        F32_PRECISION=("ieee" if interpret else "tf32x3") if f32 else "",
        BF16_OUT=bf16_out, ROTATE=rot is not None, BALANCE=kb is not None,
        ANCHOR_LEN=a_len, ANCHOR_PAD=max(16, triton.next_power_of_2(a_len)),
        WINDOWED=window > 0, SOFTCAP=softcap > 0, num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, *out.stride(), num_tokens, num_heads,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d, BF16_OUT=bf16_out,
        )
    return out


def _anchor_args(anchors: Anchors | None, index: torch.Tensor | None, kv_heads: int,
                 head_dim: int, device: torch.device, placeholder: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(anchor K, anchor V, entry per sequence, anchor length) for the kernel; placeholders
    and length 0 when there are none."""
    if anchors is None or index is None:
        return placeholder, placeholder, placeholder, 0
    ak, av = anchors
    if ak.shape != av.shape or ak.dim() != 4 or ak.shape[2:] != (kv_heads, head_dim) \
            or ak.dtype != torch.float32 or av.stride() != ak.stride() or ak.stride(3) != 1:
        raise ValueError(f"anchor rows {tuple(ak.shape)} must be float32 [entries, n, "
                         f"{kv_heads}, {head_dim}], K and V alike and contiguous per row")
    if ak.device != device:
        raise ValueError(f"anchor rows on {ak.device}, query on {device}")
    return ak, av, index, ak.shape[1]
