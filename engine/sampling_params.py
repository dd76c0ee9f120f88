"""Per-request sampling settings, validated when created."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn


def _fail(name: str, value: object, allowed: str) -> NoReturn:
    raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed}")


# The range of a 32-bit signed int, as vLLM's priority travels in its protobuf/JSON clients.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Lower is sooner, as vLLM's; counts only under scheduling_policy="priority".
    priority: int = 0
    # False: this request never takes drafted tokens (EngineConfig.speculative_method).
    speculative: bool = True
    # Hugging Face's / CTRL's: logits of every token already in the sequence (prompt and
    # output) divided by it when positive, multiplied when negative. 1 = off.
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted once from the logit of every token the reply already holds. 0 = off.
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "None or an integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", self.stop, "a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of token ids")
        if not _is_int(self.priority) or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            _fail("priority", self.priority,
                  f"an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower = sooner)")
        if not isinstance(self.speculative, bool):
            _fail("speculative", self.speculative, "True or False")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)")
        if not _is_number(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            _fail("presence_penalty", self.presence_penalty, "a number in [-2, 2] (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """A penalty changes this request's logits (they depend on its own tokens)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
