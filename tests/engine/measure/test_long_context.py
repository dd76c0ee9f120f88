"""benchmarks/long_context.py and benchmarks/llama_tools.py: llama.cpp's outputs parsed, the
table and its ratios, and an end-to-end run on a tiny model beside fake llama.cpp tools (speed
itself is measured by running the benchmark, not here)."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from kvscope.engine.cli import bench as bench_cmd
from kvscope.engine.measure import llama_tools, long_context
from kvscope.kernels import native
from kvscope.testing.tiny_models import save_tiny_model

BENCH_JSON = """[
  {"type_k": "f16", "type_v": "f16", "n_prompt": 0, "n_gen": 32, "n_depth": 512,
   "avg_ts": 140.5, "stddev_ts": 1.0},
  {"type_k": "f16", "type_v": "f16", "n_prompt": 0, "n_gen": 32, "n_depth": 6000,
   "avg_ts": 55.25, "stddev_ts": 0.5},
  {"type_k": "f16", "type_v": "f16", "n_prompt": 2048, "n_gen": 0, "n_depth": 0,
   "avg_ts": 900.0, "stddev_ts": 3.0}
]"""

BATCHED_TABLE = """main: n_kv_max = 8208, n_batch = 2048, n_ubatch = 512, flash_attn = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   512 |      4 |    1 |    516 |    0.250 |  2048.00 |    0.030 |   133.33 |    0.280 |  1842.86 |
|  8000 |      4 |    1 |   8004 |   10.000 |   800.00 |    0.100 |    40.00 |   10.100 |   792.48 |

llama_perf_context_print:        load time =      50.00 ms
"""


def test_llama_bench_json_parsed_into_decode_and_prefill_rates():
    rows = llama_tools.parse_bench_json("some log line\n" + BENCH_JSON)
    assert llama_tools.decode_rates(rows) == {512: 140.5, 6000: 55.25}
    assert llama_tools.prefill_rates(rows) == {2048: 900.0}


def test_llama_bench_jsonl_parsed_too():
    lines = "\n".join(json.dumps(t) for t in json.loads(BENCH_JSON))
    assert llama_tools.decode_rates(llama_tools.parse_bench_json(lines)) == {512: 140.5,
                                                                             6000: 55.25}


def test_llama_bench_without_tests_is_an_error():
    with pytest.raises(ValueError, match="no tests"):
        llama_tools.parse_bench_json("error: unknown argument -d")


def test_batched_bench_table_gives_prefill_at_one_sequence():
    assert llama_tools.batched_prefill_rates(BATCHED_TABLE) == {512: 2048.0, 8000: 800.0}
    with pytest.raises(ValueError, match="no table"):
        llama_tools.batched_prefill_rates("main: error")


def test_commands_carry_depths_threads_and_the_q8_0_flags(tmp_path):
    tool = tmp_path / "llama-bench"
    cmd = llama_tools.bench_decode_command(tool, "m.gguf", "q8_0", [512, 6000], 32, 2, 3)
    assert cmd[cmd.index("-d") + 1] == "512,6000" and cmd[cmd.index("-p") + 1] == "0"
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-r") + 1] == "3"
    assert cmd[-6:] == ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]
    prefill = llama_tools.bench_prefill_command(tool, "m.gguf", "f16", [512, 8000], 2, 1)
    assert prefill[prefill.index("-p") + 1] == "512,8000" and "-ctk" not in prefill
    assert prefill[prefill.index("-n") + 1] == "0"


def test_find_tool_looks_in_the_folder_then_the_environment(tmp_path, monkeypatch):
    tool = _executable(tmp_path / "a" / "llama-bench", "exit 0")
    assert llama_tools.find_tool("llama-bench", str(tool.parent)) == tool
    monkeypatch.setenv(llama_tools.ENV, str(tool.parent))
    monkeypatch.setattr(llama_tools.shutil, "which", lambda name: None)
    assert llama_tools.find_tool("llama-bench") == tool
    assert llama_tools.find_tool("llama-batched-bench") is None


def test_table_ratios_compare_each_dtype_with_f16_and_one_byte_with_q8_0():
    result = {"contexts": [512, 6000], "prompts": [512], "steps": 8,
              "kvscope": {"weights": "int4", "prefill_chunk": 512, "threads": 2,
                          "omp_wait": "spin=1000", "max_model_len": 8192, "kv_dtypes": {
                              "float32": {"decode": {512: 280.0, 6000: 110.5},
                                          "prefill": {512: 4000.0}},
                              "int8": {"decode": {512: 300.0, 6000: 80.0},
                                       "prefill": {512: 3000.0}}}},
              "llama.cpp": {"f16": {"decode": {512: 140.0, 6000: 55.25},
                                    "prefill": {512: 2000.0}},
                            "q8_0": {"decode": {512: 150.0, 6000: 40.0}, "prefill": {}}}}
    decode, prefill = (
        {line[:28].strip(): line[28:].split() for line in section.splitlines()}
        for section in long_context.format_table(result).split("\n\n")[1:3])
    assert decode["float32 / f16"] == ["2.00x", "2.00x"]
    assert decode["int8 / q8_0"] == ["2.00x", "2.00x"]
    assert decode["int8 / f16"] == ["2.14x", "1.45x"]
    assert "float32 / q8_0" not in decode
    assert decode["llama.cpp q8_0 (-fa 1)"] == ["150.0", "40.0"]
    # A length llama.cpp did not measure shows a dash, not a ratio.
    assert prefill["float32 / f16"] == ["2.00x"] and prefill["int8 / q8_0"] == ["-"]
    assert prefill["kvscope int8"] == ["3000.0"]
    head = long_context.format_table(result).splitlines()[0]
    assert "2 threads, OpenMP wait spin=1000 " in head  # it moves a single stream up to 1.5x


def test_lengths_must_fit_max_model_len():
    args = long_context.parse_args(["--contexts", "8170", "--steps", "32"])
    with pytest.raises(ValueError, match="max_model_len=8192"):
        long_context.check_lengths(args, 8192)
    args = long_context.parse_args(["--prompts", "8192"])
    with pytest.raises(ValueError, match="--prompts 8192"):
        long_context.check_lengths(args, 8192)
    long_context.check_lengths(long_context.parse_args([]), 8192)  # the defaults fit


FAKE_BENCH = """
import json, sys
a = sys.argv
val = lambda f: a[a.index(f) + 1]
kv = val("-ctk") if "-ctk" in a else "f16"
if val("-n") == "0":
    tests = [{"type_k": kv, "n_prompt": int(p), "n_gen": 0, "n_depth": 0, "avg_ts": 1000.0}
             for p in val("-p").split(",")]
