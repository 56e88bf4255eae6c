"""Paged KV block manager: ref-counted fixed-size blocks, prefix caching with LRU eviction, copy-on-write.

Plain Python, no JAX: the scheduler calls it, and tests drive it with fake sequences.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from runtime.core.sequence import Sequence


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


class BlockManager:
    """Allocates blocks to sequences. Verbs follow nano-vllm: can_allocate, allocate, may_append, deallocate."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        # ref_count == 0 blocks that still hold cached content, least recently used first.
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        # Copy-on-write work for the next step: (src block, dst block).
        self.pending_copies: list[tuple[int, int]] = []
        self._last_lookup = None
        self._version = 0  # bumped by every change to block contents or the cache index

    # ------------------------------------------------------------------ accounting

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: truly free plus evictable cached ones."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.cached)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ internals

    def _take_block(self) -> int:
        self._version += 1
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

    def _release(self, bid: int) -> None:
        self._version += 1
        blk = self.blocks[bid]
        blk.ref_count -= 1
        if blk.ref_count == 0:
            if blk.hash is not None and self.hash_to_block.get(blk.hash) == bid:
                self.cached[bid] = None
            else:
                blk.hash, blk.token_ids = None, ()
                self.free.append(bid)

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that match the sequence's leading full blocks (at least one token stays uncached).
        None for a request that asks for prompt logprobs: cached positions are never run, and their
        logprobs are wanted (vLLM skips the cache for such requests too)."""
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return []
        hits, parent = [], None
        bs = self.block_size
        # Keep the last token out of the cache hit so the step still produces its logits.
        for i in range((len(seq) - 1) // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                break
            hits.append(bid)
            parent = h
        return hits

    # ------------------------------------------------------------------ verbs

    def _lookup_cached(self, seq: Sequence) -> list[int]:
        # can_allocate and allocate run back to back on the same sequence: hash its blocks once.
        key = (seq.seq_id, len(seq), self._version)
        if self._last_lookup is None or self._last_lookup[0] != key:
            self._last_lookup = (key, self._lookup(seq))
        return self._last_lookup[1]

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._lookup_cached(seq)
        reusable_from_lru = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(seq)) - len(hits)
        return needed <= self.num_free - reusable_from_lru

    def allocate(self, seq: Sequence) -> None:
        """Gives a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq} already has blocks"
        hits = self._lookup_cached(seq)
        self._last_lookup = None
        if self.enable_prefix_caching and seq.num_preemptions == 0:
            self.stats.queries += len(seq)
            self.stats.hits += len(hits) * self.block_size
        for bid in hits:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.cached[bid]
            blk.ref_count += 1
            seq.block_table.append(bid)
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_block())

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        shared_tail = self._tail_is_shared(seq)
        return max(need, 0) + int(shared_tail) <= self.num_free

    def _tail_is_shared(self, seq: Sequence) -> bool:
        """Whether the next write lands in a partly filled block that another sequence also holds."""
        i, offset = divmod(seq.num_computed_tokens, self.block_size)
        return offset > 0 and i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Makes room for the next tokens: new blocks as needed, and copy-on-write of a shared tail."""
        if self._tail_is_shared(seq):
            i = seq.num_computed_tokens // self.block_size
            old = seq.block_table[i]
            new = self._take_block()
            self.pending_copies.append((old, new))
            self.blocks[old].ref_count -= 1  # still > 0: another sample holds it
            seq.block_table[i] = new
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_block())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases the blocks past the first `blocks_needed(num_tokens)`: room reserved for tokens
        that never came (speculative drafts the target model rejected). Their slots hold no
        computed token, so the blocks were never hashed and go back to the free list."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (n > 1); writes copy on demand."""
        for bid in parent.block_table:
            self.blocks[bid].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def mark_computed(self, seq: Sequence) -> None:
        """Registers newly completed full blocks in the prefix cache (after their KV is written)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        while seq.num_hashed_blocks < full:
            i = seq.num_hashed_blocks
            parent = seq.block_hashes[i - 1] if i else None
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, toks)
            bid = seq.block_table[i]
            blk = self.blocks[bid]
            if blk.hash is None and h not in self.hash_to_block:
                self._version += 1
                blk.hash, blk.token_ids = h, toks
                self.hash_to_block[h] = bid
            seq.block_hashes.append(h)
            seq.num_hashed_blocks += 1

    def deallocate(self, seq: Sequence) -> None:
        # Release tail first so the LRU evicts a sequence's last blocks before its prefix.
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0
        # num_cached_tokens stays: the final RequestOutput (made after this) reports the prefix-cache
        # hit of the sequence's last admission; a re-admission after preemption overwrites it.

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        self._version += 1
        for bid in list(self.cached):
            blk = self.blocks[bid]
            self.hash_to_block.pop(blk.hash, None)
            blk.hash, blk.token_ids = None, ()
            self.free.append(bid)
        self.cached.clear()

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """free + cached + used = total; ref counts = table occurrences; no block in two places."""
        refs = [0] * self.num_blocks
        for s in seqs:
            for bid in s.block_table:
                refs[bid] += 1
        free, cached = set(self.free), set(self.cached)
        if len(free) != len(self.free):
            raise AssertionError("a block is on the free list twice")
        if free & cached:
            raise AssertionError(f"blocks both free and cached: {sorted(free & cached)}")
        used = {i for i, r in enumerate(refs) if r > 0}
        if used & (free | cached):
            raise AssertionError(f"blocks in use and free/cached: {sorted(used & (free | cached))}")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + cached {len(cached)} + used {len(used)} "
                                 f"!= total {self.num_blocks}")
        for blk in self.blocks:
            if blk.ref_count != refs[blk.block_id]:
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} but "
                                     f"{refs[blk.block_id]} block tables hold it")
        for h, bid in self.hash_to_block.items():
            if self.blocks[bid].hash != h:
                raise AssertionError(f"hash index points at block {bid}, which holds another hash")
