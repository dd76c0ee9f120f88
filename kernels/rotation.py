"""The orthogonal rotation of q, k and v that makes int8 KV keep more of the answers (QuaRot).

A few channels of K (and some of V) carry most of the magnitude; a per-token scale set by
them leaves the other channels only a few quantization levels. Multiplying every head's q, k
and v (after RoPE) by one orthogonal matrix R spreads those outliers over all channels before
the K/V are quantized, and changes nothing in exact arithmetic: (qR)(kR)^T = qk^T, and the
attention output computed from vR is oR, which R^T turns back into o.

The matrix:
* head_dim a power of two: the normalized Sylvester Hadamard matrix H / sqrt(d) (entries
  +-1/sqrt(d): every output channel is an equal mix of every input channel);
* any other head_dim: a seeded random orthogonal matrix (QR of a float64 Gaussian matrix with
  the signs fixed, so it is Haar-distributed and the same on every machine). It mixes every
  channel with every other, where a block-diagonal Hadamard would only mix within blocks.
"""
from __future__ import annotations

import torch

ROTATIONS = ("hadamard", "none")
SEED = 0x5EED


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard(n: int) -> torch.Tensor:
    """The normalized n x n Sylvester Hadamard matrix (n a power of two), float64."""
    if not is_power_of_two(n):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / float(n ** 0.5)  # int ** float is typed Any


def random_orthogonal(n: int, seed: int = SEED) -> torch.Tensor:
    """A Haar-random n x n orthogonal matrix from a fixed seed, float64."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    # QR's factors are unique only up to signs; fixing diag(R) > 0 makes Q Haar-distributed.
    haar: torch.Tensor = q * torch.sign(torch.diagonal(r))[None, :]  # linalg.qr is typed Any
    return haar


def rotation_matrix(kind: str, head_dim: int, device: torch.device | str = "cpu"
                    ) -> torch.Tensor | None:
    """R [head_dim, head_dim] float32 on `device` (x -> x @ R), or None for "none"."""
    if kind == "none":
        return None
    if kind != "hadamard":
        raise ValueError(f"kv rotation {kind!r} is invalid: expected one of {ROTATIONS}")
    r = hadamard(head_dim) if is_power_of_two(head_dim) else random_orthogonal(head_dim)
    return r.to(device=device, dtype=torch.float32)


def matrix_name(head_dim: int) -> str:
    """What "hadamard" means at this head_dim, for the window and the reports."""
    return "Hadamard" if is_power_of_two(head_dim) else "random orthogonal"


def rotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x [..., head_dim] @ R in float32 (as the Triton kernels compute it); x itself if None.

    Returned in float32 so that a quantizer sees the rotated values unrounded, as the fused
    kernels do; callers that need x's dtype cast.
    """
    if r is None:
        return x
    return x.float() @ r


def unrotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x [..., head_dim] @ R^T in float32, undoing `rotate`; x itself if None."""
    if r is None:
        return x
    return x.float() @ r.T
