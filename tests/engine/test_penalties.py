"""Repetition and presence penalties: Hugging Face's repetition penalty exactly, on logits and
in a greedy decode of a tiny random model; OpenAI's presence penalty on the reply's tokens."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.sampler import apply_penalties, sample
from kvscope.engine.sequence import Sequence
from kvscope.testing.tiny_models import save_tiny_model


def test_repetition_penalty_equals_hf_logits_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 300, generator=g) * 4  # both signs, so both branches run
    ids = [3, 17, 17, 250, 3, 99, 0, 299]  # repeats count once, as HF's gather/scatter does
    for penalty in (0.7, 1.3, 2.0):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits.clone())
        got = apply_penalties(logits[0], ids, [], penalty, 0.0)
        assert torch.equal(got, want[0])
        assert not torch.equal(got, logits[0])


def test_presence_penalty_subtracts_once_per_output_token():
    logits = torch.zeros(10)
    got = apply_penalties(logits, [1, 2, 5, 5, 5], [5, 5, 5], 1.0, 0.5)
    want = torch.zeros(10)
    want[5] = -0.5  # once, though it came three times; prompt tokens 1, 2 untouched
    assert torch.equal(got, want)


def test_penalised_greedy_row_changes_the_pick():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    seq = Sequence("r", [1, 1], SamplingParams(repetition_penalty=2.0))
    assert sample(logits, [seq]) == [2]  # 5 / 2 < 4
    plain = Sequence("r", [1, 1], SamplingParams())
    assert sample(logits, [plain]) == [1]


@pytest.mark.parametrize("bad", [{"repetition_penalty": 0.0}, {"presence_penalty": 2.5},
                                 {"repetition_penalty": True}])
def test_bad_penalties_are_refused_by_name(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_greedy_decode_with_repetition_penalty_equals_hf_generate(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path, "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (7, 30)]
    llm = LLM(EngineConfig(model=str(path), weights="dense", dtype="float32",
                           kv_dtype="float32", block_size=4, num_kv_blocks=128,
                           max_model_len=256))
    n = 20
    params = SamplingParams(max_tokens=n, ignore_eos=True, repetition_penalty=1.8)
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, pad_token_id=0, repetition_penalty=1.8)
        assert out.token_ids == want[0, len(prompt):].tolist()
    # The penalty changed at least one decode, so the comparison tested it.
    assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain, strict=True))
