"""`kvscope fragsim`: the classic reserved-vs-paged waste numbers, exactly, and its errors."""
from __future__ import annotations

import json
import math
import random

import pytest

from kvscope.kvmath.fragsim import random_lengths, simulate
from kvscope.main import main as kvscope


def main(argv: list[str]) -> int:
    return kvscope(["fragsim", *argv])


def test_default_numbers_are_exact():
    lengths = random_lengths(1000, 50, 2048, 42)
    random.seed(42)
    assert lengths == [random.randint(50, 2048) for _ in range(1000)]
    r = simulate(lengths, 16, 2048)
    assert r.used_slots == sum(lengths)
    assert r.reserved_slots == 2048 * 1000
    assert r.paged_slots == sum(math.ceil(n / 16) * 16 for n in lengths)
    assert f"{r.reserved_waste * 100:.1f}" == "48.7"
    assert f"{r.paged_waste * 100:.1f}" == "0.7"
    assert f"{r.ratio:.1f}" == "1.9"


def test_cli_prints_the_classic_numbers(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "48.7 % reserved waste" in out
    assert "0.7 % paged waste" in out
    assert "1.9x" in out


def test_cli_json(capsys):
    assert main(["--json", "--requests", "3", "--min-len", "16", "--max-len", "16"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["reserved_waste"] == 0 and d["paged_waste"] == 0 and d["ratio"] == 1


def test_small_exact_case():
    r = simulate([1, 16, 17], 16, max_len=32)
    assert (r.used_slots, r.reserved_slots, r.paged_slots) == (34, 96, 64)


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--min-len", "10", "--max-len", "5"],
                                  ["--block-size", "0"]])
def test_bad_input_is_an_error(argv, capsys):
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err
