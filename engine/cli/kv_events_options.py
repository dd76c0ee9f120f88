"""`kvscope serve`'s vLLM-compatibility options: the KV-event stream and the metrics prefix."""
from __future__ import annotations

import argparse

from kvscope.ipc import endpoints


def add_kv_events_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM compatibility")
    g.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                   help="publish prefix-cache changes in vLLM's KV-event format (PUB, bound; "
                        "port 0 picks a free one, printed on stderr)")
    g.add_argument("--kv-events-replay", metavar="tcp://HOST:PORT",
                   help="with --kv-events: a ROUTER that replays buffered batches from a "
                        "given sequence number, as vLLM's replay_endpoint")
    g.add_argument("--kv-events-topic", default="", metavar="T",
                   help="topic frame of every message (default empty, as vLLM's)")
    g.add_argument("--kv-events-buffer-steps", type=int, default=10_000, metavar="N",
                   help="batches kept for replay (default 10000, as vLLM's)")
    g.add_argument("--metrics-prefix", choices=["kvscope", "vllm"], default="kvscope",
                   help="prefix of the /metrics names; vllm makes kvscope look like a vLLM "
                        "server to dashboards and to `kvscope --attach-vllm`")


def kv_events_endpoints(args) -> list[str]:
    """The endpoints the options ask to bind (for the loopback check); checks them."""
    if args.kv_events is None:
        if args.kv_events_replay:
            raise ValueError("--kv-events-replay needs --kv-events")
        return []
    if args.kv_events_buffer_steps < 1:
        raise ValueError(f"--kv-events-buffer-steps {args.kv_events_buffer_steps} must be >= 1")
    eps = [e for e in (args.kv_events, args.kv_events_replay) if e]
    for e in eps:
        if not e.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{e!r} is not a ZeroMQ endpoint: expected tcp://HOST:PORT")
        if e.startswith("tcp://"):
            endpoints.split_tcp(e)  # raises on a missing port
    return eps


def kv_events_config(args):
    """The publisher settings, or None without --kv-events."""
    if args.kv_events is None:
        return None
    from kvscope.engine.server.kv_events import KVEventsConfig

    return KVEventsConfig(args.kv_events, args.kv_events_replay, args.kv_events_topic,
                          args.kv_events_buffer_steps)
