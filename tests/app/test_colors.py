"""Block-map colours are told apart by a measured colour difference (CIEDE2000): each of the
16 most recent requests against free, cached and the background at every fill level, and
against each other (issue 53: a full block was dark purple beside free grey, load requests
came out in similar greens)."""
import itertools

import pytest

from kvscope.app import colors
from kvscope.app.color_difference import ciede2000, delta_e, srgb_to_lab

# Sharma, Wu, Dalal (2005), table 1: Lab pairs and their ΔE00.
SHARMA = [
    ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
    ((50.0, 3.1571, -77.2803), (50.0, 0.0, -82.7485), 2.8615),
    ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),
    ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
    ((50.0, 2.5, 0.0), (50.0, 3.1736, 0.5854), 1.0000),
    ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
    ((90.8027, -2.0831, 1.4410), (91.1528, -1.6435, 0.0447), 1.4441),
]
PAIRWISE_MIN = 15.0  # between two requests' full blocks
SPECIAL_MIN = 22.0  # a request's block at any fill level against free, cached, background


@pytest.mark.parametrize("lab1, lab2, expected", SHARMA)
def test_ciede2000_matches_sharmas_data(lab1, lab2, expected):
    assert ciede2000(lab1, lab2) == pytest.approx(expected, abs=1e-4)
    assert ciede2000(lab2, lab1) == pytest.approx(expected, abs=1e-4)


def test_srgb_to_lab_reference_points():
    assert srgb_to_lab((255, 255, 255)) == pytest.approx((100.0, 0.0, 0.0), abs=0.01)
    assert srgb_to_lab((255, 0, 0)) == pytest.approx((53.24, 80.09, 67.20), abs=0.05)


def lut_rgb(slot: int, level: int) -> tuple[int, int, int]:
    """What the map really paints: the LUT row of this slot and fill level."""
    row = colors.build_lut()[slot * colors.FILL_LEVELS + level]
    return tuple(int(c) for c in row[:3])


def recent_slots(n: int) -> list[int]:
    return [colors.request_slot(f"test-colors-{i}-{id(object())}") for i in range(n)]


def test_the_16_most_recent_requests_have_16_colours():
    for start in (0, 5):  # wherever the round robin stands
        recent_slots(start)
        slots = recent_slots(16)
        assert len(set(slots)) == 16


def test_a_request_keeps_its_colour():
    rid = "test-colors-keep"
    first = colors.request_rgb(rid)
    recent_slots(7)
    assert colors.request_rgb(rid) == first


def test_recent_requests_differ_from_each_other_by_delta_e():
    top = colors.FILL_LEVELS - 1
    rgbs = [lut_rgb(s, top) for s in recent_slots(16)]
    worst = min(delta_e(a, b) for a, b in itertools.combinations(rgbs, 2))
    assert worst >= PAIRWISE_MIN


def test_every_fill_level_differs_from_free_cached_and_background():
    specials = [lut_rgb(colors.SLOT_FREE, 0), lut_rgb(colors.SLOT_CACHED, 0),
                colors.MAP_BACKGROUND_RGB]
    for slot in set(recent_slots(16)):
        for level in range(colors.FILL_LEVELS):
            rgb = lut_rgb(slot, level)
            for special in specials:
                assert delta_e(rgb, special) >= SPECIAL_MIN, (slot, level, rgb, special)


def test_free_cached_and_shared_differ_from_each_other():
    specials = [colors.FREE_RGB, colors.CACHED_RGB, colors.SHARED_RGB]
    assert min(delta_e(a, b) for a, b in itertools.combinations(specials, 2)) >= SPECIAL_MIN
