"""The long-context grid end to end on a tiny random model: every dtype, every cell, the
cached-prefix scorer against the engine's whole-sequence scorer, the user-prompt sources."""
import argparse
import json

import pytest
import torch

from kvscope.engine.cli import kv_accuracy as kv_accuracy_cmd
from kvscope.engine.measure import kv_long
from kvscope.engine.measure.kv_probes import greedy_answers, tail_log_probs
from kvscope.engine.measure.progress import Progress, format_seconds
from kvscope.testing.tiny_models import save_tiny_model

ALL = ["float32", "bfloat16", "int8", "int8+none", "fp8", "fp8+none"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny")))


def byte_ids(text: str) -> list[int]:
    """The tiny model's ids are bytes (its tokenizer maps text it does not know to <0>)."""
    return list(text.encode())


def _args(model, **kw):
    args = kv_accuracy_cmd.parse_args(["--model", model, "--task", "passkey", "--kv-cache-mib", "8",
                                   "--no-save"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_cached_prefix_scoring_matches_whole_sequence_scoring(tiny, kv_dtype):
    from kvscope.engine.scoring import token_log_probs

    args = _args(tiny)
    engine = kv_long.build_engine(args).engine
    engine.reconfigure(kv_dtype=kv_dtype)
    prompt = [(7 * i) % 250 + 1 for i in range(70)]
    ((answer, _),) = greedy_answers(engine, [_probe(prompt, 5)])
    assert engine.block_manager.match_prefix(_seq(prompt + answer)), "the prompt stayed cached"
    tail = tail_log_probs(engine, prompt + answer[:-1], 5)
    whole = token_log_probs(engine, prompt + answer)[-5:]
    assert torch.allclose(tail, whole, atol=2e-4)
    assert tail.argmax(-1).tolist() == answer  # greedy answers its own most likely tokens


def _probe(ids, n):
    from kvscope.engine.measure.kv_probes import Probe

    return Probe(ids=ids, max_tokens=n, cell=("c",))


def _seq(ids):
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.sequence import Sequence

    return Sequence("probe", ids, SamplingParams())


def test_passkey_grid_runs_for_every_dtype_and_has_every_cell(tiny):
    args = _args(tiny, lengths=[250, 300], depths=[0.0, 1.0], seeds=1)
    result = kv_long.run_long(args, encode=byte_ids)
    json.dumps(result)  # --json prints it as it is
    assert list(result["settings"]) == ALL
    for name, setting in result["settings"].items():
        cells = {(c["length"], c["depth"]) for c in setting["cells"]}
        assert cells == {(n, d) for n in (250, 300) for d in (0.0, 1.0)}, name
        for c in setting["cells"]:
            assert 0 <= c["right"] <= 1 and 0 <= c["same_as_float32"] <= 1
            assert c["kl"] >= -1e-6 and c["rank"] >= 1 and c["tokens"] <= c["length"]
    ref = result["settings"]["float32"]
    assert all(c["same_as_float32"] == 1.0 and c["kl"] == 0.0 for c in ref["cells"])
    assert result["settings"]["int8"]["kv_rotation"] == "calibrated"
    assert result["settings"]["int8+none"]["kv_anchor_tokens"] == 0
    assert result["settings"]["int8"]["kv_bytes_per_token"] \
        < result["settings"]["float32"]["kv_bytes_per_token"]


def test_cli_json_and_saved_run_for_a_trace_and_the_document(tiny, tmp_path, capsys):
    trace = tmp_path / "workload.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 4}\n'
                     '{"timestamp": 5, "input_length": 90, "output_length": 50}\n')
    saved = tmp_path / "data" / "last.json"
    assert kv_accuracy_cmd.main(["--model", tiny, "--trace", str(trace), "--dtypes", "int8",
                             "--kv-cache-mib", "8", "--json", "--save", str(saved)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads(saved.read_text())
    assert out["task"] == "prompts" and out["probes"] == 2
    assert list(out["settings"]) == ["float32", "int8", "int8+none"]
    assert [c["length"] for c in out["settings"]["int8"]["cells"]] == [64, 128]
    assert kv_accuracy_cmd.main(["--model", tiny, "--task", "document", "--lengths", "128",
                             "--dtypes", "fp8", "--kv-cache-mib", "8", "--json",
                             "--no-save"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["length"] for c in doc["settings"]["fp8"]["cells"]] == [128, 511 - 32]


def test_task_defaults():
    assert kv_accuracy_cmd.parse_args([]).task == "chat"
    quick = kv_accuracy_cmd.parse_args(["--task", "passkey", "--quick"])
    assert (quick.lengths, quick.depths) == ([1024, 4096], [0.0, 0.5, 1.0])
    full = kv_accuracy_cmd.parse_args(["--task", "passkey"])
    assert full.lengths == [1024, 2048, 4096, 8192] and len(full.depths) == 5
    assert kv_accuracy_cmd.parse_args(["--prompts", "x.txt"]).task == "prompts"
    assert kv_accuracy_cmd.parse_args(["--task", "chat", "--prompts", "x.txt"]).task == "chat"
    with pytest.raises(SystemExit):
        kv_accuracy_cmd.parse_args(["--task", "passkey", "--depths", "120"])


def test_progress_estimates_the_time_left():
    import io

    from kvscope.app.kv_grid.runner import parse_progress

    now = [0.0]
    out = io.StringIO()
    p = Progress(100, stream=out, clock=lambda: now[0], every_s=0)
    assert p.eta() is None
    now[0] = 30.0
    p.advance(25, "int8")
    assert p.eta() == pytest.approx(90.0)
    assert parse_progress(out.getvalue().splitlines()[-1]) == (25, "1m30s", "int8")
    p.finish()
    assert "done in 30s" in out.getvalue()
    assert format_seconds(5) == "5s" and format_seconds(3600) == "60m00s"


def test_namespace_from_the_launcher_gets_its_task(tiny):
    """`kvscope kv-accuracy` parses with the launcher's parser, not parse_args."""
    ns = argparse.Namespace(**vars(kv_accuracy_cmd.parse_args(["--trace", "t"])))
    ns.task = None
    assert kv_accuracy_cmd.resolve_task(ns).task == "prompts"
