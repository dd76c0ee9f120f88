"""`kvscope bench` on a tiny model: equal concurrency, the engine's dtype for HF, the host
overhead in the profile (speed itself is measured by running the benchmark, not here)."""
from __future__ import annotations

import json

import pytest

from kvscope.engine.cli import bench as bench_cmd
from kvscope.engine.measure import bench
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bench") / "m")


def run(tiny, capsys, *extra) -> dict:
    argv = ["--model", str(tiny), "--device", "cpu", "--requests", "6", "--min-prompt", "4",
            "--max-prompt", "12", "--min-output", "2", "--max-output", "6", "--json",
            "--max-model-len", "64", *extra]
    assert bench_cmd.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_concurrency_is_the_engines_batch_and_hfs(tiny, capsys):
    r = run(tiny, capsys, "--concurrency", "4", "--dtype", "bfloat16", "--profile")
    c = r["config"]
    assert c["max_num_seqs"] == 4 and c["hf_batch_size"] == 4
    assert r["max_batch_seqs"] <= 4
    assert c["dtype"] == "bfloat16" and c["weights"] == "dense"
    assert r["hf_tokens_per_s"] > 0 and r["speedup"] > 0
    p = r["profile"]
    assert p["host_overhead_cpu_ms_per_step"] > 0 and p["host_overhead_ms_per_step"] > 0
    # The host overhead is the step minus the model: the parts it is made of add up to it.
    host = sum(v for k, v in p["seconds"].items() if k != "model_forward")
    assert host == pytest.approx(p["host_overhead_ms_per_step"] * p["num_steps"] / 1e3,
                                 rel=1e-6)
    # Decode-only steps (every sequence one token) are a subset, the full batches a subset
    # of those; all prompts fit in the first steps' budget, so the rest are decodes.
    d, full = p["decode_only"], p["decode_only_full_batch"]
    assert 0 < d["steps"] < p["num_steps"] and 0 <= full["steps"] <= d["steps"]
    assert 1 <= d["mean_seqs"] <= 4 and full["seqs"] == 4
    assert full["steps"] == 0 or full["mean_seqs"] == 4
    assert d["host_overhead_cpu_ms_per_step"] > 0


def test_batch_size_overrides_hf_alone(tiny, capsys):
    r = run(tiny, capsys, "--concurrency", "3", "--batch-size", "2", "--skip-hf")
    assert r["config"]["max_num_seqs"] == 3 and r["config"]["hf_batch_size"] == 2


def test_bad_concurrency_is_a_clear_error(tiny, capsys):
    assert bench_cmd.main(["--model", str(tiny), "--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err


def test_the_speedup_splits_into_fewer_rows_and_speed_per_row(tiny, capsys):
    """HF's counted rows are its static batches' padded ones: each batch feeds its widest
    prompt, then one row per sequence for every output token but the last. The engine feeds
    each request's prompt and outputs but the last, no padding (no preemption here)."""
    r = run(tiny, capsys, "--concurrency", "4")
    c = r["config"]
    from transformers import AutoConfig, AutoTokenizer
    vocab = AutoConfig.from_pretrained(tiny).vocab_size
    special = bench.special_token_ids(AutoTokenizer.from_pretrained(tiny))
    reqs = bench.build_workload(c["seed"], r["num_requests"], tuple(c["prompt_range"]),
                                tuple(c["output_range"]), vocab, special)
    assert sum(len(q.prompt) for q in reqs) == r["prompt_tokens"]  # the same workload
    assert r["engine_fed_tokens"] == r["prompt_tokens"] + r["generated_tokens"] - len(reqs)
    padded = 0
    for i in range(0, len(reqs), 4):
        batch = reqs[i:i + 4]
        padded += len(batch) * (max(len(q.prompt) for q in batch)
                                + max(q.max_tokens for q in batch) - 1)
    assert r["hf_fed_tokens"] == padded > r["engine_fed_tokens"]
    assert r["fewer_rows"] * r["faster_per_row"] == pytest.approx(r["speedup"])
