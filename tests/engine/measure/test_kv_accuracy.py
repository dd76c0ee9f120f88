"""kv-accuracy's inputs and rows: the prompt file, the rows per dtype, the agreement measures."""
from __future__ import annotations

from kvscope.engine.cli import kv_accuracy as kv_accuracy_cmd
from kvscope.engine.measure import kv_accuracy


def test_the_prompt_file_holds_forty_distinct_prompts(tmp_path):
    prompts = kv_accuracy.load_prompts()
    assert len(prompts) == 40 and len(set(prompts)) == 40
    assert all(p and not p.startswith("#") for p in prompts)
    # The older benchmarks' eight are the file's first eight, unchanged.
    assert prompts[:8] == kv_accuracy.PROMPTS
    assert kv_accuracy.PROMPTS[0] == "What is the capital of France?"
    f = tmp_path / "p.txt"
    f.write_text("# a comment\n\nfirst\n  second  \n#third\n")
    assert kv_accuracy.load_prompts(f) == ["first", "second"]


def test_rows_compare_every_rotation_on_one_byte_dtypes_only():
    rows = kv_accuracy.rows(["float32", "int8", "fp8"], ["calibrated", "hadamard", "none"])
    assert rows == [("float32", "none", 0), ("int8", "calibrated", 0), ("int8", "hadamard", 0),
                    ("int8", "none", 0), ("fp8", "calibrated", 0), ("fp8", "hadamard", 0),
                    ("fp8", "none", 0)]
    assert kv_accuracy.rows(["bfloat16", "int8"], ["calibrated"], [4, 0]) == [
        ("bfloat16", "none", 0), ("int8", "calibrated", 4), ("int8", "calibrated", 0)]
    assert kv_accuracy.row_name("int8", "calibrated") == "int8+calibrated"
    assert kv_accuracy.row_name("int8", "calibrated", 4) == "int8+calibrated+anchors4"
    assert kv_accuracy.row_name("bfloat16", "none") == "bfloat16"


def test_prefix_and_positional_agreement():
    ref = [1, 2, 3, 4]
    assert kv_accuracy.common_prefix([1, 2, 9, 4], ref) == 2
    assert kv_accuracy.positional([1, 2, 9, 4], ref) == 0.75  # the detour came back
    assert kv_accuracy.common_prefix(ref, ref) == 4


def test_arguments_take_a_prompt_file_and_a_count(tmp_path):
    args = kv_accuracy_cmd.parse_args(["--prompts", str(tmp_path / "x.txt"), "--num-prompts", "5",
                                   "--rotations", "calibrated"])
    assert args.num_prompts == 5 and args.rotations == ["calibrated"]
    assert kv_accuracy_cmd.parse_args([]).rotations == ["calibrated", "hadamard", "none"]
