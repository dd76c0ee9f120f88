"""Random-weight checkpoints of the shapes users run (1-3B), for `kvscope bench --sizes`.

Nothing is downloaded: each shape is a config with the real model's dimensions, its weights
drawn at random (seeded, normal with std 0.02; norms 1), written once as a Hugging Face
checkpoint (config.json, bfloat16 safetensors) under the user's cache dir, with the embedded
SmolLM2's tokenizer beside it (its 49152 tokens inside the shape's larger vocabulary: the
benchmark feeds random token ids and never decodes text). Speed depends on the shapes, not on
what the weights say.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

COMPLETE = "SIZES_COMPLETE"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
STD = 0.02


@dataclass(frozen=True)
class Shape:
    """A model's dimensions, as its config.json states them."""
    arch: str  # "llama" or "qwen2"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = False
    rope_theta: float = 500000.0
    max_len: int = 8192
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> dict:
        """config.json for this shape (Hugging Face's field names)."""
        model = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.arch]
        return {"architectures": [model], "model_type": self.arch,
                "hidden_size": self.hidden, "intermediate_size": self.ffn,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab, "tie_word_embeddings": self.tied,
                "rope_theta": self.rope_theta, "max_position_embeddings": self.max_len,
                "rms_norm_eps": self.eps, "hidden_act": "silu", "torch_dtype": "bfloat16",
                "bos_token_id": 1, "eos_token_id": 2, "attention_bias": self.qkv_bias}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint by its Hugging Face name."""
        h, d = self.hidden, self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h),
                                           "model.norm.weight": (h,)}
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {p + "self_attn.q_proj.weight": (self.heads * d, h),
                    p + "self_attn.k_proj.weight": (self.kv_heads * d, h),
                    p + "self_attn.v_proj.weight": (self.kv_heads * d, h),
                    p + "self_attn.o_proj.weight": (h, self.heads * d),
                    p + "mlp.gate_proj.weight": (self.ffn, h),
                    p + "mlp.up_proj.weight": (self.ffn, h),
                    p + "mlp.down_proj.weight": (h, self.ffn),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)}
            if self.qkv_bias:
                out |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in
                        (("q", self.heads * d), ("k", self.kv_heads * d),
                         ("v", self.kv_heads * d))}
        return out

    def parameters(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total


# The shapes of the models people run on a CPU, from their published configs.
SHAPES: dict[str, Shape] = {
    "llama-1b": Shape("llama", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192,
                      vocab=128256),  # Llama-3.2-1B
    "qwen2.5-1.5b": Shape("qwen2", layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960,
                          vocab=151936, qkv_bias=True, rope_theta=1000000.0, eps=1e-6),
    "llama-3b": Shape("llama", layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192,
                      vocab=128256),  # Llama-3.2-3B
}


def sizes_root() -> Path:
    from kvscope.engine.loading.checkpoint_files import cache_root

    return cache_root() / "sizes"


def checkpoint(name: str, root: Path | None = None, seed: int = 0) -> Path:
    """The folder of shape `name`'s random checkpoint, written on first use (atomically: a
    temporary folder renamed into place once complete)."""
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}: expected one of {', '.join(SHAPES)}")
    root = root or sizes_root()
    final = root / f"{name}-seed{seed}"
    if (final / COMPLETE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        write_checkpoint(SHAPES[name], tmp, seed)
        (tmp / COMPLETE).write_text(name + "\n")
        if final.exists():  # an incomplete one from a killed run
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_checkpoint(shape: Shape, folder: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, dims in shape.tensor_shapes().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(dims, generator=g) * STD).to(torch.bfloat16)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=1))
    copy_tokenizer(folder)


def copy_tokenizer(folder: Path) -> None:
    """The embedded model's tokenizer files (converted once from its GGUF)."""
    from kvscope.engine.loading.checkpoint_files import resolve_checkpoint

    source = resolve_checkpoint("default")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
