"""The window's tests: none may leave threads, running QThreads or active QTimers behind."""
import gc

import pytest

from tests.app import leaks


@pytest.fixture(autouse=True)
def _own_data_folder(tmp_path_factory, monkeypatch):
    """Saved chats (app.chat.store) go to a folder of the test's, never the user's."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))


@pytest.fixture(autouse=True)
def _app_leak_check(request):
    """Every test in this folder must not leave threads, running QThreads or active QTimers
    behind once its widgets are closed; see tests/app/leaks.py."""
    request.getfixturevalue("qapp")  # the QApplication exists before the snapshot
    # As the window does (app/gui_gc.py): no cycle collection in worker threads, where
    # freeing a Qt wrapper crashes the process; collect here, in the GUI thread, instead.
    gc.collect()
    gc.disable()
    before = leaks.Snapshot()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
    left = leaks.check(before)
    if left:
        pytest.fail("the test left these running: " + ", ".join(left), pytrace=False)
