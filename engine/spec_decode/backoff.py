"""When speculation pays: measured per batch size and per request, never assumed.

Two things decide whether a request's drafts pay, and they vary on different scales:
- what a verify costs, which depends on the machine and the batch size: per batch-size
  bucket (1, 2, 3-4, 5-8, ...) the engine keeps the medians of recent pure-decode steps'
  seconds without drafts, and of drafting steps' seconds and how many requests drafted in
  them, so the extra seconds one request's verify rows add to a step;
- what a draft brings, which depends on the request (a quote is copied, an open chat is not)
  and on where in its reply it is (a model paraphrases its first sentence, then copies): per
  request, a moving average of its tokens per verify (1 + accepted drafts). A request that
  has not verified yet takes the median of recent requests' first verifies as its estimate:
  in an open chat no one's drafts pay at 4 streams, and without that prior each new request
  paid for one losing verify (more at 16 streams, where requests come and go often).

What a draft brings also shows before it is verified: the length of the suffix n-gram it
follows. A request that paraphrased its first words and missed its first verify often copies
a paragraph a few tokens later, and a 4-gram found in the context then says so before its
own average can (the quote benchmark's requests waited 16 plain steps for their next probe
and drafted at full acceptance from then on). So the engine also keeps the mean tokens per
verify of recent drafts by match length, over every request, and a request drafts when
either its own estimate or its current match length's clears the bar (the decoder passes
only matches of prompt_lookup_max tokens: shorter ones turn up in any reply); a workload
whose long matches are not copied on (an open chat) teaches that just as fast.

A request drafts when its drafts are expected to bring more tokens than the plain steps
could make in the seconds they cost: 1 + accepted >= 1 + extra seconds x (batch size /
plain step seconds). Before a bucket has been measured both ways every request drafts,
then a few steps run plain; afterwards every 16th step runs plain (the plain side follows
the load), and a request whose drafts stopped paying drafts again after W steps without,
so its estimate follows its reply; after 2W, 4W, then 8W steps while its probes keep not
paying. W is 16, or more where a verify costs more plain tokens: long enough that such
probes cost at most 2 % of the batch's tokens (at 2 and 4 streams on the AMX Xeon with the
one-region step, a failed probe cost 0.8 and 0.7 of a plain step's seconds, and probes every
16 steps cost an open chat and a summary 4-7 % of their throughput). Where the bar is above
what any verify can bring (1 + K tokens), no request drafts, not even to probe: at 8
streams on a 2-core CPU one verify cost a whole plain step, and two probes per request cost
an open chat a fifth of its throughput. Every REFRESH_EVERY-th step of such a bucket lets
the requests draft once, so its costs follow the load. A step in which no request drafts is
a plain step.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_SAMPLES = 4
RATE_WINDOW = 9  # steps a bucket's medians are taken over
ACCEPT_ALPHA = 0.3  # weight of a request's newest verify in its acceptance average
MAX_PROBE_DOUBLINGS = 3  # a request that keeps not paying probes every W, 2W, 4W, 8W steps
REFRESH_EVERY = 256  # steps of a bucket whose bar no verify can reach, per drafting step
PRIOR_WINDOW = 16  # recent requests whose first verify is a new request's prior
PROBE_LOSS = 0.02  # the share of a batch's tokens that probes which find nothing may cost
MATCH_WINDOW = 32  # recent verifies per match length whose mean is that length's estimate


@dataclass(slots=True)
class Rate:
    """One bucket's recent steps: a count per step (tokens emitted, or requests that
    drafted) and seconds per step, each the median of the last RATE_WINDOW steps. A median,
    not a moving average: a bucket's first steps include one-off costs (a kernel measured
    on its first use of a row count, a page fault per new block), and one such step in an
    average decided for many steps after that drafts cost five times what they do."""
    samples: int = 0
    _tokens: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    _seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))

    def add(self, tokens: int, seconds: float) -> None:
        self._tokens.append(float(tokens))
        self._seconds.append(seconds)
        self.samples += 1

    @property
    def tokens(self) -> float:
        return statistics.median(self._tokens) if self._tokens else 0.0

    @property
    def seconds(self) -> float:
        return statistics.median(self._seconds) if self._seconds else 0.0

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Acceptance:
    """One request's tokens per verify (moving average; None before its first verify), its
    decode steps since it last drafted, and how many probes in a row found it not paying."""
    tokens_per_verify: float | None = None
    waited: int = 0
    failed_probes: int = 0
    probing: bool = False  # it drafts because it waited long enough, not because it pays
    by_match: bool = False  # it drafts because its match's length pays, not its own estimate
    match_bar: float = 0.0  # the bar such a draft had to clear when it was made
    match_missed: bool = False  # such a draft of its brought less than the bar: no more of them

    def verified(self, tokens: int) -> None:
        t = self.tokens_per_verify
        self.tokens_per_verify = float(tokens) if t is None else t + ACCEPT_ALPHA * (tokens - t)
        self.waited = 0
        if self.probing:  # counted failed until the next step finds it paying
            self.failed_probes, self.probing = self.failed_probes + 1, False
        if self.by_match:
            self.match_missed = self.match_missed or tokens < self.match_bar
            self.by_match = False


@dataclass
class BackOff:
    enabled: bool = True
    probe_plain_every: int = 16
    probe_request_every: int = 16
    probe_loss: float = PROBE_LOSS
    plain: dict[int, Rate] = field(default_factory=dict)  # tokens: emitted per step
    spec: dict[int, Rate] = field(default_factory=dict)  # tokens: requests that drafted
    _steps: dict[int, int] = field(default_factory=dict)
    _first_verifies: deque[float] = field(
        default_factory=lambda: deque(maxlen=PRIOR_WINDOW))
    _by_match: dict[int, deque[float]] = field(default_factory=dict)

    @staticmethod
    def bucket(batch_size: int) -> int:
        """1, 2, 4, 8, ...: the power of two at or above the batch size."""
        return 1 << max(0, batch_size - 1).bit_length()

    def should_speculate(self, batch_size: int, most: float | None = None) -> bool:
        """Whether this step may draft at all (which requests do: `pays`). `most`: the tokens
        a verify can bring at best (1 + K); where the bar is above it, only a refresh step
        drafts, and the others do not even look for drafts (at 16 streams the lookup for
        every request cost ~1 % of a step that could not draft anyway)."""
        if not self.enabled:
            return True
        b = self.bucket(batch_size)
        plain, spec = self.plain.get(b), self.spec.get(b)
        n = self._steps[b] = self._steps.get(b, 0) + 1
        if spec is None or spec.samples < MIN_SAMPLES:
            return True
        if plain is None or plain.samples < MIN_SAMPLES:
            return False
        if most is not None:
            limit = self.threshold(batch_size)
            if limit is not None and limit > most:
                return n % REFRESH_EVERY == 1
        return n % self.probe_plain_every != 0

    def threshold(self, batch_size: int) -> float | None:
        """The tokens per verify a request's drafts must bring at this batch size to pay for
        their verify rows; None until the bucket is measured both ways."""
        b = self.bucket(batch_size)
        plain, spec = self.plain.get(b), self.spec.get(b)
        if (plain is None or spec is None or plain.samples < MIN_SAMPLES
                or spec.samples < MIN_SAMPLES or plain.seconds <= 0 or spec.tokens <= 0):
            return None
        extra = max(0.0, spec.seconds - plain.seconds) / spec.tokens
        return 1.0 + extra * batch_size / plain.seconds

    def pays(self, batch_size: int, acceptance: Acceptance, most: float | None = None,
             match: int = 0, longest: bool = False) -> bool:
        """Whether this request drafts in this step; counts the steps it waits. A request
        whose probes keep not paying waits twice as long before each next one: at 16 streams
        a probe every 16 steps each is a drafting request in nearly every step. `most`: the
        tokens a verify can bring at best (1 + K); above it the bar is out of anyone's reach.
        `match`: the length of the n-gram its draft follows this step (0: none); `longest`:
        it is as long as the proposer looks for. A request drafts by its own estimate (the
        prior before its first verify), or by its match's when that is of the longest length
        and no such draft of its brought less than the bar it was made against: the match
        estimates are every request's, and after a code-editing workload an open chat's
        4-grams drafted at the code's 4.3 tokens a verify and brought 1.8 (0.92x at 2
        streams; stopping only at a draft rejected whole still let it draft 11 times in 18
        requests at 2.0 tokens against a bar of 2.3)."""
        if not self.enabled:
            return True
        limit = self.threshold(batch_size)
        if limit is not None and most is not None and limit > most:
            # 1, not 0: every 16th step (a multiple of REFRESH_EVERY too) runs plain
            return self._steps.get(self.bucket(batch_size), 0) % REFRESH_EVERY == 1
        got = acceptance.tokens_per_verify
        if got is None:
            got = self.prior()
        if limit is None or got is None or got >= limit:
            acceptance.failed_probes, acceptance.probing = 0, False
            return True
        by_match = self.match_estimate(match) if longest and not acceptance.match_missed \
            else None
        if by_match is not None and by_match >= limit:
            # not a probe: its own estimate follows from here on
            acceptance.by_match, acceptance.match_bar = True, limit
            return True
        wait = self.probe_wait(limit) << min(acceptance.failed_probes, MAX_PROBE_DOUBLINGS)
        if acceptance.waited + 1 >= wait:  # due until it verifies (no n-gram match: no draft)
            acceptance.probing = True
            return True
        acceptance.waited += 1
        return False

    def probe_wait(self, limit: float) -> int:
        """Steps a request whose drafts do not pay waits before its next probe: at least
        probe_request_every, and long enough that such probes cost at most probe_loss of the
        batch's tokens. One failed probe costs its verify's extra seconds, limit - 1 plain
        tokens of the whole batch; every request probing once per W steps is one probe per
        W / batch steps, of a step's batch tokens: a share of (limit - 1) / W."""
        return max(self.probe_request_every, math.ceil((limit - 1.0) / self.probe_loss))

    def prior(self) -> float | None:
        """A new request's expected tokens per verify: the median of recent requests' first
        verifies (not of all verifies: those come mostly from the requests whose drafts
        pay, and a request's first verify is often its poorest). None until MIN_SAMPLES."""
        if len(self._first_verifies) < MIN_SAMPLES:
            return None
        return statistics.median(self._first_verifies)

    def match_estimate(self, match: int) -> float | None:
        """Mean tokens per verify of recent drafts that followed a match of this length;
        None for no match or before MIN_SAMPLES of them."""
        got = self._by_match.get(match) if match else None
        if got is None or len(got) < MIN_SAMPLES:
            return None
        return sum(got) / len(got)

    def match_verified(self, match: int, tokens: int) -> None:
        """A draft that followed a match of this length brought `tokens` (1 + accepted)."""
        if match:
            self._by_match.setdefault(match, deque(maxlen=MATCH_WINDOW)).append(float(tokens))

    def first_verified(self, tokens: int) -> None:
        """A request's first verify brought `tokens` (1 + accepted drafts)."""
        self._first_verifies.append(float(tokens))

    def record(self, batch_size: int, drafted: int, tokens: int, seconds: float) -> None:
        """A pure-decode step: `drafted` requests verified drafts, `tokens` came out."""
        b = self.bucket(batch_size)
        if drafted:
            self.spec.setdefault(b, Rate()).add(drafted, seconds)
        else:
            self.plain.setdefault(b, Rate()).add(tokens, seconds)

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per measured bucket: the plain step's and a drafting step's milliseconds, the
        requests that drafted per drafting step, and the threshold at the bucket's largest
        batch size (benchmarks print it)."""
        out: dict[str, dict[str, float | None]] = {}
        for b in sorted(set(self.plain) | set(self.spec)):
            plain, spec = self.plain.get(b), self.spec.get(b)
            out[str(b)] = {"plain_step_ms": plain.seconds * 1e3 if plain else None,
                           "draft_step_ms": spec.seconds * 1e3 if spec else None,
                           "drafting_requests": spec.tokens if spec else None,
                           "threshold": self.threshold(b)}
        for n in sorted(self._by_match):
            out[f"match{n}"] = {"tokens_per_verify": self.match_estimate(n)}
        return out
