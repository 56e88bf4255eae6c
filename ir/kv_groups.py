"""KV cache groups: which paged pools share one block table (vLLM's hybrid KV cache manager).

A graph after `insert_paged_kv` has one or two groups of KV pools:
  full    pools [B, block_size, h, d], written at `slot_mapping`, read through `block_tables`;
          every layer without a sliding window. A sequence holds a block for each of its tokens.
  window  pools [BW, block_size, h, d], written at `window_slot_mapping`, read through
          `window_block_tables`; the sliding-window layers of a model that mixes them with full
          ones. A sequence holds only the blocks its window can still see: the entry of a block
          wholly behind `pos - window` for every token still to be computed points at the pool's
          reserved null block (block 0, never written: runtime.core.block_manager.NULL_BLOCK), and
          the block goes back to the group.
The window group exists only beside a full group (a graph of sliding layers only keeps one group
of full-length tables). Its window is the largest `window` of the paged_attention ops that read it.
"""

from __future__ import annotations

from ir.attention_ops import WINDOW
from ir.graph import Graph

SLOT_MAPPING, BLOCK_TABLES, BLOCKS_DIM = "slot_mapping", "block_tables", "B"
WINDOW_SLOT_MAPPING, WINDOW_BLOCK_TABLES, WINDOW_BLOCKS_DIM = "window_slot_mapping", "window_block_tables", "BW"


def is_pool(leaf) -> bool:
    return leaf.op == "input" and "_pool." in leaf.name


def is_window_pool(leaf) -> bool:
    return is_pool(leaf) and leaf.shape[0] == WINDOW_BLOCKS_DIM


def kv_window(graph: Graph) -> int | None:
    """The window of the graph's window group (None: one full group)."""
    windows = [n.attr(WINDOW) for n in graph.nodes()
               if n.op == "paged_attention" and n.inputs[3].name == WINDOW_BLOCK_TABLES]
    return max(windows) if windows else None


def window_span_blocks(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """Most window-group blocks one sequence holds while `num_new_tokens` tokens from position p
    are computed: those touching positions [p - window + 1, p + num_new_tokens)."""
    return -(-(window + num_new_tokens - 2) // block_size) + 1


def window_blocks_per_seq(window: int, block_size: int, max_model_len: int) -> int:
    """A decoding sequence's window-group blocks (its window and the block being filled), at most
    its full length's blocks."""
    return min(window_span_blocks(window, block_size), -(-max_model_len // block_size))


def split_kv_blocks(free_bytes: int, *, full_bytes_per_block: int, window_bytes_per_block: int,
                    window: int | None, block_size: int, max_model_len: int,
                    max_num_batched_tokens: int) -> tuple[int, int]:
    """(full blocks, window blocks) that `free_bytes` of KV memory hold, in the proportion in which
    sequences at max_model_len use them: each sequence full-length blocks in the full group and
    `window_blocks_per_seq` in the window group, and the window group also room for one prefill
    chunk's blocks and its null block. Without a window group: (all of it as full blocks, 0)."""
    if free_bytes <= 0 or not full_bytes_per_block:
        return 0, 0
    if window is None or not window_bytes_per_block:
        return free_bytes // full_bytes_per_block, 0
    full_per_seq = -(-max_model_len // block_size)
    window_per_seq = window_blocks_per_seq(window, block_size, max_model_len)
    extra = -(-max_num_batched_tokens // block_size) + 1
    seqs = max(free_bytes - extra * window_bytes_per_block, 0) / (
        full_per_seq * full_bytes_per_block + window_per_seq * window_bytes_per_block)
    full = int(seqs * full_per_seq)
    return full, int((free_bytes - full * full_bytes_per_block) // window_bytes_per_block)


def window_blocks_for(num_full_blocks: int, *, window: int | None, block_size: int, max_model_len: int,
                      max_num_batched_tokens: int) -> int:
    """The window group's blocks beside a full group of `num_full_blocks` (a count the user fixed):
    as many sequences' windows as the full group holds full-length sequences (at least one), one
    prefill chunk and the null block."""
    if window is None:
        return 0
    full_per_seq = -(-max_model_len // block_size)
    seqs = max(-(-num_full_blocks // full_per_seq), 1)
    return (seqs * window_blocks_per_seq(window, block_size, max_model_len)
            + -(-max_num_batched_tokens // block_size) + 1)
