"""Wire format, endpoints and the blocks payload, without a server process."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import zmq

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduling.scheduler import Scheduler
from kvscope.engine.sequence import Sequence
from kvscope.engine.server.snapshots import blocks_frame
from kvscope.ipc import EngineClient, codec, endpoints
from kvscope.ipc import messages as m
from kvscope.ipc.client import _sampling, _typed_prompt
from kvscope.ipc.prompts import ChatPrompt, TextPrompt, TokenPrompt
from kvscope.ipc.settings import SettingsChange
from kvscope.testing.frames import engine_settings, stats_frame


@pytest.mark.parametrize("cmd", [
    m.Hello(id=1, protocol=m.PROTOCOL_VERSION, client="t"),
    m.Submit(id=2, prompt="hi", sampling=m.Sampling(max_tokens=3, stop=["x"])),
    m.Submit(id=3, messages=[m.ChatMessage("user", "hi")]),
    m.Submit(id=4, token_ids=[1, 2], request_id="mine"),
    m.Abort(id=5, request_id="req-1"),
    m.Reconfigure(id=6, changes=SettingsChange(block_size=32, kv_dtype="float16",
                                               num_kv_blocks=0, enable_prefix_caching=False)),
    m.Snapshot(id=7), m.Shutdown(id=2**63 - 1)])
def test_commands_round_trip(cmd):
    assert codec.decode_command(codec.encode(cmd)) == cmd


@pytest.mark.parametrize("payload, code, call_id", [
    (b"", "malformed", None),
    (b"\xc1", "malformed", None),
    (b"\x91" * 100_000 + b"\xc0", "invalid", None),
    (b"\x83\xa4type\xa5hello\xa2id\x05\xa1x" + b"\x91" * 100_000 + b"\xc0", "invalid", None),
    (msgspec.msgpack.encode([1, 2]), "invalid", None),
    (msgspec.msgpack.encode({"id": 4}), "unknown_type", 4),
    (msgspec.msgpack.encode({"type": "launch", "id": 5}), "unknown_type", 5),
    (msgspec.msgpack.encode({"type": "abort", "id": 6}), "invalid", 6),
    (msgspec.msgpack.encode({"type": "abort", "id": 7, "request_id": 3}), "invalid", 7),
    (msgspec.msgpack.encode({"type": "snapshot", "id": 8, "extra": 1}), "invalid", 8),
    (msgspec.msgpack.encode({"type": "snapshot", "id": -1}), "invalid", None),
    (msgspec.msgpack.encode({"type": "submit", "id": 9, "prompt": "x",
                             "sampling": {"max_token": 3}}), "invalid", 9),
    # the prompt's shape (ipc.prompts): exactly one of prompt, messages, token_ids, not empty
    (msgspec.msgpack.encode({"type": "submit", "id": 10, "prompt": "x",
                             "token_ids": [1]}), "invalid", 10),
    (msgspec.msgpack.encode({"type": "submit", "id": 11}), "invalid", 11),
    (msgspec.msgpack.encode({"type": "submit", "id": 12, "messages": []}), "invalid", 12),
    (msgspec.msgpack.encode({"type": "submit", "id": 13, "token_ids": [1, -2]}), "invalid",
     13),
    # a settings change (ipc.settings): known names, values in range
    (msgspec.msgpack.encode({"type": "reconfigure", "id": 14, "changes": {"model": "x"}}),
     "invalid", 14),
    (msgspec.msgpack.encode({"type": "reconfigure", "id": 15, "changes": {"block_size": 3}}),
     "invalid", 15),
    (msgspec.msgpack.encode({"type": "reconfigure", "id": 16,
                             "changes": {"kv_dtype": "float8"}}), "invalid", 16),
    (msgspec.msgpack.encode({"type": "reconfigure", "id": 17,
                             "changes": {"max_num_seqs": True}}), "invalid", 17),
])
def test_bad_frames_become_typed_errors(payload, code, call_id):
    with pytest.raises(codec.BadMessage) as err:
        codec.decode_command(payload)
    assert (err.value.code, err.value.call_id) == (code, call_id)


def test_replies_round_trip():
    ok = m.Ok(3, msgspec.Raw(codec.encode(m.SubmitResult("req-0", 5))))
    back = codec.decode_reply(codec.encode(ok))
    assert codec.decode_result(back.result, m.SubmitResult) == m.SubmitResult("req-0", 5)
    deltas = m.Deltas([m.Delta(request_id="r", token_ids=[1], text="é", finished=True,
                               finish_reason="stop", ttft_s=0.1)])
    assert codec.decode_reply(codec.encode(deltas)) == deltas
    err = m.Error(None, "malformed", "bad")
    assert codec.decode_reply(codec.encode(err)) == err


def test_endpoints():
    assert endpoints.tcp("::1", 5) == "tcp://[::1]:5"
    assert endpoints.state_endpoint_for("tcp://127.0.0.1:5570") == "tcp://127.0.0.1:5571"
    assert endpoints.state_endpoint_for("tcp://[::1]:9") == "tcp://[::1]:10"
    assert endpoints.state_endpoint_for("ipc:///tmp/k") == "ipc:///tmp/k.state"
    assert endpoints.is_local("tcp://127.0.0.1:1") and endpoints.is_local("tcp://[::1]:1")
    assert endpoints.is_local("tcp://localhost:1") and endpoints.is_local("ipc:///x")
    assert not endpoints.is_local("tcp://0.0.0.0:1") and not endpoints.is_local("tcp://*:1")
    assert not endpoints.is_local("tcp://10.1.2.3:1")
    with pytest.raises(ValueError):
        endpoints.split_tcp("tcp://nohost")


def test_client_argument_forms():
    assert _typed_prompt("hi") == TextPrompt("hi")
    assert _typed_prompt((1, 2)) == TokenPrompt([1, 2])
    assert _typed_prompt([{"role": "user", "content": "x"}]) == \
        ChatPrompt([m.ChatMessage("user", "x")])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        _typed_prompt([{"role": "user"}])  # no content: refused before anything is sent
    assert _sampling(SamplingParams(max_tokens=7, stop=["a"])) == \
        m.Sampling(max_tokens=7, stop=["a"])
    assert _sampling({"temperature": 1}) == m.Sampling(temperature=1.0)
    with pytest.raises(ValueError):
        _sampling({"max_tokens": "many"})


def fake_engine(num_blocks=64, block_size=4):
    """Just what blocks_frame reads, with two requests sharing a prefix and one cached block."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence("done", list(range(100, 109)), SamplingParams(max_tokens=4)),
            Sequence("a", list(range(10)), SamplingParams(max_tokens=20)),
            Sequence("b", list(range(10)) + [77, 78], SamplingParams(max_tokens=30)),
            Sequence("w", [5, 5, 5], SamplingParams())]
    for seq in seqs[:3]:
        sched.add(seq)
        sched.schedule()
        seq.num_computed_tokens = seq.num_tokens  # as the engine's step would
    sched.finish(seqs[0], "stop")
    sched.add(seqs[3])
    return SimpleNamespace(block_manager=bm, scheduler=sched, max_model_len=128, num_steps=3)


