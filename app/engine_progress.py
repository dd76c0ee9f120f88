"""The engine child's start as the window shows it: what it is doing while it loads, read from
its stderr. The first start converts the embedded GGUF model (about 40 s on 2 cores); the
engine says each stage on a "[kvscope] converting: ..." line (engine.loading.checkpoint_files)
and transformers draws progress bars (tqdm: "desc:  42%|███▏   | 114/272 [...]", redrawn
after a carriage return). Both become one Progress: a fraction when a bar gives one, and a
line of text for the status bar and the chat.

Stderr is untrusted text: a line that matches neither pattern is ignored, never an error.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

STAGE = re.compile(r"^\[kvscope\] converting: (?P<what>.+)$")
BAR = re.compile(r"^(?P<desc>[^|\r\n]*?):?\s+(?P<pct>\d{1,3})%\|")
MAX_PIECE = 4096  # a line longer than this without an end is no progress bar: dropped


@dataclass(frozen=True)
class Progress:
    fraction: float | None  # 0..1 from a progress bar; None: a stage without a bar
    text: str  # "converting the model (first start only): de-quantizing the weights 42 %"


class ProgressReader:
    """Feed it the child's stderr as it comes; it returns what changed."""

    def __init__(self) -> None:
        self._piece = ""
        self.stage = ""  # the engine's last stage line ("" before a conversion)
        self.last: Progress | None = None

    def feed(self, text: str) -> list[Progress]:
        """Every complete piece (ended by a newline or a carriage return, as a terminal draws
        it) read for a stage or a bar; the progress each one changed, in order."""
        *pieces, self._piece = re.split(r"[\r\n]", self._piece + text)
        if len(self._piece) > MAX_PIECE:
            self._piece = ""
        out = []
        for piece in pieces:
            got = self._read(piece.strip())
            if got is not None and got != self.last:
                self.last = got
                out.append(got)
        return out

    def _read(self, piece: str) -> Progress | None:
        stage = STAGE.match(piece)
        if stage:
            what = stage.group("what")
            if " once (" in what:  # the first line names the file: the model, for the user
                self.stage = "converting the model (first start only)"
                return Progress(None, f"{self.stage}: {what.split(' once (')[0]}")
            if not self.stage:
                self.stage = "converting the model"
            if ": done in " in what:
                return Progress(1.0, f"converted the model in {what.split(': done in ')[1]}")
            return Progress(None, f"{self.stage}: {what}")
        bar = BAR.match(piece)
        if bar and self.stage:  # a bar outside a conversion (none today) says nothing
            pct = min(100, int(bar.group("pct")))
            desc = bar.group("desc").strip().rstrip(".").strip() or "working"
            return Progress(pct / 100, f"{self.stage}: {desc.lower()} {pct} %")
        return None
