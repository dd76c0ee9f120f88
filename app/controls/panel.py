"""Engine knobs: block size, KV dtype, its rotation and exact first tokens, KV budget, max
sequences, max batched tokens, prefix caching, the scheduling policy. Apply emits the changed
values; the panel then shows what the engine applied (or the refusal and its reason), busy
while the pool is rebuilt."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.controls.spec_control import SpecControl
from kvscope.app.engine_words import in_window_words
from kvscope.app.kv_grid.panel import KVGridBox
from kvscope.ipc.messages import EngineSettings

# The names, limits and which settings rebuild the pool are the engine's own (ipc.settings,
# kvmath.kv_dtypes): one definition, so the panel never offers what the engine refuses.
from kvscope.ipc.settings import (
    KV_ROTATIONS,
    MAX_BLOCK_SIZE,
    MAX_KV_ANCHOR_TOKENS,
    SCHEDULING_POLICIES,
    SettingsChange,
)
from kvscope.kvmath.kv_dtypes import KV_DTYPES, ONE_BYTE_KV_DTYPES

BLOCK_SIZES = [2**i for i in range(MAX_BLOCK_SIZE.bit_length())]
ONE_BYTE = ONE_BYTE_KV_DTYPES
ROTATED_BY_DEFAULT = ONE_BYTE_KV_DTYPES  # "auto" is "calibrated" for these (engine/config.py)
MIB = 1024 * 1024
# The panel's knobs besides the speculative ones (what "Applied" lists, and what a restarted
# engine is started with).
KEYS = ("block_size", "kv_dtype", "kv_rotation", "kv_anchor_tokens", "kv_cache_bytes",
        "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "scheduling_policy")
SCHEDULING_TIP = (
    "fcfs: requests are scheduled in arrival order; when the KV pool runs dry the newest "
    "running request is preempted. priority: by each request's priority (lower = sooner, "
    "then arrival): a more urgent waiting request may preempt a less urgent running one. "
    "The window's chat sends -1 while its Interactive toggle is on, the load generator 0.")
UNKNOWN = "—"  # shown until the engine's real settings arrive


class ControlsPanel(QWidget):
    reconfigureRequested = Signal(object)  # ipc.settings.SettingsChange: what differs

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.config: EngineSettings | None = None  # in force; None before an engine said
        self.busy = False
        self.block_size = QComboBox()
        self.block_size.addItems([str(b) for b in BLOCK_SIZES])
        self.kv_dtype = QComboBox()
        self.kv_dtype.addItems(KV_DTYPES)
        self.kv_rotation = QComboBox()
        self.kv_rotation.addItems(KV_ROTATIONS)
        self.kv_rotation.setToolTip(
            "hadamard: rotate q, k and v by a Hadamard matrix before the KV cache stores them "
            "(and the output back). calibrated: also shift the keys by a constant and balance "
            "q/k channels, calibrated once per model. Both exact in full precision, same bytes "
            "per token; 1-byte KV keeps more of the answers. auto: calibrated for int8/fp8, "
            "off otherwise.")
        self.rotation_note = QLabel("")
        self.rotation_note.setObjectName("note")
        self.rotation_note.setWordWrap(True)
        self.kv_dtype.currentTextChanged.connect(lambda _t: self._show_rotation_note())
        self.kv_grid = KVGridBox()  # the measured long-context grid per KV dtype
        self.kv_dtype.currentTextChanged.connect(self.kv_grid.highlight)
        self.kv_rotation.currentTextChanged.connect(lambda _t: self._show_rotation_note())
        self.kv_anchors = QSpinBox()
        self.kv_anchors.setRange(0, MAX_KV_ANCHOR_TOKENS)
        self.kv_anchors.setToolTip(
            "int8/fp8 KV: keep the first N positions of each conversation's opening (the "
            "attention sink most heads look at) exact, in a small fixed table beside the pool: "
            "no bytes per token. 0 = off. Float KV ignores it.")
        self.kv_budget = QSpinBox()
        self.kv_budget.setRange(1, 1024 * 1024)
        self.kv_budget.setSuffix(" MiB")
        self.max_seqs = QSpinBox()
        self.max_seqs.setRange(1, 4096)
        self.max_batched = QSpinBox()
        self.max_batched.setRange(1, 1 << 20)
        self.max_batched.setSingleStep(64)
        self.prefix_caching = QCheckBox("prefix caching")
        self.scheduling = QComboBox()
        self.scheduling.setObjectName("schedulingPolicy")
        self.scheduling.addItems(SCHEDULING_POLICIES)
        self.scheduling.setToolTip(SCHEDULING_TIP)
        self.budget_note = QLabel("")
        self.budget_note.setWordWrap(True)
        self.budget_note.setObjectName("note")
        form = QFormLayout()
        form.addRow("block size (tokens)", self.block_size)
        form.addRow("KV dtype", self.kv_dtype)
        form.addRow("KV rotation", self.kv_rotation)
        form.addRow("KV exact first tokens", self.kv_anchors)
        form.addRow("KV memory budget", self.kv_budget)
        form.addRow("", self.budget_note)
        form.addRow("max sequences", self.max_seqs)
        form.addRow("max batched tokens", self.max_batched)
        form.addRow("", self.prefix_caching)
        form.addRow("scheduling", self.scheduling)
        self.spec = SpecControl()
        form.addRow("speculative", self.spec)
        self.apply_button = QPushButton("Apply")
        self.apply_button.setObjectName("applyButton")
        self.apply_button.clicked.connect(self.apply)
        self.revert_button = QPushButton("Revert")
        self.revert_button.clicked.connect(self.revert)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # indeterminate: "rebuilding"
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(6)
        self.progress.hide()
        self.result = QLabel("")
        self.result.setObjectName("applyResult")
        self.result.setWordWrap(True)
        buttons = QHBoxLayout()
        buttons.addWidget(self.revert_button)
        buttons.addStretch(1)
        buttons.addWidget(self.apply_button)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(buttons)
        # Under Apply: a note that grows a line must never move the button under the mouse.
        layout.addWidget(self.rotation_note)
        layout.addWidget(self.progress)
        layout.addWidget(self.result)
        layout.addWidget(self.kv_grid)
        layout.addStretch(1)
        self._show_rotation_note()
        self.show_unknown()

    def show_unknown(self) -> None:
        """No engine settings known (connecting, dead): every field says "—", not a value
        that looks real, and nothing can be applied."""
        self.config = None
        for combo in (self.block_size, self.kv_dtype, self.kv_rotation, self.scheduling):
            combo.setPlaceholderText(UNKNOWN)
            combo.setCurrentIndex(-1)
        for spin in (self.kv_anchors, self.kv_budget, self.max_seqs, self.max_batched):
            if not spin.specialValueText():
                spin.setMinimum(spin.minimum() - 1)  # one below the real range means "—"
                spin.setSpecialValueText(UNKNOWN)
            spin.setValue(spin.minimum())
        self.prefix_caching.setTristate(True)
        self.prefix_caching.setCheckState(Qt.CheckState.PartiallyChecked)
        self.budget_note.setText("")
        self.result.setText("")
        self.set_enabled(False)

    def _show_known(self) -> None:
        for spin in (self.kv_anchors, self.kv_budget, self.max_seqs, self.max_batched):
            if spin.specialValueText():
                spin.setSpecialValueText("")
                spin.setMinimum(spin.minimum() + 1)
        self.prefix_caching.setTristate(False)

    def set_enabled(self, enabled: bool) -> None:
        for w in (self.block_size, self.kv_dtype, self.kv_rotation, self.kv_anchors,
                  self.kv_budget, self.max_seqs,
                  self.max_batched, self.prefix_caching, self.scheduling, self.apply_button,
                  self.revert_button):
            w.setEnabled(enabled and not self.busy)
        self.spec.set_enabled(enabled and not self.busy)

    def values(self) -> SettingsChange:
        """Every knob as the widgets show it. Raises ValueError naming the field when one
        shows no valid value (no engine settings known: "—")."""
        block = self.block_size.currentText()
        return SettingsChange(block_size=int(block) if block.isdigit() else 0,
                              kv_dtype=self.kv_dtype.currentText(),
                              kv_rotation=self.kv_rotation.currentText(),
                              kv_anchor_tokens=self.kv_anchors.value(),
                              kv_cache_bytes=self.kv_budget.value() * MIB,
                              max_num_seqs=self.max_seqs.value(),
                              max_num_batched_tokens=self.max_batched.value(),
                              enable_prefix_caching=self.prefix_caching.isChecked(),
                              scheduling_policy=self.scheduling.currentText(),
                              **self.spec.values())

    def changes(self) -> SettingsChange:
        """What differs from the configuration in force (everything, before there is one)."""
        values = self.values()
        if self.config is None:
            return values
        out = {}
        for key, value in values.changed().items():
            current = getattr(self.config, key)
            if key == "kv_cache_bytes" and round(current / MIB) == value // MIB:
                continue  # the spin box shows whole MiB
            if current != value:
                out[key] = value
        return SettingsChange(**out)

    def revert(self) -> None:
        if self.config is not None:
            self.show_config(self.config)

    def apply(self) -> None:
        try:
            changes = self.changes()
        except ValueError as exc:  # a knob shows no valid value: nothing goes to the engine
            self.result.setProperty("state", "error")
            self.result.setText(f"Not applied: {exc}")
            self._restyle()
            return
        fields = changes.changed()
        if not fields:
            self.result.setText("Nothing to apply: that is the configuration in force.")
            return
        self.busy = True
        self.set_enabled(False)
        self.progress.show()
        self.result.setProperty("state", "busy")
        how = (" — the queue is reordered from the next step (the KV pool stays)…"
               if changes.in_place else
               " — rebuilding the KV pool; running requests are preempted and recomputed…")
        self.result.setText("Applying " + _fmt(fields) + how)
        self.reconfigureRequested.emit(changes)

    # -- engine facts -----------------------------------------------------------------------
    def show_config(self, config: EngineSettings) -> None:
        """Load the configuration in force into the widgets (at connect and after apply)."""
        self.config = config
        self._show_known()
        self.block_size.setCurrentText(str(config.block_size))
        self.kv_dtype.setCurrentText(config.kv_dtype)
        self.kv_rotation.setCurrentText(config.kv_rotation)
        self.kv_anchors.setValue(config.kv_anchor_tokens)
        self.kv_budget.setValue(max(1, round(config.kv_cache_bytes / MIB)))
        self.max_seqs.setValue(config.max_num_seqs)
        self.max_batched.setValue(config.max_num_batched_tokens)
        self.prefix_caching.setChecked(config.enable_prefix_caching)
        # An engine older than issue 26 sends none: EngineSettings' default "fcfs" is right.
        self.scheduling.setCurrentText(config.scheduling_policy)
        self.spec.show_config(config)
        fixed = config.num_kv_blocks
        self.budget_note.setText(f"the pool is fixed at {fixed} blocks (--num-kv-blocks): "
                                 "the budget is ignored" if fixed else "")
        self.set_enabled(True)

    def _show_rotation_note(self) -> None:
        """What the chosen rotation means for the chosen dtype (auto resolves as the engine
        does: calibrated exactly when the KV is int8 or fp8)."""
        dtype, rotation = self.kv_dtype.currentText(), self.kv_rotation.currentText()
        if not dtype or not rotation:  # "—": no engine's settings known, nothing to explain
            self.rotation_note.setText("")
            return
        if rotation == "auto":
            rotation = "calibrated" if dtype in ROTATED_BY_DEFAULT else "none"
        if rotation == "none":
            text = f"{dtype} KV unrotated: outlier channels cost accuracy" \
                if dtype in ONE_BYTE else "unrotated"
        elif dtype not in ONE_BYTE:
            text = "rotated (exact at this precision; nothing to gain)"
        elif rotation == "calibrated":
            text = (f"{dtype} KV stored Hadamard-rotated, keys shifted and q/k-balanced "
                    "(calibrated): the default")
        else:
            text = f"{dtype} KV stored Hadamard-rotated: outliers spread before quantizing"
        self.rotation_note.setText(text)

    def show_applied(self, config: EngineSettings) -> None:
        self.busy = False
        self.progress.hide()
        self.show_config(config)
        self.result.setProperty("state", "ok")
        shown = {k: getattr(config, k) for k in KEYS}
        self.result.setText("Applied by the engine: " + _fmt(shown))
        self._restyle()

    def show_restarted(self, config: EngineSettings) -> None:
        """A restarted engine's settings, as its hello reported them (not what was applied to
        the engine before it)."""
        self.show_config(config)
        self.result.setProperty("state", "ok")
        shown = {k: getattr(config, k) for k in KEYS}
        self.result.setText("The restarted engine runs: " + _fmt(shown))
        self._restyle()

    def show_refused(self, reason: str) -> None:
        self.busy = False
        self.progress.hide()
        self.set_enabled(True)
        self.result.setProperty("state", "error")
        self.result.setText("Refused by the engine (the old configuration stays): "
                            + in_window_words(reason))
        self._restyle()

    def _restyle(self) -> None:
        self.result.style().unpolish(self.result)
        self.result.style().polish(self.result)


def _fmt(changes: dict) -> str:
    def one(k, v):
        if k == "kv_cache_bytes" and isinstance(v, int):
            return f"{k}={v / MIB:.0f} MiB"
        return f"{k}={v}"
    return ", ".join(one(k, v) for k, v in changes.items())
