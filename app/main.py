"""The `gui` command: the desktop app (`kvscope`, `kvscope gui`, `kvscope --attach URL`).

Starts a local engine child with the given engine options, or attaches to a running
`kvscope serve`. `--demo --screenshot PATH --after SECONDS` runs the load generator and saves
a PNG of the window SECONDS after the engine is ready, then exits (works offscreen)."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvscope.app.sources.source import KINDS
from kvscope.app.vllm.launch import add_vllm_options

ENGINE_OPTIONS = {  # option -> takes a value (passed through to the engine child)
    "--model": True, "--device": True, "--dtype": True, "--block-size": True,
    "--kv-dtype": True, "--kv-cache-bytes": True, "--num-kv-blocks": True,
    "--max-num-seqs": True, "--max-num-batched-tokens": True, "--max-model-len": True,
    "--no-prefix-caching": False, "--seed": True, "--state-hz": True, "--metrics-port": True,
    "--http-port": True, "--scheduling-policy": True, "--priority-aging-s": True,
    "--max-prefill-tokens-while-decoding": True, "--priority-lower-tokens": True,
    "--priority-hold-s": True, "--priority-step-stretch": True,
}
STYLE = Path(__file__).resolve().parent.parent / "resources" / "style.qss"


class AttachAction(argparse.Action):
    """--attach URL: the first in `attach` (a str, as it always was), any more in
    `attach_more` (one tab per engine)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, "attach", None) is None:
            namespace.attach = values
        else:
            namespace.attach_more = [*(getattr(namespace, "attach_more", None) or []), values]


def all_attached(args) -> list[str]:
    return ([args.attach] if args.attach else []) + list(getattr(args, "attach_more", None) or [])


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `gui` and all its options (the vLLM ones too) on the launcher's subparsers."""
    p = sub.add_parser(
        "gui", help="the desktop app (the default with no command; --attach URL)",
        description="kvscope desktop app: chat with a local model and watch its paged KV "
                    "cache, batch and memory live. `kvscope` alone, or with these options "
                    "only (`kvscope --attach URL`), runs it too.")
    p.add_argument("--attach", metavar="URL", action=AttachAction,
                   help="watch a running engine instead of starting one: tcp://HOST:PORT is "
                        "`kvscope serve`; http(s)://HOST:PORT is asked what it is (vLLM or "
                        "llama.cpp's llama-server). Repeat it to watch several (one tab each)")
    p.add_argument("--engine", choices=KINDS,
                   help="with --attach http(s)://...: the engine there (skips the probe)")
    p.add_argument("--attach-state", metavar="ENDPOINT",
                   help="its state endpoint (default: the command port + 1)")
    p.add_argument("--keys", metavar="DIR",
                   help="with --attach: CURVE key folder (default $XDG_CONFIG_HOME/kvscope/keys;"
                        " keys are used off loopback, or with --auth curve or --keys)")
    p.add_argument("--auth", choices=("auto", "curve"), default="auto",
                   help="with --attach: curve uses the keys on loopback too")
    p.add_argument("--insecure", action="store_true",
                   help="with --attach: plain text even off loopback")
    p.add_argument("--demo", action="store_true", help="start the load generator at once")
    p.add_argument("--screenshot", metavar="PATH", help="save a PNG of the window and exit")
    p.add_argument("--after", type=float, default=10.0, metavar="SECONDS",
                   help="with --screenshot: seconds after the engine is ready (default 10)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="with --screenshot: give up (exit 1) if the engine is not ready by then")
    p.add_argument("--size", type=window_size, metavar="WxH",
                   help="the window's size (default: what the screen offers, up to "
                        "1920x1080; with --screenshot: 1600x960); on screen it never "
                        "exceeds the screen's free area")
    add_vllm_options(p)
    g = p.add_argument_group("engine options (passed to the engine child)")
    g.add_argument("--model", help='"default" (embedded SmolLM2-135M-Instruct), a checkpoint '
                                   'folder or a .gguf')
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype")
    g.add_argument("--block-size", type=int)
    g.add_argument("--kv-dtype")
    g.add_argument("--kv-cache-bytes")
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int)
    g.add_argument("--state-hz", type=float)
    g.add_argument("--scheduling-policy", choices=["priority", "fcfs"],
                   help="priority (default): the chat's requests (-1) go before others (0)")
    g.add_argument("--priority-aging-s", type=float, metavar="S")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, metavar="N")
    g.add_argument("--priority-lower-tokens", type=int, metavar="N")
    g.add_argument("--priority-hold-s", type=float, metavar="S")
    g.add_argument("--priority-step-stretch", type=float, metavar="X")
    g.add_argument("--metrics-port", type=int, metavar="P",
                   help="the engine serves Prometheus metrics on 127.0.0.1:P/metrics")
    g.add_argument("--http-port", type=int, metavar="P",
                   help="the engine serves the OpenAI API on 127.0.0.1:P/v1 (0: a free port; "
                        "remembered for later starts; -1 turns it off again)")
    return p


SCREENSHOT_SIZE = (1600, 960)


def window_size(text: str) -> tuple[int, int]:
    """--size's "WxH" as (width, height)."""
    w, sep, h = text.lower().partition("x")
    try:
        size = (int(w), int(h))
    except ValueError:
        size = (0, 0)
    if not sep or min(size) <= 0:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT (1366x768), not {text!r}")
    return size


