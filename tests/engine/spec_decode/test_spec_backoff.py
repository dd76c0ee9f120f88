"""The speculative back-off's rule (engine/spec_decode/backoff.py), driven with fake step timings:
a bucket is measured both ways first, then a request drafts while its own tokens per verify
pay for the seconds its verify rows add at that batch size, and probes again after a
while when they do not."""
from __future__ import annotations

import pytest

from kvscope.engine.spec_decode.backoff import MIN_SAMPLES, Acceptance, BackOff


def measured(plain_s: float, draft_s: float, drafting: int, batch: int = 1,
             probe_loss: float = 1.0) -> BackOff:
    """A bucket measured both ways. probe_loss 1.0: probes every 16 steps whatever they cost
    (the tests of the probe schedule); the default share is tested on its own."""
    b = BackOff(probe_loss=probe_loss)
    for _ in range(MIN_SAMPLES):
        b.record(batch, 0, batch, plain_s)
        b.record(batch, drafting, batch + drafting, draft_s)
    return b


def test_a_bucket_is_measured_with_drafts_then_without_then_probed_plain():
    b = BackOff()
    decisions = []
    for _ in range(2 * MIN_SAMPLES):
        go = b.should_speculate(1)
        decisions.append(go)
        b.record(1, 1 if go else 0, 2 if go else 1, 0.03 if go else 0.02)
    assert decisions == [True] * MIN_SAMPLES + [False] * MIN_SAMPLES
    later = [b.should_speculate(1) for _ in range(64)]
    assert later.count(False) == 4  # every 16th step runs plain, to follow the load


def test_the_threshold_is_what_one_requests_verify_rows_cost_in_plain_tokens():
    # one stream: a 20 ms decode, a 32 ms verify: the drafts must bring 0.6 tokens more
    assert measured(0.020, 0.032, 1).threshold(1) == pytest.approx(1.6)
    # 16 streams, a 100 ms step; 16 verifies make it 200 ms: 6.25 ms a request, which
    # plain steps would have spent on 1 token: the drafts must bring one more
    assert measured(0.100, 0.200, 16, batch=16).threshold(16) == pytest.approx(2.0)
    # a verify cheaper than a plain step (noise) costs nothing
    assert measured(0.020, 0.018, 1).threshold(1) == 1.0
    assert BackOff().threshold(1) is None  # not measured: every request drafts
    assert measured(0.020, 0.032, 1).threshold(2) is None  # another bucket


def test_a_request_drafts_while_its_drafts_pay_and_probes_when_they_do_not():
    b = measured(0.020, 0.032, 1)  # threshold 1.6
    copying, paraphrasing, new = Acceptance(2.4), Acceptance(1.2), Acceptance()
    assert b.pays(1, copying) and b.pays(1, new)
    refused = [b.pays(1, paraphrasing) for _ in range(15)]
    assert refused == [False] * 15 and paraphrasing.waited == 15
    assert b.pays(1, paraphrasing)  # the 16th step: a probe
    paraphrasing.verified(5)  # ... which found it copying now
    assert paraphrasing.waited == 0 and paraphrasing.tokens_per_verify == pytest.approx(2.34)
    assert b.pays(1, paraphrasing)


def test_one_slow_first_step_does_not_make_drafts_look_costly():
    """A bucket's first drafting step may measure a kernel on its first use of a row count;
    that one second must not set the bar for the steps after it."""
    b = BackOff()
    b.record(4, 2, 10, 1.0)  # the first drafting step: 18 ms of work and a one-off second
    for _ in range(MIN_SAMPLES):
        b.record(4, 0, 4, 0.030)
        b.record(4, 2, 10, 0.048)
    assert b.threshold(4) == pytest.approx(1 + 0.009 * 4 / 0.030)  # 9 ms a drafting request


def probe_gaps(b: BackOff, acceptance: Acceptance, probes: int, tokens: int) -> list[int]:
    """Steps from one probe to the next while each probe brings `tokens` per verify."""
    gaps, waited = [], 0
    while len(gaps) < probes:
        waited += 1
        if b.pays(1, acceptance):
            gaps.append(waited)
            waited = 0
            acceptance.verified(tokens)
    return gaps


def test_a_request_whose_probes_keep_failing_probes_less_often_until_one_pays():
    b = measured(0.020, 0.032, 1)  # threshold 1.6
    paraphrasing = Acceptance(1.0)
    assert probe_gaps(b, paraphrasing, 5, tokens=1) == [16, 32, 64, 128, 128]
    assert probe_gaps(b, paraphrasing, 1, tokens=5) == [128]  # this one finds it copying
    assert paraphrasing.tokens_per_verify >= 1.6 and b.pays(1, paraphrasing)
    paraphrasing.verified(1)  # it paraphrases again: probes start over at 16 steps
    paraphrasing.verified(1)
    assert probe_gaps(b, paraphrasing, 2, tokens=1) == [16, 32]


