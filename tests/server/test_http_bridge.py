"""The HTTP API's side of the hand-off to the engine thread, against a stand-in engine server
(no model): what a client sees while the engine shuts down, overloads or vanishes."""
from __future__ import annotations

import asyncio
import queue
import threading

import httpx
import pytest

from kvscope.engine.server.http_api import ApiSettings, build_app
from kvscope.engine.server.http_bridge import EngineBridge
from kvscope.ipc import messages as m

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class StandInServer:
    """What EngineBridge uses of engine_server.EngineServer; `answer` replies to commands."""

    def __init__(self, answer=None) -> None:
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.done = threading.Event()
        self.answer = answer

    def enqueue(self, who, cmd) -> None:
        self.commands.put((who, cmd))

    def serve_one(self) -> None:
        who, cmd = self.commands.get(timeout=10)
        who.deliver(self.answer(cmd))


def call(server, method, path, json=None):
    async def go():
        app = build_app(EngineBridge(server), ApiSettings("m", frozenset(), 100))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            return await c.request(method, path, json=json)
    return asyncio.run(go())


def test_shutting_down_answers_503():
    server = StandInServer()
    server.stopping = True
    r = call(server, "POST", "/v1/chat/completions", CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert call(server, "GET", "/health").status_code == 503
    assert server.commands.empty()  # nothing reached the engine


def test_an_engine_that_stops_without_answering_gives_503():
    server = StandInServer()
    threading.Timer(0.2, server.done.set).start()
    r = call(server, "POST", "/v1/chat/completions", CHAT)
    assert r.status_code == 503


@pytest.mark.parametrize("code, status", [(m.OVERLOADED, 429), (m.BAD_REQUEST, 400),
                                          (m.SHUTTING_DOWN, 503), (m.INTERNAL, 500)])
def test_engine_refusals_map_to_statuses(code, status):
    server = StandInServer(lambda cmd: m.Error(cmd.id, code, f"because {code}"))
    threading.Thread(target=server.serve_one, daemon=True).start()
    r = call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == status and f"because {code}" in r.json()["error"]["message"]


def test_submit_carries_the_openai_fields_to_the_engine():
    seen = []

    def answer(cmd):
        seen.append(cmd)
        return m.Error(cmd.id, m.BAD_REQUEST, "stop here")

    server = StandInServer(answer)
    threading.Thread(target=server.serve_one, daemon=True).start()
    call(server, "POST", "/v1/chat/completions",
         {**CHAT, "temperature": 0.5, "top_p": 0.8, "seed": 3, "stop": "END", "top_k": 7,
          "stop_token_ids": [9], "ignore_eos": True, "max_completion_tokens": 5})
    (cmd,) = seen
    assert cmd.messages == [m.ChatMessage("user", "hi")] and cmd.request_id.startswith("chatcmpl-")
    assert cmd.sampling == m.Sampling(max_tokens=5, temperature=0.5, top_p=0.8, top_k=7,
                                      seed=3, stop=["END"], stop_token_ids=[9],
                                      ignore_eos=True)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "x", "messages": CHAT["messages"]}, "messages",
     "exactly one of prompt or messages"),
    ("/v1/chat/completions", {**CHAT, "prompt": "x"}, "prompt",
     "exactly one of prompt or messages"),
    ("/v1/completions", {"prompt": ""}, "prompt", "prompt is empty"),
    ("/v1/completions", {"prompt": [5, -1]}, "prompt", "token_ids[1]=-1 is invalid"),
    ("/v1/chat/completions", {"messages": []}, "messages", "messages is empty"),
])
def test_a_bad_prompt_is_a_400_before_the_engine_sees_it(path, body, param, words):
    """The typed prompt (ipc.prompts) is built in the handler: a bad one is OpenAI's 400
    naming the param, and no Submit reaches the engine server's queue."""
    server = StandInServer()
    threading.Timer(1.0, server.done.set).start()  # a Submit that got through: 503, no hang
    r = call(server, "POST", path, {"model": "m", "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["type"]) == (param,
                                                                     "invalid_request_error")
    assert words in err["message"], err
    assert server.commands.empty()  # nothing reached the engine


def test_the_api_socket_accepts_connections_before_uvicorn_runs():
    import socket

    from kvscope.engine.server.http_server import bind, url_of

    sock = bind("127.0.0.1", 0)
    try:
        assert url_of(sock).startswith("http://127.0.0.1:")
        socket.create_connection(sock.getsockname()[:2], timeout=5).close()  # not refused
    finally:
        sock.close()
