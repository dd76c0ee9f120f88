"""The offline API: `LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as Seq

from kvscope.engine.chat_template import chat_prompt_ids
from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, config: EngineConfig | None = None, loaded=None, **overrides) -> None:
        """`loaded` (an engine.loader.LoadedModel) reuses weights already in memory."""
        config = config or EngineConfig(**overrides)
        self.engine = LLMEngine(config, loaded)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. Every prompt is checked before any is queued,
        so a bad one raises without leaving the others half-run."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        params_list = _broadcast(params, len(prompts))
        for prompt, p in zip(prompts, params_list):
            p.validate()
            self.engine.check_prompt_fits(self.engine.tokenize(prompt))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        pending = set(ids)
        while pending:
            for delta in self.engine.step():
                if delta.finished:
                    pending.discard(delta.request_id)
        return [self.engine.pop_output(i) for i in ids]

    def chat(self, messages_list, params=None) -> list[RequestOutput]:
        """Conversations as lists of {"role", "content"}; the tokenizer's chat template applies."""
        if messages_list and isinstance(messages_list[0], dict):
            messages_list = [messages_list]
        prompts = [self.apply_chat_template(m) for m in messages_list]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def stats(self) -> dict:
        return self.engine.stats()


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int))


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
