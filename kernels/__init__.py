"""Attention and KV-cache kernels: torch references (the CPU path and the test oracle)."""
