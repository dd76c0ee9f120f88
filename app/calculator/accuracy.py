"""What each KV dtype costs in answers, as measured on the embedded model, for the
calculator's hints (the window cannot run the model to ask; these are the numbers of
`kvscope kv-accuracy` on SmolLM2-135M-Instruct, CPU, greedy, 48 tokens on the 40 chat prompts
of resources/kv_accuracy_prompts.txt, against float32 KV).

prefix: share of the reply generated before the first token that differs from float32 KV's;
KL: mean KL divergence of the next-token distributions along float32 KV's reply.
Rotation "calibrated" (Hadamard + the exact K shift and q/k balance) is the default for int8
and fp8 (EngineConfig.kv_rotation="auto"); "hadamard" is the rotation alone, "none" plain.
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Measured:
    prefix: float  # prefix agreement with float32 KV, 0..1
    kl: float      # mean KL divergence from float32 KV


# (kv dtype, rotation) -> what `kvscope kv-accuracy` measured.
# Measured 2026-12-01 on a shared 2-core CPU: `kvscope kv-accuracy --json` (all dtypes, all
# rotations, 40 prompts x 48 tokens). Prefix agreement moves in steps of whole near-tie flips
# (bfloat16 itself parts from float32 on 3 of the 40 replies); KL is the steadier number.
MEASURED: dict[tuple[str, str], Measured] = {
    ("bfloat16", "none"): Measured(0.935, 2.72e-5),
    ("float16", "none"): Measured(1.000, 4.6e-7),
    ("int8", "calibrated"): Measured(0.859, 1.10e-4),
    ("int8", "hadamard"): Measured(0.749, 2.19e-4),
    ("int8", "none"): Measured(0.694, 9.64e-4),
    ("fp8", "calibrated"): Measured(0.594, 2.61e-3),
    ("fp8", "hadamard"): Measured(0.523, 4.68e-3),
    ("fp8", "none"): Measured(0.478, 4.85e-3),
}
# The rotation each dtype gets by default (EngineConfig.kv_rotation="auto").
DEFAULT_ROTATION = {"int8": "calibrated", "fp8": "calibrated"}


def hint(dtype: str) -> str:
    """One line for the calculator: the dtype's measured agreement with its default rotation,
    and without it."""
    if dtype == "float32":
        return f"float32 KV is the reference the others are measured against ({MODEL})"
    plain = MEASURED.get((dtype, "none"))
    default = MEASURED.get((dtype, DEFAULT_ROTATION.get(dtype, "none")))
    if plain is None:
        return ""
    if default is plain:
        return (f"{dtype} KV on {MODEL}: {plain.prefix:.0%} of a greedy reply as float32 KV "
                f"(KL {plain.kl:.2g})")
    return (f"{dtype} KV on {MODEL}: {default.prefix:.0%} of a greedy reply as float32 KV "
            f"rotated and K-balanced, the default (KL {default.kl:.2g}); {plain.prefix:.0%} "
            f"without (KL {plain.kl:.2g})")
