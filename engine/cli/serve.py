"""`kvscope serve`: a headless engine process speaking the ZeroMQ protocol (ipc/).

On success stdout carries exactly one line, `ready <command endpoint> <state endpoint>`, so a
parent process can wait for it; everything else goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from kvscope.engine.cli.auth import add_auth_options, server_auth, trace_dir, warn_plain_http
from kvscope.engine.cli.http_options import add_http_options, http_address, start_http
from kvscope.engine.cli.kv_events_options import (
    add_kv_events_options,
    kv_events_config,
    kv_events_endpoints,
)
from kvscope.engine.cli.options import add_engine_options, engine_config_from_args, parse_bytes
from kvscope.ipc import endpoints
from kvscope.ipc.messages import DEFAULT_MAX_MESSAGE_BYTES


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` and all its options on the launcher's subparsers action."""
    p = sub.add_parser(
        "serve", help="headless engine process behind ZeroMQ",
        description="Run the engine headless: commands on a ROUTER socket (tcp://HOST:PORT), "
                    "the live state on a PUB socket (tcp://HOST:PORT+1).")
    p.add_argument("--host", default=endpoints.DEFAULT_HOST,
                   help="address to bind (default 127.0.0.1; others need --allow-remote)")
    p.add_argument("--port", type=int, default=endpoints.DEFAULT_PORT,
                   help="command port; the state stream uses the next one; 0 picks free ports")
    p.add_argument("--endpoint", help="command endpoint instead of --host/--port, e.g. "
                                      "ipc:///tmp/kvscope.sock or tcp://127.0.0.1:6000")
    p.add_argument("--state-endpoint",
                   help="state endpoint (default: tcp port + 1, or PATH.state for ipc://)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow binding a non-loopback address (ZeroMQ sockets then need "
                        "CURVE keys unless --insecure; /metrics is plain HTTP)")
    p.add_argument("--max-message-bytes", type=parse_bytes, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="larger command messages are dropped by ZeroMQ (ZMQ_MAXMSGSIZE)")
    p.add_argument("--state-hz", type=float, default=30.0,
                   help="most state frames per second and topic (default 30)")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics (off by default; "
                        "0 picks a free port; the URL is printed on stderr and in hello)")
    p.add_argument("--metrics-host",
                   help="address for /metrics (default: --host; others need --allow-remote)")
    p.add_argument("--trace", metavar="PATH", help="record the session to a JSONL trace")
    p.add_argument("--no-prompts", action="store_true",
                   help="with --trace: record prompt lengths, not the prompt token ids")
    add_kv_events_options(p)
    add_http_options(p)
    add_auth_options(p)
    add_engine_options(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """`kvscope serve`'s parser on its own, for `python -m kvscope.engine.cli.serve` (how the
    window and the benchmarks spawn an engine process)."""
    return add_parser(argparse.ArgumentParser(prog="kvscope").add_subparsers())


def main(argv: list[str]) -> int:
    """`python -m kvscope.engine.cli.serve ARGS...`: the same as `kvscope serve ARGS...`."""
    return run(build_parser().parse_args(argv))


def resolve_endpoints(args) -> tuple[str, str]:
    if args.endpoint:
        command = args.endpoint
        state = args.state_endpoint
        if state is None:
            state = (endpoints.tcp(endpoints.split_tcp(command)[0], "*")
                     if command.endswith((":0", ":*")) else endpoints.state_endpoint_for(command))
        return command, state
    if not 0 <= args.port < 65535:
        raise ValueError(f"--port {args.port} is not a port number")
    state_port = args.port + 1 if args.port else 0
    return (endpoints.tcp(args.host, args.port),
            args.state_endpoint or endpoints.tcp(args.host, state_port))


def metrics_address(args) -> tuple[str, int] | None:
    if args.metrics_port is None:
        return None
    if not 0 <= args.metrics_port < 65536:
        raise ValueError(f"--metrics-port {args.metrics_port} is not a port number")
    host = args.metrics_host or (args.host if not args.endpoint else endpoints.DEFAULT_HOST)
    return host, args.metrics_port


def check_remote(eps, allow_remote: bool) -> None:
    remote = [e for e in eps if not endpoints.is_local(e)]
    if remote and not allow_remote:
        raise ValueError(f"refusing to bind {', '.join(remote)}: not a loopback address; "
                         f"pass --allow-remote if you mean it (with CURVE keys, see "
                         f"`kvscope keys init`)")


def run(args: argparse.Namespace) -> int:
    try:
        if not args.state_hz > 0:
            raise ValueError(f"--state-hz {args.state_hz} must be > 0")
        eps = resolve_endpoints(args)
        metrics_at = metrics_address(args)
        http_at = http_address(args)
        metrics_ep = [endpoints.tcp(*metrics_at)] if metrics_at else []
        zmq_eps = [*eps, *kv_events_endpoints(args)]
        check_remote([*zmq_eps, *metrics_ep], args.allow_remote)
        auth = server_auth(args, zmq_eps)
        warn_plain_http(metrics_ep)
        traces_at = trace_dir(args)
    except (ValueError, OSError) as exc:
        print(f"kvscope serve: error: {exc}", file=sys.stderr)
        return 2
    import zmq

    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.server.engine_server import EngineServer
    from kvscope.engine.server.metrics import EngineMetrics
    from kvscope.engine.traces.recorder import start_trace

    metrics = metrics_url = kv_events = http = None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is for the ready line only
            engine = LLMEngine(engine_config_from_args(args))
        if metrics_at or http_at:  # the HTTP API serves /metrics too, and counts requests
            metrics = EngineMetrics(engine.config.model, engine.max_model_len,
                                    engine.config.max_num_batched_tokens)
        if metrics_at:
            metrics_url = metrics.serve(*metrics_at, prefix=args.metrics_prefix)
            print(f"kvscope serve: Prometheus metrics at {metrics_url}", file=sys.stderr,
                  flush=True)
        if args.trace:
            start_trace(engine, args.trace, include_prompts=not args.no_prompts)
        kv_events = start_kv_events(engine, kv_events_config(args), auth)
        server = EngineServer(engine, *eps, max_message_bytes=args.max_message_bytes,
                              state_hz=args.state_hz, metrics=metrics, metrics_url=metrics_url,
                              kv_events=kv_events, auth=auth, trace_dir=traces_at)
        if http_at:
            http = start_http(args, http_at, server, metrics)
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"kvscope serve: error: {exc}", file=sys.stderr)
        if metrics is not None:
            metrics.close()
        if kv_events is not None:
            kv_events.close()
        if auth is not None:
            auth.close()
        return 2

    def stop(*_) -> None:
        if http is not None:
            http.refuse_new()  # 503 from now on, while the engine winds down
        server.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    # The step loop runs here, on the thread that built the engine (EngineServer.start):
    # stepped from a second thread, libgomp stops spinning and a chat decodes at half speed.
    # The handlers above still run: the loop waits for commands at most HEARTBEAT_S at a time.
    command, state = server.start(engine_thread=False)
    print(f"ready {command} {state}", flush=True)
    server.run()
    if http is not None:
        http.close()
    server.close()
    if metrics is not None:
        metrics.close()
    if kv_events is not None:
        kv_events.close()
    if auth is not None:
        auth.close()  # last: the sockets it guards are closed
    engine.stop_trace()
    return 1 if server.failed else 0


def start_kv_events(engine, config, auth=None):
    """The KV-event publisher for --kv-events (None without it); says where it listens.
    auth: CURVE on its sockets too (ipc.curve.ServerAuth; None: plain text)."""
    if config is None:
        return None
    from kvscope.engine.server.kv_events import CacheEventFeed, KVEventPublisher

    publisher = KVEventPublisher(config, auth=auth)
    publisher.start()
    pub, replay = publisher.endpoints
    print(f"kvscope serve: KV events (vLLM format) on {pub}"
          + (f", replay on {replay}" if replay else "") + f", topic {config.topic!r}",
          file=sys.stderr, flush=True)
    if not engine.config.enable_prefix_caching:
        print("kvscope serve: note: --no-prefix-caching: no block enters the prefix cache, "
              "so the KV-event stream stays empty", file=sys.stderr, flush=True)
    return CacheEventFeed(engine, publisher)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
