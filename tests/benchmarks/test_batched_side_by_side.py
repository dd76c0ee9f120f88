"""benchmarks/batched_side_by_side.py on a tiny model beside a stand-in llama-batched-bench
(a script printing the tool's table): the rates are counted as the tool counts them."""
from __future__ import annotations

import json
import stat

from benchmarks.serving import batched_side_by_side
from kvscope.testing.tiny_models import save_tiny_model

TABLE = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    1 |     12 |    0.010 |   800.00 |    0.040 |   100.00 |    0.050 |   240.00 |
|     8 |      4 |    2 |     24 |    0.020 |   800.00 |    0.060 |   133.33 |    0.080 |   300.00 |
"""


def test_both_peers_in_one_table(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "m", "llama", seed=0)
    tool = tmp_path / "bin" / "llama-batched-bench"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\ncat <<'END'\n{TABLE}\nEND\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    argv = ["--model", str(model), "--gguf", "unused.gguf", "--batches", "1", "2",
            "--prompt", "8", "--tokens", "4", "--repeats", "1", "--llama-bin",
            str(tool.parent), "--json"]
    assert batched_side_by_side.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got["kvscope"]) == {"1", "2"} and all(v > 0 for v in got["kvscope"].values())
    assert got["llama.cpp"] == {"1": 240.0, "2": 300.0}
    table = batched_side_by_side.format_table(got)
    ratio = got["kvscope"]["2"] / 300.0
    assert f"{ratio:6.2f}x" in table


def test_without_the_tool_it_says_so(tmp_path, capsys, monkeypatch):
    model = save_tiny_model(tmp_path / "m", "llama", seed=0)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_BIN", raising=False)
    assert batched_side_by_side.main(["--model", str(model), "--gguf", "x", "--batches", "1",
                                      "--prompt", "4", "--tokens", "2", "--repeats", "1"]) == 0
    assert "llama-batched-bench not found" in capsys.readouterr().out
