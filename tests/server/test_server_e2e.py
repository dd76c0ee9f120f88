"""`kvscope serve` in a real subprocess, driven through EngineClient (tiny model, CPU)."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import zmq

from kvscope.engine import LLM, EngineConfig, SamplingParams
from kvscope.ipc import EngineClient, EngineDead, EngineError, codec
from kvscope.ipc import messages as m
from tests.support.server_harness import Server, save_chat_model

ENGINE = {"block_size": 8, "num_kv_blocks": 256, "max_num_seqs": 16,
          "max_num_batched_tokens": 128}
ARGS = ["--block-size", "8", "--num-kv-blocks", "256", "--max-num-seqs", "16",
        "--max-num-batched-tokens", "128"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("chat"), seed=1)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """The shared server and, loading alongside it, a victim for the kill -9 test (on ipc://)."""
    folder = tmp_path_factory.mktemp("serve")
    shared = Server(model, folder / "serve.log", *ARGS, wait=False)
    victim = Server(model, folder / "victim.log", *ARGS, "--endpoint",
                    f"ipc://{folder}/kv.sock", wait=False)
    try:
        yield shared.wait_ready(), victim
    finally:
        shared.stop()
        victim.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def reference(model):
    return LLM(EngineConfig(model=str(model), device="cpu", **ENGINE))


def prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 250, n).tolist() for n in lengths]


def test_hello_and_protocol_version(client, server):
    hello = client.hello()
    assert hello.protocol == m.PROTOCOL_VERSION and hello.config.block_size == 8
    assert hello.metrics_url is None  # /metrics is off unless --metrics-port
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as raw:
        raw.connect(server.command)
        raw.send(msgspec.msgpack.encode({"type": "hello", "id": 7, "protocol": 999}))
        assert raw.poll(10_000)
        reply = msgspec.msgpack.decode(raw.recv())
        raw.close(linger=0)
    assert reply["type"] == "error" and reply["id"] == 7 and reply["code"] == "version_mismatch"


def test_concurrent_chats_match_in_process_llm(client, reference):
    chats = [[{"role": "user", "content": text}] for text in
             ("hello there", "what is a KV cache?", "paged attention, briefly",
              "x", "count to ten", "why is the sky blue")]
    chats[1] = [{"role": "system", "content": "be brief"}] + chats[1]
    params = {"max_tokens": 24}
    with ThreadPoolExecutor(3) as pool:  # three threads share one client
        got = list(pool.map(lambda c: client.generate(c, params, timeout=60), chats))
    want = reference.chat(chats, SamplingParams(**params))
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    last = got[0].last
    assert last.num_output_tokens == len(got[0].token_ids) and last.ttft_s >= last.queued_s >= 0


