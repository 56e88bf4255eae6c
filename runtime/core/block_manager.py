"""Paged KV block manager: ref-counted fixed-size blocks, prefix caching with LRU eviction, copy-on-write.

Plain Python, no JAX: the scheduler calls it, and tests drive it with fake sequences.

One manager serves the graph's KV cache groups (ir.kv_groups), each a `BlockPool` of its own:
the full group (`seq.block_table`: a block for every token) and, for a model that mixes
sliding-window layers with full ones, the window group (`seq.window_block_table`). A window
table has an entry per block of the sequence too, but the blocks wholly behind the window of
every token still to be computed go back to the pool, their entries pointing at the null block.
The window group allocates lazily, for the tokens about to be computed, not for the whole prompt.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from runtime.core.sequence import Sequence

# The window group's reserved block: released table entries point at it, and nothing writes it
# (the pool's zeros, masked by every window read, so they cannot turn a softmax into NaN).
NULL_BLOCK = 0


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: its tokens chained with the key of everything before it."""
    return hash((parent if parent is not None else -1, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """One group's blocks: ref counts, the free list, the LRU of cached blocks, the hash index.
    The first `reserved` blocks are never handed out (the window group's null block)."""

    def __init__(self, num_blocks: int, reserved: int = 0):
        if num_blocks < reserved + 1:
            raise ValueError(f"num_blocks must be >= {reserved + 1}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.reserved = reserved
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(reserved, num_blocks))
        # ref_count == 0 blocks that still hold cached content, least recently used first.
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.version = 0  # bumped by every change to block contents or the cache index

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: truly free plus evictable cached ones."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.reserved - self.num_free

    def take(self) -> int:
        self.version += 1
        if self.free:
            bid = self.free.popleft()
        elif self.cached:
            bid, _ = self.cached.popitem(last=False)  # evict the LRU cached block
            blk = self.blocks[bid]
            if self.hash_to_block.get(blk.hash) == bid:
                del self.hash_to_block[blk.hash]
            blk.hash, blk.token_ids = None, ()
        else:
            raise RuntimeError("out of KV blocks")
        self.blocks[bid].ref_count = 1
        return bid

    def release(self, bid: int) -> None:
        self.version += 1
        blk = self.blocks[bid]
        blk.ref_count -= 1
        if blk.ref_count == 0:
            if blk.hash is not None and self.hash_to_block.get(blk.hash) == bid:
                self.cached[bid] = None
            else:
                blk.hash, blk.token_ids = None, ()
                self.free.append(bid)

    def hold(self, bid: int) -> None:
        """One more table holds a block (a prefix-cache hit, a fork)."""
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self.cached[bid]
        blk.ref_count += 1

    def find(self, h: int, toks: tuple[int, ...]) -> int | None:
        bid = self.hash_to_block.get(h)
        return bid if bid is not None and self.blocks[bid].token_ids == toks else None

    def register(self, bid: int, h: int, toks: tuple[int, ...]) -> None:
        blk = self.blocks[bid]
        if blk.hash is None and h not in self.hash_to_block:
            self.version += 1
            blk.hash, blk.token_ids = h, toks
            self.hash_to_block[h] = bid

    def evictable(self, bids) -> int:
        """How many of `bids` sit in the LRU (counted free, but about to be held)."""
        return sum(1 for b in bids if self.blocks[b].ref_count == 0)

    def append_blocks(self, table: list[int], num_blocks: int, computed: int, block_size: int,
                      copies: list[tuple[int, int]]) -> None:
        """Grows `table` to `num_blocks`, after a copy-on-write of its partly filled tail block
        (the one token `computed` lands in) when another sequence also holds it."""
        i, offset = divmod(computed, block_size)
        if offset > 0 and i < len(table) and self.blocks[table[i]].ref_count > 1:
            old, new = table[i], self.take()
            copies.append((old, new))
            self.blocks[old].ref_count -= 1  # still > 0: another sample holds it
            table[i] = new
        while len(table) < num_blocks:
            table.append(self.take())

    def tail_is_shared(self, table: list[int], computed: int, block_size: int) -> bool:
        """Whether the next write lands in a partly filled block that another sequence also holds."""
        i, offset = divmod(computed, block_size)
        return offset > 0 and i < len(table) and self.blocks[table[i]].ref_count > 1

    def reset_cache(self) -> None:
        self.version += 1
        for bid in list(self.cached):
            blk = self.blocks[bid]
            self.hash_to_block.pop(blk.hash, None)
            blk.hash, blk.token_ids = None, ()
            self.free.append(bid)
        self.cached.clear()

    def check(self, tables: list[list[int]], what: str) -> None:
        """free + cached + used = total; ref counts = table occurrences; no block in two places."""
        refs = [0] * self.num_blocks
        for t in tables:
            for bid in t:
                if bid < self.reserved:
                    raise AssertionError(f"{what}: a table holds reserved block {bid}")
                refs[bid] += 1
        free, cached = set(self.free), set(self.cached)
        if len(free) != len(self.free):
            raise AssertionError(f"{what}: a block is on the free list twice")
        if free & cached:
            raise AssertionError(f"{what}: blocks both free and cached: {sorted(free & cached)}")
        used = {i for i, r in enumerate(refs) if r > 0}
        if used & (free | cached):
            raise AssertionError(f"{what}: blocks in use and free/cached: {sorted(used & (free | cached))}")
        if len(free) + len(cached) + len(used) != self.num_blocks - self.reserved:
            raise AssertionError(f"{what}: free {len(free)} + cached {len(cached)} + used {len(used)} "
                                 f"!= total {self.num_blocks - self.reserved}")
        for blk in self.blocks:
            if blk.ref_count != refs[blk.block_id]:
                raise AssertionError(f"{what}: block {blk.block_id}: ref_count {blk.ref_count} but "
                                     f"{refs[blk.block_id]} block tables hold it")
        for h, bid in self.hash_to_block.items():
            if self.blocks[bid].hash != h:
                raise AssertionError(f"{what}: hash index points at block {bid}, which holds another hash")


@dataclass
class _Hit:
    """A prefix-cache hit: full-group blocks and their chain hashes; window-group blocks of the
    hit's last blocks that its next token's window sees (from block `first_live` on)."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    first_live: int = 0
    window_blocks: list[int] = field(default_factory=list)


class BlockManager:
    """Allocates blocks to sequences. Verbs follow nano-vllm: can_allocate, allocate, may_append, deallocate.

    `window`/`num_window_blocks`: the window group (ir.kv_groups), absent by default. Every verb
    serves both groups; a prefix hit is capped to what both can serve."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 window: int | None = None, num_window_blocks: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.window = window
        # The null block is the window pool's block 0: it needs one more to hold anything.
        self.window_pool = BlockPool(num_window_blocks, reserved=1) if window is not None else None
        self.stats = PrefixCacheStats()
        # Copy-on-write work for the next step, per group: (src block, dst block).
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_window_copies: list[tuple[int, int]] = []
        self._last_lookup = None

    # ------------------------------------------------------------------ accounting

    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def free(self) -> deque[int]:
        return self.pool.free

    @property
    def cached(self) -> OrderedDict[int, None]:
        return self.pool.cached

    @property
    def hash_to_block(self) -> dict[int, int]:
        return self.pool.hash_to_block

    @property
    def num_free(self) -> int:
        """Full-group blocks that can be handed out now: truly free plus evictable cached ones."""
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def num_window_blocks(self) -> int:
        return self.window_pool.num_blocks if self.window_pool is not None else 0

    def usage(self) -> float:
        """The fuller group's share of its blocks in use."""
        u = self.pool.num_used / self.num_blocks
        if self.window_pool is not None:
            u = max(u, self.window_pool.num_used / (self.window_pool.num_blocks - 1))
        return u

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_live_block(self, pos: int) -> int:
        """The first block that a token at `pos` or later can see in the window group."""
        return max(pos - self.window + 1, 0) // self.block_size

    # ------------------------------------------------------------------ internals

    def _lookup(self, seq: Sequence) -> _Hit:
        """Cached blocks that match the sequence's leading full blocks (at least one token stays
        uncached), capped so that the window group holds the blocks the first uncached token's
        window sees. Nothing for a request that asks for prompt logprobs: cached positions are
        never run, and their logprobs are wanted (vLLM skips the cache for such requests too)."""
        hit = _Hit()
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return hit
        parent = None
        bs = self.block_size
        toks_of = []
        # Keep the last token out of the cache hit so the step still produces its logits.
        for i in range((len(seq) - 1) // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            bid = self.pool.find(h, toks)
            if bid is None:
                break
            hit.blocks.append(bid)
            hit.hashes.append(h)
            toks_of.append(toks)
            parent = h
        if self.window_pool is None or not hit.blocks:
            return hit
        found = [self.window_pool.find(h, t) for h, t in zip(hit.hashes, toks_of)]
        n = len(hit.blocks)
        while n and any(b is None for b in found[self.first_live_block(n * bs):n]):
            n -= 1
        hit.first_live = self.first_live_block(n * bs)
        del hit.blocks[n:], hit.hashes[n:]
        hit.window_blocks = found[hit.first_live:n]
        return hit

    def _lookup_cached(self, seq: Sequence) -> _Hit:
        # can_allocate and allocate run back to back on the same sequence: hash its blocks once.
        key = (seq.seq_id, len(seq), self.pool.version, self.window_pool.version if self.window_pool else 0)
        if self._last_lookup is None or self._last_lookup[0] != key:
            self._last_lookup = (key, self._lookup(seq))
        return self._last_lookup[1]

    def _window_tokens(self, seq: Sequence, hit: _Hit, num_new_tokens: int | None) -> int:
        """Tokens the window group covers at admission: the hit's, then the first chunk's."""
        start = len(hit.blocks) * self.block_size
        n = len(seq) - start
        return start + (n if num_new_tokens is None else min(n, num_new_tokens))

    def _release_behind(self, seq: Sequence) -> None:
        """Returns the window blocks no token from `num_computed_tokens` on can see."""
        table = seq.window_block_table
        dead = min(self.first_live_block(seq.num_computed_tokens), len(table))
        for i in range(seq.num_released_blocks, dead):
            self.window_pool.release(table[i])
            table[i] = NULL_BLOCK
        seq.num_released_blocks = max(seq.num_released_blocks, dead)

    # ------------------------------------------------------------------ verbs

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """Whether `allocate(seq, num_new_tokens)` finds its blocks."""
        hit = self._lookup_cached(seq)
        needed = self.blocks_needed(len(seq)) - len(hit.blocks)
        if needed > self.pool.num_free - self.pool.evictable(hit.blocks):
            return False
        if self.window_pool is None:
            return True
        needed = self.blocks_needed(self._window_tokens(seq, hit, num_new_tokens)) - len(hit.blocks)
        return needed <= self.window_pool.num_free - self.window_pool.evictable(hit.window_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> None:
        """Gives a waiting sequence blocks for all its tokens (the window group: for its first
        `num_new_tokens` uncached ones, None: all), reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq} already has blocks"
        hit = self._lookup_cached(seq)
        self._last_lookup = None
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.stats.queries += len(seq)
            self.stats.hits += len(hit.blocks) * self.block_size
        for bid in hit.blocks:
            self.pool.hold(bid)
        seq.block_table = list(hit.blocks)
        seq.block_hashes = list(hit.hashes)
        seq.num_hashed_blocks = len(hit.blocks)
        seq.num_cached_tokens = len(hit.blocks) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        for _ in range(self.blocks_needed(len(seq)) - len(hit.blocks)):
            seq.block_table.append(self.pool.take())
        if self.window_pool is not None:
            for bid in hit.window_blocks:
                self.window_pool.hold(bid)
            table = [NULL_BLOCK] * hit.first_live + hit.window_blocks
            for _ in range(self.blocks_needed(self._window_tokens(seq, hit, num_new_tokens)) - len(table)):
                table.append(self.window_pool.take())
            seq.window_block_table = table
            seq.num_released_blocks = hit.first_live

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        shared_tail = self.pool.tail_is_shared(seq.block_table, seq.num_computed_tokens, self.block_size)
        if max(need - len(seq.block_table), 0) + int(shared_tail) > self.pool.num_free:
            return False
        if self.window_pool is None:
            return True
        self._release_behind(seq)  # dead whatever is scheduled: the computed count never goes back
        table = seq.window_block_table
        shared_tail = self.window_pool.tail_is_shared(table, seq.num_computed_tokens, self.block_size)
        return max(need - len(table), 0) + int(shared_tail) <= self.window_pool.num_free

    def can_append_all(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Whether every one of `seqs` can take `num_new_tokens` more tokens' blocks at once."""
        need = self.blocks_needed
        if sum(max(need(s.num_computed_tokens + num_new_tokens) - len(s.block_table), 0)
               for s in seqs) > self.pool.num_free:
            return False
        if self.window_pool is None:
            return True
        for s in seqs:
            self._release_behind(s)
        return sum(max(need(s.num_computed_tokens + num_new_tokens) - len(s.window_block_table), 0)
                   for s in seqs) <= self.window_pool.num_free

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Makes room for the next tokens: new blocks as needed, and copy-on-write of a shared tail."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        self.pool.append_blocks(seq.block_table, need, seq.num_computed_tokens, self.block_size,
                                self.pending_copies)
        if self.window_pool is not None:
            self._release_behind(seq)
            self.window_pool.append_blocks(seq.window_block_table, need, seq.num_computed_tokens,
                                           self.block_size, self.pending_window_copies)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases the blocks past the first `blocks_needed(num_tokens)`: room reserved for tokens
        that never came (speculative drafts the target model rejected). Their slots hold no
        computed token, so the blocks were never hashed and go back to the free list."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())
        while len(seq.window_block_table) > max(keep, seq.num_released_blocks):
            self.window_pool.release(seq.window_block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (n > 1); writes copy on demand."""
        for bid in parent.block_table:
            self.pool.hold(bid)
        for bid in parent.window_block_table[parent.num_released_blocks:]:
            self.window_pool.hold(bid)
        child.block_table = list(parent.block_table)
        child.window_block_table = list(parent.window_block_table)
        child.num_released_blocks = parent.num_released_blocks
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def mark_computed(self, seq: Sequence) -> None:
        """Registers newly completed full blocks in the prefix cache (after their KV is written),
        in each group that still holds them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        window = seq.window_block_table
        while seq.num_hashed_blocks < full:
            i = seq.num_hashed_blocks
            parent = seq.block_hashes[i - 1] if i else None
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            self.pool.register(seq.block_table[i], h, toks)
            if seq.num_released_blocks <= i < len(window):
                self.window_pool.register(window[i], h, toks)
            seq.block_hashes.append(h)
            seq.num_hashed_blocks += 1

    def deallocate(self, seq: Sequence) -> None:
        # Release tail first so the LRU evicts a sequence's last blocks before its prefix.
        for bid in reversed(seq.block_table):
            self.pool.release(bid)
        for bid in reversed(seq.window_block_table[seq.num_released_blocks:]):
            self.window_pool.release(bid)
        seq.block_table = []
        seq.window_block_table = []
        seq.num_released_blocks = 0
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
        # num_cached_tokens stays: the final RequestOutput (made after this) reports the prefix-cache
        # hit of the sequence's last admission; a re-admission after preemption overwrites it.

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_window_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_window_copies = self.pending_window_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
        if self.window_pool is not None:
            self.window_pool.reset_cache()

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Per group: free + cached + used = total; ref counts = table occurrences; no block in two
        places. Window tables: the null block exactly in the released entries, none of them visible
        to the sequence's next token, and no longer than the full table."""
        self.pool.check([s.block_table for s in seqs], "full group")
        if self.window_pool is None:
            return
        for s in seqs:
            t, r = s.window_block_table, s.num_released_blocks
            if any(b != NULL_BLOCK for b in t[:r]) or NULL_BLOCK in t[r:]:
                raise AssertionError(f"{s}: window table {t} with {r} released entries")
            # The next token, at position p, sees keys > p - window: a released block's last key must not be one.
            if r and r * self.block_size - 1 > s.num_computed_tokens - self.window:
                raise AssertionError(f"{s}: window block {r - 1} released but still visible")
            if len(t) > len(s.block_table):
                raise AssertionError(f"{s}: window table longer than its full table")
        self.window_pool.check([s.window_block_table[s.num_released_blocks:] for s in seqs], "window group")
