"""`kvscope bench --profile`: where an engine step's time goes, by wrapping the engine's
instance attributes (no engine edits): the step and its parts (schedule, inputs, model,
logits, append), host overhead (everything but the model) overall and on decode-only steps by
batch size, and what the model runner was actually given (for MFU and HFU).
"""
from __future__ import annotations

import time

from kvscope.engine.measure.timing import sync_device


class Timer:
    """Wall seconds, and this thread's CPU seconds: on a shared machine the wall clock also
    counts the time other processes held the core, the CPU clock only our own work."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.calls = 0

    def wrap(self, fn, device: str):
        def timed(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                sync_device(device)
                self.seconds += time.perf_counter() - t0
                self.cpu_seconds += time.thread_time() - c0
                self.calls += 1
        return timed


class RunnerCounter:
    """Wraps the runner instance's `run` to count what the model was actually given.

    The counting runs inside step(), so it keeps its own timer and the profile takes it out
    of the host overhead: it is the benchmark's work, not the engine's.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.fed_tokens = 0
        self.logit_rows = 0
        self.context_sum = 0
        self.peak_used_blocks = 0
        self.max_batch_seqs = 0
        self.timer = Timer()
        original = engine.runner.run
        count = self.timer.wrap(self.count, "cpu")

        def run(batch, *rest, **kw):  # rest: whatever else the engine passes (drafts)
            count(batch)
            return original(batch, *rest, **kw)

        engine.runner.run = run

    def count(self, batch) -> None:
        for item in batch:
            start, n = item.seq.num_computed_tokens, item.num_tokens
            self.fed_tokens += n
            self.context_sum += n * start + n * (n + 1) // 2
            if start + n == item.seq.num_tokens:
                self.logit_rows += 1
        self.max_batch_seqs = max(self.max_batch_seqs, len(batch))
        self.peak_used_blocks = max(self.peak_used_blocks,
                                    self.engine.block_manager.num_used_blocks)


def install_profile(engine) -> dict:
    """Time the step and its parts by wrapping instance attributes (no engine edits)."""
    dev = engine.device
    timers = {name: Timer() for name in
              ("step", "schedule", "runner", "prepare", "grouping", "forward", "logits",
               "append")}
    engine.step = timers["step"].wrap(engine.step, dev)
    engine.scheduler.schedule = timers["schedule"].wrap(engine.scheduler.schedule, dev)
    engine.runner.run = timers["runner"].wrap(engine.runner.run, dev)
    engine.runner.prepare = timers["prepare"].wrap(engine.runner.prepare, dev)
    engine.runner.decode_groups = timers["grouping"].wrap(engine.runner.decode_groups, "cpu")
    engine.model.forward = timers["forward"].wrap(engine.model.forward, dev)
    engine.model.compute_logits = timers["logits"].wrap(engine.model.compute_logits, dev)
    engine._append_tokens = timers["append"].wrap(engine._append_tokens, "cpu")
    return {"timers": timers, "decode": DecodeSteps(engine, timers)}


NOT_HOST = ("forward", "logits", "bench_counting")


def host_seconds(timers: dict[str, Timer]) -> tuple[float, float]:
    """(wall, CPU) seconds of step() so far that were neither the model's nor the
    benchmark's own counting."""
    parts = [timers[k] for k in NOT_HOST if k in timers]
    return (timers["step"].seconds - sum(t.seconds for t in parts),
            timers["step"].cpu_seconds - sum(t.cpu_seconds for t in parts))


class DecodeSteps:
    """Host overhead of decode-only steps (every scheduled sequence decodes one token after
    one it generated: the steady state of a server), by batch size, apart from the steps that
    also prefill. Classifies outside the step's timer, so the profile does not time it."""

    def __init__(self, engine, timers: dict[str, Timer]) -> None:
        self.by_size: dict[int, list[float]] = {}  # seqs -> [steps, wall s, CPU s]
        inner = engine.step

        def step(*a, **kw):
            sched = engine.scheduler
            ready = {id(s) for s in sched.running
                     if s.num_output_tokens > 0 and s.num_computed_tokens == s.num_tokens - 1}
            wall, cpu = host_seconds(timers)
            out = inner(*a, **kw)
            batch = out.scheduled  # empty when no model step ran
            if batch and all(i.num_tokens == 1 and id(i.seq) in ready for i in batch):
                wall_after, cpu_after = host_seconds(timers)
                acc = self.by_size.setdefault(len(batch), [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += wall_after - wall
                acc[2] += cpu_after - cpu
            return out

        engine.step = step

    def report(self, sizes=None) -> dict:
        rows = [v for k, v in self.by_size.items() if sizes is None or k in sizes]
        steps = sum(r[0] for r in rows)
        seqs = sum(k * v[0] for k, v in self.by_size.items() if sizes is None or k in sizes)
        per_step = 1e3 / max(steps, 1)
        return {"steps": steps, "mean_seqs": seqs / max(steps, 1),
                "host_overhead_ms_per_step": sum(r[1] for r in rows) * per_step,
                "host_overhead_cpu_ms_per_step": sum(r[2] for r in rows) * per_step}


def profile_report(profile: dict, total_seconds: float, max_num_seqs: int) -> dict:
    timers = profile["timers"]
    t = {k: v.seconds for k, v in timers.items()}
    # The host part runs on this thread alone, so its CPU time is the work it cost.
    host_cpu = max(0.0, host_seconds(timers)[1])
    # The engine's step: the benchmark's counting inside it is taken out.
    step = (t["step"] - t.get("bench_counting", 0.0)) or 1e-12
    model = t["forward"] + t["logits"]
    prepare = t["prepare"]
    # runner.run minus its parts: picking last rows, the empty-logits path.
    runner_other = max(0.0, t["runner"] - model - prepare)
    rest = max(0.0, step - t["runner"] - t["schedule"] - t["append"])
    parts = {
        "model_forward": model,
        "runner_prepare_inputs": prepare - t["grouping"] + runner_other,
        # kernels.attention_ref.group_decode_rows, called by the runner for the CPU attention.
        "attention_decode_grouping": t["grouping"],
        "scheduler": t["schedule"],
        "append_detokenize_stop": t["append"],
        "sampler_and_other": rest,
    }
    return {
        "step_seconds": step,
        "num_steps": timers["step"].calls,
        "generate_seconds": total_seconds,
        "outside_step_seconds": max(0.0, total_seconds - step),
        "seconds": parts,
        "share_of_step": {k: v / step for k, v in parts.items()},
        "model_forward_share": model / step,
        "non_model_share": 1 - model / step,
        # Everything but the model: scheduling, inputs, sampling, detokenizing, outputs.
        "host_overhead_ms_per_step": (step - model) / max(timers["step"].calls, 1) * 1e3,
        "host_overhead_cpu_ms_per_step": host_cpu / max(timers["step"].calls, 1) * 1e3,
        "decode_only": profile["decode"].report(),
        "decode_only_full_batch": {"seqs": max_num_seqs,
                                   **profile["decode"].report({max_num_seqs})},
    }
