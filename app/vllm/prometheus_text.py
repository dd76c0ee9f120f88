"""/metrics text -> {sample name: [(labels, value)]}, with the size bounded and bad text named.

The text is untrusted input: it is parsed by prometheus_client's text parser (no eval), and
a body over MAX_BYTES or one that does not parse is a MetricsError saying so.
"""
from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 16 << 20

Samples = dict[str, list[tuple[dict[str, str], float]]]


class MetricsError(ValueError):
    pass


def parse(text: str) -> Samples:
    if len(text) > MAX_BYTES:
        raise MetricsError(f"/metrics body is {len(text)} bytes, over the {MAX_BYTES} limit")
    out: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name].append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"/metrics is not Prometheus text: {exc}") from None
    return dict(out)


def total(samples: Samples, *names: str) -> float | None:
    """The first of `names` present, summed over its label sets (engines of a DP server)."""
    for name in names:
        if name in samples:
            return sum(v for _, v in samples[name])
    return None


def buckets(samples: Samples, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative (upper bound, count), summed over the other labels."""
    acc: dict[float, float] = defaultdict(float)
    for labels, value in samples.get(name + "_bucket", []):
        le = labels.get("le")
        if le is not None:
            acc[float(le)] += value
    return sorted(acc.items())


def label(samples: Samples, name: str, key: str) -> str | None:
    for labels, _ in samples.get(name, []):
        if key in labels:
            return labels[key]
    return None


def labels_of(samples: Samples, name: str) -> dict[str, str]:
    """The labels of a name's first sample (an info metric such as vllm:cache_config_info)."""
    found = samples.get(name)
    return dict(found[0][0]) if found else {}
