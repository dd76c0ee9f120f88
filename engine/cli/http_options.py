"""`kvscope serve`'s OpenAI API options (--http-port, --http-host, --api-key, ...), the
loopback rule for them, and starting the API next to the engine server."""
from __future__ import annotations

import argparse
import os
import sys

from kvscope.ipc import endpoints

API_KEY_ENV = "KVSCOPE_API_KEY"


def add_http_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP API")
    g.add_argument("--http-port", type=int, metavar="P",
                   help="serve the OpenAI API at http://HOST:P/v1 (off by default; 0 picks a "
                        "free port; the URL is printed on stderr and in hello)")
    g.add_argument("--http-host", metavar="H",
                   help="address for the API (default: --host). Anything but loopback needs "
                        "--api-key, or --allow-remote to serve it without one")
    g.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in /v1/models and `model` (default: the folder's "
                        "name, SmolLM2-135M-Instruct for the embedded model)")


def http_address(args) -> tuple[str, int] | None:
    """(host, port) to serve the API on, or None; ValueError when the rule forbids it."""
    if args.http_port is None:
        return None
    if not 0 <= args.http_port < 65536:
        raise ValueError(f"--http-port {args.http_port} is not a port number")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    host = args.http_host or (args.host if not args.endpoint else endpoints.DEFAULT_HOST)
    check_http_remote(host, args.api_key, args.allow_remote)
    return host, args.http_port


def check_http_remote(host: str, api_key: str | None, allow_remote: bool) -> None:
    if endpoints.is_loopback_host(host) and host not in ("", "*"):
        return
    if api_key is None and not allow_remote:
        raise ValueError(f"refusing to serve the HTTP API on {host}: not a loopback address "
                         f"and no --api-key; give a key, or --allow-remote if you mean it")
    if api_key is None:
        _warn(f"the HTTP API on {host} has no API key: anyone who can reach it can use it")
    else:
        _warn(f"the HTTP API on {host} is plain HTTP: the key travels unencrypted "
              f"(put a TLS proxy in front of it off a trusted network)")


def _warn(text: str) -> None:
    print(f"kvscope serve: WARNING: {text}", file=sys.stderr, flush=True)


def start_http(args, address: tuple[str, int], server, metrics):
    """The API's HttpServer for an EngineServer (started; its URL is in hello)."""
    from kvscope.engine.server.http_api import ApiSettings
    from kvscope.engine.server.http_server import HttpServer
    from kvscope.engine.server.metrics import PREFIX, model_label
    from kvscope.engine.server.metrics_prefix import prefixed

    model = server.engine.config.model
    name = args.served_model_name or model_label(model)
    settings = ApiSettings(name, frozenset({model, model_label(model)}),
                           server.engine.max_model_len, args.api_key,
                           args.max_message_bytes)
    registry = metrics.registry if metrics is not None else None
    # /metrics on the API's port names things as the --metrics-port one does.
    scraped = prefixed(registry, PREFIX, args.metrics_prefix) if registry is not None else None
    http = HttpServer(server, settings, *address, registry=registry, scraped=scraped)
    server.http_url = http.url + "/v1"
    http.start()
    print(f"kvscope serve: OpenAI API at {server.http_url}", file=sys.stderr, flush=True)
    return http
