"""Runs side by side: two traces' summaries with the ratio B/A of every number they share
(compare), and N runs of the same requests - kvscope traces, replays against external
servers, Mooncake-style workloads - as serving metrics (compare_runs): request and output
token throughput, TTFT, TPOT, ITL and E2E percentiles, goodput under an SLO, per-request
deltas against the first run, whether greedy outputs stayed identical, and why two runs are
not like for like (sampled requests, other output lengths, an unpaced replay), so a ratio
such as "7.53x throughput" is never read as the configuration's doing when it is not."""
from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvscope.engine.traces.requests import RequestRecord, Run
from kvscope.engine.traces.summary import TraceSummary, percentile, summarize
from kvscope.ipc.trace_format import Trace

PERCENTILES = (50, 90, 99)
CDF_POINTS = 200  # the window's CDF plots: enough to draw, small enough to print


class Comparison(msgspec.Struct):
    a: TraceSummary
    b: TraceSummary
    ratio: dict[str, float | None]  # B / A per numeric field; None where A is zero

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a.as_dict(), "b": self.b.as_dict(), "ratio": self.ratio}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """B/A for every key whose value is a number (not a bool) on both sides."""
    return {k: (b[k] / va if va else None) for k, va in a.items()
            if _is_number(va) and _is_number(b.get(k))}


def compare(a: TraceSummary, b: TraceSummary) -> Comparison:
    return Comparison(a=a, b=b, ratio=ratios(a.as_dict(), b.as_dict()))


def compare_traces(a: Trace, b: Trace) -> Comparison:
    return compare(summarize(a), summarize(b))


# -- serving metrics over N runs ------------------------------------------------------------
class Slo(msgspec.Struct):
    """Goodput's bounds in seconds; None: not bounded."""
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met(self, r: RequestRecord) -> bool:
        return r.ok and all(bound is None or (value is not None and value <= bound)
                            for bound, value in ((self.ttft, r.ttft), (self.e2e, r.e2e),
                                                 (self.tpot, r.tpot if r.output_tokens > 1
                                                  else 0.0)))

    def text(self) -> str:
        return ",".join(f"{k}={v * 1000:g}ms" for k, v in msgspec.structs.asdict(self).items()
                        if v is not None)


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1e-3}


def parse_slo(text: str) -> Slo:
    """"ttft=500ms,tpot=50ms[,e2e=2s]" (a bare number is milliseconds)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s|)", value.strip())
        if key.strip() not in ("ttft", "tpot", "e2e") or m is None:
            raise ValueError(f"--slo {text!r}: expected ttft=500ms,tpot=50ms[,e2e=2s] "
                             f"(units us, ms or s), got {part!r}")
        values[key.strip()] = float(m[1]) * _UNITS[m[2]]
    if not values:
        raise ValueError(f"--slo {text!r} sets no bound")
    return Slo(**values)


class RunStats(msgspec.Struct):
    """One run's serving metrics; times in ms; None where the run has nothing to measure."""
    name: str
    kind: str
    model: str
    server_url: str | None
    requests: int
    succeeded: int
    failed: int
    output_tokens: int
    duration_s: float | None
    request_throughput: float | None  # succeeded requests / s
    output_throughput: float | None  # output tokens of succeeded requests / s
    metrics: dict[str, float | None]  # ttft_p50_ms ... e2e_p99_ms
    goodput: float | None  # requests / s within the SLO
    slo_met: int | None
    finish_reasons: dict[str, int]
    errors: dict[str, int]  # error message -> how many requests


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def _values(reqs: list[RequestRecord], get: Callable[[RequestRecord], Any]) -> list[float]:
    return [v for r in reqs if r.ok and (v := get(r)) is not None]


def latency_values(run: Run) -> dict[str, list[float]]:
    """Each latency over the run's successful requests, in seconds (ITL: every gap)."""
    reqs = list(run.requests.values())
    return {"ttft": _values(reqs, lambda r: r.ttft), "tpot": _values(reqs, lambda r: r.tpot),
            "itl": [g for r in reqs if r.ok for g in r.itl],
            "e2e": _values(reqs, lambda r: r.e2e)}


