"""KV calculator and "what fits" for sliding-window models (issue 24): an all-windowed
config caps each request at its window, a mixed one says what per-layer reclamation would
save; explicit head_dim comes from the config."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import json
import math

from kvscope.app.calculator import kv_math
from kvscope.app.calculator.panel import KVCalculatorPanel
from kvscope.app.calculator.what_fits import MANUAL

GiB = 1 << 30
MISTRAL_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096}
GEMMA2_2B = {"model_type": "gemma2", "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "hidden_size": 2304, "head_dim": 256,
             "sliding_window": 4096}


def panel_with(qtbot, tmp_path, config) -> KVCalculatorPanel:
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert panel.load_config_file(str(path))
    panel.fits.source.setCurrentText(MANUAL)
    panel.fits.manual_gib.setValue(16.0)
    return panel


def ref_window_blocks(window: int, length: int, bs: int) -> int:
    """Independent: the most blocks the keys [p - W + 1, p] touch over every position p of
    a request, counted block by block."""
    most = 0
    for p in range(min(length, window + 2 * bs)):  # the pattern repeats every bs positions
        first = max(0, p - window + 1)
        most = max(most, p // bs - first // bs + 1)
    return most


def test_all_windowed_requests_hold_only_their_window(qtbot, tmp_path):
    panel = panel_with(qtbot, tmp_path, MISTRAL_V01)
    shape = panel.shape()
    assert (shape.head_dim, shape.windowed_layers, shape.window) == (128, 32, 4096)
    assert panel.window.value() == 4096 and panel.windowed_layers.value() == 32
    per = 2 * 32 * 8 * 128 * 2
    panel.context.setValue(32768)
    assert "capped at 4,096 tokens" in panel.window_info.text()
    assert "512.0 MiB</b> for 32,768 tokens" in panel.per_token.text()  # 4096 x 128 KiB
    panel.fits.request_len.setValue(32768)
    for bs in (16, 256):
        blocks = 16 * GiB // (bs * per)
        want = blocks // ref_window_blocks(4096, 32768, bs)
        assert kv_math.concurrent_requests(16 * GiB, shape, "bfloat16", bs, 32768) == want
        # 8x more than without the window (which would need 2048 blocks of 16 each)
        assert want > blocks // math.ceil(32768 / bs) * 7
    panel.block_size.setCurrentText("16")
    want = 16 * GiB // (16 * per) // 257
    assert panel.fits.line.text().startswith(f"<b>{want:,}</b> concurrent requests")
    assert "capped at 4,096 tokens" in panel.fits.line.text()


def test_mixed_model_keeps_full_tables_and_reports_the_saving(qtbot, tmp_path):
    panel = panel_with(qtbot, tmp_path, GEMMA2_2B)
    shape = panel.shape()
    assert (shape.head_dim, shape.windowed_layers, shape.window) == (256, 13, 4096)
    panel.context.setValue(8192)
    per = 2 * 26 * 4 * 256 * 2
    assert f"{8192 * per // 1024 ** 2:.1f} MiB</b> for 8,192 tokens" in panel.per_token.text()
    saving = 13 / 26 * (1 - 4096 / 8192)
    assert f"per-layer reclamation would save {100 * saving:.1f}% at 8,192 tokens" in \
        panel.window_info.text()
    # Full block tables: a request of 8192 tokens holds all of its 512 blocks of 16.
    assert kv_math.concurrent_requests(16 * GiB, shape, "bfloat16", 16, 8192) == \
        16 * GiB // (16 * per) // 512


def test_presets_and_window_spins_without_a_window(qtbot, tmp_path):
    panel = panel_with(qtbot, tmp_path, MISTRAL_V01)
    panel.source.setCurrentText("Llama-3.1-8B")
    panel.source.activated.emit(panel.source.currentIndex())
    assert panel.shape() == kv_math.ModelShape(32, 8, 128)
    assert panel.window_info.text() == "" and panel.window_info.isHidden()
    # The user types a window: all layers windowed caps the request.
    panel.window.setValue(1024)
    panel.windowed_layers.setValue(32)
    assert panel.shape().all_windowed and "capped at 1,024" in panel.window_info.text()
