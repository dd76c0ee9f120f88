"""What the engine hands back: per-step token deltas and finished request outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
