"""The session trace format (JSONL): one header line, then one event per line.

Every line is a msgspec Struct tagged by its "ev" field. Times `t` are seconds since the
header's clock anchor (`monotonic`); `wall_time` is the same instant on the wall clock.
"""
from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1


class TraceError(ValueError):
    """A trace file that does not validate; the message names the line and the reason."""


class _Line(msgspec.Struct, tag_field="ev", forbid_unknown_fields=True, omit_defaults=True):
    pass


class Header(_Line, tag="header"):
    schema_version: int
    kvscope_version: str
    model: str
    device: str
    dtype: str
    kv_dtype: str
    block_size: int
    num_kv_blocks: int
    config: dict[str, str | int | float | bool | None]
    wall_time: float
    monotonic: float
    include_prompts: bool
    kv_rotation: str = "none"  # resolved: "calibrated", "hadamard" or "none" (older traces: "none")


class Arrival(_Line, tag="arrival"):
    t: float
    id: str
    prompt_len: int
    sampling: dict[str, int | float | bool | str | None | list[int | str]]
    prompt: list[int] | None = None


class Step(_Line, tag="step"):
    t: float
    dur: float
    # [request id, tokens scheduled] per scheduled request
    seqs: list[tuple[str, int]]
    batch_size: int
    tokens: int
    budget: int
    kv_used: int
    kv_total: int
    kv_tokens: int
    running: int
    waiting: int


class Alloc(_Line, tag="alloc"):
    t: float
    id: str
    blocks: list[int]


class Free(_Line, tag="free"):
    t: float
    id: str
    blocks: list[int]


class Preempt(_Line, tag="preempt"):
    t: float
    id: str


class Token(_Line, tag="token"):
    t: float
    id: str
    tokens: list[int]


class Finish(_Line, tag="finish"):
    t: float
    id: str
    reason: str


class Abort(_Line, tag="abort"):
    t: float
    id: str


class Reconfigure(_Line, tag="reconfigure"):
    """The pool was rebuilt under a new config; live requests start over (recompute)."""
    t: float
    config: dict[str, str | int | float | bool | None]
    kv_dtype: str
    block_size: int
    num_kv_blocks: int
    kv_rotation: str = "none"


Event = Arrival | Step | Alloc | Free | Preempt | Token | Finish | Abort | Reconfigure
EVENT_TYPES = (Arrival, Step, Alloc, Free, Preempt, Token, Finish, Abort, Reconfigure)
