"""benchmarks/timing.py on a fake clock: which runs best-of-N and the median keep, where the
device sync falls, and what the `--json`-or-table ending prints."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types

import pytest

from kvscope.engine.measure import timing


class FakeClock:
    """A clock that only moves when the code under test says work was done."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def work_taking(clock: FakeClock, durations: list[float]):
    """A function whose n-th call takes durations[n] seconds on `clock`."""
    left = iter(durations)

    def fn() -> None:
        clock.now += next(left)

    return fn


def test_best_of_is_the_fastest_timed_run_and_skips_the_warm_up():
    clock = FakeClock()
    fn = work_taking(clock, [100.0, 3.0, 1.5, 2.0, 4.0])  # the first call warms up
    assert timing.best_of(fn, 4, warmup=1, clock=clock) == 1.5


def test_median_of_is_the_middle_run():
    clock = FakeClock()
    fn = work_taking(clock, [0.0, 5.0, 1.0, 3.0])
    assert timing.median_of(fn, 3, warmup=1, clock=clock) == 3.0


def test_runs_of_several_calls_report_seconds_per_call():
    clock = FakeClock()
    # Two runs of two calls: (1 + 3) / 2 and (0.5 + 0.5) / 2.
    fn = work_taking(clock, [1.0, 3.0, 0.5, 0.5])
    assert timing.timed_runs(fn, 2, calls=2, warmup=0, clock=clock) == [2.0, 0.5]
    clock2 = FakeClock()
    assert timing.best_of(work_taking(clock2, [1.0, 3.0, 0.5, 0.5]), 2, calls=2, warmup=0,
                          clock=clock2) == 0.5


def test_calls_lasting_doubles_until_a_run_is_long_enough():
    clock = FakeClock()
    calls = []

    def fn() -> None:
        calls.append(clock.now)
        clock.now += 0.01

    # 1 call: 0.01 s, 2: 0.02, 4: 0.04, 8: 0.08 >= 0.05.
    assert timing.calls_lasting(fn, 0.05, warmup=1, clock=clock) == 8
    assert len(calls) == 1 + 1 + 2 + 4 + 8


@pytest.fixture
def fake_cuda(monkeypatch, request):
    """A torch module whose cuda.synchronize records itself and lets queued work finish."""
    clock, events = FakeClock(), []

    def synchronize() -> None:
        events.append("sync")
        clock.now += 10.0  # the kernels the calls only launched run now

    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(synchronize=synchronize)
    monkeypatch.setitem(sys.modules, "torch", fake)
    return clock, events


def test_a_cuda_run_waits_for_the_device_before_the_clock_stops(fake_cuda):
    clock, events = fake_cuda

    def launch() -> None:
        events.append("call")
        clock.now += 1.0

    # Each run's time includes the device's 10 s: the sync comes before the clock stops.
    assert timing.best_of(launch, 2, warmup=1, device="cuda:0", clock=clock) == 11.0
    assert events.count("call") == 3
    calls = [i for i, e in enumerate(events) if e == "call"]
    assert all(events[i + 1] == "sync" for i in calls)  # the warm-up's too


def test_no_sync_on_the_cpu(fake_cuda):
    clock, events = fake_cuda
    timing.best_of(work_taking(clock, [1.0] * 3), 2, device="cpu", clock=clock)
    timing.sync_device("cpu")
    assert events == []
    assert timing.is_cuda("cuda") and timing.is_cuda("cuda:1") and not timing.is_cuda("cpu")


def test_the_module_does_not_import_torch():
    """gui_bench and http_bench time without torch: importing and timing on the CPU must not
    load it."""
    code = ("import sys; from kvscope.engine.measure import timing; "
            "timing.best_of(lambda: None, 2); timing.print_result({}, str, True); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_percentile_is_the_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert timing.percentile(xs, 0.5) == 3.0
    assert timing.percentile(xs, 0.95) == 5.0
    assert timing.percentile(xs, 0.0) == 1.0
    assert timing.percentile([], 0.5) is None


def table_of(result: dict) -> str:
    return "\n".join(f"{k:>6}: {v}" for k, v in result.items())


RESULT = {"tokens_per_s": 12.5, "steps": 3, "config": {"dtype": "bfloat16"}}


def test_json_ending_prints_one_json_object_with_the_results_keys(capsys):
    timing.print_result(RESULT, table_of, True)
    out, err = capsys.readouterr()
    assert json.loads(out) == RESULT
    assert err == ""


def test_json_ending_can_show_the_table_on_stderr(capsys):
    timing.print_result(RESULT, table_of, True, table_to_stderr=True, indent=2)
    out, err = capsys.readouterr()
    assert json.loads(out) == RESULT and "\n  " in out  # indented
    assert err == table_of(RESULT) + "\n"


def test_table_ending_prints_the_table_alone(capsys):
    timing.print_result(RESULT, table_of, False)
    out, err = capsys.readouterr()
    assert out == table_of(RESULT) + "\n"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    assert err == ""
    timing.print_result(RESULT, lambda r: "", False)
    assert capsys.readouterr().out == ""


def test_the_json_flag():
    p = argparse.ArgumentParser()
    timing.add_json_flag(p)
    assert p.parse_args(["--json"]).json is True and p.parse_args([]).json is False
    group = argparse.ArgumentParser().add_argument_group("report")
    timing.add_json_flag(group, "the report as JSON")
    assert group._group_actions[0].help == "the report as JSON"


def test_progress_goes_to_stderr(capsys):
    timing.progress_logger("bench")("loading ...")
    out, err = capsys.readouterr()
    assert out == "" and err == "[bench] loading ...\n"
