"""CURVE key files for remote attach: where they live, how they are made, allowed and read.

The folder ($XDG_CONFIG_HOME/kvscope/keys, or ~/.config/kvscope/keys) holds zmq.auth
certificate files:

    server.key  server.key_secret   this machine's engine (`kvscope serve`)
    client.key  client.key_secret   this machine's window and EngineClient
    allowed_clients/NAME.key        client public keys the engine admits
    servers/HOST.key                the public key of the engine on HOST (for attaching)

Secret files are 0600 and the folders 0700. Only public keys ever leave this module as text.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from kvscope.ipc.endpoints import is_local, split_tcp

SERVER, CLIENT = "server", "client"
ALLOWED = "allowed_clients"
SERVERS = "servers"
LOCAL_CLIENT = "local"  # this machine's own client, allowed by `keys init`
PUBLIC_BANNER = "#   ZeroMQ CURVE Public Certificate (kvscope)\n#   Written {}\n\n"


class KeyFileError(ValueError):
    """A key file is missing, unreadable or not what it should be (the message says which)."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes  # Z85
    secret: bytes
    allowed_dir: Path


@dataclass(frozen=True)
class ClientKeys:
    public: bytes  # Z85
    secret: bytes
    server_public: bytes


def default_keys_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvscope" / "keys"


def keys_dir(given: str | os.PathLike[str] | None = None) -> Path:
    return Path(given).expanduser() if given else default_keys_dir()


# -- writing ------------------------------------------------------------------------------
def init_keys(folder: Path, force: bool = False) -> list[Path]:
    """Write a server and a client key pair, and allow the client; returns the files written.
    Existing pairs are kept (KeyFileError) unless force."""
    existing = [folder / f"{n}{ext}" for n in (SERVER, CLIENT) for ext in (".key", ".key_secret")
                if (folder / f"{n}{ext}").exists()]
    if existing and not force:
        raise KeyFileError(f"keys exist already: {', '.join(map(str, existing))} "
                        f"(pass --force to replace them; clients and engines that know the "
                        f"old public keys will then be refused)")
    _require_curve()
    _private_dir(folder)
    _disallow(folder / ALLOWED, _public_or_none(folder / f"{CLIENT}.key"))  # being replaced
    written = []
    for name in (SERVER, CLIENT):
        for path in (folder / f"{name}.key", folder / f"{name}.key_secret"):
            path.unlink(missing_ok=True)  # so the fresh file is created under our umask
        old = os.umask(0o077)
        try:
            public, secret = zmq.auth.create_certificates(folder, name)
        finally:
            os.umask(old)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        written += [Path(public), Path(secret)]
    written.append(allow_client(folder, folder / f"{CLIENT}.key", name=LOCAL_CLIENT))
    return written


def allow_client(folder: Path, public_file: str | os.PathLike[str],
                 name: str | None = None) -> Path:
    """Admit the client whose public key is in public_file; returns the file under
    allowed_clients/. Allowing a key already there changes nothing."""
    public = read_public(public_file)
    allowed = _private_dir(folder / ALLOWED)
    for path in sorted(allowed.glob("*.key")):
        if _public_or_none(path) == public:
            return path
    stem = _safe_name(name or Path(public_file).stem)
    target, n = allowed / f"{stem}.key", 1
    while target.exists():
        n += 1
        target = allowed / f"{stem}-{n}.key"
    _write_public(target, public)
    return target


def trust_server(folder: Path, host: str, public_file: str | os.PathLike[str]) -> Path:
    """Remember the engine on host by its public key (read when attaching to tcp://host:...)."""
    public = read_public(public_file)
    target = _private_dir(folder / SERVERS) / f"{_safe_name(host)}.key"
    _write_public(target, public)
    return target


