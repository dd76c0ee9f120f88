"""The kernel-by-kernel decode attention's thread split (kernels/decode_split.py), decided by
the kernel chooser per pool dtype, bucket of cached rows and threads: either answer gives the
same bits, each bucket is decided once, one thread decides nothing."""
from __future__ import annotations

import pytest
import torch

from kvscope.kernels import cpu_attention, decode_split, native
from kvscope.testing.pools import build_batch
from tests.support.scripted_chooser import ScriptedChooser

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")


def decode(ctx_lens):
    query, kc, vc, meta, _ = build_batch([1] * len(ctx_lens), ctx_lens, 16, 9, 3, 64,
                                         num_blocks=600, seed=4)
    return lambda: cpu_attention.paged_attention_cpu(query, kc, vc, meta, 0.125)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("winner", [decode_split.PARALLEL, decode_split.SERIAL])
def test_either_split_gives_the_same_bits_and_is_decided_once(winner, monkeypatch, two_threads):
    run = decode([700, 900, 1200])  # 2800 rows x 3 KV heads: the <=16384 bucket
    monkeypatch.setattr(decode_split.kernel_choice, "default", lambda: ScriptedChooser("unused"))
    monkeypatch.setattr(decode_split, "parallel", lambda call, dtype, rows: -1)
    baseline = run()  # the kernel's own rule
    chooser = ScriptedChooser(winner)
    monkeypatch.undo()
    monkeypatch.setattr(decode_split.kernel_choice, "default", lambda: chooser)
    got = run()
    assert torch.equal(got, baseline)
    assert chooser.names == [decode_split.decision_name("float32", 8400)]
    assert "rows<=16384" in chooser.names[0]
    assert torch.equal(run(), baseline) and len(chooser.names) == 1
    decode([20, 30])()  # a smaller bucket is its own decision
    assert len(chooser.names) == 2 and "rows<=256" in chooser.names[1]


def test_one_thread_decides_nothing(monkeypatch):
    chooser = ScriptedChooser(decode_split.PARALLEL)
    monkeypatch.setattr(decode_split.kernel_choice, "default", lambda: chooser)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode([300, 40])()
    finally:
        torch.set_num_threads(threads)
    assert chooser.names == []


def test_buckets():
    assert [decode_split.bucket(n) for n in (1, 256, 257, 5000, 10**6)] == [
        256, 256, 512, 8192, 65536]
    assert decode_split.bucket_label(10**6) == "65536+"


@pytest.mark.parametrize("winner,told", [(decode_split.PARALLEL, 1), (decode_split.SERIAL, 0)])
def test_the_kernel_is_told_the_measured_split(winner, told, monkeypatch, two_threads):
    chooser = ScriptedChooser(winner)
    monkeypatch.setattr(decode_split.kernel_choice, "default", lambda: chooser)
    calls: list[int] = []
    assert decode_split.parallel(calls.append, "float32", 5000) == told
    assert calls == [1, 0]  # the measurement ran the call both ways
    assert decode_split.parallel(calls.append, "float32", 6000) == told  # same bucket: cached
    assert calls == [1, 0]
