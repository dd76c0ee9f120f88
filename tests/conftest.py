"""Every test runs offline (no hub), Qt without a display unless a test asks for one, and
Triton under its CPU interpreter."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# The Triton kernels run under the interpreter in every test, whichever imports triton first
# (benchmarks/device/gpu_check.py is the check on a real GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernel choices measured by tests go to the checkout's build folder, not the user's cache.
os.environ.setdefault("KVSCOPE_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "build", "test-cache"))

# Before any test imports transformers: kvscope moves the checkout's root, which `python -m
# pytest` put first on sys.path, behind site-packages, so its kernels/ folder cannot stand in
# for the `kernels` distribution transformers imports (kvscope/__init__.py).
import kvscope  # noqa: E402,F401

# `--quick` (make check) and `--record-durations` (make durations): tests/support/durations.py.
pytest_plugins = ["tests.support.durations"]


@pytest.fixture(scope="session", autouse=True)
def int4_kernel_family() -> str:
    """The 4-bit kernels' family is fixed per process (kernels/cpu_int4.family): decided here,
    with the real chooser, before any test fakes the chooser's timings, so the order tests run
    in does not decide it. Tests of one family's behaviour pin it with monkeypatch."""
    from kvscope.kernels import cpu_int4

    return cpu_int4.family()

