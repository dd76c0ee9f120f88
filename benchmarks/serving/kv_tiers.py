"""KV tiers beyond the pool (issue 56): what the host tier saves on a shared system prompt, and
what the disk tier saves on a conversation resumed after a restart.

    python -m benchmarks.serving.kv_tiers [--model tiny|default] [--rounds 8] [--json]

* shared prompt: a 2,000-token system prompt shared by every chat request, each followed by a
  2,000-token stranger (another user's document) in a pool of 2,600 tokens, so the pool can
  never keep the system prompt. One request at a time (closed loop), after one warm-up chat
  request (it computes the system prompt either way); prompt tokens computed (the chat
  requests', and all) and the chat requests' TTFT p50/p99, with and without
  `--kv-offload-bytes`.
* resume: a 4,000-token conversation answered once by an engine with `--kv-disk-bytes`, the
  engine dropped, a new one started on the same folder, and the next turn (the conversation,
  its reply and a 20-token question) sent: its TTFT from disk against the same turn on an
  engine without tiers (cold, the whole prompt computed).

`--model tiny` (default): a seeded random Llama (4 layers, hidden 256, float32 KV) saved to a
temporary folder, so the numbers time the engine and the tiers, not a model download; the
embedded model (`--model default`) takes minutes for the cold 4,000-token prefills on 2 cores.
Greedy outputs with and without the tiers are compared and reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvscope.engine.measure.timing import add_json_flag, print_result, progress_logger

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = progress_logger("kv_tiers")
SYSTEM_TOKENS = 2000
STRANGER_TOKENS = 2000
QUESTION_TOKENS = 40
POOL_TOKENS = 2600
CONVERSATION_TOKENS = 4000
NEXT_QUESTION_TOKENS = 20
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.kv_tiers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help='"tiny" (a random Llama) or an engine model')
    p.add_argument("--rounds", type=int, default=6, help="chat requests in the shared workload")
    add_json_flag(p)
    return p.parse_args(argv)


def tokens(n: int, seed: int, vocab: int = 250) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def ttft(engine, prompt: list[int], max_tokens: int = 4) -> tuple[float, list[int], object]:
    """Submit alone and run to the end; seconds to the first token, the output, the output."""
    from kvscope.engine import SamplingParams

    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None and engine.requests[rid].output_token_ids:
            first = time.perf_counter() - start
    out = engine.pop_output(rid)
    assert first is not None
    return first, out.token_ids, out


def engine_for(model: str, loaded, **over):
    from kvscope.engine import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine

    cfg = dict(model=model, block_size=BLOCK_SIZE, kv_anchor_tokens=0,
               max_num_batched_tokens=512, weights="dense")
    cfg.update(over)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def shared_prompt(model: str, loaded, rounds: int, host_bytes: int) -> dict:
    engine = engine_for(model, loaded, num_kv_blocks=POOL_TOKENS // BLOCK_SIZE,
                        kv_offload_bytes=host_bytes)
    system = tokens(SYSTEM_TOKENS, 1)
    ttft(engine, system + tokens(QUESTION_TOKENS, 99))  # the first chat computes it anyway
    times, outs, chat_computed = [], [], 0
    before = engine.stats().num_prompt_tokens
    for i in range(rounds):
        ttft(engine, tokens(STRANGER_TOKENS, 500 + i))  # another user's document
        t, out, full = ttft(engine, system + tokens(QUESTION_TOKENS, 100 + i))
        times.append(t)
        outs.append(out)
        chat_computed += len(full.prompt_token_ids) - full.num_cached_tokens
    stats = engine.stats()
    times.sort()
    return {"prompt_tokens_computed": stats.num_prompt_tokens - before,
            "chat_prompt_tokens_computed": chat_computed,
            "ttft_p50_s": statistics.median(times),
            "ttft_p99_s": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
            "host_hits_tokens": stats.prefix_cache_hits_host,
            "outputs": outs}


def resume(model: str, loaded, folder: Path) -> dict:
    conversation = tokens(CONVERSATION_TOKENS, 2)
    disk = dict(kv_disk_bytes=1 << 30, kv_disk_dir=str(folder), num_kv_blocks=512)
    first = engine_for(model, loaded, **disk)
    first_ttft, reply, _ = ttft(first, conversation)
    del first  # the engine stops; its disk tier's files stay
    turn = conversation + reply + tokens(NEXT_QUESTION_TOKENS, 3)
    cold_ttft, cold_out, _ = ttft(engine_for(model, loaded, num_kv_blocks=512), turn)
    second = engine_for(model, loaded, **disk)
    warm_ttft, warm_out, out = ttft(second, turn)
    return {"turn_tokens": len(turn), "first_turn_ttft_s": first_ttft,
            "cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft,
            "warm_over_cold": warm_ttft / cold_ttft,
            "prefix_from_disk_tokens": out.num_disk_cached_tokens,
            "same_output": warm_out == cold_out}


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvscope.engine.loading.loader import load_model

    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as tmp:
        model = args.model
        if model == "tiny":
            from kvscope.testing.tiny_models import save_tiny_model

            model = str(save_tiny_model(Path(tmp) / "model", "llama", seed=0, hidden_size=256,
                                        intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=8192))
        loaded = load_model(model, torch.float32)
        log("shared prompt, no host tier")
        off = shared_prompt(model, loaded, args.rounds, 0)
        log("shared prompt, host tier")
        on = shared_prompt(model, loaded, args.rounds, 256 << 20)
        log("resume after a restart")
        res = resume(model, loaded, Path(tmp) / "disk")
    same = off.pop("outputs") == on.pop("outputs")
    return {"model": args.model, "shared_prompt": {
        "without_host_tier": off, "with_host_tier": on, "same_outputs": same,
        "prompt_tokens_saved": 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"],
        "chat_prompt_tokens_saved": 1 - on["chat_prompt_tokens_computed"]
        / max(1, off["chat_prompt_tokens_computed"]),
        "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"]},
        "resume": res}


def table(r: dict) -> str:
    s, res = r["shared_prompt"], r["resume"]
    off, on = s["without_host_tier"], s["with_host_tier"]
    return "\n".join([
        f"model: {r['model']}",
        "shared 2,000-token system prompt, pool of 2,600 tokens:",
        "  host tier  prompt tokens computed  TTFT p50   TTFT p99",
        f"  off        {off['prompt_tokens_computed']:>22,}  {off['ttft_p50_s']:7.3f} s  "
        f"{off['ttft_p99_s']:7.3f} s",
        f"  on         {on['prompt_tokens_computed']:>22,}  {on['ttft_p50_s']:7.3f} s  "
        f"{on['ttft_p99_s']:7.3f} s",
        f"  chat requests' prompt tokens computed: {off['chat_prompt_tokens_computed']:,} "
        f"without, {on['chat_prompt_tokens_computed']:,} with the host tier "
        f"({100 * s['chat_prompt_tokens_saved']:.0f} % fewer)",
        f"  {100 * s['prompt_tokens_saved']:.0f} % fewer prompt tokens in all, TTFT p99 "
        f"{s['ttft_p99_speedup']:.1f}x better; same outputs: {s['same_outputs']}",
        f"resumed {res['turn_tokens']:,}-token conversation after a restart:",
        f"  cold {res['cold_ttft_s']:.3f} s, warm from disk {res['warm_ttft_s']:.3f} s "
        f"({100 * res['warm_over_cold']:.1f} % of cold; prefix from disk: "
        f"{res['prefix_from_disk_tokens']:,} tokens); same output: {res['same_output']}"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_result(run(args), table, args.json, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
