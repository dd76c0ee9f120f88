"""The window's memory of finished requests (app.blocks.history) against a real engine's
blocks frames: what it says the prefix cache still holds agrees with the block manager."""
from __future__ import annotations

import msgspec
import pytest

from kvscope.app.blocks.history import CACHED, EVICTED, FREED, REUSED, RequestHistory
from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.snapshots import blocks_frame
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=5)


class Watcher:
    """Steps the engine, hands every frame (through the codec) to a RequestHistory, and keeps
    the block manager's truth: the hash each watched request's blocks had when last seen."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.history, self.seq = engine, RequestHistory(), 0
        self.hashes: dict[str, dict[int, int | None]] = {}
        self.frame = None

    def observe(self) -> None:
        self.seq += 1
        payload = codec.encode(blocks_frame(self.engine, self.seq))
        self.frame = msgspec.msgpack.decode(payload, type=m.BlocksFrame)
        self.history.observe(self.frame)
        bm = self.engine.block_manager
        for seq in self.engine.scheduler.running:
            self.hashes[seq.request_id] = {b: bm.blocks[b].hash for b in seq.block_table}

    def run(self, prompts: dict[str, list[int]], max_tokens: int = 3) -> None:
        for rid, prompt in prompts.items():
            self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0), rid)
        self.observe()
        while self.engine.has_unfinished():
            self.engine.step()
            self.observe()

    def truth(self, rid: str) -> list[int]:
        """What each remembered block of rid is, from the block manager itself."""
        bm = self.engine.block_manager
        out = []
        for b, then in self.hashes[rid].items():
            block = bm.blocks[b]
            if then is None:
                out.append(FREED)
            elif block.hash != then:
                out.append(EVICTED)
            else:
                out.append(REUSED if block.ref_count else CACHED)
        return out


def test_finished_requests_blocks_agree_with_the_block_manager(model):
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", block_size=4,
                                    num_kv_blocks=24, max_model_len=64))
    w = Watcher(engine)
    story = list(range(10, 30))  # five full blocks of prompt
    w.run({"a": story})
    view = w.history.finished_view(w.frame, "a")
    assert view is not None and view.exact
    assert view.states.tolist() == w.truth("a")
    assert view.count(CACHED) >= 4 and view.count(FREED) >= 1  # full prompt blocks, the tail

    # The same prompt again: a prefix-cache hit takes a's cached blocks back into use.
    engine.add_request(story + [99], SamplingParams(max_tokens=8, temperature=0.0), "b")
    while not any(s.request_id == "b" and s.num_computed_tokens for s in
                  engine.scheduler.running):
        engine.step()
    w.observe()
    view = w.history.finished_view(w.frame, "a")
    assert view.states.tolist() == w.truth("a") and view.count(REUSED) >= 4
    while engine.has_unfinished():
        engine.step()
        w.observe()

    # Other prompts fill the pool: a's blocks are evicted and hold other content now.
    for i in range(3):  # 16 blocks each, one after another: 48 > the pool's 24
        w.run({f"x{i}": [(40 + 61 * i + 7 * k) % 250 for k in range(60)]}, max_tokens=2)
    view = w.history.finished_view(w.frame, "a")
    assert view.states.tolist() == w.truth("a") and view.count(EVICTED) >= 1
    for rid in ("b", "x0", "x1", "x2"):
        assert w.history.finished_view(w.frame, rid).states.tolist() == w.truth(rid)
    # A cached block's holders: the remembered requests with the content it holds now.
    for b in (int(x) for x in engine.block_manager.cached_free):
        holders = {h.request_id for h in w.history.holders(w.frame, b)}
        want = {rid for rid, hashes in w.hashes.items()
                if hashes.get(b) is not None
                and hashes[b] == engine.block_manager.blocks[b].hash}
        assert holders == want, b
