"""The knobs kvscope can turn on its own engine, shown for a vLLM server as they are, read-only,
each with the reason: vLLM fixes them when it starts."""
from __future__ import annotations

from PySide6.QtWidgets import QFormLayout, QGroupBox, QLabel, QLineEdit, QWidget

RESTART = "vLLM sets this when the server starts ({flag}); restart it to change it"
KNOBS = (  # (label, cache_config_info label, vLLM flag)
    ("KV block size", "block_size", "--block-size"),
    ("KV cache dtype", "cache_dtype", "--kv-cache-dtype"),
    ("KV blocks (GPU)", "num_gpu_blocks", "--gpu-memory-utilization / --num-gpu-blocks-override"),
    ("prefix caching", "enable_prefix_caching", "--enable-prefix-caching"),
    ("GPU memory share", "gpu_memory_utilization", "--gpu-memory-utilization"),
)
NOT_IN_METRICS = (("max running requests", "--max-num-seqs"),
                  ("token budget per step", "--max-num-batched-tokens"))


class ReadOnlyControls(QGroupBox):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Engine settings (read-only: vLLM)", parent)
        form = QFormLayout(self)
        self.fields: dict[str, QLineEdit] = {}
        for title, key, flag in KNOBS:
            self.fields[key] = self._row(form, title, RESTART.format(flag=flag))
        for title, flag in NOT_IN_METRICS:
            field = self._row(form, title, RESTART.format(flag=flag) +
                              "; its /metrics does not report it")
            field.setText("not reported")
        note = QLabel("kvscope changes these live on its own engine; a vLLM server cannot.")
        note.setWordWrap(True)
        note.setObjectName("readOnlyReason")
        form.addRow(note)

    @staticmethod
    def _row(form: QFormLayout, title: str, reason: str) -> QLineEdit:
        field = QLineEdit("—")
        field.setReadOnly(True)
        field.setEnabled(False)
        field.setToolTip(reason)
        label = QLabel(title)
        label.setToolTip(reason)
        form.addRow(label, field)
        return field

    def show_config(self, config: dict[str, str]) -> None:
        for key, field in self.fields.items():
            if key in config:
                field.setText(config[key])
