"""engine/kv_cache/memory.py: host pool tensors in their own mappings, started at a huge page's
edge (and asked for huge pages), zeroed, and unmapped when the tensor dies."""
from __future__ import annotations

import gc

import torch

from kvscope.engine.kv_cache import memory as kv_memory


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_a_big_pool_tensor_starts_at_a_huge_page_and_goes_when_freed():
    t = kv_memory.zeros((200, 16, 3, 64), torch.float32, "cpu")  # 2.3 MiB
    assert t.data_ptr() % kv_memory.HUGE_PAGE == 0
    assert t.shape == (200, 16, 3, 64) and not t.any()
    t[-1, -1, -1, -1] = 1.0  # the last element is inside the mapping
    address = t.data_ptr()
    assert mapped(address)
    del t
    gc.collect()
    assert not mapped(address)


def test_pool_tensors_under_a_huge_page_are_zeroed_whole():
    small = kv_memory.zeros((100, 16, 3, 64), torch.int8, "cpu")  # 300 KiB: torch's allocator
    assert not small.any() and small.dtype == torch.int8
    t = kv_memory.zeros((600, 16, 3, 64), torch.int8, "cpu")  # 1.8 MiB: its own mapping
    assert t.data_ptr() % 4096 == 0 and not t.any()
    assert mapped(t.data_ptr() + t.nbytes - 1)
