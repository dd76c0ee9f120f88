"""The soak-and-chaos benchmark's quick check (benchmarks/soak.py), 60 s against a real
`kvscope serve` with the tiny model. Opt-in: KVSCOPE_SOAK=1 (then `make test` runs it)."""
from __future__ import annotations

import os

import pytest

from benchmarks.serving import soak


@pytest.mark.skipif(os.environ.get("KVSCOPE_SOAK") != "1", reason="set KVSCOPE_SOAK=1")
def test_soak_quick(tmp_path):
    # Reconfigures every 5 s so the 60 s see the whole cycle (block size, dtype, budget)
    # and return to the base settings often enough to compare memory there. A tenth of this
    # run is 6 s, and one reconfigure (every running request recomputed) decides its p99:
    # the 1.2x latency bound is for the 5-minute and longer runs.
    args = soak.parse_args(["--seconds", "60", "--tiny", "--out", str(tmp_path),
                            "--reconfigure-every", "5", "--trace-every", "20",
                            "--warmup-s", "10", "--max-p99-ratio", "3"])
    report = soak.soak(args)
    print(soak.summary(report))
    assert report["passed"], report["failures"]
    outcomes = report["outcomes"]
    assert any(k.startswith("bad:") and k.endswith(":4xx") for k in outcomes)
    assert outcomes.get("zmq:aborted", 0) > 0 and outcomes.get("zmq:ok", 0) > 0
    assert sum(report["reconfigures"].values()) >= 6 and report["traces"] >= 1
