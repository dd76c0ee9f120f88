"""/metrics by priority (issue 26): the `priority` label of the latency histograms, the
preemptions by reason and the waiting requests per priority.

A priority is any 32-bit int a client sends, so the label set is bounded: the first
MAX_PRIORITY_LABELS distinct priorities get their own value, later ones share "other" (a
client cycling through priorities must not grow /metrics without bound, as CountRequests
does for paths). Dashboards sum over the label, so the totals read as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MAX_PRIORITY_LABELS = 16
OTHER = "other"
# Scheduler.preemptions_by_reason's keys: both are always exported, so rate() has a series
# from the first scrape on.
PREEMPTION_REASONS = ("memory", "priority")


class PriorityLabels:
    """Priority -> label value, bounded. Written on the engine thread only."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        self.limit = limit
        self.known: dict[int, str] = {0: "0"}  # the default, there from the start

    def __call__(self, priority: int) -> str:
        label = self.known.get(priority)
        if label is None:
            if len(self.known) >= self.limit:
                return OTHER
            label = self.known[priority] = str(priority)
        return label


@dataclass(frozen=True)
class SchedulerCounts:
    """What the scheduler counts about priority and preemption, copied between steps."""
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    waiting_by_priority: dict[int, int] = field(default_factory=dict)
    interrupted_steps: int = 0  # steps a more urgent arrival cut short (step_interrupt)


def scheduler_counts(scheduler, interrupted_steps: int = 0) -> SchedulerCounts:
    """The scheduler's counters (engine thread); copies, so /metrics never reads them live."""
    return SchedulerCounts(dict(scheduler.preemptions_by_reason), scheduler.recomputed_tokens,
                           scheduler.waiting_by_priority(), interrupted_steps)


def labelled_waiting(counts: dict[int, int], label: PriorityLabels) -> dict[str, int]:
    out: dict[str, int] = {}
    for priority, n in counts.items():
        key = label(priority)
        out[key] = out.get(key, 0) + n
    return out


def priority_families(prefix: str, counts: SchedulerCounts, waiting: dict[str, int],
                      labels: dict):
    """num_preemptions{reason} (vLLM's name, plus the reason), recomputed_tokens,
    interrupted_steps and num_requests_waiting_by_priority{priority}."""
    names, values = [*labels], [*labels.values()]
    preemptions = CounterMetricFamily(
        prefix + "num_preemptions", "Cumulative number of preemption from the engine, by "
        "reason: memory (the KV pool ran dry) or priority (a more urgent request took the "
        "place).", labels=[*names, "reason"])
    by_reason = {r: 0 for r in PREEMPTION_REASONS} | counts.preemptions_by_reason
    for reason, n in sorted(by_reason.items()):
        preemptions.add_metric([*values, reason], n)
    yield preemptions
    recomputed = CounterMetricFamily(
        prefix + "recomputed_tokens", "Tokens that preemption threw away and that had to be "
        "computed again (after prefix-cache hits).", labels=names)
    recomputed.add_metric(values, counts.recomputed_tokens)
    yield recomputed
    interrupted = CounterMetricFamily(
        prefix + "interrupted_steps", "Steps of less urgent work abandoned between layers "
        "because a request of higher priority arrived (their work is done again).",
        labels=names)
    interrupted.add_metric(values, counts.interrupted_steps)
    yield interrupted
    gauge = GaugeMetricFamily(
        prefix + "num_requests_waiting_by_priority", "Requests waiting to be processed, by "
        "priority (lower = sooner).", labels=[*names, "priority"])
    for priority, n in sorted(waiting.items()):
        gauge.add_metric([*values, priority], n)
    yield gauge
