"""On the embedded SmolLM2-135M-Instruct, rotated int8 KV is closer to float32 KV than plain,
and the calibrated K shift and balance on top of the rotation closer still.

Teacher-forced: the float32-KV engine scores a text; int8 engines (plain, rotated, calibrated)
score the same tokens; KL divergence from float32's next-token distributions must drop with the
rotation (measured 3.8x on the kv-accuracy prompts; asserted: at least 2x here) and again with
the calibration (measured about 2x; asserted: 1.4x), and perplexity must stay within 0.5 %.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvscope.engine import LLM, EngineConfig
from kvscope.engine.loading.loader import load_model
from kvscope.engine.scoring import mean_kl, perplexity, token_log_probs

pytestmark = pytest.mark.slow

TEXT = Path(__file__).resolve().parents[3] / "resources" / "perplexity_text.txt"


def test_rotation_cuts_int8_kl_on_the_embedded_model():
    loaded = load_model("default", torch.float32)
    ids = loaded.tokenizer.encode(TEXT.read_text())[:256]
    scores = {}
    for name, kv_dtype, rotation in (("float32", "float32", "none"),
                                     ("int8", "int8", "none"),
                                     ("int8+hadamard", "int8", "hadamard"),
                                     ("int8+calibrated", "int8", "calibrated")):
        # Dense weights: the KV storage is the only thing that differs between the runs; no anchor
        # tokens, so the rotation alone is measured (tests/engine/kv_cache/test_kv_anchors.py).
        llm = LLM(EngineConfig(kv_dtype=kv_dtype, kv_rotation=rotation, num_kv_blocks=32,
                               weights="dense", kv_anchor_tokens=0),
                  loaded=loaded)
        scores[name] = token_log_probs(llm.engine, ids)
        assert llm.stats().kv_rotation == rotation
    kl = {n: mean_kl(scores["float32"], scores[n])
          for n in ("int8", "int8+hadamard", "int8+calibrated")}
    assert kl["int8+hadamard"] < kl["int8"] / 2, kl
    assert kl["int8+calibrated"] < kl["int8+hadamard"] / 1.4, kl
    ppl = {n: perplexity(lp, ids) for n, lp in scores.items()}
    gap = {n: abs(ppl[n] - ppl["float32"]) for n in ppl}
    # Perplexity does not order the int8 variants: their gaps to float32 are hundredths on ~43
    # and move between runs with the matmul each process measures fastest (the kernel chooser;
    # its candidates round differently). The KL above orders them; perplexity must stay
    # within 0.5 % of float32's for every variant, which a broken KV path would not.
    assert all(gap[n] < 0.005 * ppl["float32"] for n in kl), ppl
