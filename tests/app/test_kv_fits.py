"""KV calculator, "what fits on this device": the arithmetic against an independent reference
and the panel fed with device frames (issue 7)."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import math
import random
import re

import pytest
from PySide6.QtCore import Qt

from kvscope.app.calculator import kv_math
from kvscope.app.calculator.panel import KVCalculatorPanel
from kvscope.app.calculator.what_fits import FIT_ROWS, MANUAL, SHOW_REQUESTS, THIS_DEVICE
from kvscope.ipc.messages import DeviceFrame

GiB = 1 << 30
SHAPES = {name: kv_math.ModelShape(*shape) for name, shape in kv_math.PRESETS.items()}
SHAPES["odd config"] = kv_math.ModelShape(7, 5, 96)
ELEMENT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "fp8": 1.0}


# -- an independent reference, straight from the formula, in float64 ---------------------------
def ref_bytes_per_token(shape, dtype) -> float:
    scale = 4.0 if dtype in ("int8", "fp8") else 0.0  # one float32 per token, head, layer, K/V
    return 2.0 * shape.layers * shape.kv_heads * (shape.head_dim * ELEMENT_BYTES[dtype] + scale)


def ref_tokens(available, shape, dtype, bs) -> tuple[int, int]:
    blocks = math.floor(float(available) / (bs * ref_bytes_per_token(shape, dtype)))
    return blocks, blocks * bs


def ref_requests(available, shape, dtype, bs, length) -> int:
    blocks, _ = ref_tokens(available, shape, dtype, bs)
    return blocks // math.ceil(length / bs)


def device_frame(total_gib=80.0, free_gib=61.5, pool_gib=2.0, weights_gib=16.0, **kw):
    """A CUDA-like frame: an 80 GiB card with 16 GiB of weights and a 2 GiB KV pool."""
    fields = {"seq": 1, "time": 1000.0, "pid": 4242, "device": "cuda:0",
              "name": "NVIDIA H100 80GB HBM3", "memory_total": int(total_gib * GiB),
              "memory_free": int(free_gib * GiB),
              "memory_used": int((total_gib - free_gib) * GiB),
              "process_bytes": int((weights_gib + pool_gib + 0.5) * GiB),
              "process_source": "nvml", "weights_bytes": int(weights_gib * GiB),
              "kv_pool_bytes": int(pool_gib * GiB), "kv_used_bytes": GiB // 4,
              "kv_cached_bytes": 0}
    fields.update(kw)
    return DeviceFrame(**fields)


# -- arithmetic ---------------------------------------------------------------------------
def test_bytes_per_token_of_known_models():
    assert kv_math.bytes_per_token(SHAPES["Llama-3.1-8B"], "bfloat16") == 128 * 1024
    assert kv_math.bytes_per_token(SHAPES["Qwen2-7B"], "bfloat16") == 56 * 1024
    for shape in SHAPES.values():
        for dtype in kv_math.DTYPE_BYTES:
            assert kv_math.bytes_per_token(shape, dtype) == ref_bytes_per_token(shape, dtype)


def test_kv_memory_available_against_the_formula():
    cases = [(61.5 * GiB, 2 * GiB, 80 * GiB, 0.05), (10 * GiB, 0, 24 * GiB, 0.10),
             (3 * GiB, 1 * GiB, 16 * GiB, 0.0), (123_456_789, 987_654, 2 * GiB, 0.033)]
    for free, pool, total, frac in cases:
        want = max(0.0, float(free) + float(pool) - frac * float(total))
        got = kv_math.kv_memory_available(int(free), int(pool), int(total), frac)
        assert isinstance(got, int) and abs(got - want) <= 1
    assert kv_math.kv_memory_available(int(61.5 * GiB), 2 * GiB, 80 * GiB) == \
        int(59.5 * GiB)  # default headroom 5 %
    # Headroom bigger than what is free: nothing fits, never a negative budget.
    assert kv_math.kv_memory_available(GiB, 0, 80 * GiB, 0.05) == 0
    assert kv_math.kv_memory_available(0, 0, 80 * GiB, 0.5) == 0


def test_what_fits_against_an_independent_reference():
    rng = random.Random(7)
    budgets = [0, 1, int(59.5 * GiB), 7 * GiB + 12345, 200 * GiB] + \
        [rng.randrange(1, 100 * GiB) for _ in range(5)]
    for shape in SHAPES.values():
        for avail in budgets:
            table = kv_math.what_fits(avail, shape)
            assert set(table) == set(kv_math.DTYPE_BYTES)
            for dtype, row in table.items():
                assert list(row) == list(kv_math.FIT_BLOCK_SIZES)
                for bs, f in row.items():
                    blocks, tokens = ref_tokens(avail, shape, dtype, bs)
                    assert (f.blocks, f.tokens) == (blocks, tokens), (shape, avail, dtype, bs)
                    assert f.bytes_per_token == ref_bytes_per_token(shape, dtype)
                    assert f.blocks * bs * f.bytes_per_token <= avail
                    # one more block would not fit
                    assert (f.blocks + 1) * bs * f.bytes_per_token > avail


def test_what_fits_known_numbers_and_block_rounding():
    avail = int(59.5 * GiB)
    llama = kv_math.what_fits(avail, SHAPES["Llama-3.1-8B"], ["bfloat16"], [8, 16, 256])
    assert [f.tokens for f in llama["bfloat16"].values()] == [487_424] * 3
    big = kv_math.what_fits(avail, SHAPES["Llama-3.1-70B"], ["bfloat16"], [8, 16, 256])
    assert [f.tokens for f in big["bfloat16"].values()] == [194_968, 194_960, 194_816]
    # Whole blocks only: a bigger block never holds more tokens.
    for shape in SHAPES.values():
        for dtype in kv_math.DTYPE_BYTES:
            tokens = [kv_math.fit(avail, shape, dtype, bs).tokens
                      for bs in kv_math.FIT_BLOCK_SIZES]
            assert tokens == sorted(tokens, reverse=True)
    # Less than one block: nothing fits.
    per = kv_math.bytes_per_token(SHAPES["Qwen2-7B"], "int8")
    assert kv_math.fit(16 * per - 1, SHAPES["Qwen2-7B"], "int8", 16).tokens == 0
    assert kv_math.fit(16 * per, SHAPES["Qwen2-7B"], "int8", 16).tokens == 16
    assert kv_math.concurrent_requests(16 * per - 1, SHAPES["Qwen2-7B"], "int8", 16, 1) == 0


def test_concurrent_requests_against_an_independent_reference():
    rng = random.Random(11)
    for shape in SHAPES.values():
        for _ in range(40):
            avail = rng.randrange(0, 120 * GiB)
            dtype = rng.choice(list(kv_math.DTYPE_BYTES))
            bs = rng.choice(kv_math.FIT_BLOCK_SIZES)
            length = rng.choice([1, 15, 16, 17, 700, 4096, 4097, 32768, 131072])
            assert kv_math.concurrent_requests(avail, shape, dtype, bs, length) == \
                ref_requests(avail, shape, dtype, bs, length)
    # 4097 tokens take one block more than 4096: fewer requests fit.
    llama, avail = SHAPES["Llama-3.1-8B"], int(59.5 * GiB)
    assert kv_math.concurrent_requests(avail, llama, "bfloat16", 16, 4096) == 119
    assert kv_math.concurrent_requests(avail, llama, "bfloat16", 256, 4097) == 1904 // 17


# -- the panel ------------------------------------------------------------------------------
def cell_numbers(panel, row, col) -> tuple[int, int, int]:
    """(tokens, blocks, requests) from a cell's tooltip: the exact numbers behind its text."""
    tip = panel.fits.table.item(row, col).toolTip()
    m = re.search(r"([\d,]+) tokens in ([\d,]+) blocks .*?([\d,]+) requests of", tip)
    assert m, tip
    return tuple(int(g.replace(",", "")) for g in m.groups())


