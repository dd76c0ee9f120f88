"""benchmarks/int4_in_step.py: every implementation runs on every shape and row count asked
for (speed itself is the benchmark's to show)."""
from __future__ import annotations

import json

import pytest

from benchmarks.cpu import int4_in_step
from kvscope.kernels import kernel_choice, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here")


def test_each_implementation_is_timed_on_each_shape(capsys):
    argv = ["--rows", "1", "3", "--layers", "1", "--rounds", "1", "--gap-us", "0", "--json"]
    assert int4_in_step.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["wait"] == kernel_choice.thread_wait()
    shapes = {f"{n}x{k}" for n, k in int4_in_step.SHAPES}
    assert set(got["rows"]) == {"1", "3"}
    for per_impl in got["rows"].values():
        assert set(per_impl) == {"native", "native-serial", "torch"}
        for times in per_impl.values():
            assert set(times) == shapes and all(us > 0 for us in times.values())
