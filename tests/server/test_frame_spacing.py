"""How far apart the engine spaces a topic's state frames, from what building them cost."""
from kvscope.engine.server.engine_server import PUBLISH_BUDGET, _Published

INTERVAL = 1 / 30


def spaced(costs: list[float]) -> list[float]:
    pub = _Published()
    gaps = []
    for cost in costs:
        pub.spaced_after(cost, INTERVAL)
        gaps.append(pub.gap)
    return gaps


def test_a_cheap_topic_is_sent_at_the_frame_rate():
    assert spaced([0.0002] * 5) == [INTERVAL] * 5


def test_one_slow_build_does_not_hold_back_the_frames_after_it():
    """The first build warms caches, and a preempted thread looks slow: one 50 ms build
    (a 5 s gap under a 1 % budget) must not leave the block map dark once cheap builds follow."""
    assert spaced([0.05, 0.0002, 0.0002, 0.0002]) == [INTERVAL] * 4
    assert spaced([0.0002, 0.0002, 0.04, 0.0002])[2] == INTERVAL  # a spike among cheap ones


def test_a_topic_that_is_always_costly_gets_fewer_frames():
    gaps = spaced([0.004] * 6)  # e.g. a 32k-block pool
    assert gaps[:2] == [INTERVAL] * 2  # until three builds say it is costly
    assert gaps[2:] == [0.004 / PUBLISH_BUDGET] * 4
    assert gaps[-1] > 10 * INTERVAL
