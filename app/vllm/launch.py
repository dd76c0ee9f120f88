"""The vLLM options of `kvscope` (`--attach-vllm URL`, an alias of `--attach URL --engine vllm`,
and its KV-event endpoints); app.launch_sources runs the window."""
from __future__ import annotations

import argparse


def add_vllm_options(p: argparse.ArgumentParser) -> None:
    """The vLLM options of the `gui` command (app/main.py's add_parser adds them)."""
    g = p.add_argument_group("watching a vLLM server")
    g.add_argument("--attach-vllm", metavar="http://HOST:8000",
                   help="watch a vLLM server (its /metrics, KV events and OpenAI API): the same "
                        "as --attach URL --engine vllm")
    g.add_argument("--kv-events", metavar="tcp://HOST:5557",
                   help="with a vLLM server: its KV-event PUB endpoint (vLLM's "
                        "--kv-events-config endpoint), for the prefix-cache map")
    g.add_argument("--kv-events-replay", metavar="tcp://HOST:5558",
                   help="with a vLLM server: its replay endpoint, to fill gaps")
    g.add_argument("--kv-events-topic", default="", metavar="T",
                   help="with a vLLM server: the topic vLLM publishes on (default empty)")