def run_stats(run: Run, slo: Slo | None = None) -> RunStats:
    reqs = list(run.requests.values())
    ok = [r for r in reqs if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    duration = None
    if run.has_timings and reqs:
        duration = max(r.end for r in reqs) - min(r.arrival for r in reqs)
    per_s = (lambda n: n / duration) if duration else (lambda n: None)
    values = latency_values(run) if run.has_timings else {}
    metrics = {f"{name}_p{q}_ms": _ms(percentile(values.get(name, []), q))
               for name in ("ttft", "tpot", "itl", "e2e") for q in PERCENTILES}
    met = sum(slo.met(r) for r in reqs) if slo is not None and run.has_timings else None
    reasons: dict[str, int] = {}
    errors: dict[str, int] = {}
    for r in reqs:
        if r.finish_reason:
            reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return RunStats(name=run.name, kind=run.kind, model=run.model, server_url=run.server_url,
                    requests=len(reqs), succeeded=len(ok), failed=len(reqs) - len(ok),
                    output_tokens=tokens, duration_s=duration,
                    request_throughput=per_s(len(ok)), output_throughput=per_s(tokens),
                    metrics=metrics, goodput=None if met is None else per_s(met), slo_met=met,
                    finish_reasons=reasons, errors=errors)


class MismatchError(ValueError):
    """Runs of different request sets: their numbers are not comparable."""


class Delta(msgspec.Struct):
    """B - A for one request (ms; tokens)."""
    id: str
    ttft_ms: float | None
    e2e_ms: float | None
    output_tokens: int


class OutputsCompared(msgspec.Struct):
    identical: bool | None
    compared: int = 0
    differing: list[str] = msgspec.field(default_factory=list)
    not_compared: str | None = None


class Pair(msgspec.Struct):
    a: int  # index into the runs
    b: int
    common: int
    only_a: list[str]
    only_b: list[str]
    prompt_len_differs: int  # common requests whose prompt lengths differ
    deltas: list[Delta]
    median_delta: dict[str, float | None]
    outputs: OutputsCompared
    # Why the pair's ratios may not measure the configuration alone ([]: like for like).
    not_like_for_like: list[str] = msgspec.field(default_factory=list)


def _sub(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else (x - y) * 1000


def _outputs(a: Run, b: Run, ids: list[str],
             decode: Callable[[list[int]], str] | None) -> OutputsCompared:
    both = [i for i in ids if a.requests[i].ok and b.requests[i].ok
            and a.requests[i].greedy and b.requests[i].greedy]
    if not both:
        return OutputsCompared(identical=None, not_compared="no greedy request finished in both")
    differing, compared = [], 0
    for i in both:
        ra, rb = a.requests[i], b.requests[i]
        if ra.token_ids is not None and rb.token_ids is not None:
            same = ra.token_ids == rb.token_ids
        elif ra.text is not None and rb.text is not None:
            same = ra.text == rb.text
        elif decode is not None:
            ta = ra.text if ra.text is not None else decode(ra.token_ids or [])
            tb = rb.text if rb.text is not None else decode(rb.token_ids or [])
            same = ta == tb
        else:
            return OutputsCompared(identical=None, not_compared="one run has token ids, the "
                                   "other text: give --tokenizer to decode the ids")
        compared += 1
        if not same:
            differing.append(i)
    return OutputsCompared(identical=not differing, compared=compared, differing=differing)


def _delta(ra: RequestRecord, rb: RequestRecord) -> Delta:
    """Latency deltas only where the request succeeded in both runs (a failure's E2E is the
    time to its error, not a latency)."""
    both = ra.ok and rb.ok
    return Delta(id=ra.id, ttft_ms=_sub(rb.ttft, ra.ttft) if both else None,
                 e2e_ms=_sub(rb.e2e, ra.e2e) if both else None,
                 output_tokens=rb.output_tokens - ra.output_tokens)


# A run whose arrivals span less than this share of the other's was not paced like it.
PACED_SHARE = 0.5
MIN_PACED_SPAN_S = 1.0  # shorter recordings: arrival spans say nothing about pacing


def _span(run: Run, ids: list[str]) -> float:
    return max((run.requests[i].arrival for i in ids), default=0.0)


def run_letter(k: int) -> str:
    """A run's name in the reports: A, B, ... (past Z its index)."""
    return chr(ord("A") + k) if k < 26 else str(k)


def not_like_for_like(a: Run, b: Run, ids: list[str], name_a: str = "A",
                      name_b: str = "B") -> list[str]:
    """Why B against A does not measure the configuration alone, one sentence each."""
    notes = []
    sampled_a = sum(not a.requests[i].greedy for i in ids)
    sampled_b = sum(not b.requests[i].greedy for i in ids)
    if sampled_a or sampled_b:
        notes.append(f"sampled, not greedy: {sampled_a} of {len(ids)} requests in "
                     f"{name_a}, {sampled_b} in {name_b} (their outputs and "
                     "lengths differ by chance)")
    both = [i for i in ids if a.requests[i].ok and b.requests[i].ok]
    other = [i for i in both if a.requests[i].output_tokens != b.requests[i].output_tokens]
    if other and a.has_timings and b.has_timings:
        tokens_a = sum(a.requests[i].output_tokens for i in both)
        tokens_b = sum(b.requests[i].output_tokens for i in both)
        notes.append(f"different output lengths: {len(other)} of {len(both)} requests "
                     f"({tokens_a:,} tokens in {name_a}, {tokens_b:,} in "
                     f"{name_b}): the throughputs count different work")
    span_a, span_b = _span(a, ids), _span(b, ids)
    longer = max(span_a, span_b)
    if longer >= MIN_PACED_SPAN_S and min(span_a, span_b) < PACED_SHARE * longer:
        fast = name_b if span_b < span_a else name_a
        notes.append(f"not paced alike: requests arrived over {span_a:.1f} s in "
                     f"{name_a} and {span_b:.1f} s in {name_b} ({fast} "
                     "replayed unpaced, as fast as it goes): a different load, so throughput "
                     "and latency differ for that reason too (replay at --speed 1 to compare "
                     "like for like)")
    return notes


def compare_pair(runs: Sequence[Run], ia: int, ib: int,
                 decode: Callable[[list[int]], str] | None = None) -> Pair:
    a, b = runs[ia], runs[ib]
    ids = [i for i in a.requests if i in b.requests]
    deltas = [_delta(a.requests[i], b.requests[i]) for i in ids]
    median = {}
    for key in ("ttft_ms", "e2e_ms", "output_tokens"):
        vals = [v for d in deltas if (v := getattr(d, key)) is not None]
        median[key] = float(statistics.median(vals)) if vals else None
    return Pair(a=ia, b=ib, common=len(ids), only_a=[i for i in a.requests if i not in b.requests],
                only_b=[i for i in b.requests if i not in a.requests],
                prompt_len_differs=sum(a.requests[i].prompt_len != b.requests[i].prompt_len
                                       for i in ids),
                deltas=deltas, median_delta=median,
                outputs=_outputs(a, b, ids, decode) if a.has_timings and b.has_timings
                else OutputsCompared(identical=None, not_compared="a workload has no outputs"),
                not_like_for_like=not_like_for_like(a, b, ids, run_letter(ia),
                                                    run_letter(ib)))


class RunComparison(msgspec.Struct):
    runs: list[RunStats]
    pairs: list[Pair]  # the first run against each other one
    slo: str | None
    cdf: list[dict[str, list[float]]]  # per run: ttft_ms and itl_ms, sorted (quantiles)

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def cdf_points(values: list[float], points: int = CDF_POINTS) -> list[float]:
    """Up to `points` evenly spaced quantiles of the values (all of them when fewer)."""
    s = sorted(values)
    if len(s) <= points:
        return s
    return [s[round(k * (len(s) - 1) / (points - 1))] for k in range(points)]


def compare_runs(runs: Sequence[Run], slo: Slo | None = None, allow_mismatch: bool = False,
                 decode: Callable[[list[int]], str] | None = None) -> RunComparison:
    """The first run against each other one; MismatchError when their request sets differ
    (allow_mismatch: compare the requests they share)."""
    if len(runs) < 2:
        raise ValueError("compare needs at least two runs")
    pairs = [compare_pair(runs, 0, k, decode) for k in range(1, len(runs))]
    for p in pairs:
        if (p.only_a or p.only_b) and not allow_mismatch:
            raise MismatchError(
                f"{runs[p.a].name} and {runs[p.b].name} are runs of different requests "
                f"({p.common} shared, {len(p.only_a)} only in the first, {len(p.only_b)} only "
                f"in the second, e.g. {(p.only_a or p.only_b)[:3]}): their numbers are not "
                f"comparable; --allow-mismatch compares them anyway")
    cdf = [{"ttft_ms": [v * 1000 for v in cdf_points(vals["ttft"])],
            "itl_ms": [v * 1000 for v in cdf_points(vals["itl"])]}
           for vals in (latency_values(r) for r in runs)]
    return RunComparison(runs=[run_stats(r, slo) for r in runs], pairs=pairs,
                         slo=slo.text() if slo else None, cdf=cdf)