def human(n: int) -> str:
    """Three significant digits from 10,000 on: 97,536 -> 97.5k, 2,772,896 -> 2.77M."""
    if n < 10_000:
        return str(n)
    v, unit = (n / 1e3, "k") if n < 999_500 else (n / 1e6, "M")
    return f"{v:.{max(0, 3 - len(str(int(v))))}f}{unit}"


def choose(panel, preset):
    panel.source.setCurrentText(preset)
    panel.source.activated.emit(panel.source.currentIndex())


def row_of(dtype):
    return next(r for r, (_, dtypes) in enumerate(FIT_ROWS) if dtype in dtypes)


def test_table_rows_group_dtypes_of_equal_size():
    assert sorted(d for _, dtypes in FIT_ROWS for d in dtypes) == sorted(kv_math.DTYPE_BYTES)
    for _, dtypes in FIT_ROWS:
        for shape in SHAPES.values():
            assert len({kv_math.bytes_per_token(shape, d) for d in dtypes}) == 1


@pytest.mark.parametrize("preset", ["SmolLM2-135M (embedded)", "Llama-3.1-70B"])
def test_panel_shows_what_fits_from_a_device_frame(qtbot, preset):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.running_shape = SHAPES[preset]  # the preset is the model the engine runs
    choose(panel, preset)
    shape = SHAPES[preset]
    panel.fits.set_device(device_frame())
    avail = int(59.5 * GiB)  # 61.5 free + 2 KV pool - 5 % of 80
    assert panel.fits.available()[0] == avail
    text = panel.fits.memory.text()
    assert "cuda:0" in text and "61.5 GiB free" in text and "2.0 GiB KV pool" in text
    assert "59.5 GiB" in text and "4.0 GiB headroom" in text
    length = panel.fits.request_len.value()
    for r, (_, dtypes) in enumerate(FIT_ROWS):
        for c, bs in enumerate(kv_math.FIT_BLOCK_SIZES):
            blocks, tokens = ref_tokens(avail, shape, dtypes[0], bs)
            requests = ref_requests(avail, shape, dtypes[0], bs, length)
            assert cell_numbers(panel, r, c) == (tokens, blocks, requests)
            assert panel.fits.table.item(r, c).text() == human(tokens)
    if preset.startswith("SmolLM2"):
        assert panel.fits.table.item(row_of("bfloat16"), 1).text() == "2.77M"
    else:
        assert panel.fits.table.item(row_of("bfloat16"), 0).text() == "195k"
    # The requests view: the same table in concurrent requests of the chosen length.
    panel.fits.table_shows.setCurrentText(SHOW_REQUESTS)
    panel.fits.request_len.setValue(4097)
    for c, bs in enumerate(kv_math.FIT_BLOCK_SIZES):
        want = ref_requests(avail, shape, "int8", bs, 4097)
        assert panel.fits.table.item(row_of("int8"), c).text() == human(want)
    # The line: the calculator's dtype and block size while no engine is known.
    panel.dtype.setCurrentText("int8")
    panel.block_size.setCurrentText("32")
    want = ref_requests(avail, shape, "int8", 32, 4097)
    assert panel.fits.line.text().startswith(f"<b>{want:,}</b> concurrent requests of 4,097")
    assert "at int8, block 32" in panel.fits.line.text()


