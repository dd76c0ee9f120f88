"""kernels/kernel_choice.py, kernel_cache.py, machine_key.py: the chooser driven by a fake
clock (no real timing here), its cache file and the key it is valid for, and the engine's
linear running what was chosen."""
import json
import logging
import threading

import pytest
import torch

from kvscope.kernels import cpu_linear, kernel_cache, kernel_choice, machine_key, native
from kvscope.kernels.kernel_choice import Chooser

KEY = {"cpu_model": "Test CPU", "cpu_flags_sha256": "f1", "cpu_notable_flags": "avx2",
       "kernel_sources_sha256": "s1", "torch": "2.x"}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def costs(self, *seconds):
        """A candidate whose calls take these times in turn (the last one from then on)."""
        times = list(seconds)
        calls = []

        def run():
            calls.append(1)
            self.now += times.pop(0) if len(times) > 1 else times[0]
        run.calls = calls
        return run


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path))
    monkeypatch.setattr(kernel_choice, "_loadavg", lambda: 0.5)   # a quiet machine
    kernel_choice.reset()
    yield kernel_cache.cache_path()
    kernel_choice.reset()


def reasons(caplog):
    return [r.reason for r in caplog.records if r.name == "kvscope.kernels"]


def test_the_cache_lives_under_kvscope_cache_dir(cache_file, tmp_path):
    assert cache_file == tmp_path / "kernel_choices.json"


def test_the_faster_candidate_is_chosen(cache_file):
    clock = FakeClock()
    slow, fast = clock.costs(0.002), clock.costs(0.001)
    chooser = Chooser(cache_file, KEY, clock)
    assert chooser.choose("op", {"slow": slow, "fast": fast}) == "fast"
    assert chooser.choose("op2", {"fast": slow, "slow": fast}) == "slow"  # not by name/order
    d = chooser.decisions["op"]
    assert d.times_ms == pytest.approx({"slow": 2.0, "fast": 1.0}) and d.source == "measured"


def test_a_wake_up_after_a_gap_counts_against_a_candidate(cache_file):
    """A step runs Python between two matmuls; a candidate whose threads fall asleep in that
    gap pays to wake them. Timed back to back it would look faster than it is: the chooser
    leaves the gap before every timed call, and the wake-up decides."""
    clock = FakeClock()
    state = {"gap": False}

    def gap():
        state["gap"] = True

    def parallel():  # 1 ms of work, plus 2 ms to wake its threads after a gap
        clock.now += 0.001 + (0.002 if state.pop("gap", False) else 0.0)

    def serial():
        state.pop("gap", False)
        clock.now += 0.0015

    chooser = Chooser(cache_file, KEY, clock, gap=gap)
    assert chooser.choose("op", {"parallel": parallel, "serial": serial}) == "serial"
    back_to_back = Chooser(cache_file.with_name("other.json"), KEY, clock, gap=lambda: None)
    assert back_to_back.choose("op", {"parallel": parallel, "serial": serial}) == "parallel"


