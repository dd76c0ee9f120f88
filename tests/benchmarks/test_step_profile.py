"""benchmarks/step_profile.py on a tiny model: the parts it times are really inside the step
(speed itself is measured by running the benchmark, not here)."""
from __future__ import annotations

import json

import pytest

from benchmarks.cpu import step_profile
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("sp") / "m")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_shares_of_a_decode_step(tiny, capsys, dtype):
    argv = ["--model", str(tiny), "--dtype", dtype, "--seqs", "3", "--context", "20",
            "--steps", "4", "--json"]
    assert step_profile.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == dtype and r["seqs"] == 3
    # The wrapped parts ran in every step and fit inside it. float32 and bfloat16 decode steps
    # are fused (engine.model.fused.decode): their K/V write happens inside the RoPE call, counted
    # as other; float16 takes the torch forward.
    assert r["attention_ms"] > 0 and r["matmul_ms"] > 0
    assert (r["kv_write_ms"] > 0) == (dtype == "float16")
    assert r["attention_ms"] + r["kv_write_ms"] + r["matmul_ms"] < r["step_ms"]
    assert r["attention_share"] == pytest.approx(r["attention_ms"] / r["step_ms"])
    # The wrappers on engine.model.paged_decoder's kernels do not outlive the run.
    from kvscope.engine.model import paged_decoder as model
    from kvscope.engine.model.fused import decode as fused_decode
    from kvscope.kernels import cpu_linear, ops

    assert model.paged_attention is ops.paged_attention
    assert model.write_kv is ops.write_kv
    assert fused_decode.dense.__module__ == "kvscope.engine.model.fused.decode"
    assert fused_decode.attention.__module__ == "kvscope.engine.model.fused.decode"
    assert cpu_linear.linear.__module__ == "kvscope.kernels.cpu_linear"
