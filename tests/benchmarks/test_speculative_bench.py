"""benchmarks/speculative.py without timing anything: its prompts and its table."""
from __future__ import annotations

import pytest

from benchmarks.serving.speculative import TEXT, prompts_for, table


def test_workloads_are_input_grounded_and_distinct():
    quote = prompts_for("quote", 3)
    assert len({m[0]["content"] for m in quote}) == 3
    assert all(m[0]["content"].startswith(TEXT.read_text()) for m in quote)  # shared prefix
    assert len(TEXT.read_text().split()) > 800  # ~1k tokens
    for m in quote:  # the paragraph is named by words that open one in the text
        opening = m[0]["content"].rsplit('begins "', 1)[1].split('"')[0]
        assert len(opening.split()) == 6 and f"\n\n{opening}" in TEXT.read_text()
    summary = prompts_for("summary", 2)
    assert len({m[0]["content"] for m in summary}) == 2
    assert all(m[0]["content"].startswith(TEXT.read_text()) for m in summary)
    assert "def load_orders" in prompts_for("code", 1)[0][0]["content"]
    with pytest.raises(SystemExit, match="unknown workload"):
        prompts_for("poetry", 1)


def test_table_reports_speedup_acceptance_and_llama_cpp():
    row = {"concurrency": 1, "tok_s_off": 20.0, "tok_s_on": 40.0, "speedup": 2.0,
           "acceptance_length": 3.1, "outputs_equal": 1.0}
    text = table({"tokens": 64, "spec_config": {}, "workloads": {"quote": [row]},
                  "llama_cpp": {"depth": 1200, "tok_s": 25.0}})
    assert "2.00x" in text and "3.10" in text and "1.60x" in text


class _Delta:
    def __init__(self, request_id):
        self.request_id, self.finished = request_id, True


class _Engine:
    """Each request ends after as many steps as its prompt's first token says."""

    def __init__(self):
        self.live, self.most_live, self.n = {}, 0, 0

    def add_request(self, prompt, params):
        self.params = params
        self.n += 1
        rid = f"r{self.n}"
        self.live[rid] = [prompt[0], prompt]
        self.most_live = max(self.most_live, len(self.live))
        return rid

    def step(self):
        done = []
        for rid, left in self.live.items():
            left[0] -= 1
            if left[0] == 0:
                done.append(rid)
        self.finished = {rid: self.live.pop(rid)[1] for rid in done}
        return type("Step", (), {"outputs": [_Delta(r) for r in done]})

    def pop_output(self, rid):
        return type("Out", (), {"token_ids": self.finished[rid][::-1]})


def test_a_slot_freed_by_a_finished_request_takes_the_next_prompt():
    from benchmarks.serving.speculative import run_batch

    llm = type("LLM", (), {"engine": _Engine()})
    prompts = [[3, 0], [1, 1], [1, 2], [2, 3], [5, 4]]
    _, outs = run_batch(llm, prompts, 8, concurrency=2)
    assert outs == [p[::-1] for p in prompts]  # in the prompts' order
    assert llm.engine.most_live == 2
    llm.engine = _Engine()
    run_batch(llm, prompts, 8)
    assert llm.engine.most_live == 5  # no concurrency: all at once
    assert llm.engine.params.ignore_eos  # the default: every reply runs to its length
    run_batch(llm, prompts, [8, 9, 10, 11, 12], ignore_eos=False)
    assert not llm.engine.params.ignore_eos and llm.engine.params.max_tokens == 12


def test_a_run_has_at_least_the_minimum_requests_in_whole_slots():
    from benchmarks.serving.speculative import requests_at

    assert requests_at(1, 3, 12) == 12
    assert requests_at(2, 3, 12) == 12
    assert requests_at(8, 3, 12) == 24  # 3 a slot is already more
    assert requests_at(5, 3, 12) == 15  # whole slots
    assert requests_at(5, 1, 12) == 15
