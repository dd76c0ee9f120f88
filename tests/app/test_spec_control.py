"""The Engine tab's speculative-decoding control: shows the engine's setting, applies in
place (no pool rebuild), only what changed."""
from __future__ import annotations

from kvscope.app.controls.panel import ControlsPanel
from kvscope.engine.config import EngineConfig


def test_speculation_toggle_applies_in_place(qtbot):
    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.show_config(EngineConfig(speculative_method="ngram", num_speculative_tokens=6,
                                   num_kv_blocks=64).settings())
    assert panel.spec.enabled_box.isChecked() and panel.spec.k.value() == 6
    assert panel.changes().changed() == {}
    panel.spec.enabled_box.setChecked(False)
    with qtbot.waitSignal(panel.reconfigureRequested) as sig:
        panel.apply_button.click()
    assert [a.changed() for a in sig.args] == [{"speculative_method": "off"}]
    assert "KV pool stays" in panel.result.text()


def test_acceptance_length_in_the_status_bar_and_reply_stats():
    from kvscope.app.chat.turn import Turn
    from kvscope.app.spec_text import engine_spec_text
    from kvscope.ipc.messages import Delta
    from kvscope.testing.frames import engine_stats

    assert engine_spec_text(engine_stats()) == ""  # off, nothing drafted: nothing said
    assert engine_spec_text(engine_stats(spec_method="ngram")) == " · n-gram drafts on"
    on = engine_stats(spec_method="ngram", spec_num_drafts=10, spec_num_accepted_tokens=14)
    assert "2.40 tokens/verify" in engine_spec_text(on)
    turn = Turn("r", 0)
    turn.on_delta(Delta(request_id="r", token_ids=[1, 2, 3], text="abc", finished=True,
                        finish_reason="stop", num_output_tokens=3, num_drafts=2,
                        num_accepted_tokens=1))
    assert "drafts: 1.50 tokens/verify" in turn.stats_text()
