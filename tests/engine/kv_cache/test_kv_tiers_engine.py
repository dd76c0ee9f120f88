"""The KV tiers in a real engine (tiny random checkpoints): greedy output with the tiers on equals
it with them off for every KV dtype at block sizes 1 and 16 while prefixes really come back from
the host tier; a conversation resumes from disk after a restart and prefills only its new
tokens; damaged files are refused; a reconfigure's new key never reads the old blocks; the
trace, KV events and /metrics see the tiers."""
from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.engine.loading.loader import load_model
from kvscope.engine.server.kv_events import to_vllm_events
from kvscope.engine.server.metrics_tiers import tier_families
from kvscope.engine.traces.export_perfetto import to_chrome
from kvscope.engine.traces.recorder import start_trace
from kvscope.ipc.trace_format import Offload, Onboard, read_trace
from kvscope.kvmath.kv_dtypes import STORED_KV_DTYPES
from kvscope.testing.tiny_models import save_tiny_model

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint path, its loaded weights): every engine here shares one load."""
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3)
    return path, load_model(str(path), torch.float32)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


def shared_prefix_workload() -> list[list[int]]:
    """Turns that share a 48-token prefix, each after a 56-token stranger that evicts some of
    it from a 5-block (80-token) pool."""
    prefix = tokens(48, 1)
    out = []
    for i in range(4):
        out.append(prefix + tokens(8, 10 + i))
        out.append(tokens(56, 20 + i))
    return out


def run(tiny, block_size: int, kv_dtype: str, prompts, **tiers):
    path, loaded = tiny
    llm = LLM(EngineConfig(model=str(path), block_size=block_size,
                           num_kv_blocks=80 // block_size, kv_dtype=kv_dtype,
                           kv_anchor_tokens=0, max_num_batched_tokens=64, **tiers),
              loaded=loaded)
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]  # one at a time: the pool churns
    return llm, outs


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", STORED_KV_DTYPES)
def test_greedy_output_is_the_same_with_the_host_tier(tiny, kv_dtype, block_size):
    prompts = shared_prefix_workload()
    off, plain = run(tiny, block_size, kv_dtype, prompts)
    on, tiered = run(tiny, block_size, kv_dtype, prompts, kv_offload_bytes=1 << 20)
    assert [o.token_ids for o in tiered] == [o.token_ids for o in plain]
    s_on, s_off = on.stats(), off.stats()
    assert s_on.kv_offloaded_blocks > 0 and s_on.kv_onboarded_host_blocks > 0
    assert s_on.prefix_cache_hits_host > 0
    assert s_on.num_prompt_tokens < s_off.num_prompt_tokens  # copied back, not computed
    assert sum(o.num_host_cached_tokens for o in tiered) == s_on.prefix_cache_hits_host


def disk_engine(tiny, disk_dir, **over) -> LLM:
    path, loaded = tiny
    cfg = dict(model=str(path), block_size=16, num_kv_blocks=64, kv_disk_bytes=64 << 20,
               kv_disk_dir=str(disk_dir))
    cfg.update(over)
    return LLM(EngineConfig(**cfg), loaded=loaded)


def cold(tiny, prompt, **over):
    path, loaded = tiny
    cfg = dict(model=str(path), block_size=16, num_kv_blocks=64)
    cfg.update(over)
    return LLM(EngineConfig(**cfg), loaded=loaded).generate([prompt], GREEDY)[0]


def test_a_conversation_resumes_from_disk_after_a_restart(tiny, tmp_path):
    first = disk_engine(tiny, tmp_path)
    prompt = tokens(150, 5)
    reply = first.generate([prompt], GREEDY)[0]
    del first  # the engine is gone; its disk tier's files stay
    second = disk_engine(tiny, tmp_path)
    turn = prompt + reply.token_ids + tokens(10, 6)
    out = second.generate([turn], GREEDY)[0]
    assert out.token_ids == cold(tiny, turn).token_ids
    assert out.num_disk_cached_tokens >= len(prompt) // 16 * 16
    assert out.num_cached_tokens == out.num_disk_cached_tokens
    assert second.stats().num_prompt_tokens == len(turn) - out.num_disk_cached_tokens
    assert second.stats().kv_onboarded_disk_blocks == out.num_disk_cached_tokens // 16


def test_damaged_disk_blocks_are_refused_and_the_output_stays_right(tiny, tmp_path):
    first = disk_engine(tiny, tmp_path)
    prompt = tokens(100, 7)
    first.generate([prompt], GREEDY)
    del first
    files = sorted(tmp_path.glob("*.kvb"))
    assert files
    for f in files:  # one flipped bit in every block's K/V bytes
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0x04
        f.write_bytes(bytes(raw))
    second = disk_engine(tiny, tmp_path)
    out = second.generate([prompt + [1, 2, 3]], GREEDY)[0]
    assert out.token_ids == cold(tiny, prompt + [1, 2, 3]).token_ids
    assert out.num_disk_cached_tokens == 0
    assert second.stats().kv_disk_refused_blocks >= 1


def test_a_reconfigure_never_reads_the_old_keys_blocks(tiny, tmp_path):
    llm = disk_engine(tiny, tmp_path, kv_offload_bytes=1 << 20)
    prompt = tokens(120, 8)
    llm.generate([prompt], GREEDY)
    llm.engine.reconfigure(block_size=8)
    assert llm.stats().kv_host_blocks == 0  # the old pool's host tier is gone
    out = llm.generate([prompt + [4]], GREEDY)[0]
    assert out.num_disk_cached_tokens == 0 and out.num_host_cached_tokens == 0
    assert out.token_ids == cold(tiny, prompt + [4], block_size=8).token_ids
    llm.engine.reconfigure(block_size=16)  # back: the files of that key are found again
    back = llm.generate([prompt + [5]], GREEDY)[0]
    assert back.num_disk_cached_tokens > 0
    assert back.token_ids == cold(tiny, prompt + [5]).token_ids


def test_tiers_refuse_anchor_tokens_by_name():
    with pytest.raises(ValueError, match="kv_anchor_tokens"):
        EngineConfig(kv_dtype="int8", kv_offload_bytes=1 << 20)
    EngineConfig(kv_dtype="int8", kv_offload_bytes=1 << 20, kv_anchor_tokens=0)


def test_trace_events_and_metrics_see_the_tiers(tiny, tmp_path):
    llm = LLM(EngineConfig(model=str(tiny[0]), block_size=16, num_kv_blocks=5,
                           kv_anchor_tokens=0, kv_offload_bytes=1 << 20), loaded=tiny[1])
    engine = llm.engine
    engine.block_manager.cache_events = []
    start_trace(engine, tmp_path / "t.jsonl")
    for p in shared_prefix_workload()[:4]:
        llm.generate([p], GREEDY)
    engine.stop_trace()
    trace = read_trace(tmp_path / "t.jsonl")
    assert to_chrome(trace)["traceEvents"]  # the export passes over the new events
    assert sum(e.blocks for e in trace.of_type(Offload)) == llm.stats().kv_offloaded_blocks > 0
    onboard = trace.of_type(Onboard)
    assert onboard and all(e.medium == "CPU" for e in onboard)
    assert sum(e.blocks for e in onboard) == llm.stats().kv_onboarded_host_blocks
    events = to_vllm_events(engine.block_manager.cache_events, 16, "GPU")
    media = {type(e).__name__: set() for e in events}
    for e in events:
        media[type(e).__name__].add(e.medium)
    assert "CPU" in media["BlockStored"] and "GPU" in media["BlockStored"]
    families = {f.name: f for f in tier_families("kvscope:", llm.stats(), {"model_name": "m"})}
    hits = {s.labels["source"]: s.value for s in families[
        "kvscope:prompt_tokens_cached_by_source"].samples}
    assert hits["host"] == llm.stats().prefix_cache_hits_host > 0
    moved = {s.labels["transfer_type"]: s.value
             for s in families["kvscope:kv_offload_total_bytes"].samples}
    assert moved["CPU_to_CPU"] > 0  # a CPU engine's pool is "CPU" in vLLM's media too


@pytest.mark.slow
def test_embedded_model_greedy_output_is_the_same_with_both_tiers(tmp_path):
    from kvscope.engine.loading.loader import load_model

    loaded = load_model("default", torch.float32)
    prefix = loaded.tokenizer.encode("You are a careful assistant. " * 12)
    prompts = []
    for i, q in enumerate(["What is a KV cache?", "Name a prime.", "Say hi."]):
        prompts += [prefix + loaded.tokenizer.encode(q), tokens(len(prefix) + 8, 40 + i)]
    outs = {}
    for name, tiers in (("off", {}), ("on", {"kv_offload_bytes": 64 << 20,
                                              "kv_disk_bytes": 64 << 20,
                                              "kv_disk_dir": str(tmp_path)})):
        llm = LLM(EngineConfig(block_size=16, num_kv_blocks=(len(prefix) + 40) // 16,
                               weights="dense", **tiers), loaded=loaded)
        outs[name] = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        if tiers:
            assert llm.stats().prefix_cache_hits_host > 0
    assert outs["on"] == outs["off"]
