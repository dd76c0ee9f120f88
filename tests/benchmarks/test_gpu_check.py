"""gpu_check's driver and report, on the runs that came back from a real GPU (committed under
benchmarks/results/), so a change to the report or the parts cannot break reading them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.device.gpu_check import parse_args
from benchmarks.device.gpu_report import format_with_verdict

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_the_kernel_run_reports_every_case_and_the_reference_failures():
    run = load("gpu_check-h200-2026-12-04-kernels-decode.json")
    text = format_with_verdict(run)
    lines = [x for x in text.splitlines() if x.strip().startswith(("ok", "FAIL"))]
    assert len(lines) == len(run["checks"]) == 71
    assert sum(x.strip().startswith("FAIL") for x in lines) == 6  # int8/fp8 KV write (reference)
    assert "attn+ver" in text and "CHECKS FAILED" in text
    assert text.count("smollm2-like 9/3x64") == 20  # 4 shapes x 5 KV dtypes


def test_the_end_to_end_run_reports_each_part():
    run = load("gpu_check-h200-2026-12-04-e2e.json")
    text = format_with_verdict(run)
    for needle in ("tiny families", "greedy agreement with HF", "preemption: 62 preemptions",
                   "speculative float32: 100% of requests equal", "c=64", "host overhead",
                   "memory used (MiB)", "all checks passed"):
        assert needle in text


def test_parts_are_checked_by_name():
    _, parts, named = parse_args(["--parts", "kernels,e2e"])
    assert parts == ("kernels", "e2e") and named
    _, parts, named = parse_args([])
    assert parts == ("kernels", "decode", "e2e", "device") and not named
    with pytest.raises(SystemExit):
        parse_args(["--parts", "kernels,bogus"])


def test_a_float32_difference_or_a_leaky_preemption_fails_the_run():
    from benchmarks.device.gpu_e2e import passed

    good = {"agreement": {"float32_exact": True}, "families": {"all_exact": True},
            "speculative": {"float32_exact": True}, "preemption": {"ok": True}}
    assert passed(good) and passed({}) and passed({"agreement": {"error": "OOM"}})
    for part, key in (("agreement", "float32_exact"), ("families", "all_exact"),
                      ("speculative", "float32_exact"), ("preemption", "ok")):
        assert not passed(good | {part: {key: False}})
