"""What a model on disk is, read before loading it: a Hugging Face folder (config.json and
safetensors headers) or a .gguf file (its metadata and tensor table, with the pure-Python
`gguf` package). Family, whether the engine runs it (kvmath.model_support, the engine's own
rules) or why not, parameters and weight bytes, context length, KV bytes per token.

Files are untrusted input: nothing here runs code from them, headers are bounded, and a file
that is not what it claims raises ModelFileError naming the file and what was wrong.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.kvmath.kv_size import ModelShape, bytes_per_token, shape_from_config
from kvscope.kvmath.model_support import refusal

MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # a header larger than this is no checkpoint's
# GGUF general.architecture -> Hugging Face model_type (llama.cpp writes Mistral as llama).
GGUF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                   "gemma3": "gemma3_text", "phi3": "phi3", "qwen3moe": "qwen3_moe"}
# config.json field <- GGUF key under "{arch}." (llama.cpp's names).
GGUF_FIELDS = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
               "intermediate_size": "feed_forward_length",
               "num_attention_heads": "attention.head_count",
               "num_key_value_heads": "attention.head_count_kv",
               "head_dim": "attention.key_length",
               "max_position_embeddings": "context_length",
               "sliding_window": "attention.sliding_window",
               "num_local_experts": "expert_count",
               "kv_lora_rank": "attention.kv_lora_rank"}


class ModelFileError(ValueError):
    """The path is no model the window can read (the message says which file and why)."""


@dataclass
class ModelFacts:
    path: str
    kind: str  # "Hugging Face folder" or "GGUF"
    name: str
    family: str  # the config's model_type ("" when unknown)
    refusal: str | None  # why the engine would refuse it; None: supported
    parameters: int | None
    weight_bytes: int | None
    context_length: int | None
    shape: ModelShape | None  # None: the config lacks what KV sizes need
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def supported(self) -> bool:
        return self.refusal is None

    def kv_bytes_per_token(self, kv_dtype: str) -> int | None:
        return bytes_per_token(self.shape, kv_dtype) if self.shape is not None else None


def read_model(path: str | Path) -> ModelFacts:
    """A Hugging Face folder (or its config.json) or a .gguf file; ModelFileError if not."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return read_gguf(p)
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if p.is_dir():
        return read_hf_folder(p)
    raise ModelFileError(f"{p}: not a Hugging Face model folder (with config.json) or a "
                         ".gguf file")


def _facts(path: Path, kind: str, config: dict[str, Any], parameters: int | None,
           weight_bytes: int | None) -> ModelFacts:
    try:
        shape: ModelShape | None = shape_from_config(config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        shape = None
    context = config.get("max_position_embeddings")
    return ModelFacts(path=str(path), kind=kind, name=path.name,
                      family=str(config.get("model_type") or ""), refusal=refusal(config),
                      parameters=parameters, weight_bytes=weight_bytes,
                      context_length=int(context) if isinstance(context, int) else None,
                      shape=shape, config=config)


# -- Hugging Face folders ---------------------------------------------------------------------
def read_hf_folder(folder: Path) -> ModelFacts:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{config_path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelFileError(f"{config_path}: holds JSON, but not an object")
    files = sorted(folder.glob("*.safetensors"))
    parameters = weight_bytes = 0
    for f in files:
        n, size = safetensors_totals(f)
        parameters += n
        weight_bytes += size
    return _facts(folder, "Hugging Face folder", config, parameters if files else None,
                  weight_bytes if files else None)


def safetensors_totals(path: Path) -> tuple[int, int]:
    """(parameters, bytes) of a .safetensors file, from its JSON header alone."""
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_SAFETENSORS_HEADER:
            raise ModelFileError(f"{path}: a {length:,}-byte header (not a safetensors file)")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFileError(f"{path}: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: its header is not a JSON object")
    parameters = size = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            parameters += math.prod(int(d) for d in entry["shape"])
            start, end = entry["data_offsets"]
            size += int(end) - int(start)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{path}: tensor {name!r} has no shape/data_offsets") from exc
    return parameters, size


# -- GGUF -------------------------------------------------------------------------------------
def read_gguf(path: Path) -> ModelFacts:
    from gguf import GGUFReader  # numpy only; imported here so the window starts without it

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises several kinds for a bad file
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch = _gguf_value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: no general.architecture (not a model GGUF)")
    config: dict[str, Any] = {"model_type": GGUF_MODEL_TYPE.get(arch, arch)}
    for hf_name, key in GGUF_FIELDS.items():
        value = _gguf_value(reader, f"{arch}.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            config[hf_name] = int(value)
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    facts = _facts(path, "GGUF", config, parameters, weight_bytes)
    name = _gguf_value(reader, "general.name")
    if isinstance(name, str) and name:
        facts.name = f"{name} ({path.name})"
    return facts


def _gguf_value(reader: Any, key: str) -> Any:
    fld = reader.fields.get(key)
    if fld is None:
        return None
    try:
        return fld.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


# -- what it is, in words -----------------------------------------------------------------------
def parameter_text(n: int | None) -> str:
    if n is None:
        return "unknown (no weights found)"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit} ({n:,})"
    return f"{n:,}"
