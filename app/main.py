"""Entry point of the desktop app (`kvscope`, `kvscope gui`, `kvscope --attach URL`)."""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    print("kvscope: the desktop app is not built yet; use `kvscope generate` or "
          "`kvscope serve`", file=sys.stderr)
    return 2
