"""What each KV dtype costs in answers, as measured on the embedded model, for the
calculator's hints (the window cannot run the model to ask; these are the numbers of
`kvscope kv-accuracy` on SmolLM2-135M-Instruct, CPU, greedy, 48 tokens on 8 chat prompts,
against float32 KV).

prefix: share of the reply generated before the first token that differs from float32 KV's;
KL: mean KL divergence of the next-token distributions along float32 KV's reply.
Rotation "hadamard" is the default for int8/fp8 (EngineConfig.kv_rotation="auto").
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Measured:
    prefix: float  # prefix agreement with float32 KV, 0..1
    kl: float      # mean KL divergence from float32 KV


# (kv dtype, rotation) -> what `kvscope kv-accuracy` measured.
MEASURED: dict[tuple[str, str], Measured] = {
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
                f"(KL {plain.kl:.4f})")
    return (f"{dtype} KV on {MODEL}: {rotated.prefix:.0%} of a greedy reply as float32 KV "
            f"with the Hadamard rotation (KL {rotated.kl:.4f}), {plain.prefix:.0%} without "
            f"(KL {plain.kl:.4f})")
