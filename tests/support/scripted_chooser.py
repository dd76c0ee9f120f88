"""A stand-in for the kernel chooser (kernels.kernel_choice) in tests: it runs every
candidate once, as a measurement would, and answers a set winner, remembered under the fast
key as the real chooser does."""
from __future__ import annotations


class ScriptedChooser:
    def __init__(self, winner: str) -> None:
        self.winner, self.asked, self.ran, self.decided = winner, [], [], {}

    def fast(self, key):
        return self.decided.get(key)

    def choose(self, name, candidates, info=None, fast_key=None):
        self.asked.append((name, info))
        for label, run in candidates.items():
            self.ran.append(label)
            run()
        self.decided[fast_key] = self.winner
        return self.winner

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.asked]
