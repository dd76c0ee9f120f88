"""`kvscope bench --kernels` on a tiny model, with fake timings (speed itself is measured by
running it, not here): every decision the model's matmuls need is asked for, measured once,
then read from the cache; --remeasure-kernels measures again."""
from __future__ import annotations

import json

import pytest

from kvscope.engine.cli import bench as bench_cmd
from kvscope.kernels import kernel_cache, kernel_choice, native
from kvscope.testing.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("kernels") / "m")


@pytest.fixture
def fake_chooser(tmp_path, monkeypatch):
    """A fresh process's chooser (cache in tmp_path) whose measurements take no real time:
    torch 1 ms, the kernel 2 ms on threads and 3 ms serial."""
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    made = []
    real_measure = kernel_choice.Chooser.measure

    def measure(self, candidates):
        made.append(sorted(candidates))
        fake = {"torch": 1e-3, "native": 2e-3, "native-serial": 3e-3,
                "float32": 2e-3, "bfloat16": 1e-3}  # the prefill attention's candidates
        assert real_measure  # the real one times with perf_counter: not in a test
        return {n: fake[n] for n in candidates}

    monkeypatch.setattr(kernel_choice.Chooser, "measure", measure)
    kernel_choice.reset()
    yield made
    kernel_choice.reset()


def kernels(tiny, capsys, *extra) -> dict:
    kernel_choice.reset()  # as a new process would start
    argv = ["--kernels", "--model", str(tiny), "--device", "cpu", "--dtype", "float32",
            "--concurrency", "4", "--json", "--max-model-len", "64", *extra]
    assert bench_cmd.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_measured_once_then_cached_then_measured_again(tiny, capsys, fake_chooser):
    first = kernels(tiny, capsys)
    assert first["cache_ignored_reason"] == "missing"
    assert first["machine"]["cpu_model"]
    rows = {(d["shape"], d["rows"]) for d in first["decisions"]}
    # llama tiny: qkv 128x64 (4 + 2 + 2 heads of 16), o 64x64, gate_up 256x64, down 64x128,
    # head 256x64 (tied: the same shape as gate_up, asked for once)
    for shape in ("128x64", "64x64", "256x64", "64x128"):
        assert {(shape, r) for r in ("<=1", "<=2", "<=4", "256+")} <= rows
    # float32 below 256 rows chooses between the row-invariant native variants only
    assert all(d["choice"] == ("torch" if d["rows"] == "256+" else "native")
               and d["source"] == "measured" for d in first["decisions"])
    measured = len(fake_chooser)
    assert measured == len(first["decisions"])

    second = kernels(tiny, capsys)
    assert second["cache_ignored_reason"] is None and len(fake_chooser) == measured
    assert {d["source"] for d in second["decisions"]} == {"cached"}
    assert [d["name"] for d in second["decisions"]] == [d["name"] for d in first["decisions"]]

    third = kernels(tiny, capsys, "--remeasure-kernels")
    assert {d["source"] for d in third["decisions"]} == {"measured"}
    assert len(fake_chooser) == 2 * measured


def test_the_table_names_the_cpu_and_each_decision(tiny, capsys, fake_chooser):
    kernel_choice.reset()
    assert bench_cmd.main(["--kernels", "--model", str(tiny), "--device", "cpu", "--concurrency",
                       "2", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU ") and "torch ms" in out and "native ms" in out
    assert "64x64" in out and "measured" in out and "choice" in out


def test_4bit_weights_choose_between_torch_and_the_native_int4_kernel(tiny, capsys,
                                                                       fake_chooser,
                                                                       monkeypatch):
    from kvscope.kernels import cpu_int4

    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.FMA)  # torch's layout: per-bucket choices
    got = kernels(tiny, capsys, "--weights", "int4")
    int4 = [d for d in got["decisions"] if d["op"] == "int4"]
    # the layers' four shapes at each decode bucket and prefill; the head (256x64) is int8
    # (kernels/cpu_int8.py: its thread split alone), and sees decode rows only
    assert {(d["shape"], d["rows"]) for d in int4} == {
        (s, r) for s in ("128x64", "64x64", "256x64", "64x128")
        for r in ("<=1", "<=2", "<=4", "256+")}
    assert all(set(d["times_ms"]) == {"torch", "native", "native-serial"} for d in int4)
    int8 = [d for d in got["decisions"] if d["op"] == "int8"]
    assert {(d["shape"], d["rows"]) for d in int8} == {("256x64", r) for r in ("<=1", "<=2",
                                                                              "<=4")}
    assert all(set(d["times_ms"]) == {"native", "native-serial"} for d in int8)
    assert {d["choice"] for d in int4} == {"torch"}  # the fake timings' fastest
    # int4 weights store KV in bfloat16 by default: the prefill attention's dtype is chosen
    attn, = [d for d in got["decisions"] if d["op"] == "attn"]
    assert set(attn["times_ms"]) == {"float32", "bfloat16"} and attn["choice"] == "bfloat16"
    assert attn["shape"] == "4x2x16"
    again = kernels(tiny, capsys, "--weights", "int4")
    assert {d["source"] for d in again["decisions"] if d["op"] in ("int4", "int8", "attn")} \
        == {"cached"}
    dense = kernels(tiny, capsys)  # float32 KV: no attention decision
    assert not [d for d in dense["decisions"] if d["op"] == "attn"]


def test_4bit_weights_on_the_tiles_have_no_per_bucket_choice(tiny, capsys, fake_chooser,
                                                            monkeypatch):
    """The tiles' layout has one kernel: no int4 decision per shape and bucket is made, and the
    family's own decision is listed where this process made it."""
    from kvscope.kernels import cpu_int4, native

    if not (native.available() and cpu_int4.tiles_ready()):
        pytest.skip("no AMX tiles on this CPU")
    monkeypatch.setattr(cpu_int4, "_family", cpu_int4.TILES)
    got = kernels(tiny, capsys, "--weights", "int4")
    assert not [d for d in got["decisions"] if d["op"] == "int4"]
    assert not fake_chooser or all("fma" not in c for c in fake_chooser)
    monkeypatch.setattr(cpu_int4, "_family", None)  # decided again: under the fake timings
    monkeypatch.setattr(cpu_int4, "SAMPLE_WEIGHTS", 1)
    fake = {"fma": 2e-3, "tiles": 1e-3}
    monkeypatch.setattr(kernel_choice.Chooser, "measure",
                        lambda self, candidates: {n: fake[n] for n in candidates})
    assert cpu_int4.family() == cpu_int4.TILES
    got = kernels(tiny, capsys, "--weights", "int4")
    family = [d for d in got["decisions"] if d["op"] == "family"]
    assert {d["rows"] for d in family} == {"1", "5"} and {d["choice"] for d in family} == {
        "tiles"}


def test_the_decode_attention_splits_this_machine_decided_are_listed(tiny, capsys,
                                                                     fake_chooser):
    """kernels/decode_split.py decides per call; the table shows what the runs left."""
    import torch

    from kvscope.kernels import cpu_attention
    from kvscope.testing.pools import build_batch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        query, kc, vc, meta, _ = build_batch([1, 1], [300, 40], 16, 4, 2, 64, num_blocks=64,
                                             seed=1)
        cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    attn = [d for d in kernels(tiny, capsys)["decisions"] if d["op"] == "attn"]
    assert [(d["dtype"], d["rows"], d["choice"]) for d in attn] == [
        ("float32", "<=1024", "native")]  # 340 rows x 2 KV heads; fake: native beats serial
    assert attn[0]["source"] == "cached"
