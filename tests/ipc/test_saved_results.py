"""ipc/saved_results.py: a saved kv-accuracy run survives the round trip, a bad file is refused
with the field it got wrong, and the path is the one the command and the window share."""
from __future__ import annotations

import json

import pytest

from kvscope.ipc import saved_results
from kvscope.ipc.saved_results import SavedResultsError


def cell(length: int, depth: float | None, right: float | None) -> dict:
    c = {"length": length, "tokens": length - 3, "samples": 2, "same_as_float32": 0.5,
         "agreement": 0.75, "top1_agreement": 0.9, "kl": 0.0125, "rank": 1.5,
         "answers": [{"answer": " 4821", "key": 4821, "right": True},
                     {"answer": " 77", "key": 1907, "right": False}]}
    if depth is not None:
        c["depth"] = depth
    if right is not None:
        c["right"] = right
    return c


def run(task: str = "passkey") -> dict:
    """A run as engine/measure/kv_long.py builds it (kv_grid.grid_of's settings)."""
    passkey = task == "passkey"

    def cells() -> list[dict]:
        return [cell(n, d if passkey else None, 0.5 if passkey else None)
                for n in (1024, 2048) for d in (0.0, 1.0)]
    described = ({"lengths": [1024, 2048], "depths": [0.0, 1.0], "seeds": 2} if passkey
                 else {"document": "long_document.txt", "lengths": [1024, 2048]})
    return {"task": task, "model": "SmolLM2-135M-Instruct-Q4_1.gguf",
            "date": "2026-12-07T10:00:00+00:00", "seconds": 12.5,
            "machine": "x86_64, 2 cores", "probes": 8, **described, "partial": False,
            "settings": {
                "float32": {"kv_dtype": "float32", "kv_rotation": "none",
                            "kv_anchor_tokens": 0, "kv_bytes_per_token": 46080,
                            "cells": cells()},
                "int8": {"kv_dtype": "int8", "kv_rotation": "calibrated",
                         "kv_anchor_tokens": 4, "kv_bytes_per_token": 12240,
                         "cells": cells()}}}


@pytest.mark.parametrize("task", ["passkey", "document"])
def test_a_run_survives_save_and_read(tmp_path, task):
    path = saved_results.save(saved_results.from_result(run(task)), tmp_path / "d" / "r.json")
    back = saved_results.read(path)
    assert back == saved_results.from_result(run(task))
    # Every field the measurement wrote is in the file, as it wrote it (defaults left out).
    assert {"partial": False, **json.loads(path.read_bytes())} == run(task)
    assert back.settings["int8"].cells[3].answers[1].key == 1907
    assert not path.with_name("r.json.tmp").exists()  # renamed over, not left behind


@pytest.mark.parametrize("change, field", [
    (lambda r: r["settings"]["int8"]["cells"][3].update(kl="big"), "$.settings.int8.cells[3].kl"),
    (lambda r: r["settings"]["int8"]["cells"][0].update(right=1.5),
     "$.settings.int8.cells[0].right"),
    (lambda r: r["settings"]["float32"].pop("kv_dtype"), "kv_dtype"),
    (lambda r: r.update(task="nonsense"), "$.task"),
    (lambda r: r.update(extra=1), "extra"),
    (lambda r: r["settings"]["int8"]["cells"][1].pop("depth"),
     "$.settings.int8.cells[1].depth"),
    (lambda r: r["settings"]["int8"].update(cells=[]), "$.settings.int8.cells"),
    (lambda r: r.update(settings={}), "$.settings"),
])
def test_a_malformed_run_is_refused_naming_the_field(change, field):
    bad = run()
    change(bad)
    with pytest.raises(SavedResultsError) as read_error:
        saved_results.decode(json.dumps(bad).encode())
    assert field in str(read_error.value)
    with pytest.raises(SavedResultsError):  # the writer refuses it as the reader would
        saved_results.from_result(bad)


@pytest.mark.parametrize("data", [b"", b"{not json", b"[1, 2]", b"\xff\xfe", b"null"])
def test_what_is_not_a_run_is_a_saved_results_error(data):
    with pytest.raises(SavedResultsError):
        saved_results.decode(data)


def test_the_path_is_under_the_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert saved_results.saved_path("passkey") == (
        tmp_path / "kvscope" / "kv-accuracy" / "last-passkey.json")
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert saved_results.saved_path("document") == (
        tmp_path / ".local" / "share" / "kvscope" / "kv-accuracy" / "last-document.json")
    with pytest.raises(ValueError, match="chat"):
        saved_results.saved_path("chat")  # the chat table is printed, never saved