def test_a_candidate_may_make_a_decision_of_its_own(cache_file):
    # the one-region step is timed against the kernel-by-kernel one, whose attention makes
    # its own decision the first time it runs: with a plain lock that call waited on itself
    # forever (seen on a machine whose cached choices were measured busy and so redone)
    clock = FakeClock()
    chooser = Chooser(cache_file, KEY, clock)
    inner_fast, inner_slow = clock.costs(0.001), clock.costs(0.003)

    def outer():
        chooser.choose("inner", {"fast": inner_fast, "slow": inner_slow})
        clock.now += 0.002
    got = []
    thread = threading.Thread(target=lambda: got.append(
        chooser.choose("outer", {"outer": outer, "other": clock.costs(0.004)})), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "a decision made inside another's measurement deadlocked"
    assert got == ["outer"] and chooser.decisions["inner"].choice == "fast"


def test_the_best_time_decides_not_the_mean(cache_file):
    """A neighbour's burst slows some calls: the best of each candidate's rounds is compared.
    """
    clock = FakeClock()
    a = clock.costs(0.005, 0.005, 0.001, 0.005)   # warm-up, then one quiet round of three
    b = clock.costs(0.002)
    chooser = Chooser(cache_file, KEY, clock, budget_s=1.0)
    assert chooser.choose("op", {"a": a, "b": b}) == "a"


def test_rounds_stop_at_the_budget_after_the_minimum(cache_file):
    clock = FakeClock()
    big = clock.costs(1.0)
    chooser = Chooser(cache_file, KEY, clock, budget_s=0.01)
    chooser.choose("op", {"big": big})
    assert len(big.calls) == 1 + kernel_choice.MIN_ROUNDS   # warm-up + the minimum
    tiny = clock.costs(1e-6)
    chooser.choose("op2", {"tiny": tiny})
    assert len(tiny.calls) == 1 + kernel_choice.MAX_ROUNDS


def test_a_far_slower_candidate_stops_after_the_minimum(cache_file):
    clock = FakeClock()
    slow, lead, close = clock.costs(0.03), clock.costs(0.01), clock.costs(0.015)
    chooser = Chooser(cache_file, KEY, clock, budget_s=1.0)
    assert chooser.choose("op", {"slow": slow, "lead": lead, "close": close}) == "lead"
    assert len(slow.calls) == 1 + kernel_choice.MIN_ROUNDS
    assert len(lead.calls) == len(close.calls) == 1 + kernel_choice.MAX_ROUNDS
    assert chooser.decisions["op"].times_ms["slow"] == pytest.approx(30.0)


def test_a_decision_is_measured_once_and_survives_in_the_file(cache_file, caplog):
    clock = FakeClock()
    a, b = clock.costs(0.003), clock.costs(0.001)
    with caplog.at_level(logging.INFO, "kvscope.kernels"):
        assert Chooser(cache_file, KEY, clock).choose("op", {"a": a, "b": b}) == "b"
    assert reasons(caplog) == ["missing"]
    calls = len(a.calls)
    again = Chooser(cache_file, KEY, clock)   # a new process: the file answers
    assert again.choose("op", {"a": a, "b": b}) == "b"
    assert len(a.calls) == calls and again.cache_reason is None
    assert again.decisions["op"].source == "cached"
    saved = json.loads(cache_file.read_text())
    assert saved["key"] == KEY and saved["choices"]["op"]["choice"] == "b"


def test_a_choice_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(
        cache_file, monkeypatch):
    clock = FakeClock()
    a, b = clock.costs(0.003), clock.costs(0.001)
    busy = float(kernel_choice.os.cpu_count() or 1) + 3
    monkeypatch.setattr(kernel_choice, "_loadavg", lambda: busy)
    assert Chooser(cache_file, KEY, clock).choose("op", {"a": a, "b": b}) == "b"
    calls = len(a.calls)
    still_busy = Chooser(cache_file, KEY, clock)  # busy again: the busy choice stands
    assert still_busy.choose("op", {"a": a, "b": b}) == "b" and len(a.calls) == calls
    monkeypatch.setattr(kernel_choice, "_loadavg", lambda: 0.5)
    a2, b2 = clock.costs(0.001), clock.costs(0.003)   # the quiet truth: a is faster
    quiet = Chooser(cache_file, KEY, clock)
    assert quiet.choose("op", {"a": a2, "b": b2}) == "a"
    assert quiet.decisions["op"].info["loadavg_1m"] == 0.5
    assert json.loads(cache_file.read_text())["choices"]["op"]["choice"] == "a"


def test_a_corrupt_file_is_ignored_with_its_reason_and_rewritten(cache_file, caplog):
    cache_file.write_text("{not json")
    clock = FakeClock()
    with caplog.at_level(logging.INFO, "kvscope.kernels"):
        chooser = Chooser(cache_file, KEY, clock)
        assert chooser.choose("op", {"a": clock.costs(0.001)}) == "a"
    assert reasons(caplog) == ["corrupt"] and chooser.cache_reason == "corrupt"
    assert json.loads(cache_file.read_text())["choices"]["op"]["choice"] == "a"


@pytest.mark.parametrize("body", ['[1, 2]', '{"version": 1, "key": {}, "choices": {"x": 3}}',
                                  '{"version": 99, "key": {}, "choices": {}}'])
def test_json_of_the_wrong_shape_is_corrupt(cache_file, body):
    cache_file.write_text(body)
    assert kernel_cache.load(cache_file, KEY) == ({}, "corrupt")


def test_a_file_measured_under_another_key_is_stale(cache_file, caplog):
    clock = FakeClock()
    Chooser(cache_file, KEY, clock).choose("op", {"a": clock.costs(0.001),
                                                  "b": clock.costs(0.002)})
    other = {**KEY, "cpu_flags_sha256": "f2"}
    a, b = clock.costs(0.003), clock.costs(0.001)
    with caplog.at_level(logging.INFO, "kvscope.kernels"):
        chooser = Chooser(cache_file, other, clock)
        assert chooser.choose("op", {"a": a, "b": b}) == "b"   # measured again
    assert reasons(caplog) == ["stale-key"] and a.calls
    assert json.loads(cache_file.read_text())["key"] == other


def test_the_key_follows_the_cpu_flags_model_sources_and_torch():
    base = machine_key.machine_key("EPYC", ("avx2", "avx512f"), "s1", "2.x")
    assert machine_key.machine_key("EPYC", ("avx512f", "avx2"), "s1", "2.x") == base
    with_bf16 = machine_key.machine_key("EPYC", ("avx2", "avx512f", "avx512_bf16"), "s1",
                                        "2.x")
    assert with_bf16 != base and "avx512_bf16" in with_bf16["cpu_notable_flags"]
    assert machine_key.machine_key("Xeon", ("avx2", "avx512f"), "s1", "2.x") != base
    assert machine_key.machine_key("EPYC", ("avx2", "avx512f"), "s2", "2.x") != base
    assert machine_key.machine_key("EPYC", ("avx2", "avx512f"), "s1", "2.y") != base


def test_the_source_hash_follows_the_kernel_sources(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }")
    before = machine_key.sources_hash((src,))
    src.write_text("int f(void) { return 2; }")
    assert machine_key.sources_hash((src,)) != before
    assert machine_key.machine_key()["kernel_sources_sha256"] == machine_key.sources_hash()


def test_an_unwritable_cache_leaves_the_choice_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    clock = FakeClock()
    chooser = Chooser(blocker / "sub" / "kernel_choices.json", KEY, clock)
    with caplog.at_level(logging.INFO, "kvscope.kernels"):
        assert chooser.choose("op", {"a": clock.costs(0.001)}) == "a"
    assert "unwritable" in reasons(caplog)


def test_forget_measures_again(cache_file):
    clock = FakeClock()
    chooser = Chooser(cache_file, KEY, clock)
    chooser.choose("op", {"a": clock.costs(0.001), "b": clock.costs(0.002)})
    chooser.forget(["op"])
    assert chooser.choose("op", {"a": clock.costs(0.003), "b": clock.costs(0.002)}) == "b"
    assert Chooser(cache_file, KEY, clock).table()[0].choice == "b"


def test_row_buckets():
    assert [cpu_linear.bucket(r) for r in (1, 2, 3, 4, 5, 16, 17, 256, 257, 4096)] == [
        1, 2, 4, 4, 8, 16, 32, 256, 256, 256]


needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler here")


def fake_times(monkeypatch, chooser, **ms):
    monkeypatch.setattr(chooser, "measure", lambda candidates: {
        n: ms[n.replace("-", "_")] / 1e3 for n in candidates})


@needs_native
@pytest.mark.parametrize(("winner", "times", "dtype"), [
    # (bfloat16 may also time the kernel a hardware path down: cpu_linear.has_vec)
    ("torch", {"native": 2.0, "native_serial": 3.0, "native_vec": 4.0,
               "native_vec_serial": 5.0, "torch": 1.0}, torch.bfloat16),
    ("native", {"native": 1.0, "native_serial": 3.0, "torch": 2.0}, torch.float32),
    ("native-serial", {"native": 2.0, "native_serial": 1.0, "torch": 3.0}, torch.float32),
    # float32 at a few rows: torch is no candidate (cpu_linear.row_invariant_only)
    ("native", {"native": 2.0, "native_serial": 3.0, "torch": 1.0}, torch.float32),
])
def test_the_engines_linear_runs_the_chosen_implementation(cache_file, monkeypatch, winner,
                                                           times, dtype):
    from kvscope.engine.model.weight_formats import DenseLinear

    chooser = Chooser(cache_file, KEY, FakeClock())
    fake_times(monkeypatch, chooser, **times)
    kernel_choice.reset(chooser)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)   # so the serial kernel competes
    ran = []
    real_native, real_torch = cpu_linear.native_linear, cpu_linear.F.linear
    monkeypatch.setattr(cpu_linear, "native_linear", lambda *a, parallel=True, **kw: ran.append(
        "native" if parallel else "native-serial") or real_native(*a, parallel=parallel, **kw))
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a: ran.append("torch") or real_torch(*a))
    w = torch.randn(24, 32).to(dtype)
    layer = DenseLinear(w)
    x = torch.randn(3, 32).to(dtype)
    got = layer(x)
    assert ran == [winner]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), (x.double() @ w.double().t()).float(), rtol=tol,
                               atol=tol * 10)
    d = chooser.table()[0]
    name = str(dtype).removeprefix("torch.")
    assert d.name == (f"linear {name} 24x32 rows<=4 threads=2 "
                      f"wait={kernel_choice.thread_wait()}") and d.choice == winner
    assert d.info["rows"] == "<=4" and d.info["op"] == "linear"


