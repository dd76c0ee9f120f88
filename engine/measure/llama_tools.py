"""llama.cpp's own benchmark tools beside kvscope: where they are, the commands, their output.

`llama-bench` and `llama-batched-bench` are looked for in --llama-bin, then `$LLAMA_BIN`, then
on PATH; building them is in docs/long-context.md. Nothing here imports llama.cpp: the tools
run as child processes and their printed output is parsed.

* llama-bench prints JSON with `-o json`: one object per test, with n_prompt, n_gen, n_depth
  (tokens already in the KV cache before the timed part), type_k/type_v and avg_ts (tok/s,
  averaged over -r repetitions). `-p 0 -n N -d D` times N decode steps after D tokens of
  context; `-p P -n 0` times a prefill of P tokens.
* llama-batched-bench prints a markdown table (PP, TG, B, N_KV, T_PP s, S_PP t/s, ...);
  S_PP at B = 1 is the prefill tok/s of one request, and S t/s = (PP + TG) x B / seconds the
  rate of B requests at once.
* `convert_hf_to_gguf.py` (in llama.cpp's source tree, with its `gguf-py` beside it) writes a
  Hugging Face checkpoint as a GGUF; `llama-quantize IN OUT TYPE` re-encodes one (Q4_0, Q8_0).
  The source tree is --llama-src, else `$LLAMA_SRC`, else the folder three levels above
  llama-bench (llama.cpp/build/bin/llama-bench).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

ENV = "LLAMA_BIN"
SRC_ENV = "LLAMA_SRC"
CONVERTER = "convert_hf_to_gguf.py"
# llama.cpp's KV types side by side with kvscope's: f16, its default, and q8_0, which needs
# flash attention for a quantized V.
KV_FLAGS: dict[str, list[str]] = {"f16": [], "q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "1"]}


def find_tool(name: str, bin_dir: str | None = None) -> Path | None:
    """The executable `name` in bin_dir, else in $LLAMA_BIN, else on PATH; None if nowhere."""
    for folder in (bin_dir, os.environ.get(ENV)):
        if folder:
            path = Path(folder).expanduser() / name
            if path.is_file() and os.access(path, os.X_OK):
                return path
    found = shutil.which(name)
    return Path(found) if found else None


def _joined(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)


def bench_decode_command(tool: Path, gguf: str, kv: str, depths: Iterable[int], steps: int,
                         threads: int, repeats: int) -> list[str]:
    """llama-bench timing `steps` decode steps after each depth of context."""
    return [str(tool), "-m", gguf, "-p", "0", "-n", str(steps), "-d", _joined(depths),
            "-t", str(threads), "-r", str(repeats), "-o", "json", *KV_FLAGS[kv]]


def bench_prefill_command(tool: Path, gguf: str, kv: str, prompts: Iterable[int],
                          threads: int, repeats: int) -> list[str]:
    """llama-bench timing a prefill of each prompt length."""
    return [str(tool), "-m", gguf, "-p", _joined(prompts), "-n", "0", "-t", str(threads),
            "-r", str(repeats), "-o", "json", *KV_FLAGS[kv]]


def batched_prefill_command(tool: Path, gguf: str, prompts: Iterable[int], threads: int
                            ) -> list[str]:
    """llama-batched-bench with one sequence (B = 1) per prompt length, 4 decode tokens."""
    prompts = list(prompts)
    return [str(tool), "-m", gguf, "-c", str(max(prompts) + 16), "-npp", _joined(prompts),
            "-ntg", "4", "-npl", "1", "-t", str(threads)]


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench's `-o json` (a JSON array) or `-o jsonl` (one object a line) output as
    rows {kv, n_prompt, n_gen, n_depth, tok_s}."""
    text = text.strip()
    try:
        start = text.index("[")
        tests = json.loads(text[start:])
    except ValueError:  # no array (jsonl, or junk): every line that is an object
        tests = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"llama-bench printed no tests: {text[-300:]!r}")
    return [{"kv": t.get("type_k", "f16"), "n_prompt": int(t["n_prompt"]),
             "n_gen": int(t["n_gen"]), "n_depth": int(t.get("n_depth", 0)),
             "tok_s": float(t["avg_ts"])} for t in tests]


