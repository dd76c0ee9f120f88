"""engine/measure/sizes.py, size_models.py, sizes_table.py and bandwidth.py: the checkpoints of
real shapes, the GGUFs made by (fake) llama.cpp tools, the run end to end on a tiny shape, and
the table's ratios and bandwidth shares (speed itself is measured by running the benchmark)."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from kvscope.engine.cli import bench as bench_cmd
from kvscope.engine.measure import bandwidth, llama_tools, size_models, sizes, sizes_table
from kvscope.kernels import native
from kvscope.testing.tiny_models import save_tiny_model
from tests.engine.measure.test_long_context import FAKE_BENCH, _python_tool

TINY = size_models.Shape("llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                         max_len=512)

FAKE_CONVERTER = """
import os, sys
a = sys.argv
assert os.path.join(os.path.dirname(a[0]), "gguf-py") in os.environ["PYTHONPATH"].split(":")
assert a[a.index("--outtype") + 1] == "f16"
assert os.path.isfile(os.path.join(a[1], "config.json"))
with open(os.path.join(os.path.dirname(a[0]), "calls"), "a") as f:
    f.write("convert\\n")
open(a[a.index("--outfile") + 1], "wb").write(b"F" * 4000)
"""

FAKE_QUANTIZE = """
import sys
src, out, kind = sys.argv[1:4]
assert open(src, "rb").read() == b"F" * 4000
open(out, "wb").write(b"Q" * {"Q4_0": 1000, "Q8_0": 2000}[kind])
"""

FAKE_BATCHED = """
import sys
a = sys.argv
print("|    PP |     TG |    B |   N_KV |   S_PP t/s |    S t/s |")
print("|-------|--------|------|--------|------------|----------|")
pp, tg = a[a.index("-npp") + 1], a[a.index("-ntg") + 1]
for b in a[a.index("-npl") + 1].split(","):
    print(f"| {pp} | {tg} | {b} | 0 | 1.0 | {10.0 * int(b)} |")
"""


@pytest.fixture
def tiny_shape(monkeypatch, tmp_path):
    """SHAPES with a tiny llama, and the tiny models' byte-level tokenizer beside it."""
    monkeypatch.setitem(size_models.SHAPES, "tiny", TINY)
    source = save_tiny_model(tmp_path / "tok")

    def copy(folder):
        for name in size_models.TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, folder / name)
    monkeypatch.setattr(size_models, "copy_tokenizer", copy)
    return TINY


def test_the_shapes_have_their_models_parameter_counts():
    assert size_models.SHAPES["llama-1b"].parameters() == 1_235_814_400  # Llama-3.2-1B
    assert size_models.SHAPES["llama-3b"].parameters() == 3_212_749_824  # Llama-3.2-3B
    assert size_models.SHAPES["qwen2.5-1.5b"].parameters() == 1_543_714_304  # Qwen2.5-1.5B
    qwen = size_models.SHAPES["qwen2.5-1.5b"].tensor_shapes()
    assert qwen["model.layers.0.self_attn.k_proj.bias"] == (256,)  # 2 KV heads of 128


