"""The engine end to end on a device, against Hugging Face `generate` on the same device.

Parts (each a dict in the result; a part that raises reports its error and the rest run):
- agreement: greedy output of the engine against HF, per model dtype (float32 must be token
  for token equal; float16/bfloat16 agreement reported), on prompts of one length, so HF's
  batch needs no padding; then, on the bfloat16 model, each 1-byte KV dtype against HF and
  against the engine's own bfloat16 KV;
- preemption: a pool too small for the batch (float32): requests preempted and recomputed
  must give the same tokens as with a pool that holds them all;
- speculative: n-gram drafts on and off on a prompt that repeats itself: float32 must give
  the same tokens (bfloat16 reported), with the acceptance length and the time;
- throughput: engine generated tok/s against HF static batching (one batch of c) at each
  concurrency, bfloat16, at the engine's defaults and with a GPU-sized step budget;
- steps: the decode step of 1, 16 and 64 streams split into wall time, GPU kernel
  time (torch.profiler) and the GPU-idle rest (host overhead), with kernel launches per step;
- families: each model family's tiny random checkpoint (kvscope.testing.tiny_models: sliding
  windows, soft-caps, q/k norms, longrope) in float32, token for token against HF's eager
  attention, block sizes 1 and 16 (as tests/engine/model/test_families.py does on the CPU).
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from kvscope.engine.measure.timing import sync_device

GiB = 2**30


def run_all(model: str, device: str, seed: int, quick: bool, log: Callable[[str], None],
            parts: tuple[str, ...] = ("agreement", "steps", "throughput", "preemption",
                                      "speculative", "families"),
            result: dict | None = None, saved: Callable[[], None] = lambda: None) -> dict:
    """Fills `result` part by part, calling `saved` after each (a run cut short keeps what
    it finished)."""
    ctx = Context(model, device, seed, quick)
    result = {} if result is None else result
    result |= {"model": model, "device": device}
    for name in parts:
        log(f"end to end: {name} ...")
        t0 = time.perf_counter()
        try:
            result[name] = PARTS[name](ctx)
        except Exception as e:  # noqa: BLE001 - report, never abort the other parts
            result[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        result.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        saved()
    return result


class Context:
    """Loaded weights per model dtype, shared by the parts (loading is the slow bit)."""

    def __init__(self, model: str, device: str, seed: int, quick: bool) -> None:
        self.model, self.device, self.seed, self.quick = model, device, seed, quick
        self._loaded: dict[str, Any] = {}
        self._hf: dict[str, Any] = {}

    def loaded(self, dtype: str):
        import torch

        from kvscope.engine.loading.loader import load_model

        if dtype not in self._loaded:
            self._loaded[dtype] = load_model(self.model, getattr(torch, dtype))
        return self._loaded[dtype]

    def llm(self, dtype: str, **config: Any):
        from kvscope.engine import LLM, EngineConfig

        return LLM(EngineConfig(model=self.model, device=self.device, dtype=dtype,
                                weights="dense", **config), loaded=self.loaded(dtype))

    def hf(self, dtype: str):
        import torch

        from kvscope.engine.measure.bench import load_hf

        if dtype not in self._hf:
            self._hf.clear()  # one HF model on the device at a time
            self._hf[dtype] = load_hf(self.loaded(dtype).checkpoint, self.device,
                                      getattr(torch, dtype))
        return self._hf[dtype]

    def prompts(self, n: int, length: int, salt: int = 0) -> list[list[int]]:
        """Random token ids, special tokens left out, seeded by the run's seed and `salt`."""
        from kvscope.engine.measure.bench import special_token_ids

        loaded = next(iter(self._loaded.values()), None) or self.loaded("bfloat16")
        exclude = special_token_ids(loaded.tokenizer)
        vocab = loaded.hf_config.vocab_size
        rng = random.Random(self.seed * 7919 + salt)
        allowed = [t for t in range(100, vocab) if t not in exclude]
        return [[rng.choice(allowed) for _ in range(length)] for _ in range(n)]


