"""The step cost model (engine/scheduling/step_cost.py): fitted from observed steps, never negative,
and what a protected step's time allowance asks of it."""
from __future__ import annotations

import random

import pytest

from kvscope.engine.scheduling.step_cost import (
    MIN_STEPS,
    WINDOW,
    StepCost,
    StepShape,
    step_shape,
    work_keys,
)

TRUE = (0.006, 0.0007, 0.0019, 0.0077)  # fixed, per row, per 1k decode keys, per 10k chunk keys


def true_seconds(shape: StepShape, coef=TRUE) -> float:
    return sum(c * f for c, f in zip(coef, shape.features(), strict=True))


def random_step(rng: random.Random) -> StepShape:
    work = [(rng.randrange(0, 2000), 1) for _ in range(rng.randrange(0, 17))]
    work += [(rng.randrange(0, 1000), rng.randrange(2, 33)) for _ in range(rng.randrange(0, 2))]
    return step_shape(work or [(0, 1)])


def test_keys_of_a_decode_and_of_a_chunk():
    assert work_keys(99, 1) == (100, 0)  # a decode at position 99 reads 100 keys
    # rows at 10, 11, 12 read 11, 12, 13 keys
    assert work_keys(10, 3) == (0, 11 + 12 + 13)
    assert step_shape([(99, 1), (10, 3), (0, 1)]) == StepShape(5, 101, 36)


def test_fit_recovers_the_coefficients_and_predicts():
    rng = random.Random(0)
    cost = StepCost()
    for _ in range(MIN_STEPS - 1):
        cost.observe(random_step(rng), true_seconds(random_step(rng)))
    assert not cost.ready and cost.predict(StepShape(1, 10, 0)) is None
    assert cost.tokens_within(0, 8, 1.0) == 0  # nothing handed out while learning
    cost = StepCost()
    for _ in range(300):
        shape = random_step(rng)
        cost.observe(shape, true_seconds(shape) * rng.uniform(0.97, 1.03))
    assert cost.ready
    for got, want in zip(cost.coef, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    shape = step_shape([(700, 1)] * 16 + [(300, 24)])
    assert cost.predict(shape) == pytest.approx(true_seconds(shape), rel=0.05)


def test_the_fit_follows_the_last_window_of_steps():
    """Costs change (a reconfigure keeps the scheduler; the machine gets busy): after a window
    of steps at twice the cost, the model says twice."""
    rng = random.Random(1)
    cost = StepCost(window=128, refit_every=16)
    for scale in (1.0, 2.0):
        for _ in range(160):
            shape = random_step(rng)
            cost.observe(shape, scale * true_seconds(shape))
    shape = step_shape([(500, 1)] * 8)
    assert cost.predict(shape) == pytest.approx(2 * true_seconds(shape), rel=0.05)


def test_a_coefficient_is_never_negative():
    """Steps whose time falls as their decode keys rise (noise, another process) must not
    teach that reading more keys is free time: that coefficient is held at 0."""
    rng = random.Random(2)
    cost = StepCost()
    for _ in range(200):
        shape = random_step(rng)
        cost.observe(shape, 0.01 + 0.001 * shape.rows - 0.0005 * shape.decode_keys / 1000)
    assert cost.coef is not None and min(cost.coef) >= 0.0
    assert cost.coef[2] == 0.0


def test_bad_observations_are_ignored():
    cost = StepCost(min_steps=1)
    cost.observe(StepShape(0, 0, 0), 0.01)  # an empty step
    cost.observe(StepShape(1, 5, 0), 0.0)
    cost.observe(StepShape(1, 5, 0), float("nan"))
    assert not cost.ready


def test_tokens_within_is_the_most_that_fit():
    cost = StepCost(coef=TRUE)
    for start in (0, 100, 900):
        for seconds in (0.0, 0.0005, 0.002, 0.01, 0.05):
            got = cost.tokens_within(start, 64, seconds)
            brute = max([n for n in range(65) if cost.work_seconds(start, n) <= seconds])
            assert got == brute, (start, seconds)
    # a decode costs its row and its keys: 0.7 ms + 1.9 ms per 1k keys
    assert cost.work_seconds(999, 1) == pytest.approx(0.0007 + 0.0019)


def test_a_relative_fit_is_not_set_by_the_few_big_steps():
    """Mostly big background steps (40-48 rows) and a few small ones whose cost is not on the
    big ones' line (a fixed part and a slope of their own, as a CPU's were): the plain fit
    follows the big steps and misses the small ones by a fifth; weighted by 1 / seconds it
    stays within a tenth of them."""
    def small(rows: int) -> float:
        return 0.007 + 0.004 * rows

    def big(rows: int) -> float:
        return 0.058 + 0.0022 * rows

    rng = random.Random(0)
    steps = []
    for i in range(WINDOW):
        if i % 5 == 0:
            rows = rng.randrange(1, 7)
            steps.append((rows, small(rows)))
        else:
            rows = rng.randrange(40, 49)
            steps.append((rows, big(rows)))
    errors = {}
    for relative in (False, True):
        cost = StepCost(relative=relative)
        for rows, seconds in steps:
            cost.observe(StepShape(rows, 0, 0), seconds)
        errors[relative] = max(abs(cost.predict(StepShape(r, 0, 0)) - small(r)) / small(r)
                               for r in range(1, 7))
    assert errors[False] > 0.2 and errors[True] < 0.1, errors


def test_the_engine_observes_its_protected_steps_only(tmp_path):
    """A real engine (tiny model) times each protected step it ran (a chat beside a batch)
    into its scheduler's model, and no other (every step goes to the stand-in model): after
    MIN_STEPS of them the model predicts, and what it predicts grows with the work. Under
    fcfs, where no step is protected, it learns nothing."""
    import torch

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.loading.loader import load_model
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.testing.tiny_models import save_tiny_model

    path = str(save_tiny_model(tmp_path, "llama", seed=3))
    loaded = load_model(path, torch.float32)
    counts = {}
    for policy in ("fcfs", "priority"):
        engine = LLMEngine(EngineConfig(model=path, block_size=8, num_kv_blocks=128,
                                        max_num_batched_tokens=32, scheduling_policy=policy),
                           loaded=loaded)
        rng = random.Random(0)
        for i in range(4):  # the batch, then a chat that outlives its first steps
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 60))]
            engine.add_request(prompt, SamplingParams(max_tokens=150 + 12 * i,
                                                           ignore_eos=True),
                               request_id=f"r{i}")
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=90, ignore_eos=True,
                                                        priority=-1), request_id="chat")
        protected = unprotected = 0
        while engine.has_unfinished():
            if engine.step().scheduled:
                if engine.scheduler.step_is_protected:
                    protected += 1
                else:
                    unprotected += 1
        counts[policy] = (protected, unprotected, engine.scheduler.step_cost)
        # the stand-in model sees every step, relative error
        every = engine.scheduler.every_step_cost
        assert every.relative and len(every.observed_seconds) == protected + unprotected
    protected, unprotected, cost = counts["priority"]
    assert unprotected > 0  # the batch alone once the chat ended: not observed
    assert len(cost.observed_seconds) == protected >= MIN_STEPS and cost.ready
    small, big = step_shape([(10, 1)]), step_shape([(100, 1)] * 6 + [(50, 16)])
    assert 0 < cost.predict(small) <= cost.predict(big)
    protected, unprotected, cost = counts["fcfs"]
    assert protected == 0 and unprotected > 0 and not cost.observed_seconds
