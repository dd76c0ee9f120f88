"""Every message on the wire, as msgspec Structs (msgpack encoded; never pickle).

Command channel (client DEALER -> engine ROUTER): one frame per message, a msgpack map whose
"type" field selects the command. Every command carries an `id` chosen by the client and gets
exactly one reply with the same id: `ok` (with a result) or `error` (machine-readable code and
a human message). Token deltas come back on the same channel as `deltas` messages (one per
step and client, several requests batched).

State channel (engine PUB -> client SUB): two frames, topic and payload. Each topic has its
own sequence number so a subscriber can count what it missed; counters are cumulative so it can
compute rates itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from kvscope.ipc.prompts import ChatMessage as ChatMessage
from kvscope.ipc.prompts import PromptInput, prompt_fields, prompt_of
from kvscope.ipc.settings import SettingsChange

if TYPE_CHECKING:  # annotations only: at run time numpy is imported inside BlocksFrame.array
    import numpy.typing as npt

# 2: the stats frame's engine/config/server parts and the hello/reconfigure configs became
# typed structs (EngineStats, EngineSettings, ServerCounters) instead of free-form maps.
# 3: the blocks frame carries hash_tags (a content tag per prefix-cached block).
# 4: Sampling.priority; per-request priority, queue time and wait reason and the preemptions
# since the last frame in the blocks frame; scheduling settings and decode_path_notice in
# EngineSettings.
PROTOCOL_VERSION = 4
# Bigger command frames are refused by libzmq itself (ZMQ_MAXMSGSIZE) and the peer dropped.
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024

CallId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Scalar = bool | int | float | str | None


class _Command(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    id: CallId


class Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Mirrors engine.SamplingParams; the engine validates the values. Defaults are not sent
    (omit_defaults), so a field added later (speculative) reaches an older engine, which
    forbids unknown fields, only when a client sets it."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    priority: int = 0  # lower = sooner (vLLM's convention)
    speculative: bool = True  # False: never speculate for this request (issue 31)
    repetition_penalty: float = 1.0  # Hugging Face's; 1 = off (issue 53)
    presence_penalty: float = 0.0  # OpenAI's; 0 = off


class Hello(_Command, tag="hello"):
    protocol: int
    client: str = ""


class Submit(_Command, tag="submit"):
    """Exactly one of prompt (raw text), messages (chat template applied) or token_ids:
    checked when it is built or decoded (ipc.prompts), so the engine's I/O thread answers a
    bad one `invalid` and the engine thread never sees it."""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    request_id: str | None = None

    def __post_init__(self) -> None:
        self.typed_prompt()

    def typed_prompt(self) -> PromptInput:
        return prompt_of(self.prompt, self.messages, self.token_ids)

    @classmethod
    def of(cls, prompt: PromptInput, sampling: Sampling | None = None,
           request_id: str | None = None, call_id: int = 0) -> Submit:
        text, messages, token_ids = prompt_fields(prompt)
        return cls(id=call_id, prompt=text, messages=messages, token_ids=token_ids,
                   sampling=sampling or Sampling(), request_id=request_id)


class Abort(_Command, tag="abort"):
    request_id: str


class Reconfigure(_Command, tag="reconfigure"):
    """The settings to change (ipc.settings): an unknown name or a bad value fails decoding,
    answered `invalid` by the engine's I/O thread; what only the engine can tell (a pool too
    small for a running request, no memory) it answers `refused`."""
    changes: SettingsChange


class Snapshot(_Command, tag="snapshot"):
    pass


class Shutdown(_Command, tag="shutdown"):
    pass


class TraceStart(_Command, tag="trace_start"):
    """Record the session to a new JSONL trace at path (on the engine's machine): relative
    to the engine's trace folder (HelloResult.trace_dir), or absolute inside it; anything
    else, and an existing file, is refused. include_prompts=False: prompt lengths only."""
    path: str
    include_prompts: bool = True


class TraceStop(_Command, tag="trace_stop"):
    pass


Command = Hello | Submit | Abort | Reconfigure | Snapshot | Shutdown | TraceStart | TraceStop


# -- engine -> client on the command channel ----------------------------------------------
class Ok(msgspec.Struct, tag_field="type", tag="ok"):
    id: int
    result: msgspec.Raw  # decoded by the client into the command's result type


class Error(msgspec.Struct, tag_field="type", tag="error"):
    id: int | None  # None when the request was too broken to carry an id
    code: str
    message: str


class Delta(msgspec.Struct, kw_only=True):
    """New tokens of one request. Timings in seconds since the request arrived."""
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    queued_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first token
    num_output_tokens: int = 0  # tokens so far, this delta included
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # speculative decoding, this request so far (issue 31): verifies that carried a draft
    # and drafted tokens accepted; mean acceptance length = 1 + accepted / drafts
    num_drafts: int = 0
    num_accepted_tokens: int = 0
    # Of num_cached_tokens, what the KV tiers gave back (issue 56): host memory, and disk
    # (a conversation resumed after a restart: "prefix from disk: N tokens").
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0


class Deltas(msgspec.Struct, tag_field="type", tag="deltas"):
    items: list[Delta]


Reply = Ok | Error | Deltas


# -- the engine's settings and counters ------------------------------------------------------
class EngineSettings(msgspec.Struct, kw_only=True):
    """The EngineConfig in force, as it was given: "auto" stays "auto" here (EngineStats has
    what it resolved to). Field for field engine.config.EngineConfig."""
    model: str  # "default", a checkpoint folder or a .gguf file
    device: str  # "auto", "cpu", "cuda"
    dtype: str
    weights: str
    block_size: int
    kv_dtype: str
    kv_rotation: str
    kv_anchor_tokens: int
    kv_cache_bytes: int
    num_kv_blocks: int | None  # None: the pool's size follows from kv_cache_bytes
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None  # None: the model's own limit (HelloResult.max_model_len)
    enable_prefix_caching: bool
    seed: int
    # Not an EngineConfig field: the engine's one-line notice that the model's decode takes
    # its slower ordinary path (engine.model.fused.decode.decode_path_notice); "" when none.
    decode_path_notice: str = ""
    # Added with issue 26 (defaults: an older engine sends neither).
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lower Sampling.priority sooner)
    priority_aging_s: float = 0.0  # effective priority -1 per this many s waited; 0 = off
    max_prefill_tokens_while_decoding: int = 0  # per-step prefill cap while decoding; 0 = off
    priority_lower_tokens: int = 0  # less urgent tokens per protected step; 0 = off
    priority_hold_s: float = 0.0  # protected steps go on this long after the urgent ones left
    # Added later in issue 26: an older engine sends none (1: the lower tokens only).
    priority_step_stretch: float = 1.0  # protected step <= this x the urgent work's own time
    # Added with issue 31 (speculative decoding; an older engine sends none: off).
    speculative_method: str = "off"  # "off" or "ngram" (prompt lookup)
    num_speculative_tokens: int = 4  # K drafted tokens per verify
    prompt_lookup_min: int = 2  # shortest suffix n-gram looked up
    prompt_lookup_max: int = 4  # longest
    # Added with issue 56 (KV tiers; an older engine sends none: off).
    kv_offload_bytes: int = 0  # host-memory tier for evicted cached blocks; 0 = off
    kv_disk_bytes: int = 0  # disk tier, kept across restarts; 0 = off
    kv_disk_dir: str = ""  # "": under the user's cache folder
    # Added with issue 54 (an older engine sends none: graphs were not there).
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps


class EngineStats(msgspec.Struct, kw_only=True):
    """LLMEngine.stats(): the KV pool as built (resolved dtype and rotation), its blocks now,
    the queues now, cumulative counters, and where the model runs."""
    # the pool
    num_kv_blocks: int
    block_size: int
    kv_dtype: str  # resolved: "float32", "bfloat16", "int8", "fp8", ...
    kv_rotation: str  # resolved: "calibrated", "hadamard" or "none"
    kv_rotation_matrix: str | None  # the head dim's rotation; None: K/V stored unrotated
    kv_bytes_per_token: int  # scale caches included
    kv_anchor_tokens: int  # exact first positions the pool keeps (0: none, float pools)
    kv_anchor_bytes: int
    kv_cache_bytes: int  # the whole pool, scale caches included
    num_free_blocks: int  # prefix-cached ones included
    num_cached_blocks: int
    num_used_blocks: int
    # the queues now
    num_running: int
    num_waiting: int
    # cumulative
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    # the model
    max_model_len: int
    device: str  # "cpu", "cuda", "cuda:1"
    dtype: str  # the model's: "float32", "bfloat16", ...
    weights: str  # matmul weights: "dense", "int4", "int8"
    # speculative decoding, cumulative (issue 31; defaults: an older engine sends none)
    spec_method: str = "off"  # "off" or "ngram" in force
    spec_num_drafts: int = 0  # verifies that carried a draft
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []  # accepted drafts by position in the draft
    # KV tiers beyond the pool (issue 56; an older engine sends none: no tiers). Now:
    kv_host_blocks: int = 0  # blocks in the host-memory tier
    kv_host_bytes: int = 0
    kv_host_capacity_bytes: int = 0  # --kv-offload-bytes (0: no host tier)
    kv_host_capacity_blocks: int = 0
    kv_disk_blocks: int = 0  # block files in the disk tier's folder (any key)
    kv_disk_bytes: int = 0
    kv_disk_capacity_bytes: int = 0  # --kv-disk-bytes (0: no disk tier)
    # ... and cumulative:
    kv_offloaded_blocks: int = 0  # pool -> host copies
    kv_offloaded_bytes: int = 0
    kv_onboarded_host_blocks: int = 0  # host -> pool copies
    kv_onboarded_disk_blocks: int = 0  # disk -> pool loads
    kv_onboarded_bytes: int = 0
    kv_disk_written_blocks: int = 0
    kv_disk_refused_blocks: int = 0  # bad key, checksum or size: deleted, never loaded
    prefix_cache_hits_host: int = 0  # of prefix_cache_hits, tokens the host tier gave back
    prefix_cache_hits_disk: int = 0  # ... and the disk tier
    # CUDA graphs for decode steps (issue 54; an older engine sends none: off).
    cuda_graphs: str = "off"  # "on (cuda)", "on (recorded)" (the CPU stand-in) or "off"
    cuda_graphs_reason: str = ""  # why off: "enforce_eager", "self-check failed: ..."
    cuda_graph_sizes: list[int] = []  # the captured batch-size buckets
    cuda_graph_capture_s: float = 0.0
    cuda_graph_bytes: int = 0  # the graphs' shared memory pool
    steps_by_path: dict[str, int] = {}  # "graph:16", "eager:prefill", ... -> steps, cumulative

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verify (1 + accepted per draft, vLLM's measure); 0.0 before any."""
        d = self.spec_num_drafts
        return 1.0 + self.spec_num_accepted_tokens / d if d else 0.0


class KVEventCounters(msgspec.Struct, kw_only=True):
    """The vLLM KV-event publisher's cumulative counters (engine.server.kv_events)."""
    batches: int  # handed to the publisher
    events: int
    batches_dropped: int  # the publisher was stuck: never waited for
    publish_s: float  # engine-thread seconds spent on them
    replays: int  # replay requests answered
    bad_replays: int


class ServerCounters(msgspec.Struct, kw_only=True):
    """The engine server's cumulative counters, and what is in flight over HTTP."""
    requests: int  # accepted submits, ZeroMQ and HTTP
    finished: int
    aborted: int
    errors: int  # commands answered with an error
    bad_frames: int  # command frames refused before the engine saw them
    dropped_replies: int  # replies to gone or hopelessly slow clients
    http_in_flight: int  # live requests that came over the OpenAI HTTP API
    publish_s: float  # engine-thread seconds spent building state frames
    kv_events: KVEventCounters | None = None  # None: the server publishes no KV events


# -- results ---------------------------------------------------------------------------------
class HelloResult(msgspec.Struct):
    protocol: int
    engine_version: str
    model: str
    pid: int
    config: EngineSettings
    max_model_len: int
    max_message_bytes: int
    metrics_url: str | None = None  # Prometheus /metrics, when the engine serves it
    http_url: str | None = None  # the OpenAI-compatible API's base URL (…/v1), when served
    trace_dir: str | None = None  # trace_start writes only under this folder (engine side)


class SubmitResult(msgspec.Struct):
    request_id: str
    num_prompt_tokens: int


class AbortResult(msgspec.Struct):
    aborted: bool  # False: it had already finished
    finish_reason: str | None = None


class ReconfigureResult(msgspec.Struct):
    config: EngineSettings


class ShutdownResult(msgspec.Struct):
    aborted: list[str]


class TraceResult(msgspec.Struct):
    recording: bool  # whether a trace is being recorded after this command
    path: str | None = None  # the trace started or stopped (None: there was none)
    bytes: int = 0  # its size on disk now


# Error codes (Error.code).
MALFORMED = "malformed"  # not one msgpack map in one frame
UNKNOWN_TYPE = "unknown_type"
INVALID = "invalid"  # wrong or missing field
VERSION_MISMATCH = "version_mismatch"
BAD_REQUEST = "bad_request"  # the engine refused the values (prompt, sampling)
UNKNOWN_REQUEST = "unknown_request"
REFUSED = "refused"  # reconfigure refused; the old configuration stays
OVERLOADED = "overloaded"
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal"


# -- state channel (PUB) -------------------------------------------------------------------
class StepRecord(msgspec.Struct, array_like=True):
    """One engine step, compact (a msgpack array); frames carry every step since the last."""
    step: int
    time: float  # wall clock at the step's end
    duration_s: float
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    num_running: int
    num_waiting: int


class ScheduledItem(msgspec.Struct, array_like=True):
    request_id: str
    num_tokens: int
    is_decode: bool


class StepFrame(msgspec.Struct, kw_only=True):
    seq: int
    time: float  # wall clock (time.time()) at the end of `step`
    step: int  # steps run so far (the latest step's index + 1)
    duration_s: float
    scheduled: list[ScheduledItem]
    batch_size: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_tokens: int  # the part of the token budget this step used
    token_budget: int  # max_num_batched_tokens
    num_running: int
    num_waiting: int
    num_preempted: int  # waiting again after a preemption
    preemptions_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    history: list[StepRecord]  # the steps since the previous frame (bounded)
    history_dropped_total: int  # steps that fell off that bound, cumulative
    # Added with issue 55 (a dense model, or an older engine, sends none): tokens routed to
    # each expert in this step, summed over the MoE layers (a token counts once per layer).
    expert_load: list[int] | None = None
    # Added with issue 54: the latest step's path, "graph:16" (its bucket) or "eager:prefill"
    # and the like (why eager); "" from an older engine.
    step_path: str = ""


class PreemptionEvent(msgspec.Struct, array_like=True):
    """A running request the scheduler preempted: its blocks were freed (the request waits
    to be recomputed). reason: "memory" (the pool ran dry) or "priority" (a more urgent
    waiting request displaced it)."""
    request_id: str
    reason: str
    block_ids: list[int]  # its block table's blocks as they were freed
    priority: int = 0
    step: int = 0  # the engine step (num_steps after it) that preempted it


# BlocksFrame.flags bits
BLOCK_FREE, BLOCK_CACHED, BLOCK_USED = 0, 1, 2
BLOCK_STATE_MASK = 0b11
BLOCK_HAS_HASH = 0b100
# Per-block arrays travel as raw little-endian bytes in the narrowest integer type that holds
# them (BlocksFrame.dtypes); only these numpy dtype strings are accepted.
ArrayDtype = Literal["|u1", "|i1", "<u2", "<i2", "<u4", "<i4"]
WIDE_DTYPES: dict[str, ArrayDtype] = {"owner": "<i4", "filled": "<u2", "ref_count": "<u2",
                                      "flags": "|u1", "table_offsets": "<i4", "tables": "<i4",
                                      "hash_tags": "<u4"}


class BlocksFrame(msgspec.Struct, kw_only=True):
    """The KV pool as it is. Arrays are raw bytes (dtype in `dtypes`) so 32k blocks stay a
    memcpy to encode and decode; `array(name)` gives them back as numpy arrays."""
    seq: int
    time: float
    step: int
    num_blocks: int
    block_size: int
    owner: bytes  # index into request_ids of the first holder, -1 when nobody holds it
    filled: bytes  # tokens written into the block
    ref_count: bytes
    flags: bytes  # state in bits 0-1 (BLOCK_FREE/CACHED/USED), BLOCK_HAS_HASH
    request_ids: list[str]  # running requests, then waiting ones
    request_running: list[bool]
    num_tokens: list[int]
    num_computed_tokens: list[int]
    table_offsets: bytes  # request i's block table is tables[offsets[i]:offsets[i+1]]
    tables: bytes  # logical -> physical block ids, concatenated
    used: int
    free: int  # truly free
    cached: int  # free but still holding a prefix-cache entry
    tokens_stored: int
    internal_waste_slots: int  # allocated slots not yet written
    reserved_max_len_blocks: int  # blocks if every live request reserved max_model_len
    reserved_request_blocks: int  # blocks if each reserved prompt + max_tokens
    # Where each live request came from when not over ZeroMQ ("http"), by request id.
    request_sources: dict[str, str] = {}
    # The low 32 bits of the content hash of each block whose flags carry BLOCK_HAS_HASH, in
    # block-id order (sparse: nothing for unhashed blocks). Equal tag on the same block id in
    # two frames means the same cached content (up to a 1 in 2**32 collision), which is how a
    # viewer tells "still cached" from "evicted and refilled" between frames.
    hash_tags: bytes = b""
    # Dtype of each array; the engine narrows them, the default is the widest it sends.
    dtypes: dict[str, ArrayDtype] = msgspec.field(default_factory=lambda: dict(WIDE_DTYPES))
    # Per live request, in request_ids order (empty from an engine older than issue 26):
    # SamplingParams.priority (lower = sooner), the queue time (arrival -> first scheduled,
    # seconds; None while never scheduled) and why it waits ("" running or not waiting,
    # "budget", "max_num_seqs", "memory", "preempted").
    request_priorities: list[int] = []
    request_queue_s: list[float | None] = []
    request_wait_reasons: list[str] = []
    # Preemptions since the previous blocks frame (the engine steps more often than it
    # publishes; a bounded backlog, oldest first).
    preemptions: list[PreemptionEvent] = []
    # Blocks that held speculative draft slots rolled back since the previous frame (issue
    # 31; the map marks them briefly).
    rolled_back_blocks: list[int] = []
    # The KV tiers beside the pool (issue 56; 0 from an engine without them): blocks in the
    # host-memory tier and its capacity in blocks, block files in the disk tier and their bytes.
    tier_host_blocks: int = 0
    tier_host_capacity_blocks: int = 0
    tier_disk_blocks: int = 0
    tier_disk_bytes: int = 0

    def array(self, name: str) -> npt.NDArray[Any]:
        import numpy as np

        return np.frombuffer(getattr(self, name), dtype=self.dtypes.get(name, WIDE_DTYPES[name]))

    def block_tags(self) -> npt.NDArray[Any]:
        """One content tag per block (int64), -1 where the block has no hash (or the sender
        sent no tags)."""
        import numpy as np

        tags = np.full(self.num_blocks, -1, np.int64)
        hashed = np.flatnonzero(self.array("flags") & BLOCK_HAS_HASH)
        try:
            sent = self.array("hash_tags")
        except ValueError:  # not a whole number of tags: a damaged frame tells nothing
            return tags
        if len(sent) == len(hashed):
            tags[hashed] = sent
        return tags

    def block_table(self, request_id: str) -> list[int]:
        i = self.request_ids.index(request_id)
        offsets = self.array("table_offsets")
        # tolist() is Any to mypy; the tables are integer arrays, so it gives ints
        ids: list[int] = self.array("tables")[offsets[i]:offsets[i + 1]].tolist()
        return ids


class Percentiles(msgspec.Struct, array_like=True):
    p50: float | None
    p90: float | None
    p99: float | None
    count: int


class StatsFrame(msgspec.Struct, kw_only=True):
    seq: int
    time: float
    step: int
    uptime_s: float
    window_s: float  # rates are over the last window_s seconds
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    ttft_s: Percentiles  # over the most recent requests
    itl_s: Percentiles  # inter-token latency over the most recent tokens
    kv_usage: float  # used blocks / all blocks
    engine: EngineStats  # LLMEngine.stats(): the pool, queues, cumulative counters
    config: EngineSettings  # the EngineConfig in force
    server: ServerCounters
    # Cumulative preemptions by reason ("memory", "priority"), and the tokens they threw
    # away that had to be computed again (issue 26; empty / 0 from an older engine).
    preemptions_by_reason: dict[str, int] = {}
    recomputed_tokens: int = 0
    # Steps of less urgent work a more urgent arrival cut short (engine.model.step_interrupt; 0
    # from an older engine).
    interrupted_steps: int = 0


class Heartbeat(msgspec.Struct, kw_only=True):
    seq: int
    time: float
    step: int
    uptime_s: float
    pid: int
    busy: bool
    bad_frames: int


class DeviceProcess(msgspec.Struct, array_like=True):
    """A process using the GPU, as nvidia-smi and nvitop list them (NVML)."""
    pid: int
    name: str  # its command name, "" when this pid namespace cannot see it
    bytes: int | None  # its device memory; None when the driver does not say


class DeviceFrame(msgspec.Struct, kw_only=True):
    """The engine's device, sampled about once a second. Bytes are plain byte counts. A field
    is None when this device or machine cannot tell it (no NVML, no CUDA), never a guess.

    `memory_*` is the whole device: the card on CUDA, system RAM on CPU. `process_bytes` is
    what the engine process holds there (CUDA: NVML's per-process figure, as nvidia-smi shows
    it, else the torch allocator's reserve; CPU: resident set size, as ps shows it). Its parts:
    weights + kv_pool (scale caches included) + activations + allocator_free + other, where
    other is the rest of process_bytes (CUDA context, Python, libraries). kv_used and
    kv_cached are the parts of kv_pool that live and prefix-cached blocks take."""
    seq: int
    time: float
    pid: int
    device: str  # "cuda:0", "cpu"
    name: str  # the GPU's or CPU's model name
    memory_total: int
    memory_used: int  # by every process
    memory_free: int  # available to allocate (CPU: MemAvailable)
    process_bytes: int
    process_source: str  # "nvml", "torch" or "rss": where process_bytes came from
    weights_bytes: int
    kv_pool_bytes: int
    kv_used_bytes: int
    kv_cached_bytes: int
    activations_bytes: int | None = None  # CUDA: torch allocated - weights - KV pool
    allocator_free_bytes: int | None = None  # CUDA: torch reserved - allocated
    other_bytes: int = 0
    gpu_utilization: float | None = None  # percent of time a kernel ran (NVML)
    memory_utilization: float | None = None  # percent of time memory was read/written (NVML)
    memory_clock_mhz: float | None = None
    memory_clock_max_mhz: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    cpu_percent: float | None = None  # the engine process; 100 = one core busy
    num_cpus: int = 1
    system_cpu_percent: float | None = None  # the whole machine, 0-100
    processes: list[DeviceProcess] = []  # everyone on the GPU, the engine included (NVML)


class SnapshotResult(msgspec.Struct):
    step: StepFrame | None  # None before the first step
    blocks: BlocksFrame
    stats: StatsFrame


TOPIC_TYPES: dict[str, type] = {"step": StepFrame, "blocks": BlocksFrame, "stats": StatsFrame,
                                "device": DeviceFrame, "heartbeat": Heartbeat}
TOPICS = tuple(TOPIC_TYPES)
