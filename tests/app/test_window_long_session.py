"""A long window session keeps its memory flat (issue 29): frames at full rate from synthetic
engine state, requests coming and going all the time. Scaled down for CI (20 s); the hour is
`python -m kvscope.benchmarks.window_soak --minutes 60`."""
from __future__ import annotations

from kvscope.benchmarks.window_soak import window_session


def test_window_memory_stays_flat_over_a_session(qapp):
    out = window_session(20.0, num_blocks=1024, running=16, sample_s=1.0, warmup_s=5.0)
    assert out["ticks"] >= 100  # it drew frames the whole time
    # A leak per frame or per request shows within seconds at full rate: one small object
    # per frame is hundreds; a frame's arrays kept are MiBs.
    assert out["objects_growth"] < 200, out
    assert out["rss_growth_mib"] < 8, out
