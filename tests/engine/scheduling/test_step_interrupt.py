"""Interruptible steps (engine/model/step_interrupt.py): a request of higher priority abandons a
step of less urgent work between layers; the step is rolled back (no token advanced, no
prefix-cache hash left on a block it never finished) and every reply stays what an
uninterrupted engine gives."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.model.step_interrupt import StepInterrupt, StepInterrupted
from kvscope.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from kvscope.engine.loading.loader import load_model
    from kvscope.testing.tiny_models import save_tiny_model

    path = str(save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5))
    return path, load_model(path, torch.float32)


def make_engine(loaded, **kw):
    from kvscope.engine.llm_engine import LLMEngine

    path, model = loaded
    cfg = dict(model=path, block_size=8, num_kv_blocks=96, max_num_batched_tokens=64)
    engine = LLMEngine(EngineConfig(**{**cfg, **kw}), loaded=model)
    # The one-region fused step (a single native call) is not interruptible; these steps
    # take the layer loop that checks, as a long prompt's chunks do on the embedded model.
    engine.model.fused_decode = False
    return engine


def prompts(lengths, seed):
    from tests.engine.test_engine_tiny import random_prompts

    return random_prompts(lengths, seed=seed)


def offer_at_layer(engine, layer: int, priority: int):
    """The next forward offers a request of `priority` when it reaches `layer` (as the HTTP
    thread would while the step runs); returns the list of layers run, for the test."""
    model, ran = engine.model, []
    run_layer = model.run_layer

    def wrapped(*args, **kwargs):
        if len(ran) == layer:
            engine.interrupt.offer(priority)
        ran.append(len(ran))
        return run_layer(*args, **kwargs)

    model.run_layer = wrapped
    return ran, lambda: setattr(model, "run_layer", run_layer)


def test_offer_asks_only_an_armed_step_that_carries_less_urgent_work():
    it = StepInterrupt()
    assert not it.offer(-5)  # nothing armed: no step running
    it.arm(0)
    assert not it.offer(0) and not it.offer(3)  # equal or lower priority waits its turn
    it.check()
    assert it.offer(-1) and it.requested
    with pytest.raises(StepInterrupted):
        it.check()
    it.arm(0)  # the next step starts clean
    assert not it.requested
    it.offer(-1)
    it.disarm()
    assert not it.requested
    it.check()


def test_interrupted_step_advances_nothing_and_forgets_its_hashes(loaded):
    engine = make_engine(loaded)
    (long_prompt,) = prompts([100], seed=1)
    rid = engine.add_request(long_prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # the first 64-token chunk
    seq = engine.requests[rid]
    assert seq.num_computed_tokens == 64
    cached_before = set(engine.block_manager.hash_to_block)
    ran, restore = offer_at_layer(engine, 0, priority=-1)
    result = engine.step()
    restore()
    assert not result.ran and result.outputs == []
    assert engine.interrupt.num_interrupted == 1
    assert len(ran) < len(engine.model.layers)  # it stopped before the last layer
    assert seq.num_computed_tokens == 64 and engine.num_steps == 1
    # the chunk's full blocks were registered when it was scheduled, and forgotten again
    assert set(engine.block_manager.hash_to_block) == cached_before
    while engine.has_unfinished():
        engine.step()
    reference = make_engine(loaded)
    ref = reference.add_request(long_prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    while reference.has_unfinished():
        reference.step()
    assert engine.pop_output(rid).token_ids == reference.pop_output(ref).token_ids


def test_equal_priority_or_a_protected_step_is_never_interrupted(loaded, monkeypatch):
    engine = make_engine(loaded)
    (p,) = prompts([100], seed=2)
    engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    _, restore = offer_at_layer(engine, 0, priority=0)
    assert engine.step().ran
    restore()
    fcfs = make_engine(loaded, scheduling_policy="fcfs")
    fcfs.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    _, restore = offer_at_layer(fcfs, 0, priority=-9)
    assert fcfs.step().ran and fcfs.interrupt.num_interrupted == 0  # fcfs never arms
    restore()
    monkeypatch.setenv("KVSCOPE_STEP_INTERRUPT", "off")  # the diagnostic switch
    switched_off = make_engine(loaded)
    switched_off.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    _, restore = offer_at_layer(switched_off, 0, priority=-9)
    assert switched_off.step().ran and switched_off.interrupt.num_interrupted == 0
    restore()
    monkeypatch.delenv("KVSCOPE_STEP_INTERRUPT")
    # a protected step already carries the urgent work: it runs to the end
    engine.add_request(prompts([20], seed=3)[0],
                       SamplingParams(max_tokens=4, ignore_eos=True, priority=-1))
    engine.step()
    assert engine.scheduler.step_is_protected
    _, restore = offer_at_layer(engine, 0, priority=-2)
    assert engine.step().ran and engine.interrupt.num_interrupted == 0
    restore()


def test_a_prefix_hit_taken_in_the_abandoned_step_is_given_back(loaded):
    """Two requests sharing 32 tokens are admitted in one step: the second hits the blocks
    the first registered for that very step. Abandoned, the second must not keep counting
    them as computed; both replies stay exact and no block leaks."""
    engine = make_engine(loaded, max_num_batched_tokens=128)
    shared = prompts([32], seed=4)[0]
    a, b = shared + prompts([9], seed=5)[0], shared + prompts([7], seed=6)[0]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    ra, rb = engine.add_request(a, sp), engine.add_request(b, sp)
    _, restore = offer_at_layer(engine, 0, priority=-1)
    assert not engine.step().ran
    restore()
    seq_b = engine.requests[rb]
    assert seq_b.num_computed_tokens == 0  # its hits were on blocks never computed
    assert not engine.block_manager.hash_to_block
    urgent = engine.add_request(prompts([12], seed=7)[0],
                                SamplingParams(max_tokens=3, ignore_eos=True, priority=-1))
    finished = []
    while engine.has_unfinished():
        finished += [d.request_id for d in engine.step().outputs if d.finished]
    assert finished[0] == urgent
    reference = make_engine(loaded, max_num_batched_tokens=128)
    r2 = [reference.add_request(x, sp) for x in (a, b)]
    while reference.has_unfinished():
        reference.step()
    assert [engine.pop_output(r).token_ids for r in (ra, rb)] == \
        [reference.pop_output(r).token_ids for r in r2]
    bm = engine.block_manager
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_queued_submit_offers_its_priority_to_the_running_step():
    """EngineServer.enqueue, which the ZeroMQ and HTTP threads call: the command is queued
    for the engine thread, and a Submit's priority is offered to the step in flight."""
    import queue
    from types import SimpleNamespace

    from kvscope.engine.server.engine_server import EngineServer
    from kvscope.ipc import messages as m

    server = SimpleNamespace(commands=queue.SimpleQueue(),
                             engine=SimpleNamespace(interrupt=StepInterrupt()))
    server.engine.interrupt.arm(0)
    EngineServer.enqueue(server, b"c", m.Abort(id=1, request_id="x"))
    assert not server.engine.interrupt.requested  # only a request can interrupt
    EngineServer.enqueue(server, b"c", m.Submit(id=2, prompt="hi",
                                               sampling=m.Sampling(priority=3)))
    assert not server.engine.interrupt.requested  # less urgent than the step
    EngineServer.enqueue(server, b"c", m.Submit(id=3, prompt="hi",
                                               sampling=m.Sampling(priority=-1)))
    assert server.engine.interrupt.requested
    assert [server.commands.get_nowait()[1].id for _ in range(3)] == [1, 2, 3]


