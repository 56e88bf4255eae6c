"""Block manager on fake sequences: pure Python, no JAX, milliseconds each (the scheduler's
tests, which drive it, are in test_scheduler.py)."""

from __future__ import annotations

import random

import pytest

from ir.kv_groups import window_span_blocks
from runtime.core.block_manager import NULL_BLOCK, BlockManager
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


# ------------------------------------------------------------------ the window group (ir.kv_groups)

def _step(bm, seq, n):
    """One scheduled step of `n` tokens: room for them, then they count computed. Before it, the
    window group has released exactly the blocks its first token cannot see (keys <= p - window)."""
    assert bm.can_append(seq, n)
    bm.may_append(seq, n)
    if bm.window is not None:
        dead = max(seq.num_computed_tokens - bm.window + 1, 0) // bm.block_size
        assert seq.num_released_blocks == min(dead, len(seq.window_block_table))
    seq.num_computed_tokens += n
    bm.mark_computed(seq)


def _held(seq):
    return len(seq.window_block_table) - seq.num_released_blocks


@pytest.mark.parametrize("window,bs,chunk", [(6, 4, 1), (6, 4, 5), (4, 4, 3), (9, 2, 4), (3, 8, 7)])
def test_window_group_holds_only_the_window_and_leaks_nothing(window, bs, chunk):
    """A 61-token sequence in chunks: the window group holds at most the blocks of the window and
    the chunk (entries behind it are the null block), the full group every block; all free after."""
    bm = BlockManager(40, bs, window=window, num_window_blocks=window_span_blocks(window, bs, chunk) + 1)
    s = make_seq(list(range(61)))
    assert bm.can_allocate(s, chunk)
    bm.allocate(s, chunk)
    s.num_computed_tokens += chunk
    bm.mark_computed(s)
    while s.num_uncomputed:
        n = min(chunk, s.num_uncomputed)
        _step(bm, s, n)
        assert _held(s) <= window_span_blocks(window, bs, n)
        bm.check_invariants([s])
    assert len(s.block_table) == -(-61 // bs) and len(s.window_block_table) == len(s.block_table)
    assert bm.can_append(s, 1)  # a next token's room: what position 61 cannot see is released
    assert s.num_released_blocks == (61 - window + 1) // bs
    assert s.window_block_table[:s.num_released_blocks] == [NULL_BLOCK] * s.num_released_blocks
    bm.deallocate(s)
    bm.check_invariants([])
    assert bm.num_used == 0 and bm.window_pool.num_used == 0
    assert bm.window_pool.num_free == bm.num_window_blocks - 1  # all but the null block


def test_window_group_admits_a_long_prompt_chunk_by_chunk():
    """A prompt far longer than the window pool is admitted: the window group takes blocks for its
    first chunk only, not for the whole prompt."""
    bm = BlockManager(40, 4, window=6, num_window_blocks=6)
    s = make_seq(list(range(100)))
    assert bm.can_allocate(s, 8) and not bm.can_allocate(s)
    bm.allocate(s, 8)
    assert len(s.block_table) == 25 and len(s.window_block_table) == 2
    s.num_computed_tokens = 8
    while s.num_uncomputed > 1:
        _step(bm, s, min(8, s.num_uncomputed - 1))
        bm.check_invariants([s])


def _compute_all(bm, s, chunk=4):
    bm.allocate(s, chunk)
    s.num_computed_tokens = min(chunk, len(s))
    bm.mark_computed(s)
    while s.num_uncomputed:
        _step(bm, s, min(chunk, s.num_uncomputed))


def test_prefix_hit_past_the_window_reuses_the_window_blocks_it_needs():
    """A hit of H tokens holds the window group's blocks that [H - window + 1, H) lie in; the blocks
    before it stay released (null). When those were evicted, the hit shrinks to what both groups
    still hold."""
    bm = BlockManager(40, 4, window=6, num_window_blocks=12)
    a = make_seq(list(range(21)))
    _compute_all(bm, a)
    bm.deallocate(a)  # 5 full blocks cached in both groups (window: the ones it still held)
    b = make_seq(list(range(20)) + [99, 98])
    assert bm.can_allocate(b, 4)
    bm.allocate(b, 4)
    assert b.num_cached_tokens == 20
    # Position 20's window starts at 15: block 3 on; blocks 0-2 are never held again.
    assert b.window_block_table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in b.window_block_table[3:]
    assert b.num_released_blocks == 3
    bm.check_invariants([b])
    bm.deallocate(b)
    # Evict the window group's block of tokens 16-19: a hit of 20 tokens would need it (position
    # 20 sees 15 on); at 16 tokens the window needs the blocks of tokens 8-15, still cached.
    _evict(bm.window_pool, tuple(range(16, 20)))
    c = make_seq(list(range(20)) + [7, 7])
    bm.allocate(c, 4)
    assert c.num_cached_tokens == 16
    assert c.num_released_blocks == 2
    assert [bm.window_pool.blocks[x].token_ids for x in c.window_block_table[2:4]] == [
        tuple(range(8, 12)), tuple(range(12, 16))]
    bm.check_invariants([c])
    bm.deallocate(c)
    bm.check_invariants([])


def _evict(pool, toks):
    """Evicts the cached block holding `toks`: it goes first in the LRU, and every free block
    and it are taken, then given back."""
    bid = next(b for b in pool.cached if pool.blocks[b].token_ids == toks)
    pool.cached.move_to_end(bid, last=False)
    taken = [pool.take() for _ in range(len(pool.free) + 1)]
    assert bid in taken
    for b in taken:
        pool.release(b)


def test_window_group_fork_copy_on_write_trim_and_preemption_free_everything():
    bm = BlockManager(30, 4, window=5, num_window_blocks=14)
    p = make_seq(list(range(10)), n=2)
    _compute_all(bm, p)
    child = make_seq([0])
    child.token_ids = list(p.token_ids)
    bm.fork(p, child)
    bm.check_invariants([p, child])
    # Both write token 10 into the shared, partly filled block 2: each group copies it for one.
    p.token_ids.append(50)
    child.token_ids.append(51)
    bm.may_append(p, 1)
    assert len(bm.take_copies()) == 1 and len(bm.take_window_copies()) == 1
    bm.may_append(child, 1)
    assert bm.take_copies() == [] and bm.take_window_copies() == []  # the other holds it alone now
    bm.check_invariants([p, child])
    # Room for 3 drafts, then all rejected: trim gives the blocks back in both groups.
    bm.may_append(p, 4)
    bm.trim(p, p.num_computed_tokens + 1)
    assert len(p.window_block_table) == len(p.block_table) == 3
    bm.check_invariants([p, child])
    for s in (p, child):
        s.num_computed_tokens += 1
        for _ in range(12):
            s.token_ids.append(7)
            _step(bm, s, 1)
        bm.check_invariants([p, child])
    bm.deallocate(child)  # preempted (recompute): both groups free
    bm.deallocate(p)
    bm.check_invariants([])
    assert bm.num_used == 0 and bm.window_pool.num_used == 0


def test_window_group_random_schedule_keeps_invariants():
    """Random admissions, chunks, forks and releases: the invariants hold after every verb, and
    every block is free at the end."""
    rng = random.Random(0)
    bm = BlockManager(60, 4, window=7, num_window_blocks=25)
    live = []
    for _ in range(300):
        op = rng.random()
        if op < 0.25 and len(live) < 5:
            s = make_seq([rng.randrange(4) for _ in range(rng.randrange(2, 30))])
            if bm.can_allocate(s, 6):
                bm.allocate(s, 6)
                s.num_computed_tokens += min(6, s.num_uncomputed)
                bm.mark_computed(s)
                live.append(s)
        elif op < 0.85 and live:
            s = rng.choice(live)
            if not s.num_uncomputed:
                s.token_ids.append(rng.randrange(4))
            n = min(rng.randrange(1, 6), s.num_uncomputed)
            if bm.can_append(s, n):
                _step(bm, s, n)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.deallocate(s)
        bm.take_copies(), bm.take_window_copies()
        bm.check_invariants(live)
        for s in live:
            assert _held(s) <= window_span_blocks(7, 4, 6)
    for s in live:
        bm.deallocate(s)
    bm.check_invariants([])
    assert bm.num_used == 0 and bm.window_pool.num_used == 0
