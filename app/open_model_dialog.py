"""File > Open model…'s dialog: what the chosen model is before anything loads (family, and
supported or the engine's refusal by name; parameters and weight bytes; context length; KV
bytes per token at the chosen KV dtype; what fits at the KV memory budget, from the KV
calculator's own code) and which applied settings carry over to it. For an attached
`kvscope serve` it says that the model is chosen where the server runs."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.calculator.kv_math import KV_DTYPES
from kvscope.app.fmt import human_bytes
from kvscope.app.model_file import ModelFacts, parameter_text
from kvscope.app.model_switch import Carry, what_fits

DIALOG_WIDTH = 560
ATTACHED_NOTE = ("This window is attached to a running kvscope serve: an attached server's "
                 "model is chosen where it runs (kvscope serve --model PATH). The facts above "
                 "are for reading only.")


def _wrapped(text: str = "", name: str = "") -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    policy = label.sizePolicy()
    policy.setHorizontalPolicy(QSizePolicy.Policy.Ignored)  # long paths wrap, never widen
    label.setSizePolicy(policy)
    if name:
        label.setObjectName(name)
    return label


class OpenModelDialog(QDialog):
    """Accept() means: load it. budget: (KV dtype, block size, KV memory budget bytes)."""

    def __init__(self, facts: ModelFacts, budget: tuple[str, int, int], carry: Carry | None,
                 attached: bool = False, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("openModelDialog")
        self.setWindowTitle(f"Open model: {facts.path}")
        self.facts, self.carry, self.attached = facts, carry, attached
        kv_dtype, self.block_size, self.budget_bytes = budget
        self.kv_dtype = QComboBox()
        self.kv_dtype.addItems(KV_DTYPES)
        self.kv_dtype.setCurrentText(kv_dtype)
        self.kv_dtype.currentTextChanged.connect(self.recompute)
        self.kv_dtype.setToolTip("the KV dtype the sizes below are computed at (the Engine "
                                 "tab sets the one the engine uses)")
        self.verdict = _wrapped(name="modelVerdict")
        self.kv_line = _wrapped(name="modelKvPerToken")
        self.fits_line = _wrapped(name="modelWhatFits")
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.addRow("Model", _wrapped(f"{facts.name}\n{facts.path}"))
        form.addRow("Kind", QLabel(facts.kind))
        form.addRow("Family", self.verdict)
        form.addRow("Parameters", QLabel(parameter_text(facts.parameters)))
        form.addRow("Weights", QLabel(human_bytes(facts.weight_bytes)
                                      if facts.weight_bytes is not None else "unknown"))
        form.addRow("Context length", QLabel(f"{facts.context_length:,} tokens"
                                             if facts.context_length else "unknown"))
        form.addRow("KV dtype", self.kv_dtype)
        form.addRow("KV per token", self.kv_line)
        form.addRow("What fits", self.fits_line)
        self.carry_label = _wrapped(self._carry_text(), "modelCarry")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.load_button = buttons.addButton("Load model",
                                             QDialogButtonBox.ButtonRole.AcceptRole)
        self.load_button.setObjectName("loadModelButton")
        self.load_button.setEnabled(facts.supported and not attached)
        if not facts.supported:
            self.load_button.setToolTip("the engine refuses this model (see Family)")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.carry_label)
        layout.addWidget(buttons)
        self.recompute()
        self.setMinimumWidth(DIALOG_WIDTH)
        # Height for the wrapped lines at this width (an unknown width leaves gaps).
        self.resize(DIALOG_WIDTH, layout.heightForWidth(DIALOG_WIDTH) + 24 if
                    layout.hasHeightForWidth() else self.sizeHint().height())

    def _carry_text(self) -> str:
        if self.attached:
            return ATTACHED_NOTE
        c = self.carry
        if c is None:
            return ""
        head = ("Restores the settings applied to this model before: " if c.restored
                else "Keeps the applied settings: ")
        text = head + (", ".join(c.kept) or "none applied yet (the engine's defaults)") + "."
        if c.dropped:
            text += "\nDoes not carry over: " + "; ".join(c.dropped) + "."
        return text + "\nThe engine restarts on this model; running replies are stopped."

    def recompute(self) -> None:
        f = self.facts
        family = f.family or "unknown"
        if f.supported:
            self.verdict.setText(f"{family}: supported")
            self.verdict.setProperty("state", "ok")
        else:
            self.verdict.setText(f"{family}: not supported: {f.refusal}")
            self.verdict.setProperty("state", "error")
        self.verdict.setStyleSheet("" if f.supported else "color: #e06c75;")
        dtype = self.kv_dtype.currentText()
        per = f.kv_bytes_per_token(dtype)
        if per is None:
            self.kv_line.setText("unknown (the config lacks layers / heads)")
            self.fits_line.setText("unknown")
            return
        million = per * 1_000_000
        self.kv_line.setText(f"{human_bytes(per)} per token at {dtype} "
                             f"({per:,} bytes; {human_bytes(million)} per million tokens)")
        fits = what_fits(f, dtype, self.block_size, self.budget_bytes)
        self.fits_line.setText(fits.text() if fits is not None else "unknown")