def test_a_probe_that_drafted_nothing_is_not_a_failed_probe():
    """No n-gram match means no verify: the request stays due, its wait does not double."""
    b = measured(0.020, 0.032, 1)
    a = Acceptance(1.0)
    for _ in range(15):
        assert not b.pays(1, a)
    assert all(b.pays(1, a) for _ in range(5))  # due, nothing drafted five steps running
    assert a.failed_probes == 0
    a.verified(1)  # the probe's verify, which did not pay: the next wait is 32 steps
    assert a.failed_probes == 1
    assert [b.pays(1, a) for _ in range(32)].count(True) == 1


def test_tokens_per_verify_is_a_moving_average_starting_at_the_first_verify():
    a = Acceptance()
    a.verified(1)
    assert a.tokens_per_verify == 1.0
    a.verified(5)
    assert a.tokens_per_verify == pytest.approx(2.2)


def test_disabled_it_always_drafts():
    b = measured(0.020, 0.200, 1)
    b.enabled = False
    assert b.should_speculate(1) and b.pays(1, Acceptance(1.0))


def test_over_a_simulated_load_only_the_requests_whose_drafts_pay_draft():
    """Steps cost 10 ms + 1 ms per request, and 3 ms more per drafting request; eight
    streams, half of them copying (4 tokens per verify), half not (1.1)."""
    b = BackOff()
    streams = [Acceptance() for _ in range(8)]
    accept = [4] * 4 + [1] * 4  # tokens per verify, as the model would give them
    drafted = [0] * 8
    for step in range(400):
        go = b.should_speculate(8)
        drafting = [i for i, a in enumerate(streams) if go and b.pays(8, a)]
        for i in drafting:
            streams[i].verified(accept[i])
            drafted[i] += step >= 100
        b.record(8, len(drafting), 8 + sum(accept[i] - 1 for i in drafting),
                 0.018 + 0.003 * len(drafting))
    # the threshold: 1 + 3 ms x 8 / 18 ms = 2.33; copying pays, the rest probe less and less
    assert b.threshold(8) == pytest.approx(1 + 0.003 * 8 / 0.018, rel=1e-6)
    assert all(n >= 270 for n in drafted[:4])
    # probes back off to one in 128 steps: 16 + 32 + 64 + 128 = 240, so 1-2 of the last 300
    assert all(n <= 2 for n in drafted[4:]), drafted


def test_a_new_request_takes_recent_first_verifies_as_its_estimate():
    """In an open chat at 4 streams no one's drafts pay: a new request must not pay for a
    losing first verify when the last requests' first verifies all lost."""
    b = measured(0.020, 0.032, 1)  # threshold 1.6
    assert b.prior() is None and b.pays(1, Acceptance())  # no prior yet: it drafts
    for tokens in (1, 1, 2, 1):
        b.first_verified(tokens)
    assert b.prior() == 1.0
    new = Acceptance()
    assert [b.pays(1, new) for _ in range(16)] == [False] * 15 + [True]  # then a probe
    new.verified(4)  # the probe found it copying: from now on its own estimate decides
    assert b.pays(1, new)


def test_the_prior_follows_the_most_recent_first_verifies():
    b = measured(0.020, 0.032, 1)
    for tokens in [1] * 16 + [3] * 9:  # the workload turned to quoting
        b.first_verified(tokens)
    assert b.prior() == 3.0 and b.pays(1, Acceptance())



def test_where_no_verify_can_reach_the_bar_nobody_drafts_not_even_to_probe():
    """8 streams, a 48 ms step, one verify costs 54 ms more: the bar is 10 tokens a verify,
    and K = 4 drafts bring 5 at best. Probes there only cost."""
    from kvscope.engine.spec_decode.backoff import REFRESH_EVERY

    b = measured(0.048, 0.102, 1, batch=8)
    assert b.threshold(8) == pytest.approx(1 + 0.054 * 8 / 0.048)
    without = Acceptance(5.0)
    assert [b.pays(8, without) for _ in range(16)].count(True) == 1  # no ceiling: it probes
    copying = Acceptance(5.0)
    steps = []
    for _ in range(2 * REFRESH_EVERY):  # as the engine asks: pays only in drafting steps
        steps.append(b.should_speculate(8) and b.pays(8, copying, most=5.0))
    assert steps.count(True) == 2  # one step in REFRESH_EVERY, so the costs follow the load
    # told the ceiling, the step itself is plain, so no request's drafts are even looked up
    told = measured(0.048, 0.102, 1, batch=8)
    looked = [told.should_speculate(8, most=5.0) for _ in range(2 * REFRESH_EVERY)]
    assert looked.count(True) == 2 and looked.index(True) == 0
    # a reachable bar: the ceiling changes nothing
    reachable = measured(0.020, 0.032, 1)
    assert reachable.pays(1, Acceptance(2.0), most=5.0)
    assert not reachable.pays(1, Acceptance(1.2), most=5.0)


