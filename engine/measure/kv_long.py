"""`kv-accuracy --task passkey|document` and `--trace/--prompts`: the long-context runs.

Builds the probes of the task, runs them under every KV setting (benchmarks/kv_grid.py) on
one engine with dense float32 weights (so the KV dtype is the only difference from the
reference), and returns one JSON-able result, which the command prints and saves.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

from kvscope.engine.measure import kv_grid, passkey_grid
from kvscope.engine.measure.progress import Progress

DOCUMENT_LENGTHS = [1024, 2048, 4096]


def model_label(model: str) -> str:
    if model == "default":
        from kvscope.engine.loading.checkpoint_files import DEFAULT_GGUF_NAME

        return DEFAULT_GGUF_NAME
    return model


def build_engine(args: argparse.Namespace):
    import torch

    from kvscope.engine import EngineConfig
    from kvscope.engine.llm import LLM
    from kvscope.engine.loading.loader import load_model

    loaded = load_model(args.model, torch.float32)
    config = EngineConfig(model=args.model, block_size=args.block_size, weights="dense",
                          kv_cache_bytes=args.kv_cache_mib << 20,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    return LLM(config, loaded=loaded)


def probes_for(args: argparse.Namespace, llm, encode=None) -> tuple[list, dict]:
    """The task's probes and what describes them in the result. `encode` (text -> ids)
    replaces the model's tokenizer (tests: a tiny model's ids are bytes)."""
    engine = llm.engine
    if encode is None:
        def encode(text: str) -> list[int]:
            return engine.tokenizer.encode(text, add_special_tokens=False)
    if args.task == "passkey":
        from kvscope.engine.measure.passkey import PasskeyBuilder

        lengths = passkey_grid.capped_lengths(args.lengths, engine.max_model_len, 8)
        builder = PasskeyBuilder(encode, engine.tokenizer.decode)
        probes = passkey_grid.passkey_probes(builder, lengths, args.depths,
                                             args.seeds, args.seed)
        return probes, {"lengths": lengths, "depths": args.depths, "seeds": args.seeds}
    if args.task == "document":
        from kvscope.engine.measure.long_document import DOCUMENT, document_ids, document_probes

        ids = document_ids(encode)[:getattr(args, "document_tokens", None)]
        probes = document_probes(ids, args.lengths, engine.max_model_len)
        return probes, {"document": DOCUMENT.name,
                        "lengths": [dict(p.cell)["length"] for p in probes]}
    from kvscope.engine.measure import user_prompts

    if args.trace is not None:
        ids, max_tokens = user_prompts.trace_prompts(args.trace, engine.model.shape.vocab_size)
        source = {"trace": str(args.trace)}
    else:
        ids, max_tokens = user_prompts.file_prompts(args.prompts, llm.apply_chat_template)
        source = {"prompts": str(args.prompts)}
    ids, max_tokens = ids[:args.num_prompts], max_tokens[:args.num_prompts]
    return user_prompts.probes_of(ids, max_tokens, engine.max_model_len), source


def run_long(args: argparse.Namespace, llm=None, encode=None, on_partial=None) -> dict:
    """The task's grid under every setting, with the run's date, model and duration.
    on_partial(result) after each setting but the last, with the settings done so far and
    "partial": true."""
    llm = llm if llm is not None else build_engine(args)
    started = time.monotonic()
    probes, described = probes_for(args, llm, encode)
    settings = kv_grid.settings_for(args.dtypes or kv_grid.LONG_DTYPES)
    per_setting = kv_grid.work_tokens(probes, llm.engine.block_manager.block_size)
    progress = Progress(per_setting * len(settings))

    def result_of(results: dict, partial: bool) -> dict:
        return {
            "task": args.task, "model": model_label(args.model),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - started, 1),
            "machine": f"{platform.machine()}, {_cores()} cores",
            "probes": len(probes), **described, "partial": partial,
            "settings": kv_grid.grid_of(probes, results),
        }

    def saved_so_far(results: dict) -> None:
        if on_partial is not None and len(results) < len(settings):
            on_partial(result_of(results, True))

    results = kv_grid.run_settings(llm.engine, probes, settings, progress, saved_so_far)
    progress.finish()
    return result_of(results, False)


def _cores() -> int:
    import os

    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
