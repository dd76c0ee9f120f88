"""File > Open model…: what a model is, read without the engine (checked against torch and
the engine's own refusal), what fits, which settings carry over, settings kept per model
across restarts, and the switch restarting the local engine on the new model."""
import json
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QSettings

from kvscope.app import model_settings
from kvscope.app.calculator.kv_math import concurrent_requests, fit
from kvscope.app.main_window import MainWindow
from kvscope.app.model_file import ModelFileError, read_model
from kvscope.app.model_switch import carry_over, what_fits
from kvscope.app.open_model_dialog import ATTACHED_NOTE, OpenModelDialog
from kvscope.ipc.messages import EngineSettings
from kvscope.testing.tiny_models import save_tiny_model

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


def settings(tmp_path) -> QSettings:
    return QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)


def applied(**changes) -> EngineSettings:
    base = dict(model="default", device="cpu", dtype="float32", weights="dense", block_size=32,
                kv_dtype="int8", kv_rotation="auto", kv_anchor_tokens=0,
                kv_cache_bytes=64 * MIB, num_kv_blocks=None, max_num_seqs=8,
                max_num_batched_tokens=1024, max_model_len=None, enable_prefix_caching=False,
                seed=0)
    return EngineSettings(**{**base, **changes})


def test_a_hugging_face_folder_reads_as_torch_counts_it(tiny):
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(tiny / "model.safetensors"))
    facts = read_model(tiny)
    assert facts.kind == "Hugging Face folder" and facts.family == "llama" and facts.supported
    assert facts.parameters == sum(t.numel() for t in tensors.values())
    assert facts.weight_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert facts.context_length == 512
    config = json.loads((tiny / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    for dtype, size in (("bfloat16", 2), ("float32", 4)):
        assert facts.kv_bytes_per_token(dtype) == (2 * config["num_hidden_layers"]
                                                   * config["num_key_value_heads"]
                                                   * head_dim * size)
    assert torch.is_tensor(next(iter(tensors.values())))


def test_a_gguf_reads_its_metadata_and_tensor_table(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from kvscope.testing.tiny_gguf import write_tiny_gguf

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    path = write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    facts = read_model(path)
    assert facts.kind == "GGUF" and facts.family == "llama" and facts.supported
    assert facts.context_length == 512
    # F32 GGUF: every weight once, 4 bytes each (tied or not, as the file holds them)
    assert facts.weight_bytes == 4 * facts.parameters
    assert facts.kv_bytes_per_token("bfloat16") == read_model(tiny).kv_bytes_per_token(
        "bfloat16")


def test_a_refused_model_says_why_and_cannot_be_loaded(tiny, tmp_path, qtbot):
    folder = tmp_path / "moe"
    folder.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    facts = read_model(folder)
    assert not facts.supported and "mixture of experts" in facts.refusal
    dialog = OpenModelDialog(facts, ("bfloat16", 16, 64 * MIB), None)
    qtbot.addWidget(dialog)
    assert not dialog.load_button.isEnabled()
    assert "not supported" in dialog.verdict.text() and "mixture of experts" in \
        dialog.verdict.text()


def test_not_a_model_is_a_clear_error(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFileError, match="x.gguf"):
        read_model(tmp_path / "x.gguf")
    with pytest.raises(ModelFileError, match="no config.json"):
        read_model(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match="not an object"):
        read_model(tmp_path)


def test_what_fits_is_the_calculators_answer(tiny, qtbot):
    facts = read_model(tiny)
    fits = what_fits(facts, "int8", 16, 8 * MIB)
    assert fits.tokens == fit(8 * MIB, facts.shape, "int8", 16).tokens
    assert fits.requests == concurrent_requests(8 * MIB, facts.shape, "int8", 16, 512)
    dialog = OpenModelDialog(facts, ("int8", 16, 8 * MIB), None)
    qtbot.addWidget(dialog)
    assert f"{fits.tokens:,} tokens" in dialog.fits_line.text()
    dialog.kv_dtype.setCurrentText("float32")  # the sizes follow the chosen KV dtype
    assert f"{facts.kv_bytes_per_token('float32'):,} bytes" in dialog.kv_line.text()


def test_the_dialog_says_an_attached_servers_model_is_chosen_where_it_runs(tiny, qtbot):
    dialog = OpenModelDialog(read_model(tiny), ("bfloat16", 16, 8 * MIB), None, attached=True)
    qtbot.addWidget(dialog)
    assert not dialog.load_button.isEnabled()
    assert dialog.carry_label.text() == ATTACHED_NOTE


def test_carry_over_keeps_what_applies_and_names_what_does_not(tiny):
    facts = read_model(tiny)
    carry = carry_over(applied(), None, facts, ["--num-kv-blocks", "40", "--max-model-len",
                                                 "100000"])
    assert carry.args[carry.args.index("--block-size") + 1] == "32"
    assert carry.args[carry.args.index("--kv-dtype") + 1] == "int8"
    assert "--num-kv-blocks" not in carry.args and "--max-model-len" not in carry.args
    assert any("--num-kv-blocks 40" in d for d in carry.dropped)
    assert any("--max-model-len 100000" in d for d in carry.dropped)
    # a budget that holds not one block of this model is dropped, and said to be
    tiny_budget = carry_over(applied(kv_cache_bytes=1000), None, facts, [])
    assert "--kv-cache-bytes" not in tiny_budget.args
    assert any("KV memory budget" in d for d in tiny_budget.dropped)
    # the model's own saved settings win over the running model's
    restored = carry_over(applied(), applied(block_size=64), facts, [])
    assert restored.restored and restored.args[restored.args.index("--block-size") + 1] == "64"


def test_settings_and_recent_models_persist(tmp_path, tiny):
    s = settings(tmp_path)
    model_settings.save_applied(s, str(tiny), applied(block_size=64))
    again = settings(tmp_path)
    assert model_settings.applied_for(again, str(tiny)).block_size == 64
    assert model_settings.applied_for(again, "default") is None
    again.setValue(model_settings._applied_key("default"), '{"block_size": "big"}')
    assert model_settings.applied_for(again, "default") is None  # corrupt: dropped
    for p in ("/a", "/b", "/a"):
        model_settings.remember_model(again, p)
    assert model_settings.recent_models(settings(tmp_path)) == ["/a", "/b"]


@pytest.fixture
def local_window(qtbot, tmp_path, monkeypatch):
    """A window that would start a local engine; starting is recorded, not done."""
    made = []

    def make(engine_args=()):
        w = MainWindow(engine_args=list(engine_args), settings=settings(tmp_path))
        starts = []
        monkeypatch.setattr(w.engine, "start", lambda: starts.append(list(w.engine.engine_args)))
        qtbot.addWidget(w)
        made.append(w)
        return w, starts

    yield make
    for w in made:
        w.shutdown()


def test_switching_restarts_the_local_engine_on_the_new_model(local_window, tiny):
    w, starts = local_window(["--block-size", "16", "--num-kv-blocks", "50"])
    w.applied = applied()
    carry = w.models.switch_to(read_model(tiny))
    args = starts[-1]
    assert args[args.index("--model") + 1] == str(tiny)
    assert args[args.index("--kv-dtype") + 1] == "int8"  # an applied setting kept
    assert "--num-kv-blocks" not in args and carry.dropped
    assert model_settings.recent_models(w.settings)[0] == str(tiny.resolve())
    assert w.file_menu.menu.title() == "&File"
    assert w.menuBar().actions()[0].menu() is w.file_menu.menu  # File comes first


def test_applied_settings_come_back_at_the_next_start(local_window, tiny):
    w, _starts = local_window(["--model", str(tiny)])
    w.on_reconfigured(applied(block_size=64, model=str(tiny)))
    w.shutdown()
    w2, starts = local_window(["--model", str(tiny)])
    assert w2.restored_settings is not None and w2.restored_settings.block_size == 64
    w2.start()
    args = starts[-1]
    assert args[args.index("--block-size") + 1] == "64"
