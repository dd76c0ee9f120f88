"""Run probes under every KV setting and fold the outcomes into cells.

Settings: float32 KV first (the reference every other setting is scored against, its
log-probs kept and reused), then each other dtype; a 1-byte dtype twice, with its defaults
(the calibrated rotation and anchor tokens, `auto`) and with `none` of either.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvscope.engine.measure.kv_probes import Answer, Probe, answers, outcome
from kvscope.engine.measure.progress import Progress

ONE_BYTE = ("int8", "fp8")
LONG_DTYPES = ["float32", "bfloat16", "int8", "fp8"]


@dataclass(frozen=True)
class Setting:
    kv_dtype: str
    kv_rotation: str  # "auto": the dtype's default
    kv_anchor_tokens: int | None  # None: the default

    @property
    def name(self) -> str:
        if self.kv_dtype not in ONE_BYTE or self.kv_rotation == "auto":
            return self.kv_dtype
        return f"{self.kv_dtype}+{self.kv_rotation}"

    def changes(self, default_anchors: int) -> dict:
        anchors = default_anchors if self.kv_anchor_tokens is None else self.kv_anchor_tokens
        return {"kv_dtype": self.kv_dtype, "kv_rotation": self.kv_rotation,
                "kv_anchor_tokens": anchors}


def settings_for(dtypes: list[str]) -> list[Setting]:
    """float32 first whatever was asked (it is the reference), then each dtype; 1-byte dtypes
    with their defaults and with no rotation and no anchors."""
    out = [Setting("float32", "none", 0)]
    for d in dtypes:
        if d == "float32":
            continue
        if d in ONE_BYTE:
            out += [Setting(d, "auto", None), Setting(d, "none", 0)]
        else:
            out.append(Setting(d, "none", 0))
    return out


def work_tokens(probes: list[Probe], block_size: int) -> int:
    """Tokens one setting computes: the distinct prompt blocks (a prefix shared in the cache
    counts once), each prompt's last partial block, the answers, and their scoring."""
    seen: set[int] = set()
    total = 0
    for p in probes:
        h = 0
        full = len(p.ids) // block_size
        for i in range(full):
            h = hash((h, tuple(p.ids[i * block_size:(i + 1) * block_size])))
            if h not in seen:
                seen.add(h)
                total += block_size
        total += len(p.ids) - full * block_size + 2 * p.max_tokens + block_size
    return total


def run_settings(engine, probes: list[Probe], settings: list[Setting],
                 progress: Progress | None = None, on_setting=None) -> dict[str, dict]:
    """Each setting's outcome per probe, keyed by setting name, float32 first.
    on_setting(results so far) after each setting: a long run saves what it has."""
    from kvscope.engine.config import DEFAULT_KV_ANCHOR_TOKENS

    per_setting = work_tokens(probes, engine.block_manager.block_size)
    results: dict[str, dict] = {}
    reference: list[Answer] | None = None
    for setting in settings:
        engine.reconfigure(**setting.changes(DEFAULT_KV_ANCHOR_TOKENS))
        start = engine.num_prompt_tokens + engine.num_generated_tokens
        counted = [start]

        def on_step(e, counted=counted, label=setting.name):
            now = e.num_prompt_tokens + e.num_generated_tokens
            if progress is not None:
                progress.advance(now - counted[0], label)
            counted[0] = now

        refs = None if reference is None else [a.tokens for a in reference]
        got = answers(engine, probes, refs, on_step)
        if reference is None:
            reference = got
        if progress is not None:  # the rest of the estimate: scoring, blocks it missed
            progress.advance(max(0, per_setting - (counted[0] - start)), force=True)
        results[setting.name] = {
            "kv_dtype": setting.kv_dtype, "kv_rotation": engine.kv_rotation,
            "kv_anchor_tokens": engine.config.kv_anchor_tokens,
            "kv_bytes_per_token": engine.stats().kv_bytes_per_token,
            "outcomes": [outcome(p, a, r) for p, a, r in zip(probes, got, reference,
                                                               strict=True)]}
        if on_setting is not None:
            on_setting(results)
    return results


MEASURES = ("right", "same_as_float32", "agreement", "top1_agreement", "kl", "rank")


def fold_cells(probes: list[Probe], outcomes: list[dict]) -> list[dict]:
    """Outcomes averaged per cell, in the probes' order (rank: the median); each cell keeps
    its samples."""
    cells: dict[tuple, list[tuple[Probe, dict]]] = {}
    for p, o in zip(probes, outcomes, strict=True):
        cells.setdefault(p.cell, []).append((p, o))
    folded = []
    for cell, items in cells.items():
        row: dict = dict(cell)
        row["tokens"] = round(statistics.mean(len(p.ids) for p, _ in items))
        row["samples"] = len(items)
        for m in MEASURES:
            values = [o[m] for _, o in items if m in o]
            if not values:
                continue
            row[m] = statistics.median(values) if m == "rank" else statistics.mean(values)
        row["answers"] = [{k: o[k] for k in ("key", "answer", "right") if k in o}
                          for _, o in items]
        folded.append(row)
    return folded


def grid_of(probes: list[Probe], results: dict[str, dict]) -> dict[str, dict]:
    """Per setting: its KV settings and its cells."""
    return {name: {**{k: v for k, v in r.items() if k != "outcomes"},
                   "cells": fold_cells(probes, r["outcomes"])} for name, r in results.items()}
