"""benchmarks/priority_latency.py at its smallest on the tiny chat model: every phase of every
policy reports, the server really ran under each policy, the targets are judged right (the
numbers themselves come from running the benchmark, not from here)."""
from __future__ import annotations

import json

import pytest

from benchmarks.serving import priority_latency as bench


def test_a_short_run_reports_each_phase_of_each_policy(chat_model, capsys):
    argv = ["--model", str(chat_model), "--device", "cpu", "--max-model-len", "256", "--json",
            "--seconds", "1.5", "--fg-interval", "0.5", "--fg-tokens", "5", "--bg-streams", "2",
            "--bg-min-words", "3", "--bg-max-words", "6", "--bg-tokens", "12",
            "--priority-hold-s", "0.2", "--lower-tokens", "0,2"]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert "targets: TTFT p99" in captured.err  # the table, beside the JSON
    # under priority, one beside phase per priority_lower_tokens value, one idle and alone
    assert list(r["policies"]) == ["fcfs", "priority:0", "priority:2"]
    sweep = r["policies"]["priority:0"], r["policies"]["priority:2"]
    assert sweep[0]["idle"] == sweep[1]["idle"] and sweep[0]["beside"] != sweep[1]["beside"]
    assert [s["settings"]["priority_lower_tokens"] for s in sweep] == [0, 2]
    assert r["policies"]["fcfs"]["settings"]["priority_hold_s"] == 0.2
    for policy, runs in r["policies"].items():
        assert runs["settings"]["scheduling_policy"] == policy.split(":")[0]
        idle, alone, beside = runs["idle"], runs["alone"], runs["beside"]
        for p in (idle, beside):
            assert p["fg_requests"] == 3  # 1.5 s at one every 0.5 s, all finished
            assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"]
            assert 0 <= p["itl_p50_s"] <= p["itl_p99_s"]
        assert idle["bg_tokens_per_s"] is None and alone["fg_requests"] == 0
        # the background phases alternate over one background: 3 windows each by default
        assert alone["windows"] == beside["windows"] == r["cycles"] == 3
        assert alone["seconds"] == pytest.approx(1.5) == beside["seconds"]
        assert alone["bg_tokens_per_s"] > 0 and beside["bg_tokens_per_s"] > 0
        # what the server computed: the idle chats' tokens, and the background's beside them
        assert idle["tokens_computed"] > 0 and "bg_work_per_s" not in idle
        assert alone["bg_work_per_s"] == pytest.approx(alone["tokens_computed"] / 1.5)
        assert 0 < beside["bg_work_per_s"] < beside["tokens_computed"] / 1.5
        assert set(beside["preemptions"]) == {"memory", "priority"}
        assert set(runs["ratios"]) == set(bench.TARGETS) == set(runs["meets"])


def test_targets_are_judged_in_the_right_direction():
    idle = {"ttft_p99_s": 0.1, "itl_p99_s": 0.02, "bg_tokens_per_s": None}
    alone = {"ttft_p99_s": None, "itl_p99_s": None, "bg_tokens_per_s": 100.0,
             "bg_work_per_s": 500.0}
    good = {"ttft_p99_s": 0.15, "itl_p99_s": 0.04, "bg_tokens_per_s": 90.0,
            "bg_work_per_s": 450.0}
    bad = {"ttft_p99_s": 0.16, "itl_p99_s": 0.041, "bg_tokens_per_s": 89.0,
           "bg_work_per_s": 449.0}
    assert bench.ratios(idle, alone, good)["meets"] == dict.fromkeys(bench.TARGETS, True)
    assert bench.ratios(idle, alone, bad)["meets"] == dict.fromkeys(bench.TARGETS, False)
    assert bench.ratios(idle, alone, good)["ratios"]["ttft_p99"] == pytest.approx(1.5)


def test_itl_gaps_are_split_by_whether_another_chats_prefill_ran_inside():
    """A gap of chat A inside which chat B's first token arrived spanned B's prefill; A's own
    first token does not count, nor a first token that arrived exactly at a gap's start."""
    a = [0.0, 0.1, 0.2, 0.5]  # gaps 0.1, 0.1, 0.3
    b = [0.35, 0.4]  # first token inside A's last gap; its one gap 0.05
    c = [0.2, 0.9]  # first token at the end of A's second gap (inside), the start of its third
    spanning, apart = bench.gaps_by_overlap([a, b, c])
    # A's 0.1-0.2 (C's first) and 0.2-0.5 (B's), C's 0.2-0.9 (B's)
    assert sorted(spanning) == pytest.approx([0.1, 0.3, 0.7])
    assert sorted(apart) == pytest.approx([0.05, 0.1])  # A's first gap, B's
    assert bench.gaps_by_overlap([[1.0], []]) == ([], [])


def test_the_background_work_is_what_the_server_computed_less_the_chats():
    """Each chat is charged what one cost in the idle phase (its prompt past the cache and its
    answer); the alone phase has no chats."""
    idle = {"tokens_computed": 4000.0, "fg_requests": 40, "seconds": 60.0}
    beside = {"tokens_computed": 3000.0, "fg_requests": 10, "seconds": 10.0}
    alone = {"tokens_computed": 5000.0, "fg_requests": 0, "seconds": 10.0}
    assert bench.background_work(idle, beside) == pytest.approx((3000 - 10 * 100) / 10)
    assert bench.background_work(idle, alone) == pytest.approx(500.0)


@pytest.mark.parametrize("args, message", [
    (["--seconds", "0"], "--seconds must be > 0"),
    (["--bg-min-words", "9", "--bg-max-words", "3"], "--bg-max-words must be >= --bg-min"),
    (["--policies", ","], "--policies names no policy"),
    (["--lower-tokens", "2,x"], "--lower-tokens must be integers >= 0"),
])
def test_bad_options_are_clear_errors(args, message, capsys):
    assert bench.main(args) == 2
    assert message in capsys.readouterr().err


def test_beside_phases_cover_each_lower_tokens_and_stretch_value():
    """--lower-tokens x --step-stretch: one beside phase per pair, each switching the server
    to its own settings (a fake client records the reconfigures)."""
    calls = []

    class Client:
        def reconfigure(self, **changes):
            calls.append(changes)

    phases = bench.beside_setups(Client(), "priority", [8], [1.0, 3.0])
    assert list(phases) == ["beside:8x1", "beside:8x3"]
    for setup, _ in phases.values():
        setup()
    assert calls == [s for _, s in phases.values()] == [
        {"priority_lower_tokens": 8, "priority_step_stretch": 1.0},
        {"priority_lower_tokens": 8, "priority_step_stretch": 3.0}]
    assert list(bench.beside_setups(Client(), "priority", [], [2.5])) == ["beside:2.5"]
    assert list(bench.beside_setups(Client(), "fcfs", [8], [3.0])) == ["beside"]


@pytest.mark.parametrize("value", ["0.5", "x", "inf"])
def test_a_bad_step_stretch_is_refused(value, capsys):
    assert bench.main(["--step-stretch", value]) == 2
    assert "--step-stretch must be numbers >= 1" in capsys.readouterr().err
