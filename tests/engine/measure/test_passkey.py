"""The passkey builder and the scoring of answers, on hand-made tokens and outputs."""
import pytest
import torch

from kvscope.engine.measure import kv_grid, passkey_grid
from kvscope.engine.measure.kv_probes import Answer, Probe, kl, outcome, prefix_share
from kvscope.engine.measure.passkey import (
    FILLER,
    INSTRUCTION,
    QUESTION,
    PasskeyBuilder,
    answered_key,
    draw_key,
    is_right,
    key_sentence,
    rank_of,
)

VOCAB: dict[str, int] = {}


def encode(text: str) -> list[int]:
    """One id per word (a word-level toy tokenizer: sentences have 3 to 4 tokens)."""
    return [VOCAB.setdefault(w, len(VOCAB)) for w in text.split()]


def test_prompt_has_its_pieces_in_order():
    b = PasskeyBuilder(encode)
    p = b.build(200, 0.5, 12345)
    assert p.ids[:len(encode(INSTRUCTION))] == encode(INSTRUCTION)
    assert p.ids[-len(encode(QUESTION)):] == encode(QUESTION)
    key = encode(" " + key_sentence(12345))
    assert p.ids[p.key_start:p.key_start + len(key)] == key
    assert len(p.ids) <= 200
    # The filler fills the length: adding the next sentence would go past it.
    assert len(p.ids) + max(len(encode(s)) for s in FILLER) > 200


@pytest.mark.parametrize("length", [120, 333, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
def test_key_sits_at_the_asked_depth_within_one_sentence(length, depth):
    p = PasskeyBuilder(encode).build(length, depth, draw_key(0, length, depth, 0))
    filler = p.filler_end - p.filler_start
    at = p.key_start - p.filler_start
    longest = max(len(encode(s)) for s in FILLER)
    assert abs(at - depth * filler) <= longest
    if depth == 0.0:
        assert at == 0
    if depth == 1.0:
        assert at == filler


def test_prompts_share_their_filler_up_to_the_key():
    """What lets the prefix cache compute the filler once for every cell."""
    b = PasskeyBuilder(encode)
    short, long = b.build(300, 0.5, 11111), b.build(900, 0.75, 22222)
    n = min(short.key_start, long.key_start)
    assert short.ids[:n] == long.ids[:n]


def test_keys_differ_per_cell_and_sample_and_repeat_per_seed():
    keys = {draw_key(0, n, d, s) for n in (1024, 2048) for d in (0.0, 0.5) for s in (0, 1)}
    assert len(keys) == 8
    assert draw_key(0, 1024, 0.5, 1) == draw_key(0, 1024, 0.5, 1)
    assert draw_key(1, 1024, 0.5, 1) != draw_key(0, 1024, 0.5, 1)
    assert all(10000 <= k <= 99999 for k in keys)


def test_bad_depth_and_short_length_are_refused():
    b = PasskeyBuilder(encode)
    with pytest.raises(ValueError, match="depth"):
        b.build(500, 1.5, 12345)
    with pytest.raises(ValueError, match="too short"):
        b.build(10, 0.5, 12345)


@pytest.mark.parametrize(("text", "right"), [
    (" 12345.", True), ("12345 is the pass key", True), (" 1234", False),
    (" 123456", False), (" the grass is green", False), ("", False), (" 54321. 12345", False)])
def test_is_right_on_hand_made_answers(text, right):
    assert is_right(text, 12345) is right


def test_answered_key():
    assert answered_key(" 42. Remember") == 42
    assert answered_key("none") is None


def test_rank_kl_and_agreement_by_hand():
    row = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    assert rank_of(row, 1) == 1
    assert rank_of(row, 2) == 2
    assert rank_of(row, 0) == 3
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.25, 0.75]]))
    expected = 0.5 * (torch.log(torch.tensor(0.5 / 0.25)) + torch.log(torch.tensor(0.5 / 0.75)))
    assert kl(p, q) == pytest.approx(float(expected))
    assert kl(p, p) == 0.0
    assert prefix_share([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert prefix_share([1, 2], [1, 2]) == 1.0


def _answer(tokens, text, probs, right_rank=None):
    return Answer(tokens, text, torch.log(torch.tensor(probs)), right_rank)


def test_outcome_against_float32_by_hand():
    probe = Probe(ids=[0, 1], max_tokens=2, cell=(("length", 8), ("depth", 0.5)), key=77777,
                  right=[5, 6], rank_at=1)
    ref = _answer([1, 0], " 77777", [[0.2, 0.8], [0.9, 0.1]], right_rank=1)
    got = _answer([1, 1], " 77778", [[0.4, 0.6], [0.3, 0.7]], right_rank=3)
    o = outcome(probe, got, ref)
    assert o["right"] is False and o["same_as_float32"] is False
    assert o["agreement"] == 0.5
    assert o["top1_agreement"] == 0.5  # argmax agrees at the first position only
    assert o["rank"] == 3
    assert o["kl"] == pytest.approx(kl(ref.log_probs, got.log_probs))
    same = outcome(probe, ref, ref)
    assert same["right"] and same["same_as_float32"] and same["kl"] == 0.0


def test_fold_cells_means_and_median_rank():
    cell_a, cell_b = (("length", 8), ("depth", 0.0)), (("length", 8), ("depth", 1.0))
    probes = [Probe([0] * 5, 1, cell_a), Probe([0] * 7, 1, cell_a), Probe([0], 1, cell_b)]
    outs = [{"right": True, "same_as_float32": True, "agreement": 1.0, "top1_agreement": 1.0,
             "kl": 0.1, "rank": 1, "answer": "a", "key": 1},
            {"right": False, "same_as_float32": False, "agreement": 0.0, "top1_agreement": 0.5,
             "kl": 0.3, "rank": 9, "answer": "b", "key": 2},
            {"right": False, "same_as_float32": True, "agreement": 1.0, "top1_agreement": 1.0,
             "kl": 0.0, "rank": 4, "answer": "c", "key": 3}]
    a, b = kv_grid.fold_cells(probes, outs)
    assert (a["length"], a["depth"], a["samples"], a["tokens"]) == (8, 0.0, 2, 6)
    assert a["right"] == 0.5 and a["same_as_float32"] == 0.5
    assert a["kl"] == pytest.approx(0.2) and a["rank"] == 5
    assert b["right"] == 0.0 and b["rank"] == 4
    assert [x["key"] for x in a["answers"]] == [1, 2]


def test_settings_and_lengths():
    names = [s.name for s in kv_grid.settings_for(["bfloat16", "int8", "fp8"])]
    assert names == ["float32", "bfloat16", "int8", "int8+none", "fp8", "fp8+none"]
    assert passkey_grid.capped_lengths([1024, 8192, 9000], 8192, 8) == [1024, 8183]


def test_work_tokens_counts_a_shared_prefix_once():
    shared = list(range(32))
    probes = [Probe(shared + [100 + i] * 16, 4, ("c",)) for i in range(3)]
    # 2 shared blocks once, 1 own block each, then per probe: 0 partial + 2 * 4 + 16.
    assert kv_grid.work_tokens(probes, 16) == 32 + 3 * 16 + 3 * (8 + 16)
