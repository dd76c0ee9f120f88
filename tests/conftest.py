import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


import pytest


@pytest.fixture(autouse=True)
def _app_leak_check(request):
    """App tests (modules test_app_*) must not leave threads, running QThreads or active
    QTimers behind once their widgets are closed; see tests/app_leaks.py."""
    if not request.module.__name__.rpartition(".")[2].startswith("test_app_"):
        yield
        return
    import app_leaks

    request.getfixturevalue("qapp")  # the QApplication exists before the snapshot
    # As the window does (app/gui_gc.py): no cycle collection in worker threads, where
    # freeing a Qt wrapper crashes the process; collect here, in the GUI thread, instead.
    gc.collect()
    gc.disable()
    before = app_leaks.Snapshot()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
    leaks = app_leaks.check(before)
    if leaks:
        pytest.fail("the test left these running: " + ", ".join(leaks), pytrace=False)


@pytest.fixture
def client(server):
    """An EngineClient on the test module's `server` (a server_harness.Server). Generous
    heartbeat timeout: other test processes share the CPUs."""
    from kvscope.ipc import EngineClient

    c = EngineClient(server.command, server.state, timeout=60, heartbeat_timeout=15)
    yield c
    c.close()