def test_blocks_frame_agrees_with_the_block_objects():
    engine = fake_engine()
    f = msgspec.msgpack.decode(codec.encode(blocks_frame(engine, seq=4)), type=m.BlocksFrame)
    bm = engine.block_manager
    flags, ref, owner = f.array("flags"), f.array("ref_count"), f.array("owner")
    assert f.request_ids == ["a", "b", "w"] and f.request_running == [True, True, False]
    for b in bm.blocks:
        state = flags[b.block_id] & m.BLOCK_STATE_MASK
        want = m.BLOCK_USED if b.ref_count else \
            m.BLOCK_CACHED if b.block_id in bm.cached_free else m.BLOCK_FREE
        assert state == want and ref[b.block_id] == b.ref_count
        assert bool(flags[b.block_id] & m.BLOCK_HAS_HASH) == (b.hash is not None)
    a, b = f.block_table("a"), f.block_table("b")
    assert a == bm_table(engine, "a") and b == bm_table(engine, "b") and f.block_table("w") == []
    assert a[:2] == b[:2] and ref[a[0]] == 2 and owner[a[0]] == 0 and owner[b[2]] == 1
    assert f.array("filled")[a].tolist() == [4, 4, 2] and f.array("filled")[b].tolist() == [4] * 3
    assert (f.used, f.cached, f.free) == (4, 2, 58)  # "done": 2 full blocks cached, 1 freed
    assert f.internal_waste_slots == 2 and f.tokens_stored == 14 + 8
    assert f.reserved_max_len_blocks == 2 * 32
    assert f.reserved_request_blocks == -(-30 // 4) + -(-42 // 4)


def bm_table(engine, rid):
    return next(s.block_table for s in engine.scheduler.running if s.request_id == rid)


def test_blocks_frame_at_32k_blocks_is_compact():
    engine = fake_engine(num_blocks=32768, block_size=16)
    payload = codec.encode(blocks_frame(engine, seq=1))
    assert len(payload) < 32768 * 10 + 4096  # 9 bytes a block plus the small parts
    f = codec.decode_state("blocks", payload)
    assert len(f.array("owner")) == 32768 and np.count_nonzero(f.array("ref_count")) == f.used == 2


def test_stats_frames_round_trip_as_typed_structs():
    frame = stats_frame(kv_dtype="int8", kv_rotation="calibrated", kv_rotation_matrix="Hadamard",
                        config={"num_kv_blocks": 128},
                        server={"kv_events": m.KVEventCounters(
                            batches=3, events=9, batches_dropped=0, publish_s=0.01, replays=1,
                            bad_replays=0)})
    back = codec.decode_state("stats", codec.encode(frame))
    assert back == frame
    assert isinstance(back.engine, m.EngineStats) and back.engine.kv_dtype == "int8"
    assert isinstance(back.config, m.EngineSettings) and back.config.num_kv_blocks == 128
    assert back.server.kv_events.batches == 3


def test_engine_settings_mirror_engine_config_field_for_field():
    reported = ("decode_path_notice",)  # the engine's notice, not an EngineConfig field
    assert [f for f in m.EngineSettings.__struct_fields__ if f not in reported] == \
        [f.name for f in dataclasses.fields(EngineConfig)]
    for config in (EngineConfig(), EngineConfig(num_kv_blocks=8, max_model_len=64,
                                                kv_dtype="int8", enable_prefix_caching=False)):
        wire = codec.encode(config.settings())
        # strict: every value EngineConfig holds has exactly the type the struct says
        assert msgspec.msgpack.decode(wire, type=m.EngineSettings) == \
            msgspec.convert(config.to_dict(), m.EngineSettings, strict=True)


def _edited(frame, part: str, edit) -> bytes:
    """frame encoded, with its `part` map changed by edit(dict) as another build might."""
    raw = msgspec.msgpack.decode(codec.encode(frame))
    edit(raw[part])
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("part, edit, says", [
    ("engine", lambda d: d.pop("kv_dtype"), "missing required field `kv_dtype` - at `$.engine`"),
    ("engine", lambda d: d.update(num_kv_blocks="64"),
     "Expected `int`, got `str` - at `$.engine.num_kv_blocks`"),
    ("engine", lambda d: d.update(num_free_blocks=1.5),
     "Expected `int`, got `float` - at `$.engine.num_free_blocks`"),
    ("engine", lambda d: d.update(kv_rotation_matrix=7),
     "Expected `str | null`, got `int` - at `$.engine.kv_rotation_matrix`"),
    ("config", lambda d: d.pop("max_num_seqs"), "`max_num_seqs` - at `$.config`"),
    ("config", lambda d: d.update(enable_prefix_caching=1),
     "Expected `bool`, got `int` - at `$.config.enable_prefix_caching`"),
    ("server", lambda d: d.update(http_in_flight=None),
     "Expected `int`, got `None` - at `$.server.http_in_flight`"),
])
def test_a_stats_frame_with_a_missing_or_ill_typed_field_is_refused_by_name(part, edit, says):
    with pytest.raises(codec.BadMessage) as err:
        codec.decode_state("stats", _edited(stats_frame(), part, edit))
    assert err.value.code == m.INVALID
    assert err.value.message.startswith("bad stats frame: ") and says in err.value.message


def test_a_hello_whose_config_is_ill_typed_is_refused_by_name():
    hello = m.HelloResult(m.PROTOCOL_VERSION, "x", "default", 1, engine_settings(), 512, 1 << 20)
    raw = msgspec.msgpack.decode(codec.encode(hello))
    raw["config"]["block_size"] = "16"
    with pytest.raises(msgspec.ValidationError, match=r"`\$\.config\.block_size`"):
        codec.decode_result(msgspec.msgpack.encode(raw), m.HelloResult)
    assert codec.decode_result(codec.encode(hello), m.HelloResult) == hello


def test_the_client_refuses_a_bad_stats_frame_and_keeps_the_good_ones():
    """A stats frame missing a field never reaches a view: the client counts it, says why
    once, and goes on with the next good frame."""
    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as pub, ctx.socket(zmq.ROUTER) as router:
        router.bind("tcp://127.0.0.1:0")
        pub.bind("tcp://127.0.0.1:0")
        client = EngineClient(router.getsockopt_string(zmq.LAST_ENDPOINT),
                              pub.getsockopt_string(zmq.LAST_ENDPOINT), heartbeat_timeout=60)
        try:
            client.subscribe(["stats"])
            bad = _edited(stats_frame(seq=1), "engine", lambda d: d.pop("num_used_blocks"))
            deadline = time.monotonic() + 30
            while client.bad_messages == 0 and time.monotonic() < deadline:
                pub.send_multipart([b"stats", bad])  # again until the subscription is up
                time.sleep(0.02)
            assert client.bad_messages > 0 and client.latest("stats") is None
            assert "`num_used_blocks` - at `$.engine`" in client.last_bad_message
            # Again until it arrives: under load the bad frames sent above can still fill the
            # subscriber's queue, and PUB drops what does not fit.
            give_up = time.monotonic() + 30
            while client.latest("stats") is None and time.monotonic() < give_up:
                pub.send_multipart([b"stats", codec.encode(stats_frame(seq=2))])
                time.sleep(0.02)
            good = client.latest("stats")
            assert good is not None and good.seq == 2 and good.engine.num_used_blocks == 4
        finally:
            client.close()


def test_ipc_imports_neither_torch_nor_the_engine():
    code = ("import sys, ipc, ipc.client, ipc.codec, ipc.endpoints; "
            "bad = [n for n in ('torch', 'engine', 'PySide6') if n in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
