"""`kvscope serve`'s authentication options: CURVE keys off loopback (or always), plain text
only when asked, and the one folder trace commands from the wire may write to."""
from __future__ import annotations

import argparse
import sys

from kvscope.engine.server.trace_paths import prepare_trace_dir
from kvscope.ipc.curve import ServerAuth
from kvscope.ipc.endpoints import is_local
from kvscope.ipc.keys import allowed_keys, keys_dir, load_server_keys


def add_auth_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("authentication (keys: `kvscope keys init|show|allow|trust`)")
    g.add_argument("--auth", choices=("auto", "curve"), default="auto",
                   help="auto (default): CURVE keys on every ZeroMQ socket as soon as one is "
                        "off loopback; curve: on loopback too")
    g.add_argument("--insecure", action="store_true",
                   help="plain text even off loopback: anyone who can reach the ports "
                        "controls the engine")
    g.add_argument("--keys", metavar="DIR",
                   help="key folder (default $XDG_CONFIG_HOME/kvscope/keys, or "
                        "~/.config/kvscope/keys)")
    g.add_argument("--trace-dir", metavar="DIR",
                   help="trace_start commands from clients write only under DIR (default "
                        "$XDG_DATA_HOME/kvscope/traces, or ~/.local/share/kvscope/traces)")


def uses_curve(args, zmq_endpoints: list[str]) -> bool:
    if args.auth == "curve" and args.insecure:
        raise ValueError("--auth curve and --insecure contradict each other")
    remote = [e for e in zmq_endpoints if not is_local(e)]
    if args.auth == "curve" or (remote and not args.insecure):
        return True
    if remote:
        warn(f"WARNING: --insecure: listening on {', '.join(remote)} in plain text without "
             f"authentication: anyone who can reach it can run and stop requests")
    return False


def server_auth(args, zmq_endpoints: list[str]) -> ServerAuth | None:
    """The CURVE setup for these endpoints, or None for plain text. ValueError (naming the
    file and the command that fixes it) when the keys are missing or unsafe."""
    if not uses_curve(args, zmq_endpoints):
        return None
    keys = load_server_keys(keys_dir(args.keys))
    allowed = len(allowed_keys(keys.allowed_dir))
    warn(f"CURVE authentication on; engine public key {keys.public.decode()}; "
         f"{allowed} allowed client key(s) in {keys.allowed_dir}")
    if not allowed:
        warn("WARNING: no client is allowed yet: add one with `kvscope keys allow FILE`")
    return ServerAuth(keys, on_refused=warn)


def warn_plain_http(url_endpoints: list[str]) -> None:
    """Prometheus (and the HTTP API) speak plain HTTP: say so when they leave loopback."""
    remote = [e for e in url_endpoints if not is_local(e)]
    if remote:
        warn(f"WARNING: {', '.join(remote)} is plain HTTP: anyone who can reach it can read it")


def trace_dir(args):
    """The folder trace commands may write to, created now so a bad one fails at start."""
    return prepare_trace_dir(args.trace_dir)


def warn(msg: str) -> None:
    print(f"kvscope serve: {msg}", file=sys.stderr, flush=True)
