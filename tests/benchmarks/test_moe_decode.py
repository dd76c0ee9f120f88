"""benchmarks/cpu/moe_decode.py: every engine weight format and HF are timed at each
concurrency asked for, and the dense engine's greedy tokens are checked against HF's (speed
itself is the benchmark's to show)."""
from __future__ import annotations

import json

from benchmarks.cpu import moe_decode


def test_each_weight_format_and_hf_are_timed_and_dense_matches_hf(capsys):
    argv = ["--tokens", "3", "--prompt-len", "4", "--concurrency", "1", "3", "--repeats", "1",
            "--weights", "dense", "int4", "--json"]
    assert moe_decode.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["threads"] >= 1
    for n in ("1", "3"):
        row = got[n]
        assert set(row) == {"hf", "dense", "int4", "match"}
        assert all(row[k] > 0 for k in ("hf", "dense", "int4"))
        assert row["match"] is True
