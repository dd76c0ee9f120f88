"""What the K/V rotation and the anchor tokens cost a decode step, in ms and as a share of it.

    python -m kvscope.benchmarks.rotation_cost [--batch 8] [--prompt 256] [--steps 40] [--json]

Four engines on the same weights and the same int8 pool size -- plain, rotated (Hadamard),
calibrated (Hadamard + the K shift and q/k balance) and calibrated with anchor tokens
(engine/kv_cache/anchors.py, the default) -- stepped alternately through the same decode batch so
all see the same machine load; plus the transform's own ops timed alone (q balanced and rotated, k
shifted, balanced and rotated, v rotated, the output rotated back, every layer) against the step.

On CUDA the rotation is fused into the Triton KV write and attention kernels (no separate
op), so there the step difference is the figure; on CPU the torch path runs it as four small
matmuls a layer.
"""
from __future__ import annotations

import argparse
import statistics

from kvscope.benchmarks.timing import add_json_flag, per_call_seconds, print_result

# (name, rotation, anchor tokens)
SETTINGS = [("none", "none", 0), ("hadamard", "hadamard", 0), ("calibrated", "calibrated", 0),
            ("calibrated+anchors", "calibrated", 4)]


def decode_engines(args):
    import torch

    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.loading.loader import load_model

    loaded = load_model(args.model, torch.float32 if args.device == "cpu" else torch.bfloat16)
    engines = {}
    for name, rotation, anchors in SETTINGS:
        cfg = EngineConfig(model=args.model, device=args.device, kv_dtype=args.kv_dtype,
                           kv_rotation=rotation, kv_anchor_tokens=anchors,
                           num_kv_blocks=args.batch * 64 + 64,
                           max_num_batched_tokens=max(512, args.prompt))
        engine = LLMEngine(cfg, loaded)
        for i in range(args.batch):
            prompt = [100 + (7 * i + j) % 5000 for j in range(args.prompt)]
            engine.add_request(prompt, SamplingParams(max_tokens=args.steps * 3 + 8,
                                                      ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens
                  for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill until every request decodes
        engines[name] = engine
    return engines


def rotation_ops_s(engine, device: str, reps: int) -> float:
    """The torch path's rotation work of one decode step, alone: per layer q, k, v @ R and
    the output @ R^T (and, for a calibrated pool, the K shift/balance and q balance), for this
    batch's shapes."""
    import torch

    from kvscope.kernels.k_balance import balance_k, balance_q
    from kvscope.kernels.rotation import rotate, unrotate

    s, r = engine.model.shape, engine.pool.rotation
    kb = engine.pool.k_balance[0] if engine.pool.k_balance else None
    b = len(engine.scheduler.running)
    dt = engine.model.dtype
    q = torch.randn(b, s.num_heads, s.head_dim, dtype=dt, device=r.device)
    kv = torch.randn(b, s.num_kv_heads, s.head_dim, dtype=dt, device=r.device)

    def one_step():
        for _ in range(s.num_layers):
            rotate(balance_q(q, kb), r).to(dt), rotate(balance_k(kv, kb), r), rotate(kv, r)
            unrotate(q, r).to(dt)

    return per_call_seconds(one_step, reps, device=device)


def format_table(row: dict) -> str:
    return "\n".join(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}"
                     for k, v in row.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rotation_cost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kv-dtype", default="int8", choices=["int8", "fp8"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 keeps a shared machine from oversubscribing)")
    add_json_flag(p)
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    engines = decode_engines(args)
    times = {name: [] for name in engines}
    for _ in range(args.steps):
        for name, engine in engines.items():  # alternate: both see the same load
            times[name].append(per_call_seconds(engine.step, warmup=0, device=args.device))
    step = {name: statistics.median(t) for name, t in times.items()}
    cpu = args.device == "cpu"
    ops = {n: rotation_ops_s(engines[n], args.device, 20) if cpu else None
           for n in ("hadamard", "calibrated")}
    row = {
        "device": args.device, "threads": torch.get_num_threads(), "kv_dtype": args.kv_dtype,
        "batch": args.batch,
        "context": args.prompt, "steps": args.steps,
        **{f"step_ms_{n}": t * 1e3 for n, t in step.items()},
        **{f"step_difference_share_{n}": (step[n] - step["none"]) / step[n]
           for n in ("hadamard", "calibrated", "calibrated+anchors")},
        **{f"rotation_ops_ms_{n}": None if t is None else t * 1e3 for n, t in ops.items()},
        **{f"rotation_ops_share_{n}": None if t is None else t / step[n]
           for n, t in ops.items()},
        "kv_bytes_per_token": {n: e.stats().kv_bytes_per_token for n, e in engines.items()},
    }
    print_result(row, format_table, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
