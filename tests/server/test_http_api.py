"""The OpenAI-compatible API of a real `kvscope serve --http-port`, through the official
`openai` client (and httpx for what a client library hides), against the in-process LLM."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time

import httpx
import numpy as np
import openai
import pytest

from kvscope.engine import LLM, EngineConfig, SamplingParams
from tests.support.server_harness import REPO, Server, save_chat_model, serve_command

KEY = "test-key-0123456789"
ENGINE = {"block_size": 8, "num_kv_blocks": 256, "max_num_seqs": 32,
          "max_num_batched_tokens": 256, "max_model_len": 2000}
ARGS = ["--block-size", "8", "--num-kv-blocks", "256", "--max-num-seqs", "32",
        "--max-num-batched-tokens", "256", "--max-model-len", "2000",
        "--http-port", "0", "--api-key", KEY, "--served-model-name", "tiny-chat"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat"), seed=3)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = Server(model, tmp_path_factory.mktemp("serve") / "serve.log", *ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(model):
    return LLM(EngineConfig(model=str(model), device="cpu", **ENGINE))


@pytest.fixture(scope="module")
def url(server):
    from kvscope.ipc import EngineClient

    with EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15) as c:
        return c.hello().http_url


@pytest.fixture
def oai(url):
    c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture
def raw(url):
    c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    yield c
    c.close()


def greedy(**kw) -> dict:
    return {"model": "tiny-chat", "temperature": 0, **kw}


def sse_events(response: httpx.Response) -> list[str]:
    """The data fields of an SSE body, checking the framing on the way."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block[len("data: "):])
    return events


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


# -- the happy path --------------------------------------------------------------------------
def test_models_lists_the_served_model(oai):
    (entry,) = oai.models.list().data
    assert entry.id == "tiny-chat" and entry.owned_by == "kvscope"
    assert entry.model_extra["max_model_len"] == 2000


def test_greedy_chat_equals_llm_chat(oai, reference):
    want = reference.chat(CHAT, SamplingParams(max_tokens=20))[0]
    got = oai.chat.completions.create(messages=CHAT, **greedy(max_tokens=20))
    choice = got.choices[0]
    assert choice.message.content == want.text and choice.message.role == "assistant"
    assert choice.finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == len(want.prompt_token_ids) + len(want.token_ids)
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    assert abs(got.created - time.time()) < 120 and got.model == "tiny-chat"