def passed(result: dict) -> bool:
    """False when a part that checks something found it wrong: float32 not token for token
    equal to HF (agreement, families) or to drafts off (speculative), or preemption changing
    tokens or leaking blocks. Parts that did not run, or raised, are not counted here."""
    checks = [("agreement", "float32_exact"), ("families", "all_exact"),
              ("speculative", "float32_exact"), ("preemption", "ok")]
    return all(result.get(part, {}).get(key, True) for part, key in checks)


# -- helpers ---------------------------------------------------------------------------------
def greedy(max_tokens: int, **kw: Any):
    from kvscope.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def engine_tokens(llm, prompts: list[list[int]], max_tokens: int, **kw: Any
                  ) -> tuple[list[list[int]], float]:
    sync_device(llm.engine.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(max_tokens, **kw))
    sync_device(llm.engine.device)
    return [list(o.token_ids) for o in outs], time.perf_counter() - t0


def hf_tokens(model, prompts: list[list[int]], max_tokens: int, device: str
              ) -> tuple[list[list[int]], float]:
    import torch

    from kvscope.engine.measure.bench import Request, hf_generate_batch

    pad = int(model.config.eos_token_id if isinstance(model.config.eos_token_id, int)
              else 0)
    with torch.inference_mode():
        sync_device(device)
        t0 = time.perf_counter()
        out = hf_generate_batch(model, [Request(p, max_tokens) for p in prompts], pad, device)
        sync_device(device)
    return out, time.perf_counter() - t0


