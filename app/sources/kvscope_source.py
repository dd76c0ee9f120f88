"""kvscope's own engine as a source: the ZeroMQ bridge (app.bridge.EngineBridge) as it is,
every capability, settings that change while it runs. The window's kvscope views take its
frames through the bridge's signals (newest frame per topic, ~30 Hz, lost frames counted)."""
from __future__ import annotations

from kvscope.app.bridge import EngineBridge
from kvscope.app.sources.source import ALL, Source


class KvscopeSource(Source):
    kind = "kvscope"
    capabilities = ALL

    def __init__(self, url: str | None, parent=None, heartbeat_timeout: float = 3.0) -> None:
        super().__init__(url or "a local engine")
        self.bridge = EngineBridge(parent, heartbeat_timeout=heartbeat_timeout)

    def known(self) -> str:
        return "kvscope's own engine: block tables, KV bytes, every step, device memory."
