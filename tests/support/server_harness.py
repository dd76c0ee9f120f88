"""Run `kvscope serve` as a real subprocess for the server tests, and a chat-capable tiny model."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kvscope.testing.tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120  # two busy cores: loading torch + transformers can take a while
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


def save_chat_model(path: Path, seed: int = 0) -> Path:
    """The tiny model with a character-level tokenizer (printable ASCII are their own byte
    ids, so text prompts are real prompts) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    save_tiny_model(path, "llama", seed=seed)
    name = {i: chr(i) if 32 <= i < 127 else f"<{i}>" for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab={v: k for k, v in name.items()}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=name[255])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def serve_command() -> list[str]:
    """`kvscope serve`, through the same entry point a user runs."""
    return [sys.executable, "-m", "kvscope", "serve"]


class Server:
    """One `kvscope serve` process; `command` and `state` are the endpoints it printed."""

    def __init__(self, model: Path, log: Path, *args: str, wait: bool = True) -> None:
        """wait=False returns at once (start several, then `wait_ready()` each)."""
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        cmd = serve_command() + ["--model", str(model), "--device", "cpu", *args]
        if "--endpoint" not in args:
            cmd += ["--port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Server:
        self.ready_line = _readline(self.proc, START_TIMEOUT_S)
        if not self.ready_line.startswith("ready "):
            self.stop()
            raise RuntimeError(f"no ready line, got {self.ready_line!r}:\n{self.log_text()}")
        _, self.command, self.state = self.ready_line.split()
        return self

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-4000:]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """proc's first stdout line, or "" if none comes in time (the process is then killed)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        proc.kill()
        reader.join(5)
    return box[0].strip() if box else ""