def hf_greedy_tokens(model, prompts: list[list[int]], max_tokens: int, device: str
                     ) -> list[list[int]]:
    """HF's greedy pick at every step, end-of-sequence included, for prompts of one length
    (no padding). Not hf_tokens: its min_new_tokens suppresses EOS, so where the engine
    (ignore_eos) takes EOS, HF took the runner-up (the one float32 difference on the H200,
    benchmarks/results/gpu_diag-h200-2026-12-04-float32.json)."""
    import torch

    ids = torch.tensor(prompts, device=device)
    config = model.generation_config
    eos, config.eos_token_id = config.eos_token_id, None
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    finally:
        config.eos_token_id = eos
    return out[:, ids.shape[1]:].tolist()


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of requests equal throughout, share of tokens before the first difference."""
    same_prefix = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same_prefix += n
    total = sum(len(x) for x in a)
    return {"requests_equal": sum(x == y for x, y in zip(a, b, strict=True)) / len(a),
            "tokens_before_first_difference": same_prefix / max(total, 1)}


# -- parts -----------------------------------------------------------------------------------
def agreement(ctx: Context) -> dict:
    n, length, out = (4, 48, 16) if ctx.quick else (16, 128, 48)
    prompts = ctx.prompts(n, length)
    rows: dict[str, Any] = {"requests": n, "prompt_tokens": length, "output_tokens": out}
    engine_bf16 = None
    for dtype in ("float32", "bfloat16", "float16"):
        llm = ctx.llm(dtype, kv_cache_bytes=GiB)
        mine, _ = engine_tokens(llm, prompts, out)
        ref = hf_greedy_tokens(ctx.hf(dtype), prompts, out, ctx.device)
        rows[dtype] = compare(mine, ref) | {"kv_dtype": llm.stats().kv_dtype}
        if dtype == "bfloat16":
            engine_bf16, hf_bf16 = mine, ref
            for kv in ("int8", "fp8"):
                q = ctx.llm(dtype, kv_cache_bytes=GiB, kv_dtype=kv)
                got, _ = engine_tokens(q, prompts, out)
                rows[f"bfloat16 kv {kv}"] = {"vs_hf": compare(got, hf_bf16),
                                             "vs_engine_bf16_kv": compare(got, engine_bf16),
                                             "kv_rotation": q.stats().kv_rotation}
                del q
        del llm
    rows["float32_exact"] = rows["float32"]["requests_equal"] == 1.0
    return rows


def preemption(ctx: Context) -> dict:
    n, length, out = (4, 40, 24) if ctx.quick else (8, 160, 64)
    prompts = ctx.prompts(n, length, salt=1)
    roomy = ctx.llm("float32", kv_cache_bytes=GiB)
    want, _ = engine_tokens(roomy, prompts, out)
    blocks = 2 * -(-(length + out) // 16) + 2  # two requests' worth: the rest must wait
    tight = ctx.llm("float32", num_kv_blocks=blocks, enable_prefix_caching=False)
    got, _ = engine_tokens(tight, prompts, out)
    stats = tight.stats()
    return {"num_kv_blocks": blocks, "requests": n, "preemptions": stats.num_preemptions,
            "blocks_free_after": stats.num_free_blocks, "blocks_total": stats.num_kv_blocks,
            "equal_to_roomy_pool": got == want, "ok": got == want and stats.num_preemptions > 0
            and stats.num_free_blocks == stats.num_kv_blocks}


def speculative(ctx: Context) -> dict:
    """A prompt that repeats itself, so the n-gram drafts are accepted often."""
    rows: dict[str, Any] = {}
    base = ctx.prompts(1, 24 if ctx.quick else 96, salt=2)[0]
    prompts = [base * 4, base[: len(base) // 2] * 6]
    out = 32 if ctx.quick else 96
    for dtype in ("float32", "bfloat16"):
        plain = ctx.llm(dtype, kv_cache_bytes=GiB)
        want, s_plain = engine_tokens(plain, prompts, out)
        spec = ctx.llm(dtype, kv_cache_bytes=GiB, speculative_method="ngram")
        got, s_spec = engine_tokens(spec, prompts, out)
        st = spec.stats()
        rows[dtype] = compare(got, want) | {
            "seconds_plain": s_plain, "seconds_spec": s_spec, "drafts": st.spec_num_drafts,
            "draft_tokens": st.spec_num_draft_tokens,
            "accepted_tokens": st.spec_num_accepted_tokens,
            "mean_acceptance_length": st.spec_mean_acceptance_length}
        del plain, spec
    rows["float32_exact"] = rows["float32"]["requests_equal"] == 1.0
    return rows


def throughput(ctx: Context) -> dict:
    rows = []
    out = 32 if ctx.quick else 128
    rng = random.Random(ctx.seed + 3)
    for c in ((4,) if ctx.quick else (16, 64)):
        lengths = [rng.randint(64, 256) for _ in range(c)]
        pool = ctx.prompts(c, 256, salt=10 + c)
        prompts = [p[:n] for p, n in zip(pool, lengths, strict=True)]
        model = ctx.hf("bfloat16")
        hf_tokens(model, [p[:16] for p in prompts[:2]], 4, ctx.device)  # warm-up
        _, hf_s = hf_tokens(model, prompts, out, ctx.device)
        row: dict[str, Any] = {"concurrency": c, "output_tokens": out,
                               "prompt_tokens": sum(lengths),
                               "hf_tok_s": c * out / hf_s,
                               "hf_padded_rows": c * (max(lengths) + out)}
        for label, cfg in (("defaults", {}),
                           ("step budget 8192, no prefill cap",
                            {"max_num_batched_tokens": 8192,
                             "max_prefill_tokens_while_decoding": 0})):
            llm = ctx.llm("bfloat16", kv_cache_bytes=4 * GiB, **cfg)
            engine_tokens(llm, [p[:16] for p in prompts[:2]], 4)  # compile, warm up
            _, s = engine_tokens(llm, prompts, out)
            st = llm.stats()
            row[label] = {"tok_s": c * out / s, "speedup_vs_hf": hf_s / s,
                          "steps": st.num_steps, "preemptions": st.num_preemptions}
            del llm
        rows.append(row)
    return {"dtype": "bfloat16", "rows": rows}


def steps(ctx: Context) -> dict:
    return {f"{c} streams": step_split(ctx, c, 8 if ctx.quick else 20)
            for c in ((1, 4) if ctx.quick else (1, 16, 64))}


def step_split(ctx: Context, streams: int, timed: int) -> dict:
    """Decode steps of `streams` sequences at ~160 tokens of context, bfloat16."""
    llm = ctx.llm("bfloat16", kv_cache_bytes=4 * GiB, max_num_batched_tokens=16384,
                  max_prefill_tokens_while_decoding=0)
    engine = llm.engine
    for p in ctx.prompts(streams, 128, salt=20 + streams):
        engine.add_request(p, greedy(timed + 64))
    for _ in range(8):  # prefill, then a few decode steps (compiles every decode variant)
        engine.step()
    st = llm.stats()
    walls = []
    for _ in range(timed):
        sync_device(ctx.device)
        t0 = time.perf_counter()
        engine.step()
        sync_device(ctx.device)
        walls.append(time.perf_counter() - t0)
    walls.sort()
    wall_ms = walls[len(walls) // 2] * 1e3
    row = {"running": st.num_running, "waiting": st.num_waiting, "step_wall_ms": wall_ms,
           "tok_s": streams / (wall_ms / 1e3)}
    row |= profiled(engine, ctx.device, 6)
    if row.get("gpu_kernel_ms_per_step") is not None:
        row["host_overhead_ms"] = wall_ms - row["gpu_kernel_ms_per_step"]
    while engine.has_unfinished():
        engine.step()
    row["blocks_free_after"] = llm.stats().num_free_blocks
    row["blocks_total"] = llm.stats().num_kv_blocks
    return row


def profiled(engine, device: str, n: int) -> dict:
    """GPU kernel time and kernel launches per step, from torch.profiler over n steps."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not str(device).startswith("cuda"):
        return {"gpu_kernel_ms_per_step": None, "kernels_per_step": None}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    return {"gpu_kernel_ms_per_step": busy_us / 1e3 / n, "kernels_per_step": len(kernels) / n}


