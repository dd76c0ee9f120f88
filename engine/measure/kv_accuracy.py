"""What a KV dtype costs in accuracy, measured on the embedded model against float32 KV.

    kvscope kv-accuracy [--dtypes ...] [--rotations ...] [--json]

For each KV dtype, with and without the K/V rotation (kernels/rotation.py) and the calibrated
exact K shift and q/k balance on top of it (kernels/k_balance.py), and with and without anchor
tokens (engine/kv_cache/anchors.py: the first positions of each opening kept exact) -- 1-byte dtypes
only, where they matter -- over the chat prompts of resources/kv_accuracy_prompts.txt (40,
chosen before any measurement): prefix agreement (share of generated positions before the first
token that differs from the float32-KV continuation, the number a user feels), positional
agreement (share of positions whose token equals the reference's, which forgives a detour that
comes back), mean KL divergence of next-token distributions along the float32 continuation
(teacher-forced), and perplexity on resources/perplexity_text.txt.

Long context (engine/measure/kv_long.py, docs/kv-dtypes.md), each dtype with its default rotation
and anchors and with none, against float32 KV: `--task passkey` (Landmark Attention's passkey
over lengths x depths: right answer, same as float32, KL over the answer, rank of the right
first token), `--task document` (continuing resources/long_document.txt from deep inside it),
`--trace TRACE` / `--prompts FILE` (the user's own prompts, by length). `--quick`: 2 lengths x
3 depths. The last long run is saved under the user's data folder, where the window reads it
(ipc/saved_results.py). The command's options are engine/cli/kv_accuracy.py's.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from kvscope.engine.measure import RESOURCES
from kvscope.engine.measure.timing import print_result, progress_logger

PROMPTS_FILE = RESOURCES / "kv_accuracy_prompts.txt"


def load_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    """One chat turn a line; blank lines and lines starting with # are skipped."""
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


# The file's first eight: the set kv-accuracy used before it grew to 40, which other benchmarks
# (single_stream) still measures on.
PROMPTS = load_prompts()[:8]
TEXT = RESOURCES / "perplexity_text.txt"
DTYPES = ["float32", "bfloat16", "float16", "int8", "fp8"]
ROTATIONS = ["calibrated", "hadamard", "none"]
ONE_BYTE = ("int8", "fp8")
ANCHORS = [4, 0]
TASKS = ["chat", "passkey", "document", "prompts"]
log = progress_logger("kv-accuracy")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def positional(a: list[int], b: list[int]) -> float:
    """Share of the reference's positions where the candidate has the same token."""
    return sum(x == y for x, y in zip(a, b, strict=False)) / max(len(b), 1)


def measure(engine, prompts, reference, text_ids, max_tokens) -> dict:
    from kvscope.engine.scoring import mean_kl, perplexity, token_log_probs

    greedy = _greedy(engine, prompts, max_tokens)
    refs = reference["tokens"]
    prefix = [common_prefix(g, r) / max(len(r), 1) for g, r in zip(greedy, refs, strict=True)]
    kls = [mean_kl(ref_lp, token_log_probs(engine, p + r)[len(p) - 1:])
           for p, r, ref_lp in zip(prompts, refs, reference["log_probs"], strict=True)]
    return {
        "prefix_agreement": sum(prefix) / len(prefix),
        "positional_agreement": sum(positional(g, r)
                                    for g, r in zip(greedy, refs, strict=True)) / len(refs),
        "mean_kl": sum(kls) / len(kls),
        "perplexity": perplexity(token_log_probs(engine, text_ids), text_ids),
        "kv_bytes_per_token": engine.stats().kv_bytes_per_token,
        "greedy": greedy,
    }


def _greedy(engine, prompts, max_tokens):
    from kvscope.engine import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(i).token_ids for i in ids]


