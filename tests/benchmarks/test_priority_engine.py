"""benchmarks/priority_engine.py at its smallest on the tiny chat model: both phases in
alternating windows, the chats only beside, the background counted in every window (the
numbers themselves come from running the benchmark, not from here)."""
from __future__ import annotations

import json

import pytest

from benchmarks.serving import priority_engine as bench


def test_a_short_run_alternates_alone_and_beside(chat_model, capsys):
    argv = ["--model", str(chat_model), "--device", "cpu", "--max-model-len", "256", "--json",
            "--seconds", "1.2", "--cycles", "2", "--warmup-s", "0.2", "--fg-interval", "0.3",
            "--fg-tokens", "4", "--bg-streams", "2", "--bg-min-words", "3",
            "--bg-max-words", "6", "--bg-tokens", "8", "--priority-hold-s", "0.1",
            "--priority-lower-tokens", "2"]
    assert bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["lower_tokens"] == 2 and r["hold_s"] == 0.1 and r["cycles"] == 2
    alone, beside = r["phases"]["alone"], r["phases"]["beside"]
    assert len(alone["windows"]) == len(beside["windows"]) == 2
    assert alone["chats"] == 0 and beside["chats"] == 2 * 2  # 0.6 s windows, one per 0.3 s
    for phase in (alone, beside):
        assert phase["bg_tok_s"] > 0 and phase["steps_per_s"] > 0
        assert all(w["bg_tok_s"] > 0 for w in phase["windows"])
    assert r["bg_ratio"] == pytest.approx(beside["bg_tok_s"] / alone["bg_tok_s"])
    # computed: every prompt token and output token, so more than the output alone
    assert all(p["bg_work_s"] > p["bg_tok_s"] for p in (alone, beside))
    assert r["bg_work_ratio"] == pytest.approx(beside["bg_work_s"] / alone["bg_work_s"])
    assert len(r["pair_ratios"]) == 2
    assert "background beside / alone" in bench.table(r)


@pytest.mark.parametrize("args, message", [
    (["--seconds", "0"], "--seconds must be > 0"),
    (["--bg-min-words", "9", "--bg-max-words", "3"], "--bg-max-words must be >= --bg-min"),
])
def test_bad_options_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err