def test_text_and_token_prompts_match(client, reference):
    ids = prompts([13], seed=2)[0]
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop=["zz"])
    got = [client.generate(p, params, timeout=60) for p in ("raw text, no template", ids)]
    want = reference.generate(["raw text, no template", ids], params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_bad_input_gets_typed_errors(client):
    cases = [lambda: client.submit([1, 2], {"temperature": -1}),
             lambda: client.submit([10**9], {}), lambda: client.abort("no-such-request"),
             lambda: client.reconfigure(prompt_lookup_max=1)]  # under prompt_lookup_min (2)
    codes = []
    for case in cases:
        with pytest.raises(EngineError) as err:
            case()
        codes.append(err.value.code)
    assert codes == ["bad_request"] * 2 + ["unknown_request"] + ["refused"]
    # What the client can tell itself it refuses before sending (ipc.prompts, ipc.settings).
    for case, words in [(lambda: client.submit("", {}), "prompt is empty"),
                        (lambda: client.reconfigure(block_size=3), "block_size=3"),
                        (lambda: client.reconfigure(model="x"), "cannot reconfigure")]:
        with pytest.raises(ValueError, match=words):
            case()
    with pytest.raises(ValueError, match="exceeds"):
        client.submit("x" * (9 * 2**20))
    assert client.hello().config.block_size == 8  # refusals kept the old configuration


@pytest.mark.parametrize("frame, words", [
    ({"type": "submit", "id": 41, "prompt": "hi", "token_ids": [1, 2]},
     "exactly one of prompt, messages or token_ids (got prompt and token_ids)"),
    ({"type": "submit", "id": 42, "prompt": "hi", "messages": [{"role": "user",
                                                               "content": "hi"}]},
     "got prompt and messages"),
    ({"type": "submit", "id": 43, "messages": []}, "messages is empty"),
    ({"type": "reconfigure", "id": 44, "changes": {"model": "x"}}, "unknown field `model`"),
    ({"type": "reconfigure", "id": 45, "changes": {"block_size": 3}},
     "SettingsChange.block_size=3 is invalid"),
    ({"type": "reconfigure", "id": 46, "changes": {"kv_dtype": "float8"}},
     "SettingsChange.kv_dtype='float8' is invalid"),
])
def test_the_wire_refuses_a_bad_prompt_or_setting_before_the_engine_sees_it(client, server,
                                                                            frame, words):
    """A client that skips EngineClient's checks gets a typed `invalid` reply naming what was
    wrong from the I/O thread; the engine thread never sees the command, and keeps serving."""
    before = client.snapshot().stats.server
    with zmq.Context() as ctx:
        raw = ctx.socket(zmq.DEALER)
        raw.connect(server.command)
        raw.send(msgspec.msgpack.encode(frame))
        assert raw.poll(10_000)
        reply = codec.decode_reply(raw.recv())
        raw.close(linger=0)
    assert isinstance(reply, m.Error) and (reply.id, reply.code) == (frame["id"], m.INVALID)
    assert words in reply.message, reply.message
    after = client.snapshot().stats.server
    assert after.bad_frames == before.bad_frames + 1
    assert (after.requests, after.errors) == (before.requests, before.errors)  # never queued
    assert client.hello().config.block_size == 8
    out = client.generate([5, 6, 7], {"max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert out.finish_reason == "length"


def test_abort_mid_stream(client):
    rid = client.submit(prompts([9], 3)[0], {"max_tokens": 400, "ignore_eos": True})
    stream = client.stream(rid, timeout=30)
    first = [next(stream) for _ in range(3)]
    assert all(not d.finished for d in first)
    assert client.abort(rid).aborted
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].num_output_tokens < 400
    assert client.abort(rid) == m.AbortResult(False, "abort")
    assert rid not in client.snapshot().blocks.request_ids


def _run_with_reconfigure(client, token_prompts, params, changes_list):
    """Submit, then apply each change once every request has streamed a few more tokens."""
    progress = {}
    cond = threading.Condition()
    outs = {}

    def on_delta(d):
        with cond:
            progress[d.request_id] = d.num_output_tokens
            outs.setdefault(d.request_id, []).append(d)
            cond.notify_all()

    ids = [client.submit(p, params, on_delta=on_delta) for p in token_prompts]
    applied = []
    for k, changes in enumerate(changes_list, start=1):
        with cond:
            assert cond.wait_for(lambda k=k: all(progress.get(i, 0) >= 3 * k for i in ids), 60)
        applied.append(client.reconfigure(**changes))
    with cond:
        assert cond.wait_for(lambda: all(outs.get(i) and outs[i][-1].finished for i in ids), 60)
    return [outs[i] for i in ids], applied


def test_reconfigure_block_size_mid_generation_keeps_greedy_output(client, reference):
    token_prompts = prompts([5, 30, 17, 50], seed=4)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want = reference.generate(token_prompts, params)
    outs, applied = _run_with_reconfigure(
        client, token_prompts, params,
        [{"block_size": 16}, {"block_size": 4, "num_kv_blocks": 600}])
    try:
        assert [(a.block_size, a.num_kv_blocks) for a in applied] == [(16, 256), (4, 600)]
        assert [[t for d in o for t in d.token_ids] for o in outs] == \
            [w.token_ids for w in want]
        assert all(o[-1].finish_reason == "length" for o in outs)
        assert max(o[-1].num_preemptions for o in outs) >= 2  # really recomputed, twice
    finally:
        client.reconfigure(block_size=8, num_kv_blocks=256)


def test_reconfigure_kv_dtype_mid_generation_finishes_everything(client):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs, applied = _run_with_reconfigure(client, prompts([7, 40, 12], seed=5), params,
                                          [{"kv_dtype": "bfloat16"}, {"kv_dtype": "int8"}])
    try:
        assert [a.kv_dtype for a in applied] == ["bfloat16", "int8"]
        assert all(sum(len(d.token_ids) for d in o) == 40 for o in outs)
        assert all(o[-1].finish_reason == "length" for o in outs)
        assert client.snapshot().stats.config.kv_dtype == "int8"
    finally:
        client.reconfigure(kv_dtype="auto")


def test_reconfigure_kv_rotation_over_the_wire(client):
    """The window's path: the rotation changes live, every stream finishes, stats show it."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outs, applied = _run_with_reconfigure(
        client, prompts([9, 25], seed=6), params,
        [{"kv_dtype": "int8", "kv_rotation": "none"}, {"kv_rotation": "hadamard"}])
    try:
        assert [a.kv_rotation for a in applied] == ["none", "hadamard"]
        assert all(sum(len(d.token_ids) for d in o) == 30 for o in outs)
        stats = client.snapshot().stats
        assert (stats.engine.kv_rotation, stats.config.kv_rotation) == ("hadamard",) * 2
    finally:
        client.reconfigure(kv_dtype="auto", kv_rotation="auto")


def test_state_stream_matches_snapshot(client):
    client.subscribe(["step", "blocks", "stats"])
    rid = client.submit(prompts([20], 6)[0], {"max_tokens": 200, "ignore_eos": True})
    busy = client.wait_frame("blocks", 30, lambda f: rid in f.request_ids and f.used > 0)
    _check_blocks(busy)
    i = busy.request_ids.index(rid)
    table = busy.block_table(rid)
    assert len(table) == -(-busy.num_computed_tokens[i] // 8)
    assert (busy.array("owner")[table] == i).all()
    list(client.stream(rid, timeout=30))
    idle = client.snapshot()
    _check_blocks(idle.blocks)
    assert idle.blocks.used == 0 and idle.blocks.free + idle.blocks.cached == 256
    frame = client.wait_frame("blocks", 10, lambda f: f.step == idle.blocks.step)
    assert (frame.flags, frame.used) == (idle.blocks.flags, 0)
    step = client.wait_frame("step", 10, lambda f: f.step == idle.blocks.step)
    assert step.generated_tokens_total == idle.stats.engine.num_generated_tokens
    stats = client.wait_frame("stats", 10, lambda f: f.step == idle.blocks.step)
    assert stats.config.block_size == 8 and stats.itl_s.count > 0
    beat = client.wait_frame("heartbeat", 5)
    assert beat.step == idle.blocks.step and not beat.busy
    assert client.latest("step").seq > 1


def _check_blocks(f: m.BlocksFrame) -> None:
    flags, filled, ref = f.array("flags"), f.array("filled"), f.array("ref_count")
    state = flags & m.BLOCK_STATE_MASK
    used = state == m.BLOCK_USED
    assert (f.used, f.cached) == (used.sum(), (state == m.BLOCK_CACHED).sum())
    assert f.free == (state == m.BLOCK_FREE).sum()
    assert (ref[used] > 0).all() and (ref[~used] == 0).all()
    assert (f.array("owner")[~used] == -1).all()
    assert f.internal_waste_slots == used.sum() * f.block_size - filled[used].sum()
    assert len(f.array("tables")) == ref.sum()


def test_ctrl_c_aborts_in_flight_requests_and_exits_cleanly(client, server):
    """SIGINT here; SIGTERM shares the handler."""
    rid = client.submit(prompts([9], 7)[0], {"max_tokens": 400, "ignore_eos": True})
    stream = client.stream(rid, timeout=30)
    next(stream)
    server.signal(signal.SIGINT)
    assert list(stream)[-1].finish_reason == "abort"
    assert server.proc.wait(30) == 0


def test_kill_9_is_noticed_within_3_seconds(servers):
    server = servers[1].wait_ready()
    assert server.command.startswith("ipc://") and server.state == server.command + ".state"
    client = EngineClient(server.command, server.state, timeout=30, heartbeat_timeout=2.5)
    try:
        rid = client.submit(prompts([5], 8)[0], {"max_tokens": 480, "ignore_eos": True})
        stream = client.stream(rid)
        next(stream), next(stream)
        server.signal(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDead):
            list(stream)
        assert time.monotonic() - killed < 3.0
        assert client.dead and "heartbeat" in client.dead_reason
        with pytest.raises(EngineDead):
            client.snapshot()
    finally:
        started = time.monotonic()
        client.close()
        assert time.monotonic() - started < 3.0
        server.stop()


def test_remote_bind_needs_allow_remote(capsys):
    from kvscope.engine.cli import serve as serve_cli

    assert serve_cli.main(["--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert serve_cli.main(["--endpoint", "tcp://10.0.0.1:5"]) == 2
    eps = serve_cli.resolve_endpoints(serve_cli.build_parser().parse_args(
        ["--host", "0.0.0.0", "--port", "6000"]))
    assert eps == ("tcp://0.0.0.0:6000", "tcp://0.0.0.0:6001")
    capsys.readouterr()
    serve_cli.check_remote(eps, allow_remote=True)  # allowed; CURVE unless --insecure
    assert capsys.readouterr().err == ""  # (the --insecure warning: tests/cli/test_keys.py)
