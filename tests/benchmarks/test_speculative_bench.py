"""benchmarks/speculative.py without timing anything: its prompts and its table."""
from __future__ import annotations

import pytest

from kvscope.benchmarks.speculative import TEXT, prompts_for, table


def test_workloads_are_input_grounded_and_distinct():
    quote = prompts_for("quote", 3)
    assert len({m[0]["content"] for m in quote}) == 3
    assert all(m[0]["content"].startswith(TEXT.read_text()) for m in quote)  # shared prefix
    assert len(TEXT.read_text().split()) > 800  # ~1k tokens
    assert "def load_orders" in prompts_for("code", 1)[0][0]["content"]
    with pytest.raises(SystemExit, match="unknown workload"):
        prompts_for("poetry", 1)


def test_table_reports_speedup_acceptance_and_llama_cpp():
    row = {"concurrency": 1, "tok_s_off": 20.0, "tok_s_on": 40.0, "speedup": 2.0,
           "acceptance_length": 3.1, "outputs_equal": 1.0}
    text = table({"tokens": 64, "spec_config": {}, "workloads": {"quote": [row]},
                  "llama_cpp": {"depth": 1200, "tok_s": 25.0}})
    assert "2.00x" in text and "3.10" in text and "1.60x" in text
