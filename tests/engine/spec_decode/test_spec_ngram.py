"""The n-gram (prompt lookup) proposer against a brute-force reference, and the settings."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from kvscope.engine.cli.options import engine_config_from_args, parse_speculative_config
from kvscope.engine.config import EngineConfig
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.spec_decode.ngram import TokenBuffer, propose, propose_matched


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n in max..min whose suffix occurs earlier; its earliest occurrence."""
    return brute_force_matched(tokens, min_n, max_n, k)[0]


def brute_force_matched(tokens: list[int], min_n: int, max_n: int,
                        k: int) -> tuple[list[int], int]:
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(0, L - n):  # occurrences ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k], n
    return [], 0


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_proposer_matches_brute_force(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(400):
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        got = propose(np.array(tokens, dtype=np.int64), min_n, max_n, k)
        assert got == brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
        matched = propose_matched(np.array(tokens, dtype=np.int64), min_n, max_n, k)
        assert matched == brute_force_matched(tokens, min_n, max_n, k)


def test_proposer_examples():
    t = np.array([5, 6, 7, 8, 9, 1, 6, 7], dtype=np.int64)
    assert propose(t, 2, 4, 3) == [8, 9, 1]  # suffix (6, 7) seen at 1
    assert propose(t, 3, 4, 3) == []  # (1, 6, 7) never seen before: no draft
    assert propose(np.array([1, 2, 3], dtype=np.int64), 1, 3, 4) == []
    assert propose_matched(t, 2, 4, 3) == ([8, 9, 1], 2)
    assert propose_matched(t, 3, 4, 3) == ([], 0)


def test_token_buffer_grows_with_the_list():
    buf, tokens = TokenBuffer(), list(range(10))
    assert buf.view(tokens).tolist() == tokens
    tokens += list(range(100, 200))
    assert buf.view(tokens).tolist() == tokens


def test_settings_are_validated_with_clear_errors():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")
    assert EngineConfig().speculative_method == "off"


def test_speculative_config_flag_takes_vllms_json():
    from kvscope.engine.cli.options import add_engine_options

    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", '
                         '"num_speculative_tokens": 6, "prompt_lookup_max": 5, '
                         '"prompt_lookup_min": 3}', "--num-kv-blocks", "8"])
    config = engine_config_from_args(args)
    assert (config.speculative_method, config.num_speculative_tokens,
            config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 6, 3, 5)
    assert engine_config_from_args(p.parse_args([])).speculative_method == "off"
    for bad in ("{", "[1]", '{"method": "ngram", "draft_model": "x"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_speculative_config(bad)
