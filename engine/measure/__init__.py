"""Measurements behind `kvscope bench` and `kvscope kv-accuracy` (engine/cli/ parses them).

The bench workload, its Hugging Face baseline and profile, the kernel table, long-context
speed beside llama.cpp, and the KV-dtype accuracy runs with the probes they use (passkey,
long document, the user's own prompts). The window's KV grid reads what kv-accuracy saves
through ipc/saved_results.py, never this package.
"""
from __future__ import annotations

from pathlib import Path

# The prompts and texts the accuracy runs read: resources/ at a checkout's root. The wheel
# does not carry resources/, so these runs need a checkout.
RESOURCES = Path(__file__).resolve().parents[2] / "resources"
