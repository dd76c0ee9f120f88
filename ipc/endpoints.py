"""ZeroMQ endpoint strings: build them, find the state endpoint, tell loopback from remote."""
from __future__ import annotations

import ipaddress
import socket

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5570  # commands; the state stream is on the next port
LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


def tcp(host: str, port: int | str) -> str:
    """tcp://HOST:PORT, bracketing IPv6 literals; port "*" asks zmq for a free port."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def split_tcp(endpoint: str) -> tuple[str, str]:
    """("host", "port") of a tcp:// endpoint, without IPv6 brackets."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} is not a tcp:// endpoint")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host:
        raise ValueError(f"{endpoint!r} has no port: expected tcp://HOST:PORT")
    return host.strip("[]"), port


def state_endpoint_for(command_endpoint: str) -> str:
    """The state stream next to a command endpoint: tcp port + 1, or PATH.state for ipc://."""
    if command_endpoint.startswith("ipc://"):
        return command_endpoint + ".state"
    host, port = split_tcp(command_endpoint)
    if not port.isdigit():
        raise ValueError(f"cannot derive a state endpoint from {command_endpoint!r}")
    return tcp(host, int(port) + 1)


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a name: loopback only if every address it resolves to is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)


def is_local(endpoint: str) -> bool:
    """ipc:// and inproc:// never leave the machine; tcp:// only on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host, _ = split_tcp(endpoint)
    return host != "*" and is_loopback_host(host)


def is_ipv6(endpoint: str) -> bool:
    return endpoint.startswith("tcp://[")
