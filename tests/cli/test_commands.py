"""The `kvscope` command table: help lists it, every command parses its own options and answers
--help, torch-free commands start without torch, and no other module names the commands."""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope import main as launcher
from kvscope.commands import COMMANDS, DEFAULT, Command, find
from kvscope.testing.tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE = [c for c in COMMANDS if not c.needs_torch]


def kvscope(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvscope", *args], check=False,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})


def listed_commands(help_text: str) -> dict[str, str]:
    """{name: help line} of the commands section of `kvscope --help`."""
    section = help_text.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]
    return dict(re.fullmatch(r" {2}(\S+) {2,}(\S.*)", line).groups()
                for line in section.splitlines())


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"]])
def test_top_level_help_lists_every_row_with_its_line(argv, capsys):
    assert launcher.main(argv) == 0
    assert listed_commands(capsys.readouterr().out) == {c.name: c.help for c in COMMANDS}


def test_help_imports_no_command_module():
    code = ("import json, sys; from kvscope.main import main; main(['--help']); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvscope.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    imported = json.loads(out.stdout.splitlines()[-1])
    assert imported == ["kvscope.commands", "kvscope.main"]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_command_answers_help(command: Command):
    out = kvscope(command.name, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: kvscope {command.name} ")
    assert "--help" in out.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_each_module_registers_its_row_and_nothing_else(command: Command):
    module = importlib.import_module(command.module)
    _, sub = launcher.root_parser()
    registered = module.add_parser(sub)
    assert sub.choices == {command.name: registered}
    assert [a.help for a in sub._choices_actions] == [command.help]  # no second wording
    assert callable(module.run)


def test_help_word_before_a_command_is_that_commands_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["help", "kv-calc"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvscope kv-calc ")


def test_an_unknown_command_is_named_with_the_commands_there_are(capsys):
    assert launcher.main(["kvcalc"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'kvcalc'" in err and "did you mean 'kv-calc'" in err
    assert all(c.name in err for c in COMMANDS)


@pytest.mark.parametrize(("argv", "routed"), [
    ([], [DEFAULT]),
    (["--attach", "tcp://h:5570"], [DEFAULT, "--attach", "tcp://h:5570"]),
    (["--demo"], [DEFAULT, "--demo"]),
    (["serve", "--port", "0"], ["serve", "--port", "0"]),
    (["--help"], ["--help"]),
    (["-h"], ["-h"]),
])
def test_no_command_or_an_option_first_means_the_default(argv, routed):
    assert launcher.with_command(argv) == routed
    assert find(DEFAULT) is not None


def test_an_option_first_reaches_the_guis_own_options():
    out = kvscope("--attach", "tcp://h:5570", "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"usage: kvscope {DEFAULT} ")
    assert "--attach-vllm" in out.stdout  # app/vllm/launch.py's options sit on the gui's parser
    bad = kvscope("--attach", "tcp://h:5570", "--no-such-option")
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr


def test_serve_still_runs_alone_for_the_spawned_engine_process():
    out = subprocess.run([sys.executable, "-m", "kvscope.engine.cli.serve", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvscope serve ") and "--kv-dtype" in out.stdout


# A real run of each command that needs no torch, besides its --help: (argv, expected exit).
# {tmp} is a fresh folder. A new torch-free row must add its own run here.
TORCH_FREE_RUNS = {
    "gui": [(["--attach", "tcp://10.1.2.3:5570", "--keys", "{tmp}/none"], 2)],  # no keys: 2
    "kv-calc": [(["kv-calc", "--json", "--config", json.dumps(
        {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 64})], 0)],
    "fragsim": [(["fragsim", "--requests", "20", "--json"], 0)],
    "keys": [(["keys", "init", "--keys", "{tmp}/k"], 0),
             (["keys", "show", "--keys", "{tmp}/k"], 0)],
}
PROBE = """
import json, sys
from kvscope.main import main

def code(argv):
    try:
        return main(argv)
    except SystemExit as exc:  # --help
        return exc.code

codes = [code(argv) for argv in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "torch": sorted(m for m in sys.modules
                                                  if m.split('.')[0] == 'torch')}))
"""


def test_every_torch_free_row_has_a_real_run_here():
    assert set(TORCH_FREE_RUNS) == {c.name for c in TORCH_FREE}


@pytest.mark.parametrize("command", TORCH_FREE, ids=lambda c: c.name)
def test_torch_free_commands_import_no_torch(command: Command, tmp_path):
    runs = [([command.name, "--help"], 0), *TORCH_FREE_RUNS[command.name]]
    argvs = [[a.replace("{tmp}", str(tmp_path)) for a in argv] for argv, _ in runs]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, check=False,
                         env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["codes"] == [code for _, code in runs], out.stderr
    assert result["torch"] == []


def test_kv_calc_reports_the_formula_from_a_config(capsys):
    config = {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 64}
    assert launcher.main(["kv-calc", "--config", json.dumps(config), "--dtype", "bf16",
                          "--tokens", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    per_token = 2 * 3 * 2 * (64 // 8) * 2  # K and V x layers x kv heads x head dim x 2 bytes
    assert result["bytes_per_token"] == per_token and result["total_bytes"] == 10 * per_token


def string_constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_the_launcher_names_no_command_itself():
    assert string_constants(ROOT / "kvscope" / "main.py") & {c.name for c in COMMANDS} == set()


def test_the_engine_names_no_command_it_does_not_implement():
    """No help-only copy of the launcher's commands in engine/ (a lower layer knowing an upper)."""
    elsewhere = {c.name for c in COMMANDS if not c.module.startswith("kvscope.engine.")}
    found = {f"{p.relative_to(ROOT)}: {s}" for p in (ROOT / "engine").rglob("*.py")
             for s in string_constants(p) & elsewhere}
    assert found == set()


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
