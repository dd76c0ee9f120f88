"""Every `kvscope` subcommand answers --help, and kvscope generate streams a reply."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvscope.testing.tiny_models import save_tiny_model

COMMANDS = ["generate", "serve", "bench", "kv-accuracy", "kv-calc", "gui", "trace", "fragsim"]


def kvscope(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kvscope", *args], check=False,
                          capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command):
    out = kvscope(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "--" in out.stdout


def test_top_level_help_lists_the_commands():
    out = kvscope("--help")
    assert all(c in out.stdout for c in COMMANDS)


def test_generate_json_with_a_tiny_model(tmp_path):
    path = save_tiny_model(tmp_path, "llama", seed=0)
    out = kvscope("generate", "hello", "--raw", "--json", "--model", str(path),
                  "--max-tokens", "5", "--block-size", "4", "--num-kv-blocks", "16")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) <= 5 and result["finish_reason"] in ("stop", "length")
    assert result["stats"]["block_size"] == 4 and result["stats"]["num_free_blocks"] == 16


def test_generate_reports_a_bad_option_clearly(tmp_path):
    out = kvscope("generate", "hi", "--block-size", "3", "--model", str(tmp_path))
    assert out.returncode == 2
    assert "block_size" in out.stderr