def families(ctx: Context) -> dict:
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from kvscope.engine import LLM, EngineConfig
    from kvscope.testing.hf_reference import hf_greedy
    from kvscope.testing.tiny_models import ARCHS, PHI3_MAX_LEN, save_tiny_model

    rows: dict[str, Any] = {}
    rng = random.Random(ctx.seed + 5)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 41, 23, 1, 60)]
    out = 16
    for arch in ARCHS:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = save_tiny_model(Path(tmp), arch, seed=3,
                                       **({"tie_word_embeddings": False}
                                          if arch == "gemma2" else {}))
                # eager: transformers 5.17 runs gemma2 under sdpa by default, which drops
                # its attention soft-capping (benchmarks/results/gpu_diag-h200-2026-12-04.json)
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager")
                hf = hf.to(ctx.device).eval()
                hf.generation_config.eos_token_id = None
                want = [hf_greedy(hf, p, out, ctx.device) for p in prompts]
                row = {}
                for bs in (1, 16):
                    llm = LLM(EngineConfig(model=str(path), device=ctx.device, dtype="float32",
                                           kv_dtype="float32", weights="dense",
                                           max_model_len=PHI3_MAX_LEN, block_size=bs,
                                           num_kv_blocks=4096 // bs,
                                           max_num_batched_tokens=32))
                    got, _ = engine_tokens(llm, prompts, out)
                    row[f"block {bs}"] = compare(got, want)
                    del llm
                rows[arch] = row
        except Exception as e:  # noqa: BLE001 - one family's failure must not hide the rest
            rows[arch] = {"error": f"{type(e).__name__}: {e}"[:300]}
    rows["all_exact"] = all(
        isinstance(v, dict) and "error" not in v
        and all(x["requests_equal"] == 1.0 for x in v.values()) for v in rows.values())
    return rows


PARTS: dict[str, Callable[[Context], dict]] = {
    "families": families, "agreement": agreement, "preemption": preemption,
    "speculative": speculative, "throughput": throughput, "steps": steps}
