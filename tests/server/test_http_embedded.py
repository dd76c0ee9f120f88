"""The HTTP API on the embedded SmolLM2 (its real chat template and tokenizer): greedy chat
through the `openai` client equals `LLM.chat` and `kvscope generate`."""
from __future__ import annotations

import json
import subprocess

import openai
import pytest

from kvscope.engine import LLM, EngineConfig, SamplingParams
from tests.support.server_harness import REPO, Server, serve_command

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    s = Server("default", tmp_path_factory.mktemp("serve") / "serve.log", "--http-port", "0")
    from kvscope.ipc import EngineClient

    with EngineClient(s.command, s.state, timeout=60, heartbeat_timeout=15) as c:
        yield c.hello().http_url
    s.stop()


def test_greedy_chat_equals_llm_chat_and_generate(url):
    with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT,
                                             max_tokens=24, temperature=0)
    want = LLM(EngineConfig(device="cpu")).chat(CHAT, SamplingParams(max_tokens=24))[0]
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    cli = subprocess.run(serve_command()[:-1] + ["generate", CHAT[0]["content"], "--max-tokens",
                                                 "24", "--device", "cpu", "--json"],
                         check=True, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert json.loads(cli.stdout)["text"] == want.text
