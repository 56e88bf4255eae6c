"""Block manager on fake sequences: pure Python, no JAX, milliseconds each (the scheduler's
tests, which drive it, are in test_scheduler.py)."""

from __future__ import annotations

import random

from runtime.core.block_manager import BlockManager
from runtime.core.sampling_params import SamplingParams
from runtime.core.sequence import Request


def make_seq(tokens, n=1, rid=None, arrival=None):
    req = Request(rid or f"r{random.random()}", None, tokens, SamplingParams(n=n, max_tokens=4), arrival)
    return req.seqs[0]


def test_allocate_and_free_counts():
    bm = BlockManager(10, 4)
    s = make_seq(list(range(10)))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_used == 3
    bm.check_invariants([s])
    bm.deallocate(s)
    assert bm.num_used == 0
    bm.check_invariants([])


def test_prefix_cache_hit_after_blocks_are_computed():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(13)))
    bm.allocate(a)
    a.num_computed_tokens = 13
    bm.mark_computed(a)  # 3 full blocks published
    b = make_seq(list(range(12)) + [99, 98])
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.num_cached_tokens == 12
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_table[:3])
    bm.check_invariants([a, b])
    # The whole prompt cached: the last block is recomputed so logits exist.
    c = make_seq(list(range(12)))
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    bm.check_invariants([a, b, c])


def test_freed_cached_blocks_go_to_lru_and_are_evicted_last():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4])
    bm.allocate(a)
    a.num_computed_tokens = 4
    bm.mark_computed(a)
    bm.deallocate(a)
    assert len(bm.cached) == 2 and len(bm.free) == 2
    b = make_seq([7, 8, 9, 10])  # takes the two truly free blocks first
    bm.allocate(b)
    assert len(bm.cached) == 2
    c = make_seq([1, 2, 3])  # still hits the cached prefix block
    bm.allocate(c)
    assert c.num_cached_tokens == 2
    bm.check_invariants([b, c])


def test_copy_on_write_for_forked_tail():
    bm = BlockManager(8, 4)
    p = make_seq(list(range(6)), n=2)
    bm.allocate(p)
    p.num_computed_tokens = 6
    child = make_seq(list(range(6)))
    bm.fork(p, child)
    assert all(bm.blocks[b].ref_count == 2 for b in p.block_table)
    p.token_ids.append(50)
    child.token_ids.append(51)
    bm.may_append(p, 1)
    assert bm.take_copies() == [(child.block_table[1], p.block_table[1])]
    assert p.block_table[0] == child.block_table[0] and p.block_table[1] != child.block_table[1]
    bm.may_append(child, 1)  # now the sole owner: writes in place
    assert bm.take_copies() == []
    bm.check_invariants([p, child])
