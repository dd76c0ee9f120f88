"""A comparison says when its runs are not like for like (issue 53: "7.53x throughput" for an
unpaced replay of a sampled trace with other output lengths, said without a word): sampled
versus greedy, different output lengths, unpaced replay; and says nothing for a fair pair."""
from __future__ import annotations

from kvscope.engine.traces.compare import compare_runs
from kvscope.engine.traces.compare_report import as_text
from kvscope.engine.traces.requests import load_run
from kvscope.ipc.trace_format import Arrival, Finish, Token
from tests.traces import synthetic

GREEDY = {"max_tokens": 8, "temperature": 0.0}
SAMPLED = {"max_tokens": 8, "temperature": 0.8}


def run(path, *, gap=2.0, lengths=(3, 3, 3), sampling=GREEDY):
    """Three requests arriving `gap` seconds apart, each emitting lengths[k] tokens."""
    evs = []
    for k, n in enumerate(lengths):
        t, rid = 1.0 + k * gap, f"r{k}"
        evs += [Arrival(t=t, id=rid, prompt_len=4, sampling=sampling),
                Token(t=t + 0.1, id=rid, tokens=list(range(n))),
                Finish(t=t + 0.2, id=rid, reason="length")]
    return load_run(synthetic.write(path, evs))


def notes(a, b):
    return compare_runs([a, b]).pairs[0].not_like_for_like


def test_a_fair_pair_has_no_notes(tmp_path):
    assert notes(run(tmp_path / "a.jsonl"), run(tmp_path / "b.jsonl")) == []


def test_sampled_requests_are_named(tmp_path):
    found = notes(run(tmp_path / "a.jsonl", sampling=SAMPLED), run(tmp_path / "b.jsonl"))
    assert len(found) == 1 and "sampled" in found[0] and "3 of 3 requests in A, 0 in B" \
        in found[0]


def test_other_output_lengths_are_counted(tmp_path):
    found = notes(run(tmp_path / "a.jsonl"), run(tmp_path / "b.jsonl", lengths=(3, 5, 3)))
    assert len(found) == 1
    assert "1 of 3 requests (9 tokens in A, 11 in B)" in found[0]


def test_an_unpaced_replay_is_named(tmp_path):
    found = notes(run(tmp_path / "a.jsonl", gap=2.0), run(tmp_path / "b.jsonl", gap=0.01))
    assert len(found) == 1
    assert "4.0 s in A and 0.0 s in B (B replayed unpaced" in found[0]


def test_all_three_and_the_text_report_says_so(tmp_path):
    a = run(tmp_path / "a.jsonl", sampling=SAMPLED)
    b = run(tmp_path / "b.jsonl", gap=0.0, lengths=(4, 3, 3))
    c = compare_runs([a, b])
    assert len(c.pairs[0].not_like_for_like) == 3
    text = as_text(c)
    assert text.count("not like for like:") == 3
    assert c.as_dict()["pairs"][0]["not_like_for_like"] == c.pairs[0].not_like_for_like
