"""uvicorn serving the OpenAI API (http_api.py) on a thread of its own, with its own event
loop, beside the engine thread; the socket is bound up front so a taken port fails at start
and port 0 is known before the first request. uvloop and httptools are used when installed
(as vLLM does): per streamed chunk they cost a fraction of asyncio's and h11's pure Python."""
from __future__ import annotations

import socket
import threading

import uvicorn

from kvscope.engine.server.http_api import ApiSettings, build_app
from kvscope.engine.server.http_bridge import EngineBridge

GRACE_S = 3.0  # on shutdown, how long open connections get to finish


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from None
    # Listening now, not when uvicorn's thread gets round to it: a client that read the
    # ready line may connect at once, and is queued instead of refused.
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class HttpServer:
    """The API of one engine server; `url` is the base (http://HOST:PORT), the API under /v1."""

    def __init__(self, server, settings: ApiSettings, host: str, port: int,
                 registry=None, scraped=None) -> None:
        self.bridge = EngineBridge(server)
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        config = uvicorn.Config(build_app(self.bridge, settings, registry, scraped), lifespan="off",
                                log_level="warning", access_log=False, loop="auto",
                                http="auto", ws="none", timeout_graceful_shutdown=GRACE_S)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                       name="kvscope-http", daemon=True)

    def start(self) -> str:
        self.thread.start()
        return self.url

    def refuse_new(self) -> None:
        """From now on every request is answered 503 (the engine is about to stop)."""
        self.bridge.closing = True

    def close(self) -> None:
        self.refuse_new()
        self.uvicorn.should_exit = True
        if self.thread.is_alive():
            self.thread.join(GRACE_S + 5)
        self.sock.close()
