"""Check every Triton kernel against its torch reference, time them, and run the engine end to
end against Hugging Face, on a GPU if there is one.

    python -m benchmarks.device.gpu_check [--parts kernels,decode,e2e,device]
        [--out DIR] [--model M] [--json] [--quick] [--seed N]

Parts (all by default; on one H200 about 6 minutes in all, most of it Triton compiling):
- kernels: every Triton kernel against its torch reference (benchmarks/device/gpu_kernels.py);
- decode: paged decode attention's time and bandwidth as a share of a device-to-device copy,
  at 16 and 64 sequences x 1k and 8k tokens, per KV dtype (gpu_decode.py);
- e2e: the engine against Hugging Face `generate` on the same device: greedy agreement per
  model and KV dtype, preemption, speculative drafts, throughput at concurrency 16 and 64,
  and the decode step split into GPU kernel time and host overhead (gpu_e2e.py);
- device: the device panel's numbers (NVML) beside nvidia-smi's (device_check.py).
Without CUDA the kernels part runs on small shapes under TRITON_INTERPRET=1, decode and device
are skipped with the reason, and e2e runs on the CPU only when --parts names it.

--out DIR writes gpu_check.json (rewritten after every part, so a run cut short still leaves
what it finished) and gpu_check.log (the progress and the final table). --json prints the
result as one JSON object on stdout. The exit status is 1 when a correctness check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from kvscope.engine.measure.timing import add_json_flag, print_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PARTS = ("kernels", "decode", "e2e", "device")
DECODE_CONFIGS = {  # name: (heads, kv_heads, head_dim)
    "smollm2-like 9/3x64": (9, 3, 64),
    "llama3-8b-like 32/8x128": (32, 8, 128),
}
DECODE_SHAPES = ((16, 1024), (16, 8192), (64, 1024), (64, 8192))  # (sequences, context)


class Run:
    """The result being built, its log, and where both are written as they grow."""

    def __init__(self, out: Path | None, seed: int) -> None:
        self.out = out
        self.result: dict = {"seed": seed}
        self.t0 = time.perf_counter()
        if out:
            out.mkdir(parents=True, exist_ok=True)
            self._log_file = open(out / "gpu_check.log", "a", buffering=1)  # noqa: SIM115

    def log(self, message: str) -> None:
        line = f"[gpu_check {time.perf_counter() - self.t0:6.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        if self.out:
            self._log_file.write(line + "\n")

    def save(self) -> None:
        self.result["seconds"] = time.perf_counter() - self.t0
        if self.out:
            tmp = self.out / "gpu_check.json.tmp"
            tmp.write_text(json.dumps(self.result, indent=1, default=str))
            tmp.replace(self.out / "gpu_check.json")


def run_kernels(run: Run, has_cuda: bool) -> None:
    from benchmarks.device.gpu_kernels import correctness

    def log_and_save(message: str) -> None:
        run.log(message)
        run.save()

    run.log("correctness checks ...")
    correctness("cuda" if has_cuda else "cpu", small=not has_cuda, seed=run.result["seed"],
                log=log_and_save, rows=run.result.setdefault("checks", []))


def run_decode(run: Run) -> None:
    import torch

    from benchmarks.device.gpu_decode import copy_bandwidth, time_decode
    from benchmarks.device.gpu_kernels import KV_DTYPE_NAMES

    run.log("copy bandwidth ...")
    copy_bw = copy_bandwidth("cuda")
    run.result["copy_gb_per_s"] = copy_bw / 1e9
    rows = run.result["decode"] = []
    for name, (h, kvh, hd) in DECODE_CONFIGS.items():
        for batch, ctx in DECODE_SHAPES:
            run.log(f"decode {name} {batch} x {ctx} ...")
            for kv in KV_DTYPE_NAMES:
                try:
                    rows.append(time_decode(name, h, kvh, hd, kv, batch, ctx, 16, "cuda",
                                            copy_bw, with_ref=name.startswith("smol")
                                            and ctx == 1024))
                except Exception as e:  # noqa: BLE001 - report, time the rest
                    rows.append({"config": name, "kv_dtype": kv, "batch": batch,
                                 "context": ctx, "error": f"{type(e).__name__}: {e}"[:300]})
                torch.cuda.empty_cache()
        run.save()


def run_e2e(run: Run, model: str, device: str, quick: bool) -> None:
    from benchmarks.device.gpu_e2e import run_all

    run_all(model, device, run.result["seed"], quick, run.log,
            result=run.result.setdefault("e2e", {}), saved=run.save)


def run_device(run: Run, model: str) -> None:
    from benchmarks.device.device_check import compare_with_tools
    from kvscope.engine import EngineConfig, SamplingParams
    from kvscope.engine.llm_engine import LLMEngine

    run.log("device panel against nvidia-smi ...")
    try:
        engine = LLMEngine(EngineConfig(model=model, device="cuda"))
        vocab = engine.model.shape.vocab_size
        for _ in range(4):
            engine.add_request([(100 + i) % vocab for i in range(300)],
                               SamplingParams(max_tokens=16))
        while engine.has_unfinished():
            engine.step()
        run.result["device_panel"] = compare_with_tools(engine, 0.05)
    except Exception as e:  # noqa: BLE001
        run.result["device_panel"] = {"error": f"{type(e).__name__}: {e}"[:500]}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    add_json_flag(p, "one JSON object on stdout")
    p.add_argument("--parts", default=None,
                   help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    p.add_argument("--out", type=Path, default=None, help="write gpu_check.json and .log here")
    p.add_argument("--model", default="default", help="the engine's model (default: embedded)")
    p.add_argument("--quick", action="store_true", help="smaller end-to-end workloads")
    p.add_argument("--seed", type=int, default=None, help="default: random, reported")
    args = p.parse_args(argv)
    parts = tuple(PARTS if args.parts is None else args.parts.split(","))
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {', '.join(bad)}; expected some of {', '.join(PARTS)}")
    return args, parts, args.parts is not None


def main(argv: list[str] | None = None) -> int:
    args, parts, named = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)

    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        # Must precede the first import of a kernel module (triton.jit reads it then).
        os.environ["TRITON_INTERPRET"] = "1"
    from benchmarks.device.gpu_report import format_with_verdict

    run = Run(args.out, seed)
    r = run.result
    r |= {"torch": torch.__version__, "parts": list(parts)}
    if has_cuda:
        props = torch.cuda.get_device_properties(0)
        r["device"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                       f"{props.total_memory / 2**30:.0f} GiB)")
    else:
        r["device"] = "cpu (Triton interpreter, TRITON_INTERPRET=1)"
        skipped = [x for x in parts if x in ("decode", "device") or (x == "e2e" and not named)]
        if skipped:
            r["gpu_skipped"] = (f"{', '.join(skipped)}: no CUDA device "
                                "(torch.cuda.is_available() is False)")
        parts = tuple(x for x in parts if x not in skipped)
    run.log(f"{r['device']}: parts {', '.join(parts) or 'none'}")
    for part in parts:
        if part == "kernels":
            run_kernels(run, has_cuda)
        elif part == "decode":
            run_decode(run)
        elif part == "e2e":
            run_e2e(run, args.model, "cuda" if has_cuda else "cpu", args.quick)
        elif part == "device":
            run_device(run, args.model)
        run.save()
    from benchmarks.device.gpu_e2e import passed

    r["ok"] = all(c["ok"] for c in r.get("checks", [])) and passed(r.get("e2e") or {})
    run.save()
    text = format_with_verdict(r)
    if args.out:
        run._log_file.write(text + "\n")
    print_result(r, format_with_verdict, args.json, table_to_stderr=True)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
