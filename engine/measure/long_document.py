"""The long-document task: continuing resources/long_document.txt from deep inside it.

A needle asks for one copied number; this asks the model to keep writing a text it has read
thousands of tokens of, where every next token depends on what came long before. At each cut
(a prefix length of the document) two things are measured against float32 KV: the greedy
continuation (agreement: share of tokens before the first difference, and whether all are
the same) and, teacher-forced along the document's own next tokens, the KL from float32 and
the share of positions whose most likely token matches float32's. Every cut is a prefix of
the same text, so the prefix cache computes the document once per KV setting.
"""
from __future__ import annotations

from pathlib import Path

from kvscope.engine.measure import RESOURCES
from kvscope.engine.measure.kv_probes import Probe

DOCUMENT = RESOURCES / "long_document.txt"
CONTINUATION = 32


def document_ids(encode, path: Path = DOCUMENT) -> list[int]:
    """The document's token ids, its header lines (starting with #) left out."""
    text = "\n".join(line for line in path.read_text().splitlines()
                     if not line.startswith("#")).strip()
    return encode(text)


def cut_points(num_tokens: int, lengths: list[int], continuation: int) -> list[int]:
    """Each asked length that leaves room for the continuation, plus the longest cut."""
    cuts = [n for n in lengths if n + continuation <= num_tokens]
    longest = num_tokens - continuation
    if longest > 0 and longest not in cuts:
        cuts.append(longest)
    return cuts


def document_probes(ids: list[int], lengths: list[int], max_model_len: int,
                    continuation: int = CONTINUATION) -> list[Probe]:
    ids = ids[:max_model_len - 1]
    return [Probe(ids=ids[:cut], max_tokens=continuation, cell=(("length", cut),),
                  teacher=ids[cut:cut + continuation])
            for cut in cut_points(len(ids), lengths, continuation)]
