"""The KV tiers' parts on their own: the host tier's bounded eviction order, and the disk tier's
files (round trip, planted corruptions and mismatched keys refused and deleted, the byte
budget, a failing disk) without a model."""
from __future__ import annotations

import errno
import logging

import pytest
import torch

from kvscope.engine.kv_cache.disk_tier import DiskTier
from kvscope.engine.kv_cache.host_tier import HostEntry, HostTier
from kvscope.engine.kv_cache.tier_key import TierKey, chain_digest

LAYOUT = [((4, 2, 8), torch.bfloat16), ((4, 2, 8), torch.int8), ((4, 2), torch.float32)]


def key(**over) -> TierKey:
    fields = dict(model="m", model_dtype="float32", weights="dense", device_type="cpu",
                  kv_dtype="int8", block_size=4, num_layers=1, num_kv_heads=2, head_dim=8,
                  rotation="none", calibration="")
    fields.update(over)
    return TierKey(**fields)


def payload(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 2, 8, generator=g).to(torch.bfloat16),
            torch.randint(-128, 128, (4, 2, 8), generator=g, dtype=torch.int8),
            torch.rand(4, 2, generator=g)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (NaN payloads included)."""
    return all(x.dtype == y.dtype and x.shape == y.shape
               and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for x, y in zip(a, b, strict=True))


TOKENS = (5, 6, 7, 8)


def test_disk_round_trip_is_bit_exact_and_survives_a_new_tier(tmp_path):
    k = key()
    d = chain_digest(k.digest, TOKENS)
    disk = DiskTier(tmp_path, 1 << 20, k, LAYOUT)
    assert disk.put(d, TOKENS, payload(1))
    again = DiskTier(tmp_path, 1 << 20, k, LAYOUT)  # a restart: the folder is scanned
    assert again.contains(d) and len(again) == 1
    got = again.get(d, TOKENS)
    assert got is not None and same(got, payload(1))
    assert again.get(d, (5, 6, 7, 9)) is None  # other tokens under that name: refused


@pytest.mark.parametrize("damage", ["payload", "header", "truncate", "key", "magic"])
def test_a_damaged_or_foreign_file_is_refused_deleted_and_logged(tmp_path, caplog, damage):
    k = key()
    d = chain_digest(k.digest, TOKENS)
    disk = DiskTier(tmp_path, 1 << 20, k, LAYOUT)
    disk.put(d, TOKENS, payload(2))
    path = tmp_path / (d.hex() + ".kvb")
    raw = bytearray(path.read_bytes())
    if damage == "payload":
        raw[-3] ^= 0x10
    elif damage == "header":
        raw[20] ^= 0x01  # inside the block digest (bytes 16-48 of the header)
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "magic":
        raw[:8] = b"NOTKVSCP"
    if damage == "key":  # a file written under another key, planted under this one's name
        other = DiskTier(tmp_path / "other", 1 << 20, key(block_size=4, kv_dtype="fp8"), LAYOUT)
        other.put(d, TOKENS, payload(2))
        raw = bytearray((tmp_path / "other" / path.name).read_bytes())
    path.write_bytes(bytes(raw))
    fresh = DiskTier(tmp_path, 1 << 20, k, LAYOUT)
    with caplog.at_level(logging.WARNING, logger="kvscope.kv_tiers"):
        assert fresh.get(d, TOKENS) is None
    assert not path.exists() and not fresh.contains(d)
    reasons = [r.reason for r in caplog.records if hasattr(r, "reason")]
    expected = {"payload": "checksum", "header": "digest-mismatch", "truncate": "truncated",
                "key": "key-mismatch", "magic": "bad-magic"}[damage]
    assert reasons == [expected]
    assert fresh.refused == {expected: 1}


def test_another_key_never_finds_the_block():
    a, b = key(), key(block_size=8)
    assert chain_digest(a.digest, TOKENS) != chain_digest(b.digest, TOKENS)
    assert key(calibration="x").digest != a.digest
    assert key(rotation="hadamard").digest != a.digest


def test_disk_budget_evicts_least_recently_used_files_of_any_key(tmp_path):
    k_old, k_new = key(kv_dtype="fp8"), key()
    old = DiskTier(tmp_path, 1 << 20, k_old, LAYOUT)
    old_digests = [chain_digest(k_old.digest, (i, 1, 2, 3)) for i in range(3)]
    for i, d in enumerate(old_digests):
        old.put(d, (i, 1, 2, 3), payload(i))
    budget = old.file_nbytes + 3 * DiskTier(tmp_path / "x", 1, k_new, LAYOUT).file_nbytes
    new = DiskTier(tmp_path, budget, k_new, LAYOUT)  # a reconfigure: another key
    assert len(new) == 3
    for i in range(3):
        d = chain_digest(k_new.digest, (i, 9, 9, 9))
        assert new.put(d, (i, 9, 9, 9), payload(10 + i))
    assert new.nbytes <= budget and len(new) == 4
    assert sum(new.contains(d) for d in old_digests) == 1  # the old key's were reclaimed
    assert sorted(p.name for p in tmp_path.glob("*.kvb")) == sorted(new.index)


def test_a_failing_disk_stops_the_writes_once_and_never_raises(tmp_path, caplog, monkeypatch):
    k = key()
    disk = DiskTier(tmp_path, 1 << 20, k, LAYOUT)

    def full(name, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_write_file", full)
    with caplog.at_level(logging.WARNING, logger="kvscope.kv_tiers"):
        for i in range(3):
            assert not disk.put(chain_digest(k.digest, (i, 0, 0, 0)), (i, 0, 0, 0), payload(i))
    stopped = [r for r in caplog.records if getattr(r, "reason", "") == "writes-stopped"]
    assert len(stopped) == 1 and "No space left" in stopped[0].getMessage()
    assert len(disk) == 0 and "No space left" in disk.writes_stopped


def entry(tag: int, nbytes: int = 100) -> HostEntry:
    return HostEntry([torch.tensor([tag])], (tag,), tag, nbytes)


def test_host_tier_evicts_least_urgent_then_least_recent_and_never_a_pinned_entry():
    host = HostTier(300)
    for tag, priority in ((1, 0), (2, 5), (3, 0)):
        kept, gone = host.put(bytes([tag]), entry(tag), priority)
        assert kept and not gone
    kept, gone = host.put(bytes([4]), entry(4), 0)
    assert [e.block_hash for e in gone] == [2]  # the least urgent releaser's first
    host.touch(bytes([1]))
    _, gone = host.put(bytes([5]), entry(5), 0)
    assert [e.block_hash for e in gone] == [3]  # then the least recently used
    host.pin(bytes([1]))
    host.pin(bytes([4]))
    host.pin(bytes([5]))
    kept, gone = host.put(bytes([6]), entry(6), 0)
    assert not kept and not gone  # everything pinned: it does not fit, nothing is evicted
    host.unpin(bytes([4]))
    kept, gone = host.put(bytes([6]), entry(6), 0)
    assert kept and [e.block_hash for e in gone] == [4]
    assert host.nbytes == 300 and len(host) == 3
