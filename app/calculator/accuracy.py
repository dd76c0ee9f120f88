"""What each KV dtype costs in answers, as measured on the embedded model, for the
calculator's hints (the window cannot run the model to ask; these are the numbers of
`kvscope kv-accuracy` on SmolLM2-135M-Instruct, CPU, greedy, 48 tokens on the 40 chat prompts
of resources/kv_accuracy_prompts.txt, against float32 KV).

prefix: share of the reply generated before the first token that differs from float32 KV's;
KL: mean KL divergence of the next-token distributions along float32 KV's reply.
The default for int8 and fp8 (EngineConfig.kv_rotation="auto", kv_anchor_tokens=4) is
"calibrated+anchors": Hadamard + the exact K shift and q/k balance, with the first 4 positions
of each opening kept exact beside the pool; "calibrated" is that without the anchor tokens,
"hadamard" the rotation alone, "none" plain.
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Measured:
    prefix: float  # prefix agreement with float32 KV, 0..1
    kl: float      # mean KL divergence from float32 KV


# (kv dtype, setting) -> what `kvscope kv-accuracy` measured.
# Measured 2026-12-01 on a shared 2-core CPU: `OMP_NUM_THREADS=2 kvscope kv-accuracy --dtypes
# bfloat16 int8 fp8 --json` (40 prompts x 48 tokens); float16 from the earlier full run.
# Prefix agreement moves in steps of whole near-tie flips (bfloat16 itself parts from float32
# on 3 of the 40 replies); KL is the steadier number.
MEASURED: dict[tuple[str, str], Measured] = {
    ("bfloat16", "none"): Measured(0.935, 2.70e-5),
    ("float16", "none"): Measured(1.000, 4.6e-7),
    ("int8", "calibrated+anchors"): Measured(0.968, 6.79e-5),
    ("int8", "calibrated"): Measured(0.839, 1.11e-4),
    ("int8", "hadamard"): Measured(0.746, 2.30e-4),
    ("int8", "none"): Measured(0.690, 9.31e-4),
    ("fp8", "calibrated+anchors"): Measured(0.643, 1.43e-3),
    ("fp8", "calibrated"): Measured(0.548, 2.66e-3),
    ("fp8", "hadamard"): Measured(0.470, 4.71e-3),
    ("fp8", "none"): Measured(0.485, 4.89e-3),
}
# What each dtype gets by default (kv_rotation="auto", kv_anchor_tokens=4).
DEFAULT_SETTING = {"int8": "calibrated+anchors", "fp8": "calibrated+anchors"}


def hint(dtype: str) -> str:
    """One line for the calculator: the dtype's measured agreement with its default setting,
    and without rotation or anchors."""
    if dtype == "float32":
        return f"float32 KV is the reference the others are measured against ({MODEL})"
    plain = MEASURED.get((dtype, "none"))
    default = MEASURED.get((dtype, DEFAULT_SETTING.get(dtype, "none")))
    if plain is None:
        return ""
    if default is plain:
        return (f"{dtype} KV on {MODEL}: {plain.prefix:.0%} of a greedy reply as float32 KV "
                f"(KL {plain.kl:.2g})")
    return (f"{dtype} KV on {MODEL}: {default.prefix:.0%} of a greedy reply as float32 KV "
            f"rotated, K-balanced and with the first 4 tokens exact, the default "
            f"(KL {default.kl:.2g}); {plain.prefix:.0%} without (KL {plain.kl:.2g})")