def test_max_completion_tokens_wins_over_max_tokens(oai, reference):
    want = reference.chat(CHAT, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    got = oai.chat.completions.create(messages=CHAT, max_completion_tokens=5,
                                      **greedy(max_tokens=30, extra_body={"ignore_eos": True}))
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"


def test_stream_equals_non_stream_with_usage(oai):
    args = greedy(messages=CHAT, max_tokens=24)
    whole = oai.chat.completions.create(**args)
    chunks = list(oai.chat.completions.create(stream=True,
                                              stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_text_and_token_prompts_equal_llm_generate(oai, reference):
    ids = np.random.default_rng(5).integers(1, 250, 11).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = reference.generate(["raw text, no template", ids], params)
    for prompt, w in zip(["raw text, no template", ids], want, strict=True):
        got = oai.completions.create(prompt=prompt,
                                     **greedy(max_tokens=12, extra_body={"ignore_eos": True}))
        assert got.choices[0].text == w.text and got.object == "text_completion"
        assert got.usage.prompt_tokens == len(w.prompt_token_ids)
        streamed = oai.completions.create(prompt=prompt, stream=True, **greedy(
            max_tokens=12, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in streamed) == w.text


def test_stop_strings_and_stop_token_ids(oai, reference):
    base = reference.chat(CHAT, SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_char = next(ch for ch in base.text[4:] if ch.isalnum())
    cut = base.text.index(stop_char)
    got = oai.chat.completions.create(messages=CHAT, stop=[stop_char], **greedy(
        max_tokens=30, extra_body={"ignore_eos": True}))
    assert got.choices[0].message.content == base.text[:cut]
    assert got.choices[0].finish_reason == "stop"
    token = base.token_ids[6]
    got = oai.chat.completions.create(messages=CHAT, **greedy(
        max_tokens=30, extra_body={"ignore_eos": True, "stop_token_ids": [token]}))
    assert got.usage.completion_tokens == base.token_ids.index(token) + 1
    assert got.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(oai):
    args = {"messages": CHAT, "max_tokens": 16, "temperature": 1.0, "top_p": 0.9,
            "model": "tiny-chat", "extra_body": {"top_k": 50, "ignore_eos": True}}
    a, b = (oai.chat.completions.create(seed=7, **args) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


def test_32_concurrent_streams_equal_llm_generate(url, reference):
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(32)]
    want = reference.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))

    async def one(client, prompt):
        stream = await client.completions.create(
            prompt=prompt, stream=True, **greedy(max_tokens=16, extra_body={"ignore_eos": True}))
        return "".join([c.choices[0].text async for c in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run()) == [w.text for w in want]


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 2100}]}, "messages"),  # > max_model_len
])
def test_invalid_values_are_400_naming_the_param(oai, kw, param):
    args = greedy(messages=CHAT, max_tokens=4)
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**args)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    if "x" * 2100 in str(kw):
        assert "max_model_len" in err["message"]


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(messages=CHAT, model="gpt-9", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "gpt-9" in info.value.body["message"]


def test_wrong_or_missing_key_is_401(url):
    for key in ("wrong-key", KEY[:-1], KEY + "x"):
        with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as c, \
                pytest.raises(openai.AuthenticationError) as info:
            c.chat.completions.create(messages=CHAT, **greedy(max_tokens=2))
        assert info.value.body["code"] == "invalid_api_key"
    r = httpx.get(url + "/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200  # no key needed


def test_raw_bodies_that_are_not_requests(raw):
    cases = [(b"{not json", 400), (b"[]", 400), (b'{"messages": "hi"}', 400),
             (json.dumps({"messages": CHAT, "max_tokens": "many"}).encode(), 400),
             (b"x" * (9 << 20), 413)]
    for body, status in cases:
        r = raw.post("/chat/completions", content=body)
        assert r.status_code == status, (body[:40], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = raw.post("/chat/completions", content=json.dumps(
        {"messages": CHAT, "max_tokens": "many"}))
    assert r.json()["error"]["param"] == "max_tokens"
    assert raw.get("/chat/completions").status_code == 405
    assert raw.get("/no/such/thing").json()["error"]["code"] == "not_found"


def test_errors_leave_the_engine_serving(oai, reference):
    for bad in ({"max_tokens": 0}, {"model": "nope"}):
        with pytest.raises(openai.APIStatusError):
            oai.chat.completions.create(**{**greedy(messages=CHAT, max_tokens=3), **bad})
    want = reference.chat(CHAT, SamplingParams(max_tokens=3))[0]
    got = oai.chat.completions.create(messages=CHAT, **greedy(max_tokens=3))
    assert got.choices[0].message.content == want.text


# -- raw SSE ---------------------------------------------------------------------------------
def test_sse_framing_and_done(raw):
    r = raw.post("/chat/completions", json=greedy(messages=CHAT, max_tokens=5, stream=True,
                                                  ignore_eos=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert not any(c["usage"] for c in chunks)  # no include_usage: no usage chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_content_parts_are_flattened_to_text(raw, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there!"}]}]
    r = raw.post("/chat/completions", json=greedy(messages=parts, max_tokens=6))
    want = reference.chat([{"role": "user", "content": "Hello there!"}],
                          SamplingParams(max_tokens=6))[0]
    assert r.json()["choices"][0]["message"]["content"] == want.text


def test_a_refused_stream_is_plain_json_not_sse(raw):
    r = raw.post("/chat/completions", json=greedy(messages=CHAT, max_tokens=-3, stream=True))
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"


# -- hang-ups, the window's view, metrics -----------------------------------------------------
def _live(client):
    return client.snapshot().blocks


def _without(frame, rid):
    return frame if rid not in frame.request_ids else None


def _aborted(client) -> int:
    return client.snapshot().stats.server.aborted


def test_stream_hang_up_aborts_and_frees_blocks(client, url):
    free_before = _live(client).free + _live(client).cached
    aborted = _aborted(client)
    with httpx.Client(timeout=60) as h, h.stream(
            "POST", url + "/completions", headers={"Authorization": f"Bearer {KEY}"},
            json=greedy(prompt="a long one " * 8, max_tokens=1500, stream=True,
                        ignore_eos=True)) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first[6:])["id"]
        frame = _live(client)
        assert rid in frame.request_ids and frame.request_sources[rid] == "http"
        assert frame.used > 0 and client.snapshot().stats.server.http_in_flight == 1
    # The connection is closed here, long before 1500 tokens.
    frame = wait_for(lambda: _without(_live(client), rid))
    assert frame.used == 0 and frame.free + frame.cached == free_before
    assert rid not in frame.request_sources
    assert _aborted(client) == aborted + 1  # ended by the hang-up, not by running out


def test_non_stream_hang_up_aborts_too(client, url):
    aborted = _aborted(client)
    body = json.dumps(greedy(prompt="wait for me " * 4, max_tokens=1900, ignore_eos=True))
    host, port = url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        rid = wait_for(lambda: next(iter(_live(client).request_sources), None))
    frame = wait_for(lambda: _without(_live(client), rid))
    assert frame.used == 0 and _aborted(client) == aborted + 1


def test_http_requests_total_counts_by_endpoint_and_status(url, raw):
    base = url.removesuffix("/v1")

    def count(endpoint, status):
        text = httpx.get(base + "/metrics").text
        line = (f'http_requests_total{{endpoint="{endpoint}",method="POST",'
                f'status="{status}"}} ')
        return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0)

    ok, bad = count("/v1/completions", 200), count("/v1/completions", 400)
    raw.post("/completions", json=greedy(prompt="hi", max_tokens=2))
    raw.post("/completions", json=greedy(prompt="hi", max_tokens=0))
    raw.post("/completions", json=greedy(prompt="hi", max_tokens=0))
    assert count("/v1/completions", 200) == ok + 1
    assert count("/v1/completions", 400) == bad + 2
    assert "kvscope:num_requests_running" in httpx.get(base + "/metrics").text


def test_shutdown_ends_streams_with_an_error_and_refuses_new_ones(server, url):
    """Last: it stops the module's server."""
    with httpx.Client(timeout=60) as h, h.stream(
            "POST", url + "/completions", headers={"Authorization": f"Bearer {KEY}"},
            json=greedy(prompt="long", max_tokens=1900, stream=True, ignore_eos=True)) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.signal(15)
        rest = [line for line in lines if line.startswith("data: ")]
    error = json.loads(rest[-2][6:])["error"]
    assert rest[-1] == "data: [DONE]" and error["code"] == "shutting_down"
    assert server.proc.wait(30) == 0


# -- the loopback rule -----------------------------------------------------------------------
def test_remote_http_needs_a_key_or_allow_remote(tmp_path):
    cmd = serve_command() + ["--model", str(tmp_path / "none"), "--port", "0",
                             "--http-port", "0", "--http-host", "0.0.0.0"]
    r = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True,
                       timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--api-key" in r.stderr and "0.0.0.0" in r.stderr


def test_http_remote_rule(capsys):
    from kvscope.engine.cli.http_options import check_http_remote

    check_http_remote("127.0.0.1", None, False)
    check_http_remote("::1", None, False)
    check_http_remote("localhost", None, False)
    assert capsys.readouterr().err == ""
    for host in ("0.0.0.0", "192.0.2.1", "::"):
        with pytest.raises(ValueError, match="--api-key"):
            check_http_remote(host, None, False)
        check_http_remote(host, "k", False)  # a key makes it allowed
        assert "plain HTTP" in capsys.readouterr().err
        check_http_remote(host, None, True)  # so does --allow-remote, with a warning
        assert "WARNING" in capsys.readouterr().err


def test_api_key_comes_from_the_environment(monkeypatch):
    from kvscope.engine.cli.http_options import http_address
    from kvscope.engine.cli.serve import build_parser

    monkeypatch.setenv("KVSCOPE_API_KEY", "from-env")
    args = build_parser().parse_args(["--http-port", "0", "--http-host", "0.0.0.0"])
    assert args.api_key == "from-env" and http_address(args) == ("0.0.0.0", 0)
    args = build_parser().parse_args(["--http-port", "0", "--api-key", "flag"])
    assert args.api_key == "flag" and http_address(args) == ("127.0.0.1", 0)
    monkeypatch.delenv("KVSCOPE_API_KEY")
    args = build_parser().parse_args(["--http-port", "0", "--http-host", "0.0.0.0"])
    with pytest.raises(ValueError, match="--api-key"):
        http_address(args)
