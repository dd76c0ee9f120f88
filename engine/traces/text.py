"""Token ids as text, for replays against servers that speak text: a chat prompt, and a
recorded greedy output set beside the text a server streamed back. The decoding is the
server's own (engine.detokenizer.Decoder: no special tokens), so kvscope serve's replies
compare equal to the ids it would have produced."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TextTokenizer:
    name: str
    vocab_size: int
    decode: Callable[[list[int]], str]


def load_text_tokenizer(model: str) -> TextTokenizer:
    """The tokenizer of a kvscope model spec ("default", a folder, a .gguf); local files
    only. ValueError/OSError when there is none."""
    from kvscope.engine.detokenizer import Decoder
    from kvscope.engine.loading.checkpoint_files import load_tokenizer, resolve_checkpoint

    tokenizer = load_tokenizer(resolve_checkpoint(model))
    return TextTokenizer(name=model, vocab_size=len(tokenizer), decode=Decoder(tokenizer))


def try_text_tokenizer(model: str | None) -> tuple[TextTokenizer | None, str | None]:
    """(the tokenizer, None), or (None, why there is none)."""
    if not model:
        return None, "no tokenizer (give --tokenizer)"
    try:
        return load_text_tokenizer(model), None
    except (ValueError, OSError, ImportError) as exc:
        return None, f"no tokenizer for {model!r}: {str(exc)[:200]}"
