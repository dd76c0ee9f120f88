"""Engine configuration: every knob the user can turn, validated up front."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NoReturn

from kvscope.ipc.messages import EngineSettings
from kvscope.ipc.settings import FLOAT_SETTINGS, RULES, check_setting

# The settings a running engine can change, their names and limits, are defined once in
# ipc/settings.py (the window reads them too); re-exported here for the engine's commands.
from kvscope.ipc.settings import KV_ROTATIONS as KV_ROTATIONS
from kvscope.ipc.settings import MAX_KV_ANCHOR_TOKENS as MAX_KV_ANCHOR_TOKENS
from kvscope.ipc.settings import MAX_SPECULATIVE_TOKENS as MAX_SPECULATIVE_TOKENS
from kvscope.ipc.settings import SCHEDULING_POLICIES as SCHEDULING_POLICIES
from kvscope.ipc.settings import SPECULATIVE_METHODS as SPECULATIVE_METHODS
from kvscope.kvmath.kv_dtypes import KV_DTYPES as KV_DTYPES
from kvscope.kvmath.kv_dtypes import ONE_BYTE_KV_DTYPES

if TYPE_CHECKING:  # annotations only: at run time the functions below import torch lazily
    import torch

MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
# Matmul weights: dense in the model dtype, or weight-only int4 / int8 (CPU); see
# engine.model.weight_formats. 'auto' by default (resolve_weights): int4 on a CPU when the
# checkpoint is 4-bit already (the embedded Q4_1 GGUF), where it is about twice the speed of
# dense float32 and agrees with Hugging Face float32 on most greedy replies
# (docs/cpu-speed.md); dense everywhere else. 'dense' is the token-exact choice.
WEIGHT_FORMATS = ("auto", "dense", "int4", "int8")
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
# Anchor tokens (engine/kv_cache/anchors.py): a 1-byte pool keeps the first N positions of each
# opening exact in a small fixed table beside it (no bytes per token); 0 turns them off.
# 4 by default: on the embedded model int8's mean KL from float32 KV falls 40 %
# (engine/measure/kv_accuracy.py, docs/kv-dtypes.md). Float pools ignore it.
DEFAULT_KV_ANCHOR_TOKENS = 4
# Scheduling (engine/scheduling/scheduler.py). "priority" by default: with every request at the
# default priority 0 it schedules exactly as "fcfs" does
# (tests/engine/scheduling/test_priority_properties.py checks it step for step), so it costs nothing
# until a client sets a priority, and the window's chat (priority -1) then overtakes background work
# out of the box.
# Aging: a request's effective priority improves by 1 per this many seconds since it arrived, so a
# stream of urgent work cannot starve the rest; 0 = off. 60 s, measured
# (benchmarks/serving/priority_latency.py, README): at 10 s, background requests queued more than
# 10 s on a saturated 2-core box outranked each new chat, whose TTFT p99 went to 21 s; at 60 s the
# chat stays ahead of anything that has waited under a minute.
DEFAULT_PRIORITY_AGING_S = 60.0
# While decodes run, a step carries at most this many prefill tokens (at least a block's
# worth, so a prefill always progresses); 0 = off, the whole max_num_batched_tokens budget.
# Every running decode waits for the whole step. Measured beside 16 background streams
# (README): no cap, the chat's ITL p99 was 1.4 s; 64, 0.34 s; 32, 0.23 s, with background
# throughput the same at 64 and 32 (0.8x of it alone, 0.88x with no cap).
DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING = 32
# Protected steps (engine/scheduling/scheduler.py, docs/scheduling.md): while a request of higher
# priority is live, or left less than priority_hold_s ago, a step carries at most
# priority_lower_tokens tokens of less urgent work (round-robin); 0 = off. 8 by default, measured
# beside 16 background streams over the OpenAI API (benchmarks/serving/priority_latency.py, 60 s
# phases, 2026-12-06): the chat's TTFT p99 243 -> 74 ms and ITL p99 139 -> 28 ms (1.66x idle), for
# 1-3 % of the background's throughput (105.3 against 108.2 tok/s; measured in alternating windows
# later that day, 7 %: 0.83x -> 0.76x of the background alone). It used to cost the background
# 0.3-0.6x, while float32 KV left its prompts short of memory.
DEFAULT_PRIORITY_LOWER_TOKENS = 8
# ... and more while the step's predicted time (engine/scheduling/step_cost.py, learned from the
# protected steps run) stays within this many times what the urgent decodes cost alone; 1 =
# the tokens only. 2: the chat's ITL p99 within the 2x idle asked on both CPUs measured. On
# an AVX2 EPYC (2026-12-07, 60-second windows) 2 gave 1.96x and 3 4.11x (20-second windows:
# 1.5 1.60x, 2 1.66x, 2.5 1.98x, 3 3.49x), the background's computed tokens 0.55-0.70x of
# alone at every stretch (there the chat's own steps bound it); on the AMX Xeon (2026-12-06)
# 2.5 gave 1.41x and 3 1.72x, 3 keeping 5-7 % more of the background than 1.
DEFAULT_PRIORITY_STEP_STRETCH = 2.0
# Protected steps went on this long after the urgent requests left, so a chat's next turn
# started within a short step. Since a step of only less urgent work gives way to an urgent
# arrival (engine/model/step_interrupt.py) that costs the background more than it saves: with the
# 4-bit tiles, 5 s kept it at 0.51x of its output alone, 0 at 0.68x, the chat's TTFT p99
# 1.34x and 1.04x idle (docs/scheduling.md). 0 by default.
DEFAULT_PRIORITY_HOLD_S = 0.0
# KV tiers beyond the pool (engine/kv_cache/tiers.py, docs/kv-tiers.md): host memory for the
# cached blocks the pool evicts, and a disk folder that keeps them across restarts; 0 = off.
DEFAULT_KV_OFFLOAD_BYTES = 0
DEFAULT_KV_DISK_BYTES = 0


def _fail(field: str, value: object, allowed: str) -> NoReturn:
    raise ValueError(f"EngineConfig.{field}={value!r} is invalid: expected {allowed}")


@dataclass
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"
    block_size: int = 16
    kv_dtype: str = "auto"
    kv_rotation: str = "auto"
    kv_anchor_tokens: int = DEFAULT_KV_ANCHOR_TOKENS
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    scheduling_policy: str = "priority"
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S
    max_prefill_tokens_while_decoding: int = DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING
    priority_lower_tokens: int = DEFAULT_PRIORITY_LOWER_TOKENS
    priority_hold_s: float = DEFAULT_PRIORITY_HOLD_S
    priority_step_stretch: float = DEFAULT_PRIORITY_STEP_STRETCH
    speculative_method: str = "off"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    kv_offload_bytes: int = DEFAULT_KV_OFFLOAD_BYTES
    kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES
    kv_disk_dir: str = ""  # "": under the user's cache folder (engine.kv_cache.disk_tier)
    # Decode steps replay CUDA graphs per batch-size bucket (engine/cuda_graphs, CUDA only,
    # behind a start-up self-check); True runs every step eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            _fail("model", self.model, '"default", a checkpoint folder or a .gguf file')
        if self.device not in DEVICES:
            _fail("device", self.device, f"one of {DEVICES}")
        if self.dtype not in MODEL_DTYPES:
            _fail("dtype", self.dtype, f"one of {MODEL_DTYPES}")
        if self.weights not in WEIGHT_FORMATS:
            _fail("weights", self.weights, f"one of {WEIGHT_FORMATS}")
        for name in RULES:  # what a running engine may change: ipc.settings' rules
            check_setting("EngineConfig", name, getattr(self, name))
        for name in FLOAT_SETTINGS:
            setattr(self, name, float(getattr(self, name)))  # the wire's type (EngineSettings)
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks)
                                               or self.num_kv_blocks < 1):
            _fail("num_kv_blocks", self.num_kv_blocks, "None or an integer >= 1")
        if self.max_model_len is not None and (not _is_int(self.max_model_len)
                                               or self.max_model_len < 2):
            _fail("max_model_len", self.max_model_len, "None or an integer >= 2")
        if not _is_int(self.seed):
            _fail("seed", self.seed, "an integer")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if hi < lo:
            _fail("prompt_lookup_max", hi, f"an integer >= prompt_lookup_min ({lo})")
        if not isinstance(self.enforce_eager, bool):
            _fail("enforce_eager", self.enforce_eager, "True or False")
        self._validate_tiers()

    def _validate_tiers(self) -> None:
        for name in ("kv_offload_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                _fail(name, value, "an integer >= 0 (0: off)")
        if not isinstance(self.kv_disk_dir, str):
            _fail("kv_disk_dir", self.kv_disk_dir, 'a folder path, or "" for the default')
        tiered = self.kv_offload_bytes > 0 or self.kv_disk_bytes > 0
        if tiered and self.kv_dtype in ONE_BYTE_KV_DTYPES and self.kv_anchor_tokens > 0:
            # Anchor rows are kept per opening beside the pool, not per block, so a block
            # copied back from a tier would be read without the exact rows a recompute fills.
            raise ValueError(
                f"EngineConfig.kv_anchor_tokens={self.kv_anchor_tokens} is invalid with KV "
                f"tiers (kv_offload_bytes/kv_disk_bytes) on a {self.kv_dtype} pool: anchor "
                "tokens are kept per opening, not per block, so tiered blocks cannot carry "
                "them; set kv_anchor_tokens=0 (--kv-anchor-tokens 0) or turn the tiers off")

    def to_dict(self) -> dict[str, str | int | bool | None]:
        return asdict(self)

    def settings(self) -> EngineSettings:
        """This configuration as the wire carries it (hello, reconfigure, stats frames)."""
        return EngineSettings(**asdict(self))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_device(device: str) -> str:
    """'auto' picks CUDA when a GPU is visible, else the CPU."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("EngineConfig.device='cuda' is invalid: no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """'auto' means float32 on CPU (bf16 matmuls are slow there) and bfloat16 on CUDA."""
    import torch

    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    resolved: torch.dtype = getattr(torch, dtype)  # getattr is Any; MODEL_DTYPES are dtypes
    return resolved


