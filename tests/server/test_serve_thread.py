"""`kvscope serve` steps the engine on the thread that built it (EngineServer.start): a second
OpenMP master thread makes libgomp stop spinning, and one chat decoded at half the speed."""
from __future__ import annotations

import threading

from kvscope.engine import llm_engine
from kvscope.engine.cli import serve
from kvscope.engine.server import engine_server
from kvscope.testing.tiny_models import save_tiny_model


def test_serve_runs_the_step_loop_on_the_thread_that_built_the_engine(tmp_path, monkeypatch):
    model = save_tiny_model(tmp_path / "m", "llama", seed=0)
    seen: dict[str, int] = {}
    built, loop = llm_engine.LLMEngine.__init__, engine_server.EngineServer._run

    def recording_init(self, *args, **kwargs):
        seen["built"] = threading.get_ident()
        built(self, *args, **kwargs)

    def recording_loop(self):
        seen["loop"] = threading.get_ident()
        self.request_stop()  # nothing to serve: the loop shuts down at once
        loop(self)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(engine_server.EngineServer, "_run", recording_loop)
    assert serve.main(["--model", str(model), "--device", "cpu", "--port", "0"]) == 0
    assert seen["loop"] == seen["built"]


def test_the_step_loop_can_run_in_the_callers_thread(tmp_path):
    """start(engine_thread=False) starts no engine thread; run() serves until request_stop."""
    from kvscope.engine import EngineConfig

    model = save_tiny_model(tmp_path / "m", "llama", seed=0)
    engine = llm_engine.LLMEngine(EngineConfig(model=str(model), device="cpu"))
    server = engine_server.EngineServer(engine, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    server.start(engine_thread=False)
    assert not server.thread.is_alive()
    threading.Timer(0.2, server.request_stop).start()
    server.run()
    assert server.wait(0) and not server.failed
    server.close()
