"""A stand-in engine for the CURVE tests: a CURVE ROUTER and state PUB that only send heartbeats."""
from __future__ import annotations

import threading
import time

import zmq

from kvscope.ipc import codec, keys
from kvscope.ipc import messages as m
from kvscope.ipc.curve import ServerAuth, secure_server_socket


class CurveHeartbeats:
    """A stand-in engine: a CURVE ROUTER and state PUB that only send heartbeats."""

    def __init__(self, folder) -> None:
        self.ctx = zmq.Context()
        self.auth = ServerAuth(keys.load_server_keys(folder))
        self.router, self.pub = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PUB)
        self.endpoints = []
        for sock in (self.router, self.pub):
            secure_server_socket(sock, self.auth)
            sock.bind("tcp://127.0.0.1:*")
            self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        seq = 0
        while not self.stop.wait(0.2):
            seq += 1
            beat = m.Heartbeat(seq=seq, time=time.time(), step=0, uptime_s=0.0, pid=0,
                               busy=False, bad_frames=0)
            self.pub.send_multipart([b"heartbeat", codec.encode(beat)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in (self.router, self.pub):
            sock.close(linger=0)
        self.auth.close()
        self.ctx.term()