def resolve_kv_dtype(kv_dtype: str, model_dtype: str, device: str,
                     weights: str = "dense") -> torch.dtype:
    """The pool's storage dtype. Refuses what the device can't do.

    'auto' follows the model, except a float32 model on the CPU with quantized weights
    (`weights`, as resolve_weights resolved it: int4 for the embedded Q4_1 checkpoint, the CPU
    default), which gets bfloat16: those steps already round every matmul input to bfloat16,
    and a bfloat16 KV added 0.2 % to their KL from dense float32 (5.19e-3 against 5.18e-3),
    for half the bytes per token and 1.1-1.4x the decode speed (docs/notes/settled-experiments.md,
    docs/kv-dtypes.md, "The CPU default"). Dense weights keep float32 KV, the setting whose
    greedy output equals Hugging Face's."""
    import torch

    if kv_dtype == "auto":
        model = resolve_dtype(model_dtype, device)
        if device == "cpu" and weights != "dense" and model == torch.float32:
            return torch.bfloat16
        return model
    if kv_dtype == "int8":
        return torch.int8
    # getattr is Any; the other KV_DTYPES left here name torch dtypes
    dtype: torch.dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else getattr(torch, kv_dtype)
    if device == "cuda":
        check_cuda_supports(kv_dtype, dtype)
    return dtype


# "auto" rotation: "calibrated" for the 1-byte dtypes, where it halves int8's KL from float32
# again after the rotation's 4.4x (fp8: 1.9x in all; engine/measure/kv_accuracy.py,
# docs/kv-dtypes.md), "none" for the float ones, where nothing is lost to begin with.
ROTATED_BY_DEFAULT = ONE_BYTE_KV_DTYPES


def resolve_kv_rotation(kv_rotation: str, kv_dtype_name: str) -> str:
    """'calibrated', 'hadamard' or 'none'; 'auto' is 'calibrated' for the 1-byte pools."""
    if kv_rotation == "auto":
        return "calibrated" if kv_dtype_name in ROTATED_BY_DEFAULT else "none"
    return kv_rotation


def check_cuda_supports(name: str, dtype: torch.dtype) -> None:
    import torch

    major, minor = torch.cuda.get_device_capability()
    need = {torch.float8_e4m3fn: (8, 9), torch.bfloat16: (8, 0)}.get(dtype)
    if need and (major, minor) < need:
        gpu = torch.cuda.get_device_name()
        raise ValueError(f"EngineConfig.kv_dtype={name!r} is not supported on {gpu} "
                         f"(compute capability {major}.{minor}; needs {need[0]}.{need[1]}+)")
