"""What each KV dtype costs in answers, as measured on the embedded model, for the
calculator's hints (the window cannot run the model to ask; these are the numbers of
`kvscope kv-accuracy` on SmolLM2-135M-Instruct, CPU, greedy, 48 tokens on 8 chat prompts,
against float32 KV).

prefix: share of the reply generated before the first token that differs from float32 KV's;
KL: mean KL divergence of the next-token distributions along float32 KV's reply.
Rotation "hadamard" is the default for int8 only (EngineConfig.kv_rotation="auto"): it cuts
int8's KL 3.8x, while fp8 (a float format) measured slightly worse rotated.
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Measured:
    prefix: float  # prefix agreement with float32 KV, 0..1
    kl: float      # mean KL divergence from float32 KV


# (kv dtype, rotation) -> what `kvscope kv-accuracy` measured.
# Measured 2026-12-01 on a shared 2-core CPU: `kvscope kv-accuracy --json` (all dtypes, both
# rotations). Prefix agreement on 8 x 48 tokens moves in steps of whole near-tie flips; KL is
# the steadier number.
MEASURED: dict[tuple[str, str], Measured] = {
    ("bfloat16", "none"): Measured(1.000, 3.04e-5),
    ("float16", "none"): Measured(1.000, 5.8e-7),
    ("int8", "hadamard"): Measured(0.708, 2.76e-4),
    ("int8", "none"): Measured(0.703, 1.05e-3),
    ("fp8", "hadamard"): Measured(0.383, 5.96e-3),
    ("fp8", "none"): Measured(0.471, 5.61e-3),
}


def hint(dtype: str) -> str:
    """One line for the calculator: the dtype's measured agreement, rotated and not."""
    if dtype == "float32":
        return f"float32 KV is the reference the others are measured against ({MODEL})"
    rotated, plain = MEASURED.get((dtype, "hadamard")), MEASURED.get((dtype, "none"))
    if plain is None:
        return ""
    if rotated is None:
        return (f"{dtype} KV on {MODEL}: {plain.prefix:.0%} of a greedy reply as float32 KV "
                f"(KL {plain.kl:.2g})")
    return (f"{dtype} KV on {MODEL}: {rotated.prefix:.0%} of a greedy reply as float32 KV "
            f"with the Hadamard rotation (KL {rotated.kl:.2g}), {plain.prefix:.0%} without "
            f"(KL {plain.kl:.2g})")