def measure_rows(args: argparse.Namespace) -> dict:
    """Every row's measures against the float32-KV reference, keyed by row name."""
    import torch

    from kvscope.engine import EngineConfig
    from kvscope.engine.llm import LLM
    from kvscope.engine.loading.loader import load_model

    loaded = load_model(args.model, torch.float32)
    # Dense float32 weights: the KV dtype is the only thing that differs from the reference.
    llm = LLM(EngineConfig(model=args.model, block_size=args.block_size, weights="dense"),
              loaded=loaded)
    questions = load_prompts(args.prompts)[:args.num_prompts]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    text_ids = loaded.tokenizer.encode(TEXT.read_text())[:args.text_tokens]
    engine = llm.engine
    reference = reference_of(engine, prompts, args.max_tokens)
    results = {}
    for dtype, rotation, anchors in rows(args.dtypes, args.rotations, args.anchor_tokens):
        name = row_name(dtype, rotation, anchors)
        log(f"{name} ...")
        engine.reconfigure(kv_dtype=dtype, kv_rotation=rotation, kv_anchor_tokens=anchors)
        result = measure(engine, prompts, reference, text_ids, args.max_tokens)
        result.pop("greedy")
        results[name] = {"kv_dtype": dtype, "kv_rotation": rotation,
                         "kv_anchor_tokens": anchors, **result}
    return results


def reference_of(engine, prompts, max_tokens) -> dict:
    """Greedy continuations and their log-probs on the engine as it is (float32 KV)."""
    from kvscope.engine.scoring import token_log_probs

    tokens = _greedy(engine, prompts, max_tokens)
    return {"tokens": tokens, "log_probs": [token_log_probs(engine, p + r)[len(p) - 1:]
                                            for p, r in zip(prompts, tokens, strict=True)]}


def rows(dtypes: list[str], rotations: list[str], anchors: list[int] = (0,)
         ) -> list[tuple[str, str, int]]:
    """(dtype, rotation, anchor tokens): every rotation and anchor count for 1-byte dtypes,
    unrotated and unanchored for the rest."""
    return [(d, r, a) for d in dtypes for r in (rotations if d in ONE_BYTE else ["none"])
            for a in (anchors if d in ONE_BYTE else [0])]


def row_name(dtype: str, rotation: str, anchors: int = 0) -> str:
    if dtype not in ONE_BYTE:
        return dtype
    return f"{dtype}+{rotation}" + (f"+anchors{anchors}" if anchors else "")


def format_table(results: dict) -> str:
    lines = [(f"{'kv dtype':10} {'rotation':>10} {'anchors':>7} {'bytes/token':>12} "
              f"{'prefix agree':>13} {'position agree':>15} {'mean KL':>10} {'perplexity':>11}")]
    lines += [f"{r['kv_dtype']:10} {r['kv_rotation']:>10} {r['kv_anchor_tokens']:7d} "
              f"{r['kv_bytes_per_token']:12d} "
              f"{r['prefix_agreement']:12.1%} {r['positional_agreement']:14.1%} "
              f"{r['mean_kl']:10.5f} {r['perplexity']:11.3f}" for r in results.values()]
    return "\n".join(lines)


def run_long_task(args: argparse.Namespace) -> int:
    """A long task: the grid printed (or its JSON), and saved for the window. Both go through
    ipc/saved_results.py, checked as the window will read them, so --json prints what the
    file holds."""
    from kvscope.engine.measure.kv_long import run_long
    from kvscope.engine.measure.kv_long_table import format_long
    from kvscope.ipc import saved_results

    path = args.save or saved_results.saved_path(args.task)

    def save(result: dict) -> None:
        saved_results.save(saved_results.from_result(result), path)

    # Each setting as it ends: a run cut short still leaves what it measured (marked partial).
    run = saved_results.from_result(run_long(args, on_partial=None if args.no_save else save))
    if not args.no_save:
        saved_results.save(run, path)
        log(f"saved to {path}")
    print_result(saved_results.to_builtins(run), format_long, args.json)
    return 0
