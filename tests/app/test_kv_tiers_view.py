"""The KV tiers in the window (issue 56): the block map's host-tier strip and disk count, from
the blocks frame's tier fields, and a chat reply's "prefix from disk" from its deltas."""
from __future__ import annotations

from types import SimpleNamespace

from kvscope.app.blocks.tier_strip import STRIP_CELLS, tier_lines
from kvscope.app.chat.turn import Turn
from kvscope.ipc import messages as m


def test_the_strip_shows_the_host_tiers_fill_and_the_disk_count():
    frame = SimpleNamespace(tier_host_blocks=3, tier_host_capacity_blocks=12,
                            tier_disk_blocks=250, tier_disk_bytes=3 << 20)
    host, disk = tier_lines(frame)
    assert "host tier: <b>3</b> of 12 blocks" in host
    filled, empty = host.split("</span>")[:2]
    assert filled.count("▮") == STRIP_CELLS // 4 and empty.count("▮") == STRIP_CELLS * 3 // 4
    assert "disk tier: <b>250</b> blocks" in disk and "3" in disk


def test_an_engine_without_tiers_shows_nothing():
    assert tier_lines(SimpleNamespace()) == []
    frame = m.BlocksFrame.__struct_fields__  # the wire's defaults say "no tiers"
    assert "tier_host_blocks" in frame


def test_a_reply_resumed_from_disk_says_so_in_its_stats():
    turn = Turn("r1", 0)
    turn.on_delta(m.Delta(request_id="r1", token_ids=[5], text="hi", num_prompt_tokens=180,
                          num_cached_tokens=160, num_disk_cached_tokens=160,
                          num_output_tokens=1))
    assert "prefix from disk: 160 tokens" in turn.stats_text()
    plain = Turn("r2", 0)
    plain.on_delta(m.Delta(request_id="r2", token_ids=[5], text="hi", num_cached_tokens=16))
    assert "from disk" not in plain.stats_text()
