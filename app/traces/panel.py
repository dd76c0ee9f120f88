"""The "Trace" tab: record the session (top) and replay a trace against the settings in the
Engine tab (below)."""
from __future__ import annotations

from PySide6.QtWidgets import QGroupBox, QVBoxLayout, QWidget

from kvscope.app.traces.record import TraceRecordPanel
from kvscope.app.traces.replay import TraceReplayPanel


def engine_args_from(values: dict, config: dict) -> list[str]:
    """CLI engine options for a replay: the model the engine runs (config) and the knobs as
    set in the controls (values, ControlsPanel.values())."""
    args: list[str] = []
    for key, flag in (("model", "--model"), ("device", "--device"), ("dtype", "--dtype")):
        if config.get(key):
            args += [flag, str(config[key])]
    if not values:
        return args
    args += ["--block-size", str(values["block_size"]), "--kv-dtype", values["kv_dtype"],
             "--kv-cache-bytes", str(values["kv_cache_bytes"]),
             "--max-num-seqs", str(values["max_num_seqs"]),
             "--max-num-batched-tokens", str(values["max_num_batched_tokens"])]
    if values.get("kv_rotation"):
        args += ["--kv-rotation", values["kv_rotation"]]
    if config.get("num_kv_blocks"):
        args += ["--num-kv-blocks", str(config["num_kv_blocks"])]
    if not values["enable_prefix_caching"]:
        args.append("--no-prefix-caching")
    if values.get("scheduling_policy"):
        args += ["--scheduling-policy", values["scheduling_policy"]]
    return args


class TracePanel(QWidget):
    def __init__(self, bridge, engine_args=None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.record = TraceRecordPanel(bridge)
        self.replay = TraceReplayPanel(engine_args, start_folder=self.record.traces_folder)
        record_box = QGroupBox("Record this session")
        QVBoxLayout(record_box).addWidget(self.record)
        replay_box = QGroupBox("Replay a trace")
        QVBoxLayout(replay_box).addWidget(self.replay)
        layout = QVBoxLayout(self)
        layout.addWidget(record_box)
        layout.addWidget(replay_box, 1)

    def stop(self) -> None:
        self.record.stop_timers()
        self.replay.stop()
