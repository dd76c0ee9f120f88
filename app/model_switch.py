"""Open another model from the window (File > Open model…): which applied settings carry over
to it and which do not, and the switch itself, which restarts the local engine child on the
new model with them. An attached `kvscope serve` keeps its model: it is chosen where it runs.

Settings applied in the window are saved per model (app.model_settings): starting on a model,
or switching to one, restores what was applied to it before, and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal

from kvscope.app import model_settings
from kvscope.app.calculator.kv_math import concurrent_requests, fit
from kvscope.app.controls.panel import KEYS
from kvscope.app.fmt import human_bytes
from kvscope.app.model_file import ModelFacts
from kvscope.app.traces.panel import engine_args_from
from kvscope.ipc.messages import EngineSettings

# Options tied to the model the engine ran: a switch drops them from the engine's options.
MODEL_OPTIONS = {"--model": True, "--num-kv-blocks": True, "--max-model-len": True}
FIT_REQUEST_TOKENS = 2048  # "what fits" counts concurrent requests of this many tokens


@dataclass
class Carry:
    """What a switch starts the new engine with, and why each setting is or is not there."""
    args: list[str] = field(default_factory=list)  # engine options besides --model
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    restored: bool = False  # the model's own saved settings, not the running model's


@dataclass(frozen=True)
class WhatFits:
    kv_dtype: str
    block_size: int
    budget_bytes: int
    bytes_per_token: int
    tokens: int
    request_tokens: int
    requests: int

    def text(self) -> str:
        return (f"{self.tokens:,} tokens, {self.requests:,} concurrent requests of "
                f"{self.request_tokens:,} tokens, in the KV memory budget of "
                f"{human_bytes(self.budget_bytes)} (KV {self.kv_dtype}, block "
                f"{self.block_size})")


def what_fits(facts: ModelFacts, kv_dtype: str, block_size: int, budget_bytes: int,
              request_tokens: int = FIT_REQUEST_TOKENS) -> WhatFits | None:
    """The KV calculator's answer for this model at the window's budget (None: no shape)."""
    if facts.shape is None:
        return None
    length = min(request_tokens, facts.context_length or request_tokens)
    f = fit(budget_bytes, facts.shape, kv_dtype, block_size)
    return WhatFits(kv_dtype, block_size, budget_bytes, f.bytes_per_token, f.tokens, length,
                    concurrent_requests(budget_bytes, facts.shape, kv_dtype, block_size, length))


def settings_args(config: EngineSettings) -> list[str]:
    """Engine options that start a child with these settings (as app.main_window's restart)."""
    values = {k: getattr(config, k) for k in KEYS}
    return engine_args_from(values, {}) + ["--kv-anchor-tokens", str(config.kv_anchor_tokens)]


def carry_over(applied: EngineSettings | None, saved: EngineSettings | None,
               facts: ModelFacts, base_args: list[str]) -> Carry:
    """The settings a switch to `facts` starts with: the model's own saved ones when it has
    them (restored), else those applied to the running model; a setting the new model cannot
    take is dropped and named."""
    carry = Carry()
    source = saved if saved is not None else applied
    carry.restored = saved is not None
    for option in ("--num-kv-blocks", "--max-model-len"):
        if option in base_args:
            value = base_args[base_args.index(option) + 1]
            if option == "--max-model-len" and facts.context_length and \
                    value.isdigit() and int(value) <= facts.context_length:
                carry.args += [option, value]
                carry.kept.append(f"max model length {value}")
            else:
                carry.dropped.append(f"{option} {value} (set for the model that ran before)")
    if source is None:
        return carry
    args = settings_args(source)
    carry.args += args
    carry.kept += [f"block {source.block_size}", f"KV {source.kv_dtype}",
                   f"{source.max_num_seqs} sequences",
                   f"{source.max_num_batched_tokens:,} batched tokens",
                   "prefix caching " + ("on" if source.enable_prefix_caching else "off")]
    if facts.shape is not None:
        room = fit(source.kv_cache_bytes, facts.shape, source.kv_dtype, source.block_size)
        if room.blocks < 1:
            i = carry.args.index("--kv-cache-bytes")
            del carry.args[i:i + 2]
            carry.dropped.append(
                f"KV memory budget {human_bytes(source.kv_cache_bytes)} (not one block of "
                f"{source.block_size} tokens of this model fits: the engine's default instead)")
            return carry
    carry.kept.append(f"KV memory budget {human_bytes(source.kv_cache_bytes)}")
    return carry


class ModelSwitcher(QObject):
    """The window's side of a switch: restart the local engine child on another model."""

    switched = Signal(str, object)  # the model, its Carry

    def __init__(self, window) -> None:
        super().__init__(window)
        self.window = window
        self.settings = window.settings
        self.pending = False  # a switch waits for its engine's hello
        self.restored: EngineSettings | None = None  # said once the engine is up
        window.engineReady.connect(self._on_ready)

    @property
    def attached(self) -> bool:
        return self.window.engine is None

    @property
    def model(self) -> str:
        return model_settings.model_of(self.window.base_engine_args)

    def budget(self) -> tuple[str, int, int]:
        """(KV dtype, block size, KV memory budget in bytes) of the engine as it runs now."""
        config = self.window.applied or (self.window.hello.config if self.window.hello
                                         else None)
        if config is None:
            config = model_settings.applied_for(self.settings, self.model)
        if config is None:
            return "bfloat16", 16, 512 * 1024 * 1024
        return config.kv_dtype, config.block_size, config.kv_cache_bytes

    def plan(self, facts: ModelFacts) -> Carry:
        saved = model_settings.applied_for(self.settings, facts.path)
        return carry_over(self.window.applied, saved, facts, self.window.base_engine_args)

    def restore_at_start(self) -> EngineSettings | None:
        """At start: the settings applied to this model in an earlier session, into the
        engine's options (None when there are none, or the window attaches)."""
        if self.attached:
            return None
        saved = model_settings.applied_for(self.settings, self.model)
        if saved is not None:
            self.window.engine.engine_args = (self.window.base_engine_args
                                              + settings_args(saved))
            self.window.applied = saved
            self.restored = saved
        return saved

    def remember_applied(self, config: EngineSettings) -> None:
        if not self.attached:
            model_settings.save_applied(self.settings, self.model, config)

    def switch_to(self, facts: ModelFacts) -> Carry:
        """Restart the local engine on facts.path with what carries over."""
        carry = self.plan(facts)
        base = model_settings.without_options(self.window.base_engine_args, MODEL_OPTIONS)
        self.window.base_engine_args = [*base, "--model", facts.path]
        model_settings.remember_model(self.settings, facts.path)
        self.window.applied = None  # restart_engine must not add the old model's settings
        self.window.engine.engine_args = [*self.window.base_engine_args, *carry.args]
        self.pending = True
        self.window.restart_engine()
        self.switched.emit(facts.path, carry)
        return carry

    def switch_to_default(self) -> None:
        """Back to the embedded model, with its own saved settings if it has any."""
        saved = model_settings.applied_for(self.settings, model_settings.DEFAULT_MODEL)
        base = model_settings.without_options(self.window.base_engine_args, MODEL_OPTIONS)
        self.window.base_engine_args = base
        self.window.applied = None
        self.window.engine.engine_args = [*base, *(settings_args(saved) if saved else [])]
        self.pending = True
        self.window.restart_engine()

    def _on_ready(self, hello) -> None:
        """The switched-to engine runs: what it runs is what a later restart starts with."""
        if self.pending:
            self.pending = False
            self.window.applied = hello.config
        if self.restored is not None:
            saved, self.restored = self.restored, None
            text = (f"Restored from an earlier session (applied in the window to "
                    f"{model_settings.model_of(self.window.base_engine_args)}): block "
                    f"{saved.block_size}, KV {saved.kv_dtype}, KV memory budget "
                    f"{human_bytes(saved.kv_cache_bytes)}")
            self.window.controls.result.setText(text)
            self.window.status.showMessage(text, 15000)
