"""vLLM's `priority` over a real `kvscope serve --http-port` (issue 26): under the priority
policy a high-priority chat overtakes a saturated low-priority batch (under fcfs the same
request waits its turn), /metrics labels its latencies, and a bad priority is a 400 naming it.
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine import EngineConfig
from kvscope.ipc import EngineClient, EngineError
from tests.support.server_harness import Server, save_chat_model

needs_policy = pytest.mark.skipif(
    "scheduling_policy" not in EngineConfig.__dataclass_fields__,
    reason="needs EngineConfig.scheduling_policy (issue 26, the scheduler's part)")

# Two sequences at most: six long low-priority chats saturate it, four of them queue.
ARGS = ["--block-size", "4", "--num-kv-blocks", "256", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "64", "--http-port", "0"]
LOW, HIGH = 5, -1
NUM_LOW, LOW_TOKENS, HIGH_TOKENS = 6, 120, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_chat_model(tmp_path_factory.mktemp("chat"), seed=4)
    s = Server(model, tmp_path_factory.mktemp("serve") / "serve.log", *ARGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def zmq_client(server):
    c = EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15)
    yield c
    c.close()


@pytest.fixture(scope="module")
def url(zmq_client):
    return zmq_client.hello().http_url


def chat_body(name: str, priority: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f"request {name}"}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "priority": priority}


async def stream_chat(client: httpx.AsyncClient, name: str, body: dict, log: list,
                      accepted: asyncio.Event) -> None:
    """Logs (event, name) in the order they arrive: "first" token, "done"."""
    async with client.stream("POST", "/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        first = True
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if "role" in delta:
                accepted.set()  # the role chunk comes once the engine took the request
            elif delta.get("content") and first:
                log.append(("first", name))
                first = False
    log.append(("done", name))


async def overtake(url: str) -> list[tuple[str, str]]:
    """Six low-priority chats, then (once the engine holds them all) one high-priority one."""
    log: list[tuple[str, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = []
        for i in range(NUM_LOW):  # one at a time, so they queue in this order
            accepted = asyncio.Event()
            tasks.append(asyncio.create_task(stream_chat(
                client, f"low{i}", chat_body(f"low{i}", LOW, LOW_TOKENS), log, accepted)))
            await accepted.wait()
        log.append(("sent", "high"))
        accepted = asyncio.Event()
        tasks.append(asyncio.create_task(stream_chat(
            client, "high", chat_body("high", HIGH, HIGH_TOKENS), log, accepted)))
        await asyncio.gather(*tasks)
    return log


def scrape(url: str) -> list:
    base = url.removesuffix("/v1")
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


@needs_policy
def test_fcfs_serves_the_high_priority_chat_in_arrival_order(zmq_client, url):
    zmq_client.reconfigure(scheduling_policy="fcfs")
    log = asyncio.run(overtake(url))
    sent = log.index(("sent", "high"))
    queued = [n for n in (f"low{i}" for i in range(NUM_LOW)) if ("first", n) not in log[:sent]]
    assert len(queued) >= 2  # the batch was saturated when it came
    # Priority is ignored: every low request queued before it starts first.
    high_first = log.index(("first", "high"))
    assert all(log.index(("first", n)) < high_first for n in queued), log


@needs_policy
def test_priority_lets_the_high_chat_overtake_the_saturated_batch(zmq_client, url):
    zmq_client.reconfigure(scheduling_policy="priority")
    before = scrape(url)
    log = asyncio.run(overtake(url))
    sent = log.index(("sent", "high"))
    queued = [n for n in (f"low{i}" for i in range(NUM_LOW)) if ("first", n) not in log[:sent]]
    assert len(queued) >= 2, log
    high_first, high_done = log.index(("first", "high")), log.index(("done", "high"))
    # Its first token comes before any queued low one's, and it finishes before every low
    # one: max_num_seqs blocked it, so it displaced a running low request.
    assert all(log.index(("first", n)) > high_first for n in queued), log
    assert all(log.index(("done", f"low{i}")) > high_done for i in range(NUM_LOW)), log
    after = scrape(url)

    def moved(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("kvscope:num_preemptions_total", reason="priority") >= 1
    assert moved("kvscope:time_to_first_token_seconds_count", priority=str(HIGH)) == 1
    assert moved("kvscope:time_to_first_token_seconds_count", priority=str(LOW)) == NUM_LOW
    assert moved("kvscope:request_queue_time_seconds_count", priority=str(HIGH)) == 1
    assert moved("kvscope:e2e_request_latency_seconds_count", priority=str(LOW)) == NUM_LOW
    assert moved("kvscope:inter_token_latency_seconds_count", priority=str(HIGH)) == \
        HIGH_TOKENS - 1


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
@pytest.mark.parametrize("priority", [True, 1.5, 1.0, "1", [1], 2**31, -(2**31) - 1, 10**30])
def test_a_bad_priority_is_400_naming_it(url, path, priority):
    body = {"max_tokens": 2, "priority": priority}
    body |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else \
        {"prompt": "x"}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and "priority" in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_the_extreme_priorities_and_the_openai_client_s_extra_body(url):
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as c:
        model = c.models.list().data[0].id
        for priority in (-(2**31), 2**31 - 1):
            got = c.completions.create(model=model, prompt="hi", max_tokens=2,
                                       extra_body={"priority": priority})
            assert got.choices[0].finish_reason in ("stop", "length")
        chat = c.chat.completions.create(model=model, max_tokens=2, extra_body={"priority": -7},
                                         messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason in ("stop", "length")


def test_zeromq_submit_and_generate_take_a_priority(zmq_client, url):
    before = scrape(url)
    zmq_client.generate("hi", {"max_tokens": 3, "ignore_eos": True}, priority=-3)
    rid = zmq_client.submit("hi", {"max_tokens": 3, "ignore_eos": True, "priority": 9},
                            priority=-4)  # the argument wins over the sampling's
    assert list(zmq_client.stream(rid, timeout=60))[-1].finished
    after = scrape(url)
    for priority in ("-3", "-4"):
        name = "kvscope:e2e_request_latency_seconds_count"
        assert total(after, name, priority=priority) - total(before, name,
                                                             priority=priority) == 1
    assert total(after, name, priority="9") == 0
    with pytest.raises(EngineError) as info:
        zmq_client.submit("hi", {"max_tokens": 3}, priority=2**31)
    assert info.value.code == "bad_request" and "SamplingParams.priority" in info.value.message
