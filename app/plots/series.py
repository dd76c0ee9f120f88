"""Growable numpy time series for the plots (append is amortised O(1), capped)."""
from __future__ import annotations

import numpy as np

MAX_POINTS = 200_000


class Series:
    def __init__(self, names: tuple[str, ...], capacity: int = 1024) -> None:
        self.names = names
        self.t = np.empty(capacity)
        self.cols = {n: np.empty(capacity) for n in names}
        self.n = 0

    def append(self, t: float, **values: float) -> None:
        if self.n == len(self.t):
            if self.n >= MAX_POINTS:  # drop the older half
                keep = self.n // 2
                self.t[:keep] = self.t[self.n - keep:self.n]
                for c in self.cols.values():
                    c[:keep] = c[self.n - keep:self.n]
                self.n = keep
            else:
                self.t = np.resize(self.t, 2 * self.n)
                self.cols = {k: np.resize(v, 2 * self.n) for k, v in self.cols.items()}
        self.t[self.n] = t
        for name in self.names:
            v = values.get(name)
            self.cols[name][self.n] = np.nan if v is None else v
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def times(self) -> np.ndarray:
        return self.t[:self.n]

    def values(self, name: str) -> np.ndarray:
        return self.cols[name][:self.n]

    def clear(self) -> None:
        self.n = 0
