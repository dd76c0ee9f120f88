"""A long window session keeps its memory flat (issue 29): frames at full rate from synthetic
engine state, requests coming and going all the time. Scaled down for CI (20 s); the hour is
`python -m benchmarks.window.window_soak --minutes 60`."""
from __future__ import annotations

from benchmarks.window.window_soak import window_session
from kvscope.app.blocks import history


def test_window_memory_stays_flat_over_a_session(qapp, monkeypatch):
    # The block map remembers up to FINISHED_KEPT finished requests' tables by design (bounded,
    # oldest dropped). At this test's ~20 finished requests a second, 512 take longer than the
    # run, so on a fast CPU (190-320 frames/s on an AVX-512 EPYC) that bounded memory counted
    # as ~300 objects of growth. With 16 it is full within the warm-up; what grows after is
    # a leak.
    monkeypatch.setattr(history, "FINISHED_KEPT", 16)
    out = window_session(20.0, num_blocks=1024, running=16, sample_s=1.0, warmup_s=5.0)
    assert out["ticks"] >= 100  # it drew frames the whole time
    # A leak per frame or per request shows within seconds at full rate: one small object
    # per frame is hundreds; a frame's arrays kept are MiBs.
    assert out["objects_growth"] < 200, out
    assert out["rss_growth_mib"] < 8, out
