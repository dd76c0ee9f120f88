"""SettingsChange: the one definition of what a running engine may change, checked where it is
built or decoded, with the field's name in every refusal."""
from __future__ import annotations

import msgspec
import pytest

from kvscope.engine import config as engine_config
from kvscope.engine.config import EngineConfig
from kvscope.engine.scheduling.scheduler import SCHEDULING_SETTINGS
from kvscope.engine.spec_decode.decoder import SPEC_SETTINGS
from kvscope.engine.traces import reproduced_outputs
from kvscope.ipc import codec
from kvscope.ipc import messages as m
from kvscope.ipc.settings import (
    CHANGE_RULES,
    IN_PLACE_SETTINGS,
    REBUILDS_POOL,
    RECONFIGURABLE,
    SettingsChange,
)
from kvscope.kvmath import kv_dtypes, kv_size

BAD = [("block_size", 3), ("block_size", 512), ("block_size", 0), ("block_size", True),
       ("kv_dtype", "float8"), ("kv_dtype", "fp4"), ("kv_rotation", "random"),
       ("kv_anchor_tokens", 65), ("kv_anchor_tokens", -1), ("kv_cache_bytes", 0),
       ("num_kv_blocks", -1), ("max_num_seqs", 0), ("max_num_batched_tokens", 0),
       ("enable_prefix_caching", 1), ("scheduling_policy", "lifo"),
       ("priority_aging_s", -1.0), ("priority_aging_s", float("inf")),
       ("max_prefill_tokens_while_decoding", -1), ("priority_lower_tokens", -3),
       ("priority_hold_s", -0.5), ("priority_step_stretch", 0.5),
       ("speculative_method", "eagle"), ("num_speculative_tokens", 0),
       ("num_speculative_tokens", 17), ("prompt_lookup_min", 0), ("prompt_lookup_max", 0)]


def test_every_reconfigurable_setting_has_a_rule_and_a_bad_value_here():
    assert set(CHANGE_RULES) == RECONFIGURABLE
    assert {name for name, _ in BAD} == RECONFIGURABLE


@pytest.mark.parametrize("name, value", BAD)
def test_a_bad_value_is_refused_where_it_is_built_naming_the_field(name, value):
    with pytest.raises(ValueError) as err:
        SettingsChange(**{name: value})
    assert f"SettingsChange.{name}={value!r} is invalid" in str(err.value)
    with pytest.raises(ValueError, match=f"SettingsChange.{name}="):
        SettingsChange.from_options({name: value})


@pytest.mark.parametrize("name, value", BAD)
def test_a_bad_value_on_the_wire_is_a_typed_error_naming_the_field(name, value):
    frame = msgspec.msgpack.encode({"type": "reconfigure", "id": 7, "changes": {name: value}})
    with pytest.raises(codec.BadMessage) as err:
        codec.decode_command(frame)
    assert (err.value.code, err.value.call_id) == (m.INVALID, 7)
    assert name in err.value.message


def test_an_unknown_setting_is_refused():
    frame = msgspec.msgpack.encode({"type": "reconfigure", "id": 3,
                                    "changes": {"block_size": 8, "model": "other"}})
    with pytest.raises(codec.BadMessage) as err:
        codec.decode_command(frame)
    assert (err.value.code, err.value.call_id) == (m.INVALID, 3)
    assert "unknown field `model`" in err.value.message
    with pytest.raises(ValueError, match=r"cannot reconfigure \['model'\]"):
        SettingsChange.from_options({"block_size": 8, "model": "other"})


def test_only_the_settings_given_travel_and_come_back():
    change = SettingsChange(block_size=32, kv_dtype="int8", priority_aging_s=10)
    assert change.priority_aging_s == 10.0 and isinstance(change.priority_aging_s, float)
    wire = msgspec.msgpack.encode(change)
    assert msgspec.msgpack.decode(wire) == {"block_size": 32, "kv_dtype": "int8",
                                            "priority_aging_s": 10.0}
    cmd = codec.decode_command(codec.encode(m.Reconfigure(id=1, changes=change)))
    assert cmd.changes == change
    assert change.changed() == {"block_size": 32, "kv_dtype": "int8", "priority_aging_s": 10.0}


def test_in_place_is_what_the_scheduler_and_the_drafter_read():
    """The in-place settings are SettingsChange's own fields, and exactly those the scheduler
    and the speculative decoder take from a new configuration without a pool rebuild."""
    assert IN_PLACE_SETTINGS == SCHEDULING_SETTINGS | SPEC_SETTINGS
    assert REBUILDS_POOL | IN_PLACE_SETTINGS == RECONFIGURABLE
    assert not REBUILDS_POOL & IN_PLACE_SETTINGS
    assert set(EngineConfig.__dataclass_fields__) >= RECONFIGURABLE
    assert SettingsChange(scheduling_policy="fcfs", num_speculative_tokens=3).in_place
    assert not SettingsChange(scheduling_policy="fcfs", block_size=8).in_place
    assert not SettingsChange().in_place  # nothing: a rebuild (a cold, empty pool)


def test_num_kv_blocks_zero_hands_the_size_back_to_the_budget():
    assert SettingsChange(num_kv_blocks=0).config_fields() == {"num_kv_blocks": None}
    assert SettingsChange(num_kv_blocks=12).config_fields() == {"num_kv_blocks": 12}


def test_the_kv_dtype_names_are_one_object():
    """The engine's configuration, the change's rule, the KV arithmetic and the trace check
    all read kvmath.kv_dtypes (the window's panel too: tests/app/test_controls.py)."""
    assert engine_config.KV_DTYPES is kv_dtypes.KV_DTYPES
    assert kv_size.KV_DTYPES is kv_dtypes.STORED_KV_DTYPES
    assert reproduced_outputs.FULL_PRECISION is kv_dtypes.FULL_PRECISION_KV_DTYPES
    assert ("auto", *kv_dtypes.STORED_KV_DTYPES) == kv_dtypes.KV_DTYPES
    for name in kv_dtypes.KV_DTYPES:
        assert SettingsChange(kv_dtype=name).kv_dtype == EngineConfig(kv_dtype=name).kv_dtype
    assert set(kv_size.DTYPE_BYTES) >= set(kv_dtypes.STORED_KV_DTYPES)


def test_engine_config_refuses_with_the_same_rule():
    for name, value in BAD:
        if name == "num_kv_blocks":
            continue  # the config's own: None or >= 1
        with pytest.raises(ValueError, match=f"EngineConfig.{name}="):
            EngineConfig(**{name: value})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineConfig(prompt_lookup_min=4, prompt_lookup_max=3)
