"""`--metrics-prefix vllm`: the same /metrics under vLLM's own prefix, so tools made for a vLLM
server (its Grafana dashboard, kvscope's `--attach-vllm`) read kvscope unchanged."""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIXES = ("kvscope", "vllm")


class _Renamed(Collector):
    def __init__(self, inner: CollectorRegistry, old: str, new: str) -> None:
        self.inner, self.old, self.new = inner, old, new

    def collect(self):
        for metric in self.inner.collect():
            if not metric.name.startswith(self.old):
                yield metric  # process_* and other unprefixed families stay as they are
                continue
            renamed = Metric(self._rename(metric.name), metric.documentation, metric.type,
                             metric.unit)
            renamed.samples = [s._replace(name=self._rename(s.name)) for s in metric.samples]
            yield renamed

    def _rename(self, name: str) -> str:
        return self.new + name[len(self.old):] if name.startswith(self.old) else name


def prefixed(registry: CollectorRegistry, old: str, prefix: str) -> CollectorRegistry:
    """A registry that serves `registry` with the `old` prefix (e.g. "kvscope:") replaced."""
    if prefix not in PREFIXES:
        raise ValueError(f"--metrics-prefix {prefix!r} is not one of {', '.join(PREFIXES)}")
    if old == prefix + ":":
        return registry
    out = CollectorRegistry(auto_describe=False)
    out.register(_Renamed(registry, old, prefix + ":"))
    return out