def test_engine_setting_highlighted_and_line_follows_the_picked_cell(qtbot):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.running_shape = SHAPES["Llama-3.1-8B"]  # the preset is the model that runs
    choose(panel, "Llama-3.1-8B")
    panel.fits.set_device(device_frame())
    panel.set_engine_kv(131072, "bfloat16")
    panel.fits.set_engine_block_size(32)
    shaded = [(r, c) for r in range(len(FIT_ROWS))
              for c in range(len(kv_math.FIT_BLOCK_SIZES))
              if panel.fits.table.item(r, c).font().bold()]
    assert shaded == [(row_of("bfloat16"), 2)]
    item = panel.fits.table.item(row_of("bfloat16"), 2)
    assert item.background().style() != Qt.BrushStyle.NoBrush
    assert "running engine" in item.toolTip()
    # The line defaults to the calculator's dtype and the engine's block size.
    assert panel.fits.choice() == ("bfloat16", 32)
    assert (panel.fits.table.currentRow(), panel.fits.table.currentColumn()) == \
        (row_of("bfloat16"), 2)
    assert "<b>119</b> concurrent requests of 4,096 tokens at bfloat16, block 32" in \
        panel.fits.line.text()
    assert "at most" not in panel.fits.line.text()
    panel.fits.set_engine_max_seqs(64)  # memory holds 119, the engine runs 64 at once: say so
    assert "the engine runs at most 64 at once" in panel.fits.line.text()
    panel.fits.set_engine_max_seqs(256)
    assert "at most" not in panel.fits.line.text()
    # The user picks a cell: new frames change numbers, not the pick.
    panel.fits.table.setCurrentCell(row_of("fp8"), 5)
    assert panel.fits.choice() == ("int8", 256)  # int8 and fp8 share a row
    panel.fits.set_device(device_frame(free_gib=30.0))
    avail = int(28.0 * GiB)
    assert (panel.fits.table.currentRow(), panel.fits.table.currentColumn()) == \
        (row_of("fp8"), 5)
    want = ref_requests(avail, SHAPES["Llama-3.1-8B"], "fp8", 256, 4096)
    assert f"<b>{want:,}</b> concurrent requests" in panel.fits.line.text()
    assert "at int8 / fp8, block 256" in panel.fits.line.text()
    # Changing the calculator's dtype makes the line follow the calculator again.
    panel.dtype.setCurrentText("float32")
    assert panel.fits.choice() == ("float32", 32)


