"""The KV cache's dtype names, defined once for the engine, the window and the calculator.

Pure names (no torch): kvmath imports nothing of ours, so the engine's configuration, the
window's controls and the KV arithmetic can all read the same tuples.
"""
from __future__ import annotations

# What a KV pool can store, by its canonical name (kv_size.DTYPE_BYTES also takes aliases).
STORED_KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8")
# What a setting may name: "auto" follows the model (engine.config.resolve_kv_dtype).
KV_DTYPES = ("auto", *STORED_KV_DTYPES)
# One byte per element plus a float32 scale per (token, KV head); the K/V rotation's "auto"
# is "calibrated" for these (engine.config.resolve_kv_rotation).
ONE_BYTE_KV_DTYPES = ("int8", "fp8")
# Stored unquantised: greedy outputs are reproducible across block sizes.
FULL_PRECISION_KV_DTYPES = tuple(d for d in KV_DTYPES if d not in ONE_BYTE_KV_DTYPES)
