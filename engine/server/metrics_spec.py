"""/metrics for speculative decoding (issue 31), under vLLM's names: verifies that carried a
draft, drafted tokens, accepted ones, and accepted ones by position in the draft (vLLM's
`spec_decode_num_accepted_tokens_per_pos{position}`), all counters, so acceptance rate =
rate(accepted) / rate(draft_tokens) and mean acceptance length = 1 + rate(accepted) /
rate(drafts) as in vLLM's dashboards."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily

from kvscope.ipc import messages as m


def spec_families(prefix: str, stats: m.EngineStats, labels: dict[str, str]
                  ) -> Iterator[CounterMetricFamily]:
    names = list(labels)
    values = list(labels.values())
    for key, doc, value in (
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.",
             stats.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             stats.spec_num_accepted_tokens)):
        family = CounterMetricFamily(prefix + key, doc, labels=names)
        family.add_metric(values, value)
        yield family
    per_pos = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.",
                                  labels=[*names, "position"])
    for position, count in enumerate(stats.spec_accepted_per_pos):
        per_pos.add_metric([*values, str(position)], count)
    yield per_pos
