"""What persists between runs (QSettings): window geometry and layout, chat sampling and its
Interactive (priority) toggle, the plots' time window, the load generator and the KV
calculator inputs."""
from __future__ import annotations

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QSpinBox

ORGANIZATION, APPLICATION = "kvscope", "kvscope"


def default_settings() -> QSettings:
    return QSettings(ORGANIZATION, APPLICATION)


HTTP_PORT = "engine/http_port"


def with_http_port(engine_args: list[str], s: QSettings) -> list[str]:
    """The local engine's options with its OpenAI API port: one given on the command line is
    remembered (a negative one forgets it), otherwise the remembered one applies."""
    args = list(engine_args)
    if "--http-port" in args:
        i = args.index("--http-port")
        port = int(args[i + 1])
        if port < 0:
            s.remove(HTTP_PORT)
            del args[i:i + 2]
        else:
            s.setValue(HTTP_PORT, port)
        return args
    saved = s.value(HTTP_PORT)
    try:
        return args + ["--http-port", str(int(saved))] if saved is not None else args
    except (TypeError, ValueError):
        return args  # a corrupt value: no API


def _widgets(window) -> dict[str, object]:
    lg, kv = window.load_panel, window.kv_calculator
    return {
        "chat/max_tokens": window.chat.max_tokens, "chat/temperature": window.chat.temperature,
        "chat/interactive": window.chat.interactive,
        "plots/window": window.plots.window,
        "load/rate": lg.rate, "load/concurrency": lg.concurrency, "load/seed": lg.seed,
        "load/prompt_min": lg.prompt_min, "load/prompt_max": lg.prompt_max,
        "load/tokens_min": lg.tokens_min, "load/tokens_max": lg.tokens_max,
        "kv/dtype": kv.dtype, "kv/context": kv.context, "kv/requests": kv.requests,
        "kv/dist": kv.dist, "kv/mean": kv.mean, "kv/block_size": kv.block_size,
        "kv/seed": kv.seed, "kv/headroom": kv.fits.headroom,
        "kv/request_len": kv.fits.request_len,
        # Restored in this order: setting the amount switches to manual, the source then wins.
        "kv/manual_gib": kv.fits.manual_gib, "kv/fits_source": kv.fits.source,
    }


def save(window, s: QSettings) -> None:
    s.setValue("window/geometry", window.saveGeometry())
    s.setValue("window/state", window.saveState())
    s.setValue("window/screen", screen_key(window.screen()))
    s.setValue("window/views_splitter", window.views_splitter.saveState())
    s.setValue("window/history_splitter", window.history_splitter.saveState())
    s.setValue("window/side_tab", window.side_tabs.currentIndex())
    for key, w in _widgets(window).items():
        s.setValue(key, _value_of(w))
    s.sync()


LAYOUT_KEYS = ("window/geometry", "window/state", "window/views_splitter",
               "window/history_splitter", "window/screen")


def screen_key(screen) -> str:
    """The screen's free area as saved with a layout ("1920x1080"; "" without a screen)."""
    if screen is None:
        return ""
    free = screen.availableGeometry()
    return f"{free.width()}x{free.height()}"


def layout_is_for(s: QSettings, screen) -> bool:
    """Whether the saved layout was saved on a screen of this size (an older one, saved
    without its screen, counts as this screen's; MainWindow still checks that it fits)."""
    saved = s.value("window/screen")
    return saved is None or str(saved) == screen_key(screen)


def forget_layout(s: QSettings) -> None:
    """Drop the saved geometry, docks and splits (Reset layout, or they no longer fit)."""
    for key in LAYOUT_KEYS:
        s.remove(key)
    s.sync()


def restore(window, s: QSettings) -> None:
    for key, setter in (("window/geometry", window.restoreGeometry),
                        ("window/state", window.restoreState),
                        ("window/views_splitter", window.views_splitter.restoreState),
                        ("window/history_splitter", window.history_splitter.restoreState)):
        value = s.value(key)
        if value is not None:
            setter(value)
    tab = s.value("window/side_tab")
    if tab is not None:
        window.side_tabs.setCurrentIndex(int(tab))
    for key, w in _widgets(window).items():
        value = s.value(key)
        if value is None:
            continue
        try:
            if isinstance(w, QComboBox):
                w.setCurrentText(str(value))
            elif isinstance(w, QCheckBox):
                w.setChecked(_as_bool(value))
            elif isinstance(w, QDoubleSpinBox):
                w.setValue(float(value))
            elif isinstance(w, QSpinBox):
                w.setValue(int(value))
        except (TypeError, ValueError):
            pass  # a corrupt value: keep the default


def _value_of(widget) -> object:
    if isinstance(widget, QComboBox):
        return widget.currentText()
    if isinstance(widget, QCheckBox):
        return widget.isChecked()
    return widget.value()


def _as_bool(value) -> bool:
    """QSettings gives a bool back as "true"/"false" from an INI file, a bool otherwise."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(value)
        return value.lower() in ("true", "1")
    return bool(value)
