"""One chat request as the GUI follows it: phase, counters, timings, and its stats line."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvscope.app.fmt import rate, seconds
from kvscope.app.request_waits import WAIT_TEXT, request_wait
from kvscope.app.spec_text import acceptance_text

SENDING, QUEUED, PREFILL, DECODING, PREEMPTED = "sending", "queued", "prefill", "decoding", \
    "preempted"
# Running again after a preemption (or a pool rebuild), its KV computed anew: no new tokens
# come out until it has caught up, so "decoding" would be untrue (issue 53, item 8).
RECOMPUTING = "recomputing"
FINISHED, FAILED = "finished", "failed"
HELD = "held"  # sent before the engine was ready: the window holds it until it is
DONE_PHASES = (FINISHED, FAILED)


@dataclass
class Turn:
    request_id: str
    conversation: int
    submitted_at: float = field(default_factory=time.monotonic)
    phase: str = SENDING
    text: str = ""
    num_output: int = 0
    num_prompt: int = 0
    num_cached: int = 0
    num_preemptions: int = 0
    queued_s: float | None = None
    ttft_s: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    computed: int = 0  # from the blocks frame: tokens with KV written
    max_blocks: int = 0  # most blocks its table held
    block_size: int = 0
    priority: int = 0  # as submitted (lower = sooner)
    wait_reason: str = ""  # from the blocks frame: why it waits now ("" not waiting)
    num_drafts: int = 0  # speculative verifies that carried a draft (issue 31)
    num_accepted: int = 0  # drafted tokens accepted
    num_from_disk: int = 0  # of num_cached, prefix tokens the KV disk tier gave back (issue 56)
    blocks_now: int = 0  # KV blocks its table holds in the latest blocks frame
    total: int = 0  # from the blocks frame: its tokens, prompt and output

    @property
    def done(self) -> bool:
        return self.phase in DONE_PHASES

    def on_delta(self, d, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.text += d.text
        self.num_output = max(self.num_output, d.num_output_tokens)
        self.num_prompt = d.num_prompt_tokens or self.num_prompt
        self.num_cached = d.num_cached_tokens
        self.num_preemptions = d.num_preemptions
        self.num_drafts = getattr(d, "num_drafts", 0)  # not sent by an older engine
        self.num_accepted = getattr(d, "num_accepted_tokens", 0)
        self.num_from_disk = getattr(d, "num_disk_cached_tokens", 0)
        self.queued_s = d.queued_s if d.queued_s is not None else self.queued_s
        self.ttft_s = d.ttft_s if d.ttft_s is not None else self.ttft_s
        if d.token_ids and self.first_token_at is None:
            self.first_token_at = now
        if self.phase not in DONE_PHASES and (self.phase != RECOMPUTING or d.token_ids):
            self.phase = DECODING if self.num_output else self.phase
        if d.finished:
            self.phase, self.finish_reason, self.finished_at = FINISHED, d.finish_reason, now

    def on_blocks(self, frame) -> None:
        """Phase from the engine's view: queued, prefill (progress), preempted."""
        if self.done:
            return
        self.block_size = frame.block_size
        try:
            i = frame.request_ids.index(self.request_id)
        except ValueError:
            self.blocks_now = 0
            return
        self.computed = frame.num_computed_tokens[i]
        self.total = frame.num_tokens[i]
        offsets = frame.array("table_offsets")
        self.blocks_now = int(offsets[i + 1] - offsets[i])
        self.max_blocks = max(self.max_blocks, self.blocks_now)
        running = frame.request_running[i]
        self.wait_reason = request_wait(frame, i).reason
        if not self.num_prompt and not self.num_output:
            self.num_prompt = frame.num_tokens[i]
        if not running:
            self.phase = PREEMPTED if (self.num_output or self.num_preemptions) else QUEUED
        elif not self.num_output:
            self.phase = PREFILL
        elif self.computed + 1 < self.total:  # decoding leaves only the newest token to do
            self.phase = RECOMPUTING
        else:
            self.phase = DECODING

    def fail(self, reason: str) -> None:
        if not self.done:
            self.phase, self.error, self.finished_at = FAILED, reason, time.monotonic()

    def decode_rate(self) -> float | None:
        end = self.finished_at or time.monotonic()
        if self.first_token_at is None or self.num_output < 2 or end <= self.first_token_at:
            return None
        return (self.num_output - 1) / (end - self.first_token_at)

    def prefill_rate(self) -> float | None:
        if self.ttft_s is None:
            return None
        busy = self.ttft_s - (self.queued_s or 0.0)
        computed = self.num_prompt - self.num_cached
        return computed / busy if busy > 0 and computed > 0 else None

    def phase_text(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        if self.phase == HELD:
            return f"queued until the engine is ready · {now - self.submitted_at:.1f} s"
        if self.phase in (SENDING, QUEUED):
            why = f" · waiting: {WAIT_TEXT.get(self.wait_reason, self.wait_reason)}" \
                if self.phase == QUEUED and self.wait_reason else ""
            return f"{self.phase} {now - self.submitted_at:.1f} s{why}"
        if self.phase == PREFILL:
            total = max(1, self.num_prompt)
            return f"prefill {self.computed}/{total} tokens ({100 * self.computed // total} %)"
        if self.phase == DECODING:
            return f"decoding · {self.num_output} tokens · {rate(self.decode_rate())}"
        if self.phase == RECOMPUTING:
            total = max(1, self.total)
            return (f"recomputing after preemption · {self.computed}/{total} tokens "
                    f"({100 * self.computed // total} %) · no new tokens until done")
        if self.phase == PREEMPTED:
            return f"preempted · waiting to recompute ({self.num_preemptions}×)"
        if self.phase == FAILED:
            return f"failed: {self.error}"
        return f"finished ({self.finish_reason})"

    def stats_text(self) -> str:
        blocks = self.max_blocks
        if not blocks and self.block_size:
            blocks = -(-(self.num_prompt + self.num_output) // self.block_size)
        parts = [f"TTFT {seconds(self.ttft_s)}",
                 f"prefill {rate(self.prefill_rate())}",
                 f"decode {rate(self.decode_rate())}",
                 f"{self.num_prompt} prompt + {self.num_output} tokens",
                 f"{blocks} blocks"]
        if self.num_cached:
            parts.append(f"{self.num_cached} cached")
        if self.num_from_disk:  # a conversation resumed after a restart
            parts.append(f"prefix from disk: {self.num_from_disk} tokens")
        if self.num_preemptions:
            parts.append(f"{self.num_preemptions} preemptions")
        if self.priority:
            parts.append(f"priority {self.priority}")
        if self.num_drafts:
            parts.append(acceptance_text(self.num_drafts, self.num_accepted))
        # A failure's reason is on the line above the stats (the view's ⚠ note): once.
        parts.append(f"stop: {self.finish_reason or ('failed' if self.error else '?')}")
        return " · ".join(parts)