def on_screen_size(size: tuple[int, int], screen) -> tuple[int, int]:
    """A requested size, cut down to the screen's free area."""
    if screen is None:
        return size
    free = screen.availableGeometry()
    return min(size[0], free.width()), min(size[1], free.height())


def build_parser() -> argparse.ArgumentParser:
    """The `gui` command's parser on its own (`kvscope gui` without the launcher's table)."""
    return add_parser(argparse.ArgumentParser(prog="kvscope").add_subparsers())


def engine_args(args) -> list[str]:
    out: list[str] = []
    for option, takes_value in ENGINE_OPTIONS.items():
        value = getattr(args, option[2:].replace("-", "_"))
        if takes_value and value is not None:
            out += [option, str(value)]
        elif not takes_value and value:
            out.append(option)
    return out


DEMO_PROMPT = "Explain in a few sentences why a paged KV cache wastes less memory."


def start_demo(window) -> None:
    """Synthetic load plus one chat, so every view has something to show."""
    window.load_panel.set_running(True)
    window.chat.input.setPlainText(DEMO_PROMPT)
    rid = window.chat.send()
    if rid:
        window.block_map.select_request(rid)


def attach_keys(args, endpoint: str | None = None):
    """The CURVE keys to attach with (None: plain text); KeyFileError says what is missing."""
    endpoint = endpoint or kvscope_endpoint(args)
    if not endpoint:
        return None
    from kvscope.ipc.keys import client_keys_for

    curve = True if args.auth == "curve" else (False if args.insecure else None)
    return client_keys_for(endpoint, args.keys, curve)


def kvscope_endpoint(args) -> str | None:
    """The one tcp:// --attach when that is all there is to watch (today's kvscope path)."""
    attach = all_attached(args)
    return attach[0] if len(attach) == 1 and not args.attach_vllm \
        and attach[0].startswith("tcp://") else None


def targets(args) -> list[tuple[str, str]]:
    """(kind, url) of every engine to watch: --attach (probed unless --engine says),
    --attach-vllm (an alias of --attach URL --engine vllm). ProbeError says what failed."""
    from kvscope.app.sources.probe import ProbeError, probe

    out = []
    for url in all_attached(args):
        if url.startswith("tcp://"):
            if args.engine not in (None, "kvscope"):
                raise ProbeError(f"--engine {args.engine} needs an http(s):// URL, not {url}")
            out.append(("kvscope", url))
        elif args.engine == "kvscope":
            raise ProbeError(f"--engine kvscope attaches over ZeroMQ: give tcp://HOST:PORT, "
                             f"not {url}")
        else:
            out.append((args.engine or probe(url), url))
    if args.attach_vllm:
        out.append(("vllm", args.attach_vllm))
    return out


def run(args: argparse.Namespace) -> int:
    watched = None  # several engines, or one that is not kvscope's: app.launch_sources
    try:
        keys = attach_keys(args)
        if args.attach_vllm and not args.attach_vllm.startswith(("http://", "https://")):
            raise ValueError(f"--attach-vllm {args.attach_vllm!r} is not an http(s):// URL")
        if (args.attach or args.attach_vllm) and kvscope_endpoint(args) is None:
            watched = targets(args)
    except ValueError as exc:  # KeyFileError names the missing file; ProbeError the URL
        print(f"kvscope: error: {exc}", file=sys.stderr)
        return 2
    from kvscope.app.preflight import preflight_exit_code

    if (code := preflight_exit_code()) is not None:  # Qt's own xcb message misleads
        return code
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from kvscope.app.gui_gc import GuiThreadCollector
    from kvscope.app.main_window import MainWindow

    app = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "kvscope"])
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    if STYLE.is_file():
        app.setStyleSheet(STYLE.read_text())
    GuiThreadCollector(app)  # worker threads must never free a Qt object
    if watched is not None:
        from kvscope.app.launch_sources import run_watched

        return run_watched(args, app, watched, lambda url: attach_keys(args, url))
    settings = None
    if args.screenshot:  # the default layout, and the user's saved one stays untouched
        from PySide6.QtCore import QSettings

        scratch = tempfile.mkdtemp(prefix="kvscope-shot-")
        settings = QSettings(f"{scratch}/settings.ini", QSettings.Format.IniFormat)
    window = MainWindow(engine_args=engine_args(args), attach=kvscope_endpoint(args),
                        attach_state=args.attach_state, settings=settings, attach_keys=keys)
    if args.screenshot:  # exactly this size: a screenshot may be larger than the screen
        window.resize(*(args.size or SCREENSHOT_SIZE))
    elif args.size:
        window.resize(*on_screen_size(args.size, window.screen()))
        window.center_on_screen()
    status = {"code": 0}
    if args.demo or args.screenshot:
        window.engineReady.connect(lambda _hello: start_demo(window))
    if args.screenshot:
        def shoot() -> None:
            window.repaint_views()
            window.refresh_labels()
            ok = window.grab().save(args.screenshot)
            print(f"kvscope: screenshot {'saved to' if ok else 'FAILED:'} {args.screenshot}",
                  file=sys.stderr)
            status["code"] = 0 if ok else 1
            window.close()

        def give_up() -> None:
            if window.hello is None:
                print("kvscope: the engine was not ready in time", file=sys.stderr)
                status["code"] = 1
                window.close()

        window.engineReady.connect(lambda _h: QTimer.singleShot(int(args.after * 1000), shoot))
        QTimer.singleShot(int(args.timeout * 1000), give_up)
    window.show()
    window.start()
    app.exec()
    window.shutdown()
    return status["code"]