def test_a_checkpoint_is_written_once_with_its_shapes(tiny_shape, tmp_path):
    folder = size_models.checkpoint("tiny", tmp_path / "c")
    config = json.loads((folder / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(TINY.tensor_shapes())
        w = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        assert tuple(w.shape) == (64, 128) and abs(float(w.float().std()) - 0.02) < 0.003
        assert float(f.get_tensor("model.norm.weight").float().min()) == 1.0
    assert (folder / "tokenizer.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert size_models.checkpoint("tiny", tmp_path / "c") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    with pytest.raises(ValueError, match="shape 'nope'"):
        size_models.checkpoint("nope", tmp_path / "c")


def test_the_llama_commands(tmp_path):
    tool = tmp_path / "llama-batched-bench"
    cmd = llama_tools.batched_command(tool, "m.gguf", 128, 64, [8, 32], 2)
    assert cmd[cmd.index("-npl") + 1] == "8,32" and cmd[cmd.index("-c") + 1] == str(192 * 32 + 16)
    assert llama_tools.quantize_command(tool, tmp_path / "a", tmp_path / "b", "Q4_0", 2)[3:] == [
        "Q4_0", "2"]
    (tmp_path / "src").mkdir()
    assert llama_tools.find_converter(str(tmp_path / "src")) is None
    (tmp_path / "src" / llama_tools.CONVERTER).write_text("")
    assert llama_tools.find_converter(str(tmp_path / "src")).parent == tmp_path / "src"
    # the source tree llama-bench was built in: src/build/bin/llama-bench
    assert llama_tools.find_converter(None, tmp_path / "src" / "build" / "bin" / "llama-bench") \
        == tmp_path / "src" / llama_tools.CONVERTER


def test_bandwidth_is_measured_and_shared_out():
    got = bandwidth.measure(mib=16, rounds=2)
    assert got["read_gbs"] > 0.1 and got["copy_gbs"] > 0.1
    assert bandwidth.share(1e9, 10.0, 20.0) == pytest.approx(0.5)


def _result(kv_decode=25.0):
    side = {"prefill": {512: 100.0}, "decode": {512: kv_decode, 4096: 10.0},
            "batched": {8: 80.0, 32: 160.0}, "weight_bytes": 600_000_000,
            "kv_bytes_per_token": 32768, "fused_decode": True, "decode_path": ""}
    llama = {"prefill": {512: 50.0}, "decode": {512: 20.0}, "batched": {8: 40.0},
             "weight_bytes": 700_000_000}
    return {"cpu": "a CPU", "cpu_flags": "avx2", "threads": 2, "omp_wait": "spin=1000",
            "kv_dtype": "bfloat16", "contexts": [512, 4096], "prompt": 512, "steps": 16,
            "batches": [8, 32], "batch_prompt": 128, "batch_tokens": 64, "native_kernels": True,
            "bandwidth": {"read_gbs": 20.0, "copy_gbs": 30.0, "buffer_mib": 512.0},
            "shapes": {"llama-1b": {"f16_kv_bytes_per_token": 32768, "formats": {
                "int4": {"peer": "Q4_0", "kvscope": side, "llama.cpp": llama}}}}}


def test_the_table_gives_ratios_and_bandwidth_shares():
    lines = {line[27:41].strip(): line[41:].split()
             for line in sizes_table.format_table(_result()).splitlines()
             if line.startswith("llama-1b")}
    assert lines["prefill 512"][:3] == ["100.0", "50.0", "2.00x"]
    # kvscope: (600e6 + 32768 x 512) bytes x 25 tok/s = 15.4 GB/s, 77 % of 20
    assert lines["decode @512"] == ["25.0", "20.0", "1.25x", "15.4", "GB/s", "77%", "14.3",
                                    "GB/s", "72%"]
    # llama.cpp did not measure 4096 here: a dash, not a ratio
    assert lines["decode @4096"][1:3] == ["-", "-"]
    assert lines["B=8 S t/s"][:3] == ["80.0", "40.0", "2.00x"]
    assert lines["B=32 S t/s"][1] == "-"
    round_trip = json.loads(json.dumps(_result()))  # --json's string keys read back
    assert sizes_table.format_table(round_trip) == sizes_table.format_table(_result())


@pytest.mark.skipif(not native.available(), reason="the native CPU kernels did not build")
def test_end_to_end_on_a_tiny_shape_beside_fake_llama_tools(tiny_shape, tmp_path, capsys):
    src = tmp_path / "llama.cpp"
    bin_dir = src / "build" / "bin"
    (src / "gguf-py").mkdir(parents=True)
    (src / llama_tools.CONVERTER).write_text(FAKE_CONVERTER)
    _python_tool(bin_dir / "llama-bench", FAKE_BENCH)
    _python_tool(bin_dir / "llama-batched-bench", FAKE_BATCHED)
    _python_tool(bin_dir / "llama-quantize", FAKE_QUANTIZE)
    argv = ["--shapes", "tiny", "--contexts", "40", "16", "--prompt", "24", "--steps", "3",
            "--warmup", "1", "--batches", "3", "2", "--batch-prompt", "8", "--batch-tokens",
            "4", "--bandwidth-mib", "8", "--cache-dir", str(tmp_path / "cache"),
            "--llama-bin", str(bin_dir), "--json"]
    assert sizes.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["contexts"] == [16, 40] and r["batches"] == [2, 3]
    tiny = r["shapes"]["tiny"]
    assert tiny["f16_kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    for fmt, size in (("int4", 1000), ("int8", 2000), ("bf16", 4000)):
        row = tiny["formats"][fmt]
        ours, theirs = row["kvscope"], row["llama.cpp"]
        assert row["peer"] == sizes.PEERS[fmt]
        assert set(ours["decode"]) == {"16", "40"} and set(ours["prefill"]) == {"24"}
        assert set(ours["batched"]) == {"2", "3"}
        assert all(v > 0 for part in ("decode", "prefill", "batched")
                   for v in ours[part].values())
        assert ours["fused_decode"], (fmt, ours["decode_path"])  # int8 too (cpu_int8)
        assert theirs["decode"] == {"16": 100.0, "40": 100.0}
        assert theirs["prefill"] == {"24": 1000.0}
        assert theirs["batched"] == {"2": 20.0, "3": 30.0}
        assert theirs["weight_bytes"] == size and "errors" not in theirs
    # the weights as stored: int4 about half int8's bytes, bf16 twice int8's
    w = {f: tiny["formats"][f]["kvscope"]["weight_bytes"] for f in ("int4", "int8", "bf16")}
    assert w["int4"] < 0.7 * w["int8"] < 0.7 * w["bf16"]
    assert tiny["formats"]["bf16"]["kvscope"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    # a second run converts nothing again (the GGUFs are kept beside the checkpoint)
    assert sizes.main([*argv[:-1], "--formats", "int4", "--json"]) == 0
    capsys.readouterr()
    assert (src / "calls").read_text() == "convert\n"


def test_kvscope_bench_sizes_without_llama_tools_says_so(tiny_shape, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.delenv(llama_tools.ENV, raising=False)
    monkeypatch.setattr(llama_tools.shutil, "which", lambda name: None)
    argv = ["--shapes", "tiny", "--formats", "int8", "--contexts", "16", "--prompt", "16",
            "--steps", "2", "--warmup", "0", "--batches", "2", "--batch-prompt", "4",
            "--batch-tokens", "2", "--bandwidth-mib", "8", "--cache-dir", str(tmp_path)]
    assert bench_cmd.main(["--sizes", *argv]) == 0  # `kvscope bench --sizes ...`
    out = capsys.readouterr().out
    assert "int8 / Q8_0" in out and "llama.cpp: skipped (llama-bench not found" in out
