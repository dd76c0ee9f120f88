"""Controls: Apply emits the chosen values, then shows what was applied or the refusal."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import msgspec

from kvscope.app.controls.panel import MIB, ControlsPanel
from kvscope.engine import config as engine_config
from kvscope.ipc.settings import SettingsChange
from kvscope.testing.frames import engine_settings

CONFIG = engine_settings(block_size=16, kv_dtype="auto", kv_cache_bytes=256 * MIB,
                         kv_rotation="auto", kv_anchor_tokens=4)


def config(**changes):
    return msgspec.structs.replace(CONFIG, **changes)


def test_apply_emits_changes_and_shows_applied(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(CONFIG)
    assert panel.apply_button.isEnabled()
    panel.block_size.setCurrentText("32")
    panel.kv_dtype.setCurrentText("int8")
    panel.kv_budget.setValue(64)
    panel.prefix_caching.setChecked(False)
    with qtbot.waitSignal(panel.reconfigureRequested) as sig:
        panel.apply_button.click()
    assert [a.changed() for a in sig.args] == [{"block_size": 32, "kv_dtype": "int8",
                                                "kv_cache_bytes": 64 * MIB,
                                                "enable_prefix_caching": False}]
    assert panel.busy and not panel.apply_button.isEnabled() and panel.progress.isVisibleTo(panel)
    applied = config(block_size=32, kv_dtype="int8", kv_cache_bytes=64 * MIB,
                     enable_prefix_caching=False)
    panel.show_applied(applied)
    assert not panel.busy and panel.apply_button.isEnabled()
    assert panel.result.property("state") == "ok"
    assert "block_size=32" in panel.result.text() and "kv_dtype=int8" in panel.result.text()
    assert panel.changes().changed() == {}


def test_refusal_is_shown_and_config_kept(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(CONFIG)
    panel.block_size.setCurrentText("256")
    with qtbot.waitSignal(panel.reconfigureRequested):
        panel.apply()
    panel.show_refused("the new KV pool (2 blocks of 256) cannot hold a running request")
    assert panel.result.property("state") == "error"
    assert "cannot hold a running request" in panel.result.text()
    assert panel.config.block_size == 16 and panel.apply_button.isEnabled()


def test_nothing_to_apply(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(CONFIG)
    with qtbot.assertNotEmitted(panel.reconfigureRequested):
        panel.apply()
    assert "Nothing to apply" in panel.result.text()


def test_kv_rotation_is_a_knob_next_to_the_dtype(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(config(kv_dtype="int8", kv_rotation="auto"))
    assert panel.kv_rotation.currentText() == "auto"
    assert "Hadamard-rotated" in panel.rotation_note.text()  # auto: calibrated for int8
    assert "calibrated" in panel.rotation_note.text()
    panel.kv_rotation.setCurrentText("hadamard")
    assert "Hadamard-rotated" in panel.rotation_note.text()
    assert "calibrated" not in panel.rotation_note.text()
    panel.kv_rotation.setCurrentText("none")
    assert "unrotated" in panel.rotation_note.text()
    with qtbot.waitSignal(panel.reconfigureRequested) as sig:
        panel.apply_button.click()
    assert [a.changed() for a in sig.args] == [{"kv_rotation": "none"}]
    panel.show_applied(config(kv_dtype="int8", kv_rotation="none"))
    assert "kv_rotation=none" in panel.result.text() and panel.changes().changed() == {}
    panel.kv_dtype.setCurrentText("bfloat16")
    panel.kv_rotation.setCurrentText("auto")
    assert panel.rotation_note.text() == "unrotated"  # auto leaves 2-byte KV alone
    panel.kv_dtype.setCurrentText("fp8")
    assert "calibrated" in panel.rotation_note.text()  # auto: calibrated for fp8 too
    assert [panel.kv_rotation.itemText(i) for i in range(panel.kv_rotation.count())] == \
        ["auto", "calibrated", "hadamard", "none"]


def test_the_widgets_show_the_settings_in_force_and_revert_to_them(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(config(block_size=8, kv_dtype="fp8", kv_rotation="hadamard",
                             kv_anchor_tokens=2, kv_cache_bytes=96 * MIB, max_num_seqs=7,
                             max_num_batched_tokens=128, enable_prefix_caching=False,
                             num_kv_blocks=300, scheduling_policy="priority"))
    shown = panel.values()
    assert shown.changed() == {"block_size": 8, "kv_dtype": "fp8", "kv_rotation": "hadamard",
                     "kv_anchor_tokens": 2, "kv_cache_bytes": 96 * MIB, "max_num_seqs": 7,
                     "max_num_batched_tokens": 128, "enable_prefix_caching": False,
                     "scheduling_policy": "priority", "speculative_method": "off",
                     "num_speculative_tokens": 4}
    assert "fixed at 300 blocks" in panel.budget_note.text() and panel.changes().changed() == {}
    panel.block_size.setCurrentText("32")
    panel.kv_anchors.setValue(4)
    assert panel.changes().changed() == {"block_size": 32, "kv_anchor_tokens": 4}
    panel.revert_button.click()
    assert panel.values() == shown and panel.changes().changed() == {}


def test_exact_first_tokens_is_a_knob(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(config(kv_dtype="int8", kv_anchor_tokens=4))
    assert panel.kv_anchors.value() == 4 and panel.changes().changed() == {}
    panel.kv_anchors.setValue(0)
    with qtbot.waitSignal(panel.reconfigureRequested) as sig:
        panel.apply_button.click()
    assert [a.changed() for a in sig.args] == [{"kv_anchor_tokens": 0}]
    panel.show_applied(config(kv_dtype="int8", kv_anchor_tokens=0))
    assert "kv_anchor_tokens=0" in panel.result.text() and panel.changes().changed() == {}


def test_the_choices_are_the_engines_own(qtbot):
    """One definition of the names: every choice the panel offers is one the engine's
    configuration accepts, and the engine accepts no KV dtype the panel lacks."""
    panel = ControlsPanel()
    qtbot.addWidget(panel)

    def items(combo):
        return tuple(combo.itemText(i) for i in range(combo.count()))

    assert items(panel.kv_dtype) == engine_config.KV_DTYPES
    assert items(panel.kv_rotation) == engine_config.KV_ROTATIONS
    assert items(panel.scheduling) == engine_config.SCHEDULING_POLICIES
    for dtype in items(panel.kv_dtype):
        assert engine_config.EngineConfig(kv_dtype=dtype).kv_dtype == dtype
    for size in items(panel.block_size):
        assert engine_config.EngineConfig(block_size=int(size)).block_size == int(size)
    assert panel.kv_anchors.maximum() == engine_config.MAX_KV_ANCHOR_TOKENS
    assert panel.spec.k.maximum() == engine_config.MAX_SPECULATIVE_TOKENS


def test_a_knob_with_no_valid_value_is_refused_naming_it(qtbot):
    """No engine settings known ("—" everywhere): Apply sends nothing and says which
    setting has no valid value, rather than the engine refusing a made-up one."""
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    with qtbot.assertNotEmitted(panel.reconfigureRequested):
        panel.apply()
    assert panel.result.property("state") == "error"
    assert "SettingsChange.block_size=0 is invalid" in panel.result.text()
    assert not panel.busy


def test_scheduling_alone_applies_in_place(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(config(scheduling_policy="priority"))
    panel.scheduling.setCurrentText("fcfs")
    with qtbot.waitSignal(panel.reconfigureRequested) as sig:
        panel.apply_button.click()
    assert sig.args == [SettingsChange(scheduling_policy="fcfs")] and sig.args[0].in_place
    assert "KV pool stays" in panel.result.text()
