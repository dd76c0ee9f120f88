"""What a tiered KV block is only valid under (the tier key), and the blocks' content digests.

A block's K/V bytes are reusable only by an engine that would have written the very same bytes:
the same model and weights, the same pool dtype, block size, rotation and K calibration, the
same storage layout. The key names all of that; its digest starts every block's content chain,
so a block written under one key is not even found under another (after a reconfigure of
block size or dtype, or another model), and each disk file carries the key in full as well.

The prefix cache's own chain hash (block_manager.chain_hash) is Python's `hash`, which is 64
bits and, for the first block (`hash(None)` before Python 3.12), differs between processes;
the tiers outlive the process, so they chain SHA-256 instead.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

# Bumped whenever the bytes a block is stored as change (disk_tier's header or tensor order).
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TierKey:
    model: str  # the checkpoint's identity (model_identity)
    model_dtype: str  # the weights' compute dtype and format change every K/V bit
    weights: str
    device_type: str  # "cpu" or "cuda": kernels round differently
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rotation: str  # "none", "hadamard", "calibrated"
    calibration: str  # digest of the K balance ("" when none)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.to_json().encode()).digest()


def chain_digest(prev: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    """A full block's content digest: its tokens chained on everything before it (`prev` is
    the previous block's digest, or the key's digest for the first block)."""
    return hashlib.sha256(prev + np.asarray(token_ids, dtype="<i8").tobytes()).digest()


def tensors_digest(tensors: list[bytes]) -> str:
    """A short stable digest of some raw tensor bytes (the K calibration)."""
    h = hashlib.sha256()
    for raw in tensors:
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()[:32]
