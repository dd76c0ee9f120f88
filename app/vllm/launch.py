"""Run the vLLM window for `kvscope --attach-vllm URL [--kv-events tcp://HOST:PORT]`."""
from __future__ import annotations

import argparse
import sys


def add_vllm_options(p: argparse.ArgumentParser) -> None:
    """The vLLM options of the `gui` command (app/main.py's add_parser adds them)."""
    g = p.add_argument_group("watching a vLLM server")
    g.add_argument("--attach-vllm", metavar="http://HOST:8000",
                   help="watch a vLLM server (its /metrics, KV events and OpenAI API) instead "
                        "of kvscope's own engine")
    g.add_argument("--kv-events", metavar="tcp://HOST:5557",
                   help="with --attach-vllm: its KV-event PUB endpoint (vLLM's "
                        "--kv-events-config endpoint), for the prefix-cache map")
    g.add_argument("--kv-events-replay", metavar="tcp://HOST:5558",
                   help="with --attach-vllm: its replay endpoint, to fill gaps")
    g.add_argument("--kv-events-topic", default="", metavar="T",
                   help="with --attach-vllm: the topic vLLM publishes on (default empty)")


def run(args: argparse.Namespace, app) -> int:
    from PySide6.QtCore import QTimer

    from kvscope.app.vllm.source import VllmTarget
    from kvscope.app.vllm.window import VllmWindow

    url = args.attach_vllm
    if not url.startswith(("http://", "https://")):
        print(f"kvscope: --attach-vllm {url!r} is not an http(s):// URL", file=sys.stderr)
        return 2
    window = VllmWindow(VllmTarget(url, args.kv_events, args.kv_events_replay,
                                   args.kv_events_topic))
    window.resize(*(args.size or (1600, 960)))  # --size is (width, height): app.main
    status = {"code": 0}
    if args.screenshot:
        def shoot() -> None:
            window.refresh()
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
