"""The step-level engine: add and abort requests, run one step, get token deltas.

`LLM.generate` and the server are both loops over `step()`; there is no second path.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

import torch

from kvscope.engine.chat_template import chat_prompt_ids
from kvscope.engine.config import (
    EngineConfig,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
    resolve_kv_rotation,
)
from kvscope.engine.cuda_graphs.backend import GraphBackend
from kvscope.engine.detokenizer import Decoder, decode_delta, decode_rest
from kvscope.engine.kv_cache import memory as kv_memory
from kvscope.engine.kv_cache.block_manager import BlockManager
from kvscope.engine.kv_cache.calibration import calibrate_k_balance
from kvscope.engine.kv_cache.pool import (
    KVPool,
    kv_bytes_per_token,
    num_blocks_for_budget,
    pool_bytes,
)
from kvscope.engine.kv_cache.tiers import KVTiers, model_identity, tiers_for
from kvscope.engine.loading.loader import LoadedModel, load_model
from kvscope.engine.model.family import layer_windows
from kvscope.engine.model.paged_decoder import PagedLlama
from kvscope.engine.model.step_interrupt import (
    StepInterrupt,
    StepInterrupted,
    interrupts_enabled,
)
from kvscope.engine.model.weight_formats import resolve_weights
from kvscope.engine.model_runner import ModelRunner, default_graph_backend, runner_for
from kvscope.engine.outputs import RequestOutput, StepResult, TokenDelta
from kvscope.engine.sampler import make_generator, sample
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduling.roll_back import roll_back
from kvscope.engine.scheduling.scheduler import ScheduledSeq, Scheduler, scheduler_for
from kvscope.engine.scheduling.step_cost import StepShape, step_shape
from kvscope.engine.sequence import Sequence
from kvscope.engine.spec_decode.decoder import SpecDecoder
from kvscope.ipc.messages import EngineStats
from kvscope.ipc.prompts import ChatPrompt, PromptInput, TextPrompt, as_prompt
from kvscope.ipc.settings import SettingsChange
from kvscope.kernels.k_balance import KBalanceLayer
from kvscope.kernels.rotation import matrix_name
from kvscope.kvmath.windows import uniform_window


def kv_dtype_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


class StepRecorder(Protocol):
    """What the engine calls while a trace records (engine.traces.recorder.TraceRecorder, a
    layer above the core, attaches itself as `LLMEngine.trace`)."""

    def on_arrival(self, seq: Sequence) -> None: ...
    def on_abort(self, seq: Sequence) -> None: ...
    def on_reconfigure(self, engine: LLMEngine, live: Iterable[Sequence]) -> None: ...
    def record_step(self, engine: LLMEngine, step: Callable[[], StepResult]) -> StepResult: ...
    def close(self) -> None: ...


class LLMEngine:
    # What _build_pool makes from the config in force, and rebuilds on every reconfigure.
    kv_dtype: torch.dtype
    kv_rotation: str
    pool: KVPool
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 graph_backend: GraphBackend | None = None) -> None:
        """`graph_backend`: how decode steps are captured (engine.cuda_graphs.backend);
        None: CUDA graphs on CUDA, none elsewhere (tests pass the CPU stand-in)."""
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded = loaded or load_model(config.model, self.dtype)
        self.tokenizer = self.loaded.tokenizer
        self._decode = Decoder(self.tokenizer)
        hf = self.loaded.hf_config
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        self.weights = resolve_weights(config.weights, self.device, self.loaded.state_dict)
        self.model = PagedLlama(hf, self.loaded.state_dict, self.device, self.dtype,
                                self.max_model_len, self.weights)
        if loaded is None:
            # The model keeps its own (fused, on-device) tensors; nothing needs the loader's
            # host copies any more, and a caller's `loaded` stays theirs to reuse.
            self.loaded = replace(self.loaded, state_dict={})
        # W when every layer slides the same window W: each running sequence's blocks wholly
        # behind it are freed every step (BlockManager.free_behind_window). 0: keep them all.
        self.reclaim_window = uniform_window(layer_windows(hf))
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self._ids = itertools.count()
        self._rng = make_generator(config.seed)
        self.trace: StepRecorder | None = None  # while a trace records
        # The model's calibrated K balance (kernels/k_balance.py), per layer: computed the
        # first time a pool wants it, then kept across reconfigures. None: not computed yet.
        self._k_balance_layers: list[KBalanceLayer] | None = None
        self._model_identity: str | None = None  # the KV tiers' name for the model
        self.spec = SpecDecoder(config)  # speculative decoding (engine.spec_decode.decoder)
        # A request of higher priority may abandon a step of less urgent work midway.
        self.interrupt = self.model.interrupt = StepInterrupt()
        self._interrupts = interrupts_enabled()
        self.graph_backend = graph_backend or default_graph_backend(self.device)
        self._build_pool(previous=None)

    # -- pool ------------------------------------------------------------------------------
    def _kv_torch_dtype(self, config: EngineConfig) -> torch.dtype:
        return resolve_kv_dtype(config.kv_dtype, config.dtype, self.device, self.weights)

    def _build_pool(self, previous: Scheduler | None) -> None:
        """The pool, block manager, scheduler and runner for the config in force. `previous`
        is the scheduler being replaced (its preemption count is cumulative)."""
        cfg, shape = self.config, self.model.shape
        self.kv_dtype = self._kv_torch_dtype(cfg)
        self.kv_rotation = resolve_kv_rotation(cfg.kv_rotation, kv_dtype_name(self.kv_dtype))
        if previous is not None:
            self._release_pool()
        per_token = kv_bytes_per_token(shape, self.kv_dtype)
        num_blocks = self._pool_blocks(cfg)
        if num_blocks < 1:
            raise ValueError(f"EngineConfig.kv_cache_bytes={cfg.kv_cache_bytes} is invalid: "
                             f"one block of {cfg.block_size} tokens needs "
                             f"{cfg.block_size * per_token} bytes")
        self.pool = KVPool.allocate(shape, num_blocks, cfg.block_size, self.kv_dtype, self.device,
                                    self.kv_rotation, self._k_balance(self.kv_rotation),
                                    cfg.kv_anchor_tokens)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.block_manager.tiers = self._tiers(cfg)
        self.scheduler = scheduler_for(self.block_manager, cfg, previous)
        self.runner = runner_for(self.model, self.pool, self.graph_backend, cfg.max_num_seqs,
                                 self.max_model_len, cfg.enforce_eager)

    def _tiers(self, cfg: EngineConfig) -> KVTiers | None:
        """The host and disk tiers behind this pool's prefix cache, keyed to it; None: off."""
        if cfg.kv_offload_bytes <= 0 and cfg.kv_disk_bytes <= 0:
            return None
        if self._model_identity is None:
            self._model_identity = model_identity(self.loaded.checkpoint,
                                                  self.loaded.hf_config.to_json_string())
        return tiers_for(cfg, self.pool, self._model_identity, str(self.dtype),
                         self.weights, self.device, kv_dtype_name(self.kv_dtype),
                         self.kv_rotation)

    def _release_pool(self) -> None:
        """Let the old pool go (the runner holds it too) and hand its memory back before the
        new one is built, so a rebuild never holds two pools (engine.kv_cache.memory). Absent
        already when a rebuild failed and the old settings are being restored."""
        runner = self.__dict__.get("runner")
        if runner is not None and runner.graphs is not None:  # their memory goes first
            runner.graphs.release()
        for name in ("runner", "pool"):
            self.__dict__.pop(name, None)
        kv_memory.release_freed(self.device)

    def _pool_blocks(self, config: EngineConfig) -> int:
        per_token = kv_bytes_per_token(self.model.shape, self._kv_torch_dtype(config))
        return config.num_kv_blocks or num_blocks_for_budget(
            config.kv_cache_bytes, config.block_size, per_token)

    def _k_balance(self, rotation: str) -> list[KBalanceLayer] | None:
        """The model's calibrated K balance when the pool wants it: computed on first use
        (one forward pass over engine.kv_cache.calibration's text) and kept across reconfigures."""
        if rotation != "calibrated":
            return None
        if self._k_balance_layers is None:
            self._k_balance_layers = calibrate_k_balance(self.model, self.tokenizer,
                                                         self.max_model_len)
        return self._k_balance_layers

    # -- reconfigure -----------------------------------------------------------------------
    def reconfigure(self, change: SettingsChange | None = None, /,
                    **options: object) -> EngineConfig:
        """Apply a SettingsChange (ipc.settings) while requests are in flight; keyword
        options (`reconfigure(kv_dtype="int8")`, the scripts' and tests' shorthand) become one
        first, refused with ValueError when a name or value is bad.

        Scheduling and speculative settings apply in place. Any other rebuilds the KV pool:
        running requests are preempted (recompute) onto the new pool, in their order, so no
        request is lost and their streams simply continue. A setting the whole configuration
        or the device refuses raises ValueError and the old configuration stays in force.
        """
        if change is not None and options:
            raise ValueError("give a SettingsChange or keyword options, not both")
        if change is None:
            change = SettingsChange.from_options(options)
        # Any: the values are the fields' own types, checked by SettingsChange already and
        # by EngineConfig.validate again (the cross-field rules) inside replace().
        fields: dict[str, Any] = change.config_fields()
        new = replace(self.config, **fields)
        if change.in_place:  # the pool and queues stay as they are
            self.config = new
            self.scheduler.configure_from(new)
            self.spec.configure(new)
            if self.trace is not None:
                self.trace.on_reconfigure(self, [])
            return new
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self._check_pool_holds(new, live)
        self._check_memory_holds(new)
        old, previous = self.config, self.scheduler
        self.config = new
        try:
            self._build_pool(previous)
        except Exception as exc:
            self.config = old
            self._build_pool(previous)
            if isinstance(exc, (MemoryError, RuntimeError)):  # torch's OutOfMemoryError too
                raise ValueError(f"the new KV pool could not be allocated ({exc}); the old "
                                 f"one is back") from exc
            raise
        self.spec.configure(new)
        if self.trace is not None:
            self.trace.on_reconfigure(self, live)
        for seq in live:
            seq.reset_for_recompute()
            self.scheduler.add(seq)
        return new

    def _check_pool_holds(self, config: EngineConfig, live: list[Sequence]) -> None:
        blocks = self._pool_blocks(config)
        longest = max((s.num_tokens for s in live), default=0)
        if blocks * config.block_size < max(longest + 1, config.block_size):
            raise ValueError(f"the new KV pool ({blocks} blocks of {config.block_size}) cannot "
                             f"hold a running request of {longest} tokens; keeping the old one")

    def _check_memory_holds(self, config: EngineConfig) -> None:
        """Refuse, before the old pool goes, a new one the device has no room for. The old
        pool is freed first, so its bytes count as room: there is never a two-pool peak."""
        need = pool_bytes(self.model.shape, self._pool_blocks(config), config.block_size,
                          self._kv_torch_dtype(config), config.kv_anchor_tokens)
        old = self.pool.nbytes + self.pool.anchor_nbytes
        room = kv_memory.available_bytes(self.device) + old
        if need > room:
            mib = 2**20
            raise ValueError(f"the new KV pool needs {need / mib:.0f} MiB but only "
                             f"{room / mib:.0f} MiB are free on {self.device} (the old pool's "
                             f"{old / mib:.0f} MiB included); keeping the old one")

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: PromptInput | str | list[int],
                    params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request: a typed prompt (ipc.prompts), or text or token ids (made one
        here). Bad input raises ValueError and leaves the engine untouched."""
        params = params or SamplingParams()
        params.validate()
        token_ids = self.tokenize(prompt)
        self.check_prompt_fits(token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params)
        seed = params.seed if params.seed is not None else \
            int(torch.randint(0, 2**62, (1,), generator=self._rng))
        seq.generator = make_generator(seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        if self.trace is not None:
            self.trace.on_arrival(seq)
        return request_id

    def tokenize(self, prompt: PromptInput | str | list[int]) -> list[int]:
        """The prompt's token ids. Its shape was checked where it was built (ipc.prompts);
        what only the model can tell is checked here: the vocabulary, the chat template."""
        prompt = as_prompt(prompt)
        if isinstance(prompt, TextPrompt):
            # transformers' encode reaches mypy as Any; it returns the ids as a list of ints
            ids: list[int] = self.tokenizer.encode(prompt.text, add_special_tokens=False)
            return ids
        if isinstance(prompt, ChatPrompt):
            try:
                return chat_prompt_ids(self.tokenizer, [{"role": x.role, "content": x.content}
                                                        for x in prompt.messages])
            except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
                raise ValueError(f"chat template failed: {exc}") from None
        vocab = self.model.shape.vocab_size
        bad = [t for t in prompt.token_ids if t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return list(prompt.token_ids)

    def check_prompt_fits(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len="
                             f"{self.max_model_len} allows (at most {self.max_model_len - 1})")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if n + 1 > capacity:
            raise ValueError(f"prompt has {n} tokens but the whole KV pool holds {capacity} "
                             f"({self.block_manager.num_blocks} blocks of "
                             f"{self.block_manager.block_size}); raise kv_cache_bytes")

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        if self.trace is not None:
            self.trace.on_abort(seq)
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_output(self, request_id: str) -> RequestOutput:
        """The request's result; a finished one is forgotten afterwards."""
        seq = self.requests[request_id]
        if seq.is_finished:
            del self.requests[request_id]
        return self.output_of(seq)

    # -- tracing ---------------------------------------------------------------------------
    # Recording starts with engine.traces.recorder.start_trace(engine, path): the recorder sits
    # above the core and attaches itself as `self.trace`.
    def stop_trace(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    # -- the step --------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, run the model once, sample: what was scheduled and what came out."""
        if self.trace is not None:
            return self.trace.record_step(self, self._step)
        return self._step()

    def _step(self) -> StepResult:
        started = time.perf_counter()
        if self.reclaim_window:
            self._free_behind_window()
        bm = self.block_manager
        bm.journal = []
        try:
            batch = self.scheduler.schedule()
        finally:
            registered, bm.journal = bm.journal, None
        self._arm_interrupt(batch)
        deltas = [TokenDelta(s.request_id, [], "", True, s.finish_reason)
                  for s in self._drain_capacity_finishes()]
        if not batch:
            return StepResult(deltas, [])
        drafted = self._draft(batch)
        shape = step_shape((item.seq.num_computed_tokens, item.num_tokens) for item in batch)
        try:
            logits = self.runner.run(batch, drafted)
        except StepInterrupted:
            self.spec.abandon(batch, bm)
            roll_back(bm, batch, registered)
            self.interrupt.num_interrupted += 1
            return StepResult(deltas, [])
        except BaseException:
            self.spec.abandon(batch, bm)
            raise
        finally:
            self.interrupt.disarm()
        if bm.tiers is not None:  # the step's full blocks hold their K/V now
            bm.tiers.after_step(bm, registered)
        sampling = self._advance(batch)
        if drafted:
            deltas += self.spec.verify(self, logits, sampling)
        elif sampling:
            deltas += self._append_tokens(sampling, sample(logits, sampling))
        self.spec.end_step(sum(len(d.token_ids) for d in deltas))
        self.num_steps += 1
        self._observe_cost(shape, time.perf_counter() - started)
        return StepResult(deltas, batch)

    def _observe_cost(self, shape: StepShape, seconds: float) -> None:
        """The scheduler's step-cost models: every step, and the protected ones apart (the
        only steps whose cost is asked for)."""
        sched = self.scheduler
        sched.every_step_cost.observe(shape, seconds)
        if sched.step_is_protected:
            sched.step_cost.observe(shape, seconds)

    def _arm_interrupt(self, batch: list[ScheduledSeq]) -> None:
        """Let a request of higher priority abandon this step (engine.model.step_interrupt): only an
        unprotected step under the priority policy, whose work is all less urgent."""
        if batch and self._interrupts and self.scheduler.policy == "priority" \
                and not self.scheduler.step_is_protected:
            self.interrupt.arm(min(item.seq.params.priority for item in batch))

    def _draft(self, batch: list[ScheduledSeq]) -> bool:
        """Speculative drafts for the step's decodes (engine.spec_decode.decoder); True if any."""
        anchors = self.pool.anchor_table
        return self.spec.draft(batch, self.block_manager, self.config.max_num_batched_tokens,
                               self.max_model_len, anchors.num_tokens if anchors else 0)

    def _free_behind_window(self) -> None:
        """Before scheduling, so the step can already allocate the blocks this releases."""
        bm, window = self.block_manager, self.reclaim_window
        for seq in self.scheduler.running:
            bm.free_behind_window(seq, window)

    def _drain_capacity_finishes(self) -> list[Sequence]:
        done, self.scheduler.finished_by_capacity = self.scheduler.finished_by_capacity, []
        return done

    def _advance(self, batch: list[ScheduledSeq]) -> list[Sequence]:
        """Mark the step's tokens computed; return the sequences that now sample."""
        sampling = []
        prompt_tokens = 0
        for item in batch:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            num_tokens = len(seq.token_ids)
            if num_tokens == len(seq.prompt_token_ids):  # no output yet: prompt work
                prompt_tokens += item.num_tokens
            if seq.num_computed_tokens == num_tokens:
                sampling.append(seq)
        self.num_prompt_tokens += prompt_tokens
        return sampling

    def _append_tokens(self, seqs: list[Sequence], tokens: list[int]) -> list[TokenDelta]:
        """Append each sequence's sampled token, detokenize it and check for a stop.

        One loop over the step's sequences with its lookups hoisted: at 64 sequences this
        runs 64 times a step, and most of a step's host time is such per-sequence work.
        """
        self.num_generated_tokens += len(tokens)
        now = time.monotonic()
        decode, stop_reason = self._decode, self._stop_reason
        deltas = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            text = decode_delta(decode, seq)
            reason = stop_reason(seq, token)
            if reason is not None or seq.params.stop:
                text, reason = self._final_text(seq, text, reason)
            seq.text += text
            if reason is not None:
                self.scheduler.finish(seq, reason)
            deltas.append(TokenDelta(seq.request_id, [token], text, reason is not None, reason))
        return deltas

    def _final_text(self, seq: Sequence, text: str, reason: str | None
                    ) -> tuple[str, str | None]:
        """The delta's text once the stop rules apply: the detokenizer's held-back rest at
        the end, and a cut before a stop string (which also ends the request)."""
        if reason is not None:
            text += decode_rest(self._decode, seq, seq.text + text)
        if seq.params.stop:
            text, hit = self._cut_at_stop_string(seq, text)
            reason = "stop" if hit else reason
        return text, reason

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.loaded.eos_token_ids):
            return "stop"
        num_tokens = len(seq.token_ids)
        if num_tokens - len(seq.prompt_token_ids) >= p.max_tokens \
                or num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, text: str) -> tuple[str, bool]:
        """Cut the reply before the first stop string (which is not returned)."""
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, len(seq.text) - longest + 1)
        combined = seq.text + text
        hits = [i for i in (combined.find(s, window_start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return text, False
        cut = min(hits)
        if cut < len(seq.text):  # the stop string began in text already streamed
            seq.text = seq.text[:cut]
            return "", True
        return combined[len(seq.text):cut], True

    # -- views -----------------------------------------------------------------------------
    def output_of(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids,
                             seq.text, seq.finish_reason, seq.num_cached_tokens,
                             seq.num_preemptions,
                             num_host_cached_tokens=seq.num_host_cached_tokens,
                             num_disk_cached_tokens=seq.num_disk_cached_tokens)

    def stats(self) -> EngineStats:
        bm, pool = self.block_manager, self.pool
        rotated = self.kv_rotation != "none"
        g = self.runner.graph_stats()
        stats = EngineStats(
            cuda_graphs=g.status, cuda_graphs_reason=g.reason, cuda_graph_sizes=g.sizes,
            cuda_graph_capture_s=g.capture_s, cuda_graph_bytes=g.graph_bytes,
            steps_by_path=g.steps_by_path,
            num_kv_blocks=bm.num_blocks, block_size=bm.block_size,
            kv_dtype=kv_dtype_name(self.kv_dtype), kv_rotation=self.kv_rotation,
            kv_rotation_matrix=matrix_name(self.model.shape.head_dim) if rotated else None,
            kv_bytes_per_token=pool.bytes_per_token,
            kv_anchor_tokens=pool.anchor_table.num_tokens
            if pool.anchor_table is not None else 0,
            kv_anchor_bytes=pool.anchor_nbytes, kv_cache_bytes=pool.nbytes,
            num_free_blocks=bm.num_free_blocks, num_cached_blocks=bm.num_cached_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            max_model_len=self.max_model_len, device=self.device,
            dtype=str(self.dtype).removeprefix("torch."), weights=self.weights,
            **self.spec.stats_fields(),
            **(bm.tiers.stats_fields() if bm.tiers is not None else {}))
        return stats