# -- reading ------------------------------------------------------------------------------
def read_public(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key of a certificate file. A file that also holds a secret key is
    refused: public keys are what travels between machines."""
    path = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: not a readable CURVE certificate ({exc})") from None
    if secret is not None:
        raise KeyFileError(f"{path} holds a secret key: give the public .key file instead")
    return _checked(public, path)


def load_server_keys(folder: Path) -> ServerKeys:
    public, secret = _pair(folder, SERVER)
    return ServerKeys(public, secret, folder / ALLOWED)


def load_client_keys(folder: Path, host: str | None = None) -> ClientKeys:
    """This machine's client pair and the public key of the engine on host
    (servers/HOST.key), or of this machine's own engine (server.key)."""
    public, secret = _pair(folder, CLIENT)
    known = folder / SERVERS / f"{_safe_name(host)}.key" if host else None
    server_file = known if known is not None and known.exists() else folder / f"{SERVER}.key"
    if not server_file.exists():
        raise KeyFileError(f"no engine public key: neither {known or folder / SERVERS} nor "
                        f"{server_file} exists (copy the engine's server.key here and run "
                        f"`kvscope keys trust HOST server.key`)")
    return ClientKeys(public, secret, read_public(server_file))


def client_keys_for(endpoint: str, folder: str | os.PathLike[str] | None = None,
                    curve: bool | None = None) -> ClientKeys | None:
    """The keys to attach to endpoint with, or None for plain text. curve None (auto): CURVE
    when a folder is given or the endpoint is off loopback; True: always; False: never."""
    if curve is False or (curve is None and folder is None and is_local(endpoint)):
        return None
    host = split_tcp(endpoint)[0] if endpoint.startswith("tcp://") else None
    return load_client_keys(keys_dir(folder), host)


def allowed_keys(folder: Path) -> dict[bytes, str]:
    """Public key -> file name of every readable key in allowed_clients/ (others skipped)."""
    out: dict[bytes, str] = {}
    for path in sorted(Path(folder).glob("*.key")):
        public = _public_or_none(path)
        if public is not None:
            out.setdefault(public, path.name)
    return out


def describe(folder: Path) -> list[str]:
    """`kvscope keys show`: the folder and every public key in it, one per line."""
    lines = [f"keys folder: {folder}"]
    for name in (SERVER, CLIENT):
        path = folder / f"{name}.key"
        public = _public_or_none(path)
        lines.append(f"{name} public key: {public.decode() if public else '(none)'}  {path}")
    for title, sub in (("allowed clients", ALLOWED), ("known engines", SERVERS)):
        keys = {v: k for k, v in allowed_keys(folder / sub).items()}
        lines.append(f"{title} ({len(keys)}):")
        lines += [f"  {name[:-4]}: {key.decode()}" for name, key in sorted(keys.items())]
    return lines


# -- helpers ------------------------------------------------------------------------------
def _require_curve() -> None:
    if not zmq.has("curve"):
        raise KeyFileError(f"this pyzmq (libzmq {zmq.zmq_version()}) was built without CURVE "
                           f"support: install the PyPI pyzmq wheel, which bundles libsodium")


def _pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    _require_curve()
    path = folder / f"{name}.key_secret"
    if not path.exists():
        raise KeyFileError(f"no {name} keys: {path} does not exist (run `kvscope keys init`"
                        f"{'' if folder == default_keys_dir() else f' --keys {folder}'})")
    if os.stat(path).st_mode & 0o077:
        raise KeyFileError(f"{path} can be read by other users: chmod 600 it (or run "
                        f"`kvscope keys init --force` for new keys)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: not a readable CURVE certificate ({exc})") from None
    if not secret:
        raise KeyFileError(f"{path} has no secret key")
    return _checked(public, path), _checked(secret, path)


def _checked(key: bytes, path: Path) -> bytes:
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise KeyFileError(f"{path}: the key is not a 40-character Z85 CURVE key")
    return key


def _public_or_none(path: Path) -> bytes | None:
    try:
        public, _ = zmq.auth.load_certificate(path)
        return _checked(public, path)
    except (OSError, ValueError):
        return None


def _disallow(allowed: Path, public: bytes | None) -> None:
    for path in allowed.glob("*.key") if public is not None else ():
        if _public_or_none(path) == public:
            path.unlink()


def _write_public(path: Path, public: bytes) -> None:
    path.write_text(PUBLIC_BANNER.format(datetime.datetime.now().isoformat(timespec="seconds"))
                    + f'metadata\ncurve\n    public-key = "{public.decode()}"\n')
    os.chmod(path, 0o644)


def _private_dir(folder: Path) -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _safe_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".")
    if not safe:
        raise KeyFileError(f"{name!r} cannot name a key file")
    return safe
