"""Sampled requests under speculation: the rejection rule keeps the model's distribution.

Statistical tests with fixed seeds (so they are deterministic) and a chi-square threshold
at significance 0.001: a correct sampler fails one such check with probability 1/1000 per
seed choice, while the wrong rules that matter (always accepting the draft, resampling from
p instead of the residual, forgetting top-k/top-p) move a cell by tens of percent, which at
these sample sizes gives statistics in the hundreds.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.sampler import keep_top_k, keep_top_p
from kvscope.engine.spec_decode import decoder as spec_decode
from kvscope.engine.spec_decode.verify import accept_sampled, target_probs
from kvscope.testing.tiny_models import save_tiny_model

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
            9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def chi2_fits(counts: Counter, probs: torch.Tensor) -> bool:
    """Goodness of fit of counts to probs (cells with expected < 5 pooled)."""
    n = sum(counts.values())
    expected = (probs.double() * n).tolist()
    big = [i for i, e in enumerate(expected) if e >= 5]
    stat, rest_obs, rest_exp = 0.0, n, n
    for i in big:
        stat += (counts[i] - expected[i]) ** 2 / expected[i]
        rest_obs -= counts[i]
        rest_exp -= expected[i]
    cells = len(big)
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    elif rest_obs > 5 * max(rest_exp, 1e-9) + 5:
        return False  # many hits where the model puts almost nothing
    return stat < CHI2_999[cells - 1]


def test_target_probs_are_the_samplers_distribution():
    rows = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=9, top_p=0.8)
    want = torch.stack([torch.softmax(keep_top_p(keep_top_k(r / 0.7, 9), 0.8), -1)
                        for r in rows])
    assert torch.allclose(target_probs(rows, params), want)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.6, top_k=4, top_p=0.9)])
def test_accept_sampled_outputs_follow_the_target(params):
    """First token ~ p0; given it equals the first draft, the second ~ p1; and so on."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 6, generator=g) * 1.5
    probs = target_probs(rows, params)
    draft = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]  # plausible, not certain
    gen = torch.Generator().manual_seed(2)
    outs = [accept_sampled(rows, draft, params, gen) for _ in range(12000)]
    assert chi2_fits(Counter(o[0] for o in outs), probs[0])
    on_draft = [o for o in outs if o[0] == draft[0]]
    assert len(on_draft) > 1000
    assert chi2_fits(Counter(o[1] for o in on_draft), probs[1])
    both = [o for o in on_draft if o[1] == draft[1]]
    assert chi2_fits(Counter(o[2] for o in both), probs[2])
    assert all(len(o) == 3 for o in both) and all(len(o) <= 3 for o in outs)


def test_wrong_rule_would_fail_the_check():
    """The check has teeth: accepting every draft is far from p0."""
    rows = torch.randn(2, 6, generator=torch.Generator().manual_seed(1)) * 1.5
    probs = target_probs(rows, SamplingParams(temperature=1.0))
    draft = int(probs[0].argsort()[-2])
    assert not chi2_fits(Counter({draft: 12000}), probs[0])


@pytest.fixture
def one_thread():
    """Hundreds of tiny per-sequence attention calls: one torch thread is many times faster
    than two fighting over a loaded machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_engine_sampled_output_distribution_unchanged(tmp_path, monkeypatch, one_thread):
    """Two samples of the engine's second output token, drafts on and off, against the
    model's own distribution given the first (grouped on the commonest first token)."""
    path = str(save_tiny_model(tmp_path / "m", "llama", seed=3))
    prompt = list(range(10, 22))
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True, seed=s)
              for s in range(600)]
    llm = LLM(EngineConfig(model=path, block_size=4, num_kv_blocks=2048, max_num_seqs=256,
                           max_num_batched_tokens=4096))
    plain = llm.generate([prompt] * len(params), params)
    first = Counter(o.token_ids[0] for o in plain).most_common(1)[0][0]
    # The model's distribution of the second token after (prompt, first).
    ids = torch.tensor([prompt + [first]])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(ids).logits[0, -1:].float()
    p1 = target_probs(logits, params[0])[0]
    draft_token = int(p1.argsort()[-2])
    monkeypatch.setattr(spec_decode, "propose_matched",
                        lambda t, lo, hi, k: ([draft_token] * k, hi))
    spec = LLM(EngineConfig(model=path, block_size=4, num_kv_blocks=2048, max_num_seqs=256,
                            max_num_batched_tokens=4096, speculative_method="ngram"))
    outs = spec.generate([prompt] * len(params), params)
    assert spec.engine.spec.counters.num_accepted_tokens > 0
    for got in (plain, outs):
        second = Counter(o.token_ids[1] for o in got if o.token_ids[0] == first)
        assert sum(second.values()) > 100
        assert chi2_fits(second, p1)
