"""CURVE on ZeroMQ sockets: make a server socket admit only allowed client keys, or a client
socket present its keys.

Every server socket of an engine goes through `secure_server_socket(sock, auth)` before it
binds; with auth None (plain text, loopback) it is left as it was. The ZAP authenticator
(zmq.auth.thread.ThreadAuthenticator) is per ZeroMQ context, started on first use; it reads
allowed_clients/ at each handshake, so `kvscope keys allow` takes effect without a restart.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvscope.ipc.keys import ClientKeys, ServerKeys, allowed_keys

ZAP_DOMAIN = "kvscope"


class AllowedClients:
    """The ZAP credentials provider: a key is admitted while its file is in allowed_clients/."""

    def __init__(self, folder: Path, on_refused: Callable[[str], None] | None = None) -> None:
        self.folder = folder
        self.on_refused = on_refused
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in allowed_keys(self.folder):
            return True
        if self.on_refused is not None and key not in self.refused:
            self.refused.add(key)  # once per key: a retrying client must not flood the log
            self.on_refused(f"refused a client with the unknown public key {key.decode()} "
                            f"(admit it with `kvscope keys allow FILE`)")
        return False


class ServerAuth:
    """An engine's CURVE keys and the ZAP authenticator of each context its sockets use."""

    def __init__(self, keys: ServerKeys,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.keys = keys
        self.clients = AllowedClients(keys.allowed_dir, on_refused)
        self._authenticators: dict[int, ThreadAuthenticator] = {}
        self._lock = threading.Lock()

    def authenticate(self, ctx: zmq.Context[Any]) -> None:
        """Start ctx's authenticator unless it runs already."""
        with self._lock:
            if id(ctx) in self._authenticators:
                return
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.clients)
            self._authenticators[id(ctx)] = auth

    def release(self, ctx: zmq.Context[Any]) -> None:
        """Stop ctx's authenticator (before ctx.term(), which would wait for it forever)."""
        with self._lock:
            auth = self._authenticators.pop(id(ctx), None)
        if auth is not None:
            auth.stop()

    def close(self) -> None:
        with self._lock:
            auths, self._authenticators = list(self._authenticators.values()), {}
        for auth in auths:
            auth.stop()


def secure_server_socket(sock: zmq.Socket[Any], auth: ServerAuth | None) -> None:
    """Before bind: sock speaks CURVE and admits only allowed client keys. None: plain."""
    if auth is None:
        return
    auth.authenticate(sock.context)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    if hasattr(zmq, "ZAP_ENFORCE_DOMAIN"):  # no ZAP handler answering -> refuse, not admit
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.keys.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def secure_client_socket(sock: zmq.Socket[Any], keys: ClientKeys | None) -> None:
    """Before connect: sock authenticates with keys and checks the engine's key. None: plain."""
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
