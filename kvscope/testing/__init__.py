"""Helpers the tests and the benchmarks share (frame builders, tiny models, poisoned pools)."""