@needs_native
def test_each_bucket_and_dtype_is_its_own_decision(cache_file, monkeypatch):
    chooser = Chooser(cache_file, KEY, FakeClock())
    fake_times(monkeypatch, chooser, native=1.0, native_serial=2.0, torch=3.0)
    kernel_choice.reset(chooser)
    w = torch.randn(8, 16)
    for rows in (1, 2, 3, 4, 300):
        cpu_linear.linear(torch.randn(rows, 16), w)
    cpu_linear.linear(torch.randn(1, 16).bfloat16(), w.bfloat16())
    rows = [(d.info["dtype"], d.info["rows"]) for d in chooser.table()]
    assert sorted(rows) == sorted([("float32", "<=1"), ("float32", "<=2"), ("float32", "<=4"),
                                   ("float32", "256+"), ("bfloat16", "<=1")])


def test_a_choice_made_under_one_openmp_wait_is_not_taken_under_another(monkeypatch):
    """Whether waking threads pays depends on how they wait, so the wait is in the name."""
    from kvscope.kernels import cpu_int4

    names = {}
    for spin, policy in [("1000", None), (None, None), (None, "passive"), ("1000", "active")]:
        for var, value in (("GOMP_SPINCOUNT", spin), ("OMP_WAIT_POLICY", policy)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        names[(spin, policy)] = cpu_int4.decision_name(1, 128, 64)
    assert names[("1000", None)].endswith("wait=spin=1000")
    assert names[(None, None)].endswith("wait=spin=default")
    assert names[(None, "passive")].endswith("wait=passive")
    assert len(set(names.values())) == 3  # the spin count is what libgomp uses over a policy


def test_the_default_gap_keeps_the_thread_busy_for_gap_s(cache_file):
    import time

    chooser = Chooser(cache_file, KEY)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(50):
        chooser.gap()
    assert time.perf_counter() - start >= 50 * kernel_choice.GAP_S
    assert time.process_time() > cpu  # spent working, as a step's Python is, not asleep
