"""The ZMQ <-> Qt bridge alone, against a fake engine (ROUTER + PUB in a thread): a burst of
10k state frames keeps the GUI responsive and the view ends on the newest state."""
import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import itertools
import threading
import time

import msgspec
import zmq
from PySide6.QtCore import QTimer

from kvscope.app.bridge import EngineBridge
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.testing.frames import blocks_frame, engine_settings, heartbeat, step_frame
from tests.app.leaks import leaked_threads

BURST = 10_000


class FakeEngine(threading.Thread):
    def __init__(self):
        super().__init__(name="fake-engine", daemon=True)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.router.bind("tcp://127.0.0.1:0")
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoints = (self.router.getsockopt_string(zmq.LAST_ENDPOINT),
                          self.pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self.burst = threading.Event()
        self.stop = threading.Event()
        self.burst_done = threading.Event()

    def publish(self, topic, frame):
        self.pub.send_multipart([topic.encode(), codec.encode(frame)])

    def run(self):
        hb = 0
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                if self.router.poll(5):
                    who, payload = self.router.recv_multipart()
                    cmd = codec.decode_command(payload)
                    result = m.HelloResult(m.PROTOCOL_VERSION, "fake", "fake-model", 1,
                                           engine_settings(), 512,
                                           m.DEFAULT_MAX_MESSAGE_BYTES)
                    self.router.send_multipart(
                        [who, codec.encode(m.Ok(cmd.id, msgspec.Raw(codec.encode(result))))])
                if time.monotonic() >= next_beat:
                    hb += 1
                    self.publish("heartbeat", heartbeat(hb))
                    next_beat = time.monotonic() + 0.1
                if self.burst.is_set() and not self.burst_done.is_set():
                    blocks = blocks_frame(1024, 16, {"r": [1, 2, 3]})
                    for seq in range(1, BURST + 1):
                        self.publish("step", step_frame(seq))
                        if seq % 10 == 0:
                            blocks.seq = seq
                            self.publish("blocks", blocks)
                    self.burst_done.set()
                if self.burst_done.is_set():  # the engine republishes its newest state
                    self.publish("step", step_frame(BURST))
                    time.sleep(0.05)
        finally:
            self.router.close(0)
            self.pub.close(0)
            self.ctx.term()


def test_burst_keeps_gui_responsive_and_ends_on_newest(qtbot):
    before = set(threading.enumerate())
    fake = FakeEngine()
    fake.start()
    bridge = EngineBridge()
    ticks = []
    timer = QTimer()
    timer.setInterval(16)
    timer.timeout.connect(lambda: ticks.append(time.monotonic()))
    received = {"step": [], "blocks": [], "heartbeat": []}
    bridge.stateReceived.connect(lambda topic, f: received[topic].append(f.seq))
    try:
        with qtbot.waitSignal(bridge.helloReceived, timeout=10_000):
            bridge.attach(*fake.endpoints)
        qtbot.waitUntil(lambda: bool(received["heartbeat"]), timeout=5000)  # subscribed
        timer.start()
        t0 = time.monotonic()
        fake.burst.set()
        qtbot.waitUntil(lambda: bool(received["step"]) and received["step"][-1] == BURST,
                        timeout=30_000)
        elapsed = time.monotonic() - t0
        timer.stop()
        gaps = [b - a for a, b in itertools.pairwise(ticks)]
        assert len(ticks) >= elapsed / 0.016 * 0.3, (len(ticks), elapsed)
        assert max(gaps) < 0.25, max(gaps)
        # Conflated: far fewer GUI frames than published, always in order, newest last.
        assert len(received["step"]) < BURST / 5
        assert received["step"] == sorted(received["step"])
        assert not bridge.dead
    finally:
        timer.stop()
        bridge.close()
        fake.stop.set()
        fake.join(5)
    assert leaked_threads(before) == []