def test_the_one_region_fused_step_stops_at_its_flag(loaded, monkeypatch):
    """A decode step on the fused CPU path is one native call with the GIL released: the
    kernel reads the flag before each layer and returns early; the engine rolls back."""
    from kvscope.engine.model.fused import one_region as fused_one_region
    from kvscope.kernels import native

    engine = make_engine(loaded)
    engine.model.fused_decode = True
    if native.library() is None or not fused_one_region.enabled():
        pytest.skip("no native kernels here")
    rid = engine.add_request(prompts([20], seed=8)[0],
                             SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()  # now decoding
    seq = engine.requests[rid]
    before = (list(seq.token_ids), seq.num_computed_tokens)
    calls = []
    run = fused_one_region.run

    def spy(*args, **kwargs):
        calls.append(engine.interrupt.requested)
        return run(*args, **kwargs)
    monkeypatch.setattr(fused_one_region, "run", spy)
    it = engine.interrupt
    arm = it.arm
    it.arm = lambda best: (arm(best), it.offer(best - 1))  # arrives as the step starts
    result = engine.step()
    it.arm = arm
    assert calls == [True], "the step went through the one-region kernel, flag set"
    assert not result.ran and it.num_interrupted == 1
    assert (list(seq.token_ids), seq.num_computed_tokens) == before
    assert engine.step().ran  # the next step runs whole