else:
    tests = [{"type_k": kv, "n_prompt": 0, "n_gen": int(val("-n")), "n_depth": int(d),
              "avg_ts": 100.0 if kv == "f16" else 50.0} for d in val("-d").split(",")]
print(json.dumps(tests))
"""

FAKE_BATCHED = """
import sys
a = sys.argv
print("| PP | TG | B | S_PP t/s |")
print("|----|----|---|----------|")
for p in a[a.index("-npp") + 1].split(","):
    print(f"| {p} | 4 | 1 | 500.00 |")
"""


def _executable(path, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)
    return path


def _python_tool(path, source):
    script = path.with_suffix(".py")
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(textwrap.dedent(source))
    return _executable(path, f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')


def test_end_to_end_on_a_tiny_model_beside_fake_llama_tools(tmp_path, capsys):
    tiny = save_tiny_model(tmp_path / "m")
    bin_dir = tmp_path / "bin"
    _python_tool(bin_dir / "llama-bench", FAKE_BENCH)
    _python_tool(bin_dir / "llama-batched-bench", FAKE_BATCHED)
    argv = ["--model", str(tiny), "--gguf", "fake.gguf", "--llama-bin", str(bin_dir),
            "--contexts", "40", "20", "--prompts", "20", "64", "--kv-dtypes", "float32",
            "int8", "--steps", "3", "--warmup", "1", "--json"]
    assert long_context.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["contexts"] == [20, 40] and r["kvscope"]["max_model_len"] == 512
    assert r["kvscope"]["native_kernels"] == native.available()
    for kv in ("float32", "int8"):
        got = r["kvscope"]["kv_dtypes"][kv]
        assert set(got["decode"]) == {"20", "40"} and set(got["prefill"]) == {"20", "64"}
        assert all(v > 0 for v in got["decode"].values())
        assert all(got["decode_best"][n] >= got["decode"][n] for n in got["decode"])
    assert r["kvscope"]["kv_dtypes"]["int8"]["rotation"] == "calibrated"
    llama = r["llama.cpp"]
    assert llama["f16"]["decode"] == {"20": 100.0, "40": 100.0}
    assert llama["q8_0"]["decode"] == {"20": 50.0, "40": 50.0}
    assert llama["f16"]["prefill"] == {"20": 1000.0, "64": 1000.0}
    assert llama["batched_prefill"] == {"20": 500.0, "64": 500.0}
    assert "errors" not in llama


def test_kvscope_bench_long_context_without_llama_tools_says_so(tmp_path, capsys,
                                                               monkeypatch):
    tiny = save_tiny_model(tmp_path / "m")
    monkeypatch.delenv(llama_tools.ENV, raising=False)
    monkeypatch.setattr(llama_tools.shutil, "which", lambda name: None)  # none on PATH
    argv = ["--model", str(tiny), "--gguf", "fake.gguf", "--contexts", "16", "--prompts",
            "16", "--kv-dtypes", "bfloat16", "--steps", "2", "--warmup", "0"]
    assert bench_cmd.main(["--long-context", *argv]) == 0  # `kvscope bench --long-context ...`
    out = capsys.readouterr().out
    assert "kvscope bfloat16" in out and "llama.cpp: skipped (llama-bench not found" in out