def test_manual_amount_wins_over_device_frames(qtbot):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.running_shape = SHAPES["Qwen2-7B"]  # the preset is the model that runs
    choose(panel, "Qwen2-7B")
    qwen = SHAPES["Qwen2-7B"]
    panel.fits.set_device(device_frame())
    assert panel.fits.source.currentText() == THIS_DEVICE
    panel.fits.manual_gib.setValue(10.0)  # typing an amount is an override
    assert panel.fits.source.currentText() == MANUAL
    assert not panel.fits.headroom.isEnabled()  # headroom is for the device's memory only
    for free in (70.0, 5.0, 61.5):
        panel.fits.set_device(device_frame(free_gib=free))
        assert panel.fits.available()[0] == 10 * GiB
        assert "manual" in panel.fits.memory.text() and "10.0 GiB" in panel.fits.memory.text()
        assert cell_numbers(panel, row_of("bfloat16"), 1)[0] == \
            ref_tokens(10 * GiB, qwen, "bfloat16", 16)[1]
    assert panel.fits.manual_gib.value() == 10.0  # frames never touch the user's inputs
    panel.fits.source.setCurrentText(THIS_DEVICE)
    assert panel.fits.available()[0] == int(59.5 * GiB)
    assert panel.fits.headroom.isEnabled()
    panel.fits.headroom.setValue(10.0)
    assert panel.fits.available()[0] == int(55.5 * GiB)
    panel.fits.set_device(device_frame())
    assert panel.fits.headroom.value() == 10.0 and panel.fits.available()[0] == int(55.5 * GiB)


