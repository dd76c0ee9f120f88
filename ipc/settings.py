"""A change to a running engine's settings (the window's Apply, `EngineClient.reconfigure`,
`LLMEngine.reconfigure`), and the one definition of which settings may change, which of them
rebuild the KV pool and what values each may take.

`SettingsChange` is checked where it is made: built in Python (the window's panel, a client's
keyword arguments) or decoded from the wire, a bad value raises naming its field, so the
engine thread only ever sees values in range. engine.config.EngineConfig checks the same
fields with the same rules (`check_setting`), plus what only a whole configuration can tell.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import msgspec

from kvscope.kvmath.kv_dtypes import KV_DTYPES

# K/V rotation (kernels/rotation.py) and the exact K shift and q/k balance on top of it
# (kernels/k_balance.py): "calibrated" = Hadamard + K balance, "hadamard" = the rotation alone,
# "none" = plain, "auto" = "calibrated" for the 1-byte dtypes and "none" for the float ones.
KV_ROTATIONS = ("auto", "calibrated", "hadamard", "none")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Speculative decoding from the context: "off" or "ngram" (prompt lookup; vLLM's names).
SPECULATIVE_METHODS = ("off", "ngram")
MAX_BLOCK_SIZE = 256
MAX_KV_ANCHOR_TOKENS = 64
MAX_SPECULATIVE_TOKENS = 16


class Rule(NamedTuple):
    """What a setting accepts: a test, and the words an error uses for what was expected."""
    accepts: Callable[[object], bool]
    expected: str


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _whole(lo: int, hi: float = math.inf) -> Callable[[object], bool]:
    return lambda x: _is_int(x) and lo <= x <= hi  # type: ignore[operator]  # an int here


def _number(lo: float) -> Callable[[object], bool]:
    return lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) \
        and lo <= x < math.inf


def _one_of(names: tuple[str, ...]) -> Rule:
    return Rule(lambda x: isinstance(x, str) and x in names, f"one of {names}")


def _power_of_two(x: object) -> bool:
    return _is_int(x) and 1 <= x <= MAX_BLOCK_SIZE and x & (x - 1) == 0  # type: ignore[operator]


RULES: dict[str, Rule] = {
    "block_size": Rule(_power_of_two, f"a power of two from 1 to {MAX_BLOCK_SIZE}"),
    "kv_dtype": _one_of(KV_DTYPES),
    "kv_rotation": _one_of(KV_ROTATIONS),
    "kv_anchor_tokens": Rule(_whole(0, MAX_KV_ANCHOR_TOKENS),
                             f"a whole number from 0 (off) to {MAX_KV_ANCHOR_TOKENS}"),
    "kv_cache_bytes": Rule(_whole(1), "a positive number of bytes"),
    "max_num_seqs": Rule(_whole(1), "an integer >= 1"),
    "max_num_batched_tokens": Rule(_whole(1), "an integer >= 1"),
    "enable_prefix_caching": Rule(lambda x: isinstance(x, bool), "True or False"),
    "scheduling_policy": _one_of(SCHEDULING_POLICIES),
    "priority_aging_s": Rule(_number(0), "a number of seconds >= 0 (0 = no aging)"),
    "max_prefill_tokens_while_decoding": Rule(_whole(0), "an integer >= 0 (0 = no cap)"),
    "priority_lower_tokens": Rule(_whole(0), "an integer >= 0 (0 = off)"),
    "priority_hold_s": Rule(_number(0), "a number of seconds >= 0"),
    "priority_step_stretch": Rule(_number(1), "a number >= 1 (1 = the lower tokens only)"),
    "speculative_method": _one_of(SPECULATIVE_METHODS),
    "num_speculative_tokens": Rule(_whole(1, MAX_SPECULATIVE_TOKENS),
                                   f"an integer from 1 to {MAX_SPECULATIVE_TOKENS}"),
    "prompt_lookup_min": Rule(_whole(1), "an integer >= 1"),
    "prompt_lookup_max": Rule(_whole(1), "an integer >= 1"),
}
# Seconds and ratios: an int is taken, and kept as the float the wire carries (EngineSettings).
FLOAT_SETTINGS = frozenset({"priority_aging_s", "priority_hold_s", "priority_step_stretch"})
# A change's num_kv_blocks: 0 hands the pool's size back to kv_cache_bytes (EngineConfig's
# None, which in a change means "unchanged"). EngineConfig checks its own num_kv_blocks.
CHANGE_RULES = {**RULES, "num_kv_blocks": Rule(
    _whole(0), "an integer >= 0 (0: the pool's size follows kv_cache_bytes)")}


def check_setting(owner: str, name: str, value: object,
                  rules: Mapping[str, Rule] = RULES) -> None:
    """Raise ValueError naming owner.name and the value unless rules[name] accepts it."""
    rule = rules[name]
    if not rule.accepts(value):
        raise ValueError(f"{owner}.{name}={value!r} is invalid: expected {rule.expected}")


class _RebuildsPool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                    omit_defaults=True):
    """The settings the KV pool is built from: changing one rebuilds it, preempting the running
    requests onto the new pool (they recompute and go on)."""
    block_size: int | None = None
    kv_dtype: str | None = None
    kv_rotation: str | None = None
    kv_anchor_tokens: int | None = None
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None  # 0: sized from kv_cache_bytes again
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None


class SettingsChange(_RebuildsPool, kw_only=True, forbid_unknown_fields=True,
                     omit_defaults=True):
    """The settings to change, by EngineConfig's names; None leaves one as it is. The fields
    declared here (scheduling, speculative decoding) are applied in place: the pool, its
    prefix cache and the queues stay. Unknown names and bad values are refused here."""
    scheduling_policy: str | None = None
    priority_aging_s: float | None = None
    max_prefill_tokens_while_decoding: int | None = None
    priority_lower_tokens: int | None = None
    priority_hold_s: float | None = None
    priority_step_stretch: float | None = None
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        # Runs on construction and on decoding alike (msgspec turns the ValueError into a
        # ValidationError there, which the engine's I/O thread answers as `invalid`).
        for name, value in self.changed().items():
            check_setting("SettingsChange", name, value, CHANGE_RULES)
            if name in FLOAT_SETTINGS:
                setattr(self, name, float(value))  # checked above: a number
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and hi < lo:
            raise ValueError(f"SettingsChange.prompt_lookup_max={hi!r} is invalid: expected "
                             f"an integer >= prompt_lookup_min ({lo})")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> SettingsChange:
        """A change from keyword options (`reconfigure(block_size=8)`); an unknown name or a
        bad value raises ValueError naming it."""
        unknown = set(options) - RECONFIGURABLE
        if unknown:
            raise ValueError(f"cannot reconfigure {sorted(unknown)} at run time: "
                             f"allowed are {sorted(RECONFIGURABLE)}")
        try:
            return msgspec.convert(dict(options), cls)
        except msgspec.ValidationError as exc:  # a wrong type, or __post_init__'s refusal
            text, at, where = str(exc).rpartition(" - at `$.")
            name = where.removesuffix("`")
            if not (at and name in options):
                raise ValueError(str(exc)) from None
            raise ValueError(f"SettingsChange.{name}={options[name]!r} is invalid: "
                             f"{text[:1].lower()}{text[1:]}") from None

    def changed(self) -> dict[str, bool | int | float | str]:
        """The settings this change sets, by name, in declaration order."""
        out = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def config_fields(self) -> dict[str, bool | int | float | str | None]:
        """changed() as EngineConfig spells it: num_kv_blocks 0 is its None."""
        out: dict[str, bool | int | float | str | None] = dict(self.changed())
        if out.get("num_kv_blocks") == 0:
            out["num_kv_blocks"] = None
        return out

    @property
    def in_place(self) -> bool:
        """Only settings applied in place. An empty change is not: it rebuilds the pool (an
        empty, cold one; a benchmark's way to start from scratch)."""
        changed = self.changed()
        return bool(changed) and set(changed) <= IN_PLACE_SETTINGS


RECONFIGURABLE = frozenset(SettingsChange.__struct_fields__)
REBUILDS_POOL = frozenset(_RebuildsPool.__struct_fields__)
IN_PLACE_SETTINGS = RECONFIGURABLE - REBUILDS_POOL
