"""Loads a model spec into what the engine needs: HF config, weights and tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvscope.engine.loading import checkpoint_files as model_files
from kvscope.engine.model.support import check_supported

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    checkpoint: Path
    hf_config: PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]


def load_model(model: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig

    checkpoint = model_files.resolve_checkpoint(model)
    hf_config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    # Before the tokenizer and the weights: a model the engine cannot run loads nothing.
    check_supported(hf_config)
    tokenizer = model_files.load_tokenizer(checkpoint)
    state_dict = model_files.load_state_dict(checkpoint, dtype)
    return LoadedModel(checkpoint, hf_config, state_dict, tokenizer,
                       eos_token_ids(checkpoint, hf_config, tokenizer))


def eos_token_ids(checkpoint: Path, hf_config: PretrainedConfig,
                  tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a reply: the tokenizer's EOS and generation_config's list, as
    Hugging Face generate uses them."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    gen_path = checkpoint / "generation_config.json"
    if gen_path.exists():
        import json

        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(i for i in src if isinstance(i, int))
    return ids
