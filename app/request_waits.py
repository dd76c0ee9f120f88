"""Why a live request waits, its priority and its queue time, as a blocks frame tells them
(issue 26). A frame from an older engine has none of these lists: everything reads as
priority 0, never scheduled, not waiting."""
from __future__ import annotations

from dataclasses import dataclass

from kvscope.app.fmt import seconds

# Short words for the map's narrow side panel and the hover line; WAIT_TIPS says them whole.
WAIT_TEXT = {"budget": "token budget", "max_num_seqs": "max sequences", "memory": "KV memory",
             "preempted": "preempted"}
WAIT_TIPS = {
    "budget": "this step's token budget (max batched tokens) was spent on others",
    "max_num_seqs": "max sequences were already running",
    "memory": "no free KV blocks for it",
    "preempted": "preempted: its blocks were freed and it waits to be recomputed"}


@dataclass(frozen=True)
class RequestWait:
    priority: int = 0  # lower = sooner, under the priority policy
    queue_s: float | None = None  # arrival -> first scheduled; None: never scheduled yet
    reason: str = ""  # "" not waiting, else a WAIT_TEXT key

    def reason_text(self) -> str:
        return WAIT_TEXT.get(self.reason, self.reason)

    def summary(self) -> str:
        """"priority -1 · queued 120 ms · waiting: KV memory" (what applies)."""
        queue = "not scheduled yet" if self.queue_s is None else f"queued {seconds(self.queue_s)}"
        parts = [f"priority {self.priority}", queue]
        if self.reason:
            parts.append(f"waiting: {self.reason_text()}")
        return " · ".join(parts)


def request_wait(frame, index: int) -> RequestWait:
    """The index-th live request's wait facts in frame (request_ids order)."""
    def at(name: str, default):
        values = getattr(frame, name, None) or ()
        return values[index] if index < len(values) else default

    return RequestWait(int(at("request_priorities", 0)), at("request_queue_s", None),
                       str(at("request_wait_reasons", "")))

