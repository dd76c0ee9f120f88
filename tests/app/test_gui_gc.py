"""app/gui_gc.py: while the window runs, cycles are collected by a GUI-thread timer only, so
a worker thread never frees a Qt object."""
import gc
import threading
import weakref

from kvscope.app.gui_gc import GuiThreadCollector


class Node:
    pass


def make_cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_worker_threads_do_not_collect_and_the_timer_does(qapp):
    collector = GuiThreadCollector(interval_ms=10_000)
    try:
        assert not gc.isenabled()
        dead = make_cycle()

        def allocate_a_lot():  # crosses generation 0's threshold many times over
            junk = [[Node()] for _ in range(50_000)]
            del junk

        worker = threading.Thread(target=allocate_a_lot)
        worker.start()
        worker.join()
        assert dead() is not None  # nobody collected it off the GUI thread
        gc.collect()
        dead = make_cycle()
        collector.collect_due()  # generation 0 is under its threshold: nothing due yet
        assert dead() is not None
        keep = [[] for _ in range(gc.get_threshold()[0] + 1)]
        collector.collect_due()
        assert dead() is None and keep
    finally:
        collector.stop()
        collector.deleteLater()


def test_stop_restores_automatic_collection(qapp):
    gc.enable()
    collector = GuiThreadCollector()
    assert not gc.isenabled()
    collector.stop()
    collector.deleteLater()
    assert gc.isenabled()
    gc.disable()  # as the app-test fixture had it