def decode_rates(rows: list[dict]) -> dict[int, float]:
    """Decode tok/s by context depth, from the tests that generated tokens."""
    return {r["n_depth"]: r["tok_s"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0}


def prefill_rates(rows: list[dict]) -> dict[int, float]:
    """Prefill tok/s by prompt length, from the tests that generated none."""
    return {r["n_prompt"]: r["tok_s"] for r in rows if r["n_gen"] == 0 and r["n_prompt"] > 0}


def parse_markdown_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in `text` as {header: cell}."""
    header: list[str] | None = None
    rows: list[dict[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            if header is not None and rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(c) <= set("-: ") for c in cells):
            rows.append(dict(zip(header, cells, strict=False)))
    return rows


def batched_prefill_rates(text: str) -> dict[int, float]:
    """S_PP t/s at B = 1 by prompt length, from llama-batched-bench's table."""
    rows = parse_markdown_table(text)
    if not rows or "S_PP t/s" not in rows[0]:
        raise ValueError(f"llama-batched-bench printed no table: {text[-300:]!r}")
    return {int(r["PP"]): float(r["S_PP t/s"]) for r in rows if r.get("B") == "1"}


def run_tool(command: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """The command's stdout; a failure raises RuntimeError with the end of its stderr. env:
    its environment (default: this process's)."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              check=False, env=env)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{Path(command[0]).name} ran past {timeout:.0f} s") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-600:]}")
    return proc.stdout


def find_converter(src_dir: str | None = None, bench: Path | None = None) -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py in src_dir, else $LLAMA_SRC, else the source tree
    llama-bench was built in; None if nowhere."""
    folders = [src_dir, os.environ.get(SRC_ENV)]
    if bench is not None:
        folders.append(str(Path(bench).resolve().parent.parent.parent))
    for folder in folders:
        if folder and (Path(folder).expanduser() / CONVERTER).is_file():
            return Path(folder).expanduser() / CONVERTER
    return None


def convert_command(python: str, converter: Path, checkpoint: Path, out: Path,
                    outtype: str = "f16") -> list[str]:
    """The converter writing `checkpoint` (a Hugging Face folder) as one GGUF file."""
    return [python, str(converter), str(checkpoint), "--outfile", str(out), "--outtype", outtype]


def converter_env(converter: Path) -> dict[str, str]:
    """The environment the converter runs in: its own gguf-py first on PYTHONPATH (the gguf
    package of the same llama.cpp), then whatever PYTHONPATH held (sentencepiece, which it
    imports)."""
    env = dict(os.environ)
    paths = [str(converter.parent / "gguf-py"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def quantize_command(tool: Path, source: Path, out: Path, kind: str, threads: int) -> list[str]:
    """llama-quantize re-encoding a GGUF as `kind` (Q4_0, Q8_0, ...)."""
    return [str(tool), str(source), str(out), kind, str(threads)]


def batched_command(tool: Path, gguf: str, prompt: int, tokens: int, batches: Iterable[int],
                    threads: int) -> list[str]:
    """llama-batched-bench: B requests of `prompt` tokens each generating `tokens`, for each
    B, in a context that holds the largest batch."""
    batches = list(batches)
    return [str(tool), "-m", gguf, "-c", str((prompt + tokens) * max(batches) + 16),
            "-npp", str(prompt), "-ntg", str(tokens), "-npl", _joined(batches),
            "-t", str(threads)]


def batched_rates(text: str) -> dict[int, float]:
    """S t/s by B, from llama-batched-bench's table."""
    rows = parse_markdown_table(text)
    if not rows or "S t/s" not in rows[0]:
        raise ValueError(f"llama-batched-bench printed no table: {text[-300:]!r}")
    return {int(r["B"]): float(r["S t/s"]) for r in rows}

