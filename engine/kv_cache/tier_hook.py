"""What the block manager and the engine call on the KV tiers (engine/kv_cache/tiers.py), as a
protocol: the tiers use the block manager, so the block manager must not import them.

`bm` and `block` are the calling BlockManager and one of its Blocks (typed loosely here for
that same reason; engine/kv_cache/tiers.py types them exactly)."""
from __future__ import annotations

from typing import Any, Protocol

from kvscope.engine.sequence import Sequence


class TierHook(Protocol):
    trace_events: list[Any] | None

    def digest(self, bm: Any, seq: Sequence, i: int) -> bytes: ...

    def offload(self, bm: Any, block: Any, priority: int) -> None: ...

    def onboard(self, bm: Any, seq: Sequence, hits: list[int], stop: int) -> list[int]: ...

    def on_allocate(self, bm: Any, seq: Sequence, hits: list[int]) -> None: ...

    def after_step(self, bm: Any, registered: list[int]) -> None: ...

    def stats_fields(self) -> dict[str, Any]: ...
