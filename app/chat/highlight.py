"""A small syntax highlighter for code blocks: comments, strings, numbers and keywords.

No language grammar: one regular expression covers the lexical shapes most languages share
(# and // comments, quoted strings, numbers) and a keyword set from the common ones (Python,
C-like, Rust, Go, JavaScript, shell). It is there for reading, not for correctness.
"""
from __future__ import annotations

import re

_WORDS = """
and as assert async await break case catch class const continue def default del do elif else
enum except export extends false final finally fn for from func function go if impl import in
interface is lambda let loop match mod mut new nil none not null or package pass pub raise
return self static struct super switch this throw true try type typeof use var void while with
yield True False None int float str bool char long double unsigned echo then fi done esac local
"""
KEYWORDS = frozenset(_WORDS.split())

_TOKEN = re.compile(r"""
    (?P<comment>\#[^\n]*|//[^\n]*|/\*.*?\*/)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<number>\b(?:0[xX][0-9a-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b)
  | (?P<word>\b[A-Za-z_][A-Za-z0-9_]*\b)
""", re.VERBOSE | re.DOTALL)

# Colours on the chat's dark background (One Dark's).
COLORS = {"comment": "#7f848e", "string": "#98c379", "number": "#d19a66",
          "keyword": "#c678dd", "plain": "#dcdfe4"}


def spans(code: str) -> list[tuple[int, int, str]]:
    """(start, length, kind) of every highlighted token, in order; the rest is plain."""
    out: list[tuple[int, int, str]] = []
    for m in _TOKEN.finditer(code):
        kind = m.lastgroup or "plain"
        if kind == "word":
            if m.group() not in KEYWORDS:
                continue
            kind = "keyword"
        out.append((m.start(), m.end() - m.start(), kind))
    return out
