"""Run the window over the engines `--attach` named when that is not one kvscope engine:
a vLLM or llama-server window, or one tab per engine (app.engines_window)."""
from __future__ import annotations

import sys
import tempfile

SCREENSHOT_SIZE = (1600, 960)


def make_source(kind: str, url: str, args):
    if kind == "vllm":
        from kvscope.app.sources.vllm_source import VllmSource, VllmTarget

        return VllmSource(VllmTarget(url, getattr(args, "kv_events", None),
                                     getattr(args, "kv_events_replay", None),
                                     getattr(args, "kv_events_topic", "") or ""))
    if kind == "llama-server":
        from kvscope.app.sources.llama_server_source import LlamaServerSource

        return LlamaServerSource(url)
    raise ValueError(f"no source for engine {kind!r}")


def make_page(kind: str, url: str, args, settings=None, keys_for=None):
    """keys_for(url): the CURVE keys to attach to a kvscope engine with (app.main)."""
    if kind == "kvscope":
        from kvscope.app.main_window import MainWindow

        return MainWindow(attach=url, attach_state=None, settings=settings,
                          attach_keys=keys_for(url) if keys_for else None)
    from kvscope.app.source_window import SourceWindow

    return SourceWindow(make_source(kind, url, args))


def build_window(args, watched: list[tuple[str, str]], keys_for=None):
    settings = None
    if args.screenshot:  # the user's saved layout stays untouched
        from PySide6.QtCore import QSettings

        scratch = tempfile.mkdtemp(prefix="kvscope-shot-")
        settings = QSettings(f"{scratch}/settings.ini", QSettings.Format.IniFormat)
    pages = [make_page(kind, url, args, settings, keys_for) for kind, url in watched]
    if len(pages) == 1:
        return pages[0]
    from kvscope.app.engines_window import EnginesWindow

    return EnginesWindow(pages)


def run_watched(args, app, watched: list[tuple[str, str]], keys_for=None) -> int:
    from PySide6.QtCore import QTimer

    window = build_window(args, watched, keys_for)
    window.resize(*(args.size or SCREENSHOT_SIZE))
    status = {"code": 0}
    if args.screenshot:
        def shoot() -> None:
            window.repaint_views()
            ok = window.grab().save(args.screenshot)
            print(f"kvscope: screenshot {'saved to' if ok else 'FAILED:'} {args.screenshot}",
                  file=sys.stderr)
            status["code"] = 0 if ok else 1
            window.close()

        QTimer.singleShot(int(args.after * 1000), shoot)
    window.show()
    window.start()
    app.exec()
    window.shutdown()
    return status["code"]