def test_no_frame_and_headroom_bigger_than_free(qtbot):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    choose(panel, "SmolLM2-135M (embedded)")
    # No engine yet: the manual amount (16 GiB by default) answers.
    assert panel.fits.available()[0] == 16 * GiB
    assert "no device report" in panel.fits.memory.text()
    assert cell_numbers(panel, 0, 0)[0] == \
        ref_tokens(16 * GiB, SHAPES["SmolLM2-135M (embedded)"], "float32", 8)[1]
    # Headroom bigger than free memory: nothing fits, every cell says 0.
    panel.fits.set_device(device_frame(free_gib=1.0, pool_gib=0.0))
    assert panel.fits.available()[0] == 0
    texts = {panel.fits.table.item(r, c).text() for r in range(len(FIT_ROWS))
             for c in range(len(kv_math.FIT_BLOCK_SIZES))}
    assert texts == {"0"}
    assert panel.fits.line.text().startswith("<b>0</b> concurrent requests")
    # The engine went away.
    panel.fits.set_device(None)
    assert panel.fits.available()[0] == 16 * GiB


def test_device_frames_do_not_steal_focus_or_rebuild(qtbot):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.show()
    qtbot.waitExposed(panel)
    panel.fits.request_len.setFocus()
    items = [panel.fits.table.item(r, c) for r in range(len(FIT_ROWS))
             for c in range(len(kv_math.FIT_BLOCK_SIZES))]
    for i in range(5):
        panel.fits.set_device(device_frame(seq=i, free_gib=60.0 + i))
    assert panel.fits.request_len.hasFocus() or not panel.isActiveWindow()
    assert panel.focusWidget() is panel.fits.request_len
    assert items == [panel.fits.table.item(r, c) for r in range(len(FIT_ROWS))
                     for c in range(len(kv_math.FIT_BLOCK_SIZES))]
    panel.close()


def test_calculator_fits_the_narrow_side_dock(qtbot):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.running_shape = SHAPES["Llama-3.1-70B"]  # the preset is the model that runs
    choose(panel, "Llama-3.1-70B")
    panel.fits.set_device(device_frame())
    panel.set_engine_kv(327680, "bfloat16")
    panel.fits.set_engine_block_size(16)
    # Everything scrolls vertically; nothing may need more width than the dock gives.
    assert panel.scroll.widget().minimumSizeHint().width() <= 360
    panel.resize(380, 900)
    panel.show()
    qtbot.waitExposed(panel)
    table = panel.fits.table
    metrics = table.fontMetrics()
    for r in range(len(FIT_ROWS)):
        for c in range(len(kv_math.FIT_BLOCK_SIZES)):
            assert metrics.horizontalAdvance(table.item(r, c).text()) < table.columnWidth(c)
    panel.close()


def test_another_model_swaps_in_its_own_weights_and_drops_the_smollm2_note(qtbot):
    panel = KVCalculatorPanel()
    qtbot.addWidget(panel)
    panel.set_running_model("default")  # the embedded SmolLM2 runs, its weights loaded
    panel.fits.set_device(device_frame(weights_gib=0.25))
    choose(panel, "SmolLM2-135M (embedded)")
    panel.dtype.setCurrentText("int8")
    running_avail = int(59.5 * GiB)  # 61.5 free + 2 KV pool - 5 % of 80
    assert panel.fits.available()[0] == running_avail
    assert "SmolLM2" in panel.accuracy.text() and "int8" in panel.accuracy.text()
    choose(panel, "Qwen2-7B")
    qwen_weights = int(7.62e9 * 2)  # 7.62 B parameters in bf16
    want = running_avail + int(0.25 * GiB) - qwen_weights
    assert panel.fits.available()[0] == want
    assert "Qwen2-7B weights" in panel.fits.memory.text()
    blocks, tokens = ref_tokens(want, SHAPES["Qwen2-7B"], "bfloat16", 16)
    col = kv_math.FIT_BLOCK_SIZES.index(16)
    assert cell_numbers(panel, row_of("bfloat16"), col)[:2] == (tokens, blocks)
    note = panel.accuracy.text()
    assert "measured on SmolLM2-135M-Instruct only" in note and "Qwen2-7B" in note
    assert "% of a greedy reply" not in note  # no SmolLM2 number presented as Qwen2's
