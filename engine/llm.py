"""The offline API: `LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from kvscope.engine.chat_template import chat_prompt_ids
from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.loading.loader import LoadedModel
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.ipc.messages import EngineStats
from kvscope.ipc.prompts import ChatPrompt, PromptInput, TextPrompt, TokenPrompt, as_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = PromptInput | str | list[int]  # typed (ipc.prompts), or text or token ids
Messages = list[dict[str, str]]  # one conversation: [{"role": ..., "content": ...}, ...]


class LLM:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 **overrides: Any) -> None:
        """`loaded` (an engine.loading.loader.LoadedModel) reuses weights already in memory."""
        config = config or EngineConfig(**overrides)
        self.engine = LLMEngine(config, loaded)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is checked before any is queued,
        so a bad one raises without leaving the others half-run."""
        prompt_list = [as_prompt(p) for p in _prompt_list(prompts)]
        params_list = _broadcast(params, len(prompt_list))
        for prompt, p in zip(prompt_list, params_list, strict=True):
            p.validate()
            self.engine.check_prompt_fits(self.engine.tokenize(prompt))
        ids = [self.engine.add_request(p, sp)
               for p, sp in zip(prompt_list, params_list, strict=True)]
        pending = set(ids)
        while pending:
            for delta in self.engine.step().outputs:
                if delta.finished:
                    pending.discard(delta.request_id)
        return [self.engine.pop_output(i) for i in ids]

    def chat(self, messages_list: Messages | Seq[Messages],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Conversations as lists of {"role", "content"}; the tokenizer's chat template applies."""
        prompts = [self.apply_chat_template(m) for m in _conversation_list(messages_list)]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages: Messages) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (typed, text, or token ids) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, (str, TextPrompt, ChatPrompt, TokenPrompt)):
        return [prompts]
    items = list(prompts)
    ids = [t for t in items if isinstance(t, int)]
    if not ids:
        return [p for p in items if not isinstance(p, int)]
    if len(ids) < len(items):
        raise ValueError("a prompt is a string or a list of token ids, not a mix of both")
    return [ids]


def _conversation_list(messages: Messages | Seq[Messages]) -> list[Messages]:
    """One conversation (a list of message dicts) or a sequence of them, as a list."""
    items: list[dict[str, str] | Messages] = list(messages)
    turns = [m for m in items if isinstance(m, dict)]
    if not turns:
        return [m for m in items if not isinstance(m, dict)]
    if len(turns) < len(items):
        raise ValueError("messages are one conversation or a list of them, not a mix of both")
    return [turns]


def _broadcast(params: SamplingParams | Seq[SamplingParams] | None, n: int
               ) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params_list = list(params)
    if len(params_list) != n:
        raise ValueError(f"got {len(params_list)} SamplingParams for {n} prompts")
    return params_list
