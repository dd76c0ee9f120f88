"""/metrics for mixture-of-experts models: the tokens routed to each expert, in the latest
engine step (a gauge) and since the model loaded (a counter, whose rate is each expert's load
per second), labelled by expert. A token counts once per MoE layer it passes, as in the step
frame's expert_load. Dense models export neither series."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass(frozen=True)
class ExpertLoad:
    last_step: list[int]
    total: list[int]


def expert_load(engine) -> ExpertLoad | None:
    """The engine's model's expert load (engine.model.moe.ExpertLoad), copied on the engine
    thread; None for a dense model."""
    load = getattr(getattr(engine, "model", None), "expert_load", None)
    return None if load is None else ExpertLoad(load.last_step(), load.totals())


def moe_families(prefix: str, load: ExpertLoad, labels: dict[str, str]
                 ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    names, values = [*labels, "expert"], list(labels.values())
    step = GaugeMetricFamily(prefix + "moe_expert_tokens_last_step",
                             "Tokens routed to each expert in the latest engine step, summed "
                             "over the MoE layers.", labels=names)
    for expert, count in enumerate(load.last_step):
        step.add_metric([*values, str(expert)], count)
    yield step
    total = CounterMetricFamily(prefix + "moe_expert_tokens",
                                "Tokens routed to each expert, summed over the MoE layers.",
                                labels=names)
    for expert, count in enumerate(load.total):
        total.add_metric([*values, str(expert)], count)
    yield total