def test_a_long_match_drafts_for_a_request_whose_own_estimate_is_below_the_bar():
    """A quote's first verify often misses (the reply's opening words), yet a few tokens on
    its suffix is a 4-gram of the paragraph it copies: the mean tokens per verify of recent
    drafts after such a match says so before the request's own average can."""
    b = measured(0.020, 0.032, 1)  # threshold 1.6
    missed_once = Acceptance(1.0)
    assert not b.pays(1, missed_once, 5.0, match=4, longest=True)  # no statistics yet
    for tokens in (5, 5, 4, 5):
        b.match_verified(4, tokens)
    for tokens in (1, 1, 2, 1):  # short matches were mostly wrong
        b.match_verified(2, tokens)
    assert b.match_estimate(4) == pytest.approx(4.75) and b.match_estimate(2) == 1.25
    assert b.pays(1, missed_once, 5.0, match=4, longest=True)
    assert not b.pays(1, missed_once, 5.0, match=4)  # not the proposer's longest: no evidence
    assert not b.pays(1, missed_once, 5.0, match=2)
    assert not b.pays(1, missed_once, 5.0, match=0)  # no draft this step
    assert missed_once.waited == 4 and not missed_once.probing  # the match was no probe
    # where long matches are not copied on either (an open chat), they teach that too
    for _ in range(32):
        b.match_verified(4, 1)
    assert b.match_estimate(4) == 1.0 and not b.pays(1, missed_once, 5.0, 4, longest=True)


def test_a_request_whose_long_match_draft_missed_whole_drafts_by_its_own_estimate_again():
    """The match estimates are every request's: after a code edit, an open chat's 4-grams
    would draft at the code's rate. One whole miss ends that for the request."""
    b = measured(0.020, 0.032, 1)  # threshold 1.6
    for tokens in (5, 4, 5, 5):
        b.match_verified(4, tokens)
    chat, quote = Acceptance(1.0), Acceptance(1.0)
    assert b.pays(1, chat, 5.0, match=4, longest=True) and chat.by_match
    chat.verified(1)  # rejected whole
    assert chat.match_missed and not chat.by_match
    assert not b.pays(1, chat, 5.0, match=4, longest=True)
    assert b.pays(1, quote, 5.0, match=4, longest=True)
    quote.verified(3)  # part of it was copied: the match still speaks for it
    assert not quote.match_missed and b.pays(1, quote, 5.0, match=4, longest=True)


def test_a_long_match_draft_that_brought_less_than_its_bar_ends_the_match_route():
    """At 2 streams the bar is ~2.4 tokens a verify: a chat's 4-gram draft that kept one of
    its four tokens (2) lost, though it was not rejected whole; a quote's that kept two (3)
    paid. The bar is the one the draft was made against."""
    b = measured(0.0065, 0.0115, 1, batch=2)  # threshold 2.54 at 2 streams
    for tokens in (5, 4, 5, 5):
        b.match_verified(4, tokens)
    chat, quote = Acceptance(1.0), Acceptance(1.0)
    assert b.pays(2, chat, 5.0, match=4, longest=True)
    assert chat.match_bar == pytest.approx(b.threshold(2))
    chat.verified(2)
    assert chat.match_missed and not b.pays(2, chat, 5.0, match=4, longest=True)
    assert b.pays(2, quote, 5.0, match=4, longest=True)
    quote.verified(3)
    assert not quote.match_missed and b.pays(2, quote, 5.0, match=4, longest=True)


def test_probes_wait_long_enough_to_cost_at_most_two_percent_of_the_batch():
    """A failed probe costs threshold - 1 plain tokens of the batch; one per request every W
    steps costs (threshold - 1) / W of them."""
    from kvscope.engine.spec_decode.backoff import PROBE_LOSS

    assert PROBE_LOSS == 0.02
    cheap = measured(0.020, 0.0203, 1, probe_loss=PROBE_LOSS)  # threshold 1.015
    assert cheap.probe_wait(cheap.threshold(1)) == 16  # never more often than 16 steps
    # 2 streams, a 6.5 ms step, a verify 5 ms more: threshold 2.54; 77 steps between probes
    b = measured(0.0065, 0.0115, 1, batch=2, probe_loss=PROBE_LOSS)
    limit = b.threshold(2)
    assert limit == pytest.approx(1 + 0.005 * 2 / 0.0065)
    assert b.probe_wait(limit) == 77
    paraphrasing = Acceptance(1.5)
    assert [b.pays(2, paraphrasing) for _ in range(77)].count(True) == 1
    assert paraphrasing.probing
