"""Fixtures the benchmark tests share."""
from __future__ import annotations

import pytest

from tests.support.server_harness import save_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny chat model (a character tokenizer and a chat template), saved once a module."""
    return save_chat_model(tmp_path_factory.mktemp("chat"), seed=1)
