"""The classic allocation experiment: reserve max-length slots per request vs paged blocks.

Reserved: every request reserves `max_len` slots up front; waste = (reserved - used) / reserved.
Paged: a request holds ceil(len / block_size) blocks; waste = (paged - used) / paged (only the
last, partly filled block is wasted). The ratio is reserved slots / paged slots.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FragResult:
    requests: int
    block_size: int
    max_len: int
    used_slots: int
    reserved_slots: int
    paged_slots: int

    @property
    def reserved_waste(self) -> float:
        return (self.reserved_slots - self.used_slots) / self.reserved_slots

    @property
    def paged_waste(self) -> float:
        return (self.paged_slots - self.used_slots) / self.paged_slots

    @property
    def ratio(self) -> float:
        return self.reserved_slots / self.paged_slots

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "reserved_waste": self.reserved_waste,
                "paged_waste": self.paged_waste, "ratio": self.ratio}


def random_lengths(requests: int, min_len: int, max_len: int, seed: int) -> list[int]:
    if requests < 1 or min_len < 1 or max_len < min_len:
        raise ValueError(f"need requests >= 1 and 1 <= min_len <= max_len, got requests="
                         f"{requests}, min_len={min_len}, max_len={max_len}")
    random.seed(seed)
    return [random.randint(min_len, max_len) for _ in range(requests)]


def simulate(lengths: list[int], block_size: int, max_len: int | None = None) -> FragResult:
    if not lengths:
        raise ValueError("no request lengths to simulate")
    if block_size < 1:
        raise ValueError(f"block_size {block_size} must be >= 1")
    if any(n < 1 for n in lengths):
        raise ValueError("every request length must be >= 1")
    max_len = max(lengths) if max_len is None else max_len
    if max_len < max(lengths):
        raise ValueError(f"max_len {max_len} is below the longest request {max(lengths)}")
    used = sum(lengths)
    paged = sum(-(-n // block_size) * block_size for n in lengths)
    return FragResult(len(lengths), block_size, max_len, used, max_len * len(lengths), paged)
