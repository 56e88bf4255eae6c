"""The host arrays of one step, padded to its bucket, and which sequence each sampler row feeds.

A scheduled chunk of n tokens is one attention "sequence" of the step: n query tokens at the end of
its context. Speculative verification lays a decoding sequence with drafts d1..dm out as m+1
one-token sequences that share its block table: the j-th scores the token after d1..dj, with its
context ending at that position. Every verify row is then a decode row, so verification runs in the
decode buckets already compiled, and the fused sampler draws one token per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ir.kv_groups import BLOCK_TABLES, SLOT_MAPPING, WINDOW_BLOCK_TABLES, WINDOW_SLOT_MAPPING
from runtime.core.buckets import BucketTable
from runtime.core.scheduler import ScheduleOutput
from runtime.core.sequence import Sequence
from runtime.core.structured_output import allocate_bitmask


class Row(NamedTuple):
    """One sampler row: the sequence it feeds, the child it becomes for a request's n first
    samples (None otherwise), and for speculative verification how many drafts precede it."""

    seq: Sequence
    fork_index: int | None = None
    draft_pos: int = 0


@dataclass
class StepBatch:
    bucket: tuple[int, int]
    inputs: dict[str, np.ndarray]
    rows: list[Row]
    offsets: dict[int, int] = field(default_factory=dict)  # seq_id -> its first token's index in the step


def step_shape(sched: ScheduleOutput, drafts: dict[int, list[int]]) -> tuple[int, int]:
    """(tokens, attention sequences or sampler rows, whichever is more) of the step with `drafts`."""
    tokens = seqs = rows = 0
    for sc in sched.scheduled:
        m = len(drafts.get(sc.seq.seq_id, ()))
        tokens += sc.num_new_tokens + m
        seqs += 1 + m
        rows += sc.num_rows + m
    return tokens, max(seqs, rows)


def pick_bucket(sched: ScheduleOutput, drafts: dict[int, list[int]], buckets: BucketTable) -> tuple[int, int] | None:
    """The bucket for the step with these drafts, or None when no compiled bucket holds it."""
    t, s = step_shape(sched, drafts)
    try:
        return buckets.pick(t, s)
    except ValueError:
        return None


def build_step(sched: ScheduleOutput, bucket: tuple[int, int], *, block_size: int, max_blocks_per_seq: int,
               drafts: dict[int, list[int]] | None = None, window_group: bool = False) -> StepBatch:
    """The step's model inputs (tokens, positions, slots, block tables, context lengths, ragged query
    offsets, logits rows) and its sampler rows. `drafts`: seq_id -> draft tokens to verify.
    `window_group`: the graph has a window group (ir.kv_groups), with its own slots and tables."""
    drafts = drafts or {}
    T, S = bucket
    bs = block_size
    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.full(T, -1, np.int32)
    tables = np.zeros((S, max_blocks_per_seq), np.int32)
    # Entries past a sequence's blocks read block 0 (the null block in the window group), masked.
    wslots = np.full(T, -1, np.int32) if window_group else None
    wtables = np.zeros((S, max_blocks_per_seq), np.int32) if window_group else None
    ctx = np.zeros(S, np.int32)
    cu = np.zeros(S + 1, np.int32)
    logits_idx = np.zeros(S, np.int32)
    rows: list[Row] = []
    offsets: dict[int, int] = {}
    off = 0  # tokens so far
    a = 0  # attention sequences so far
    for sc in sched.scheduled:
        seq, n = sc.seq, sc.num_new_tokens
        offsets[seq.seq_id] = off
        start = seq.num_computed_tokens
        table = np.asarray(seq.block_table, np.int32)
        wtable = np.asarray(seq.window_block_table, np.int32) if window_group else None
        d = drafts.get(seq.seq_id, ())
        if d:  # verify: the last token, then each draft, each its own one-token sequence
            toks = [seq.token_ids[start]] + list(d)
            for j, tok in enumerate(toks):
                pos = start + j
                tokens[off], positions[off] = tok, pos
                slots[off] = table[pos // bs] * bs + pos % bs
                tables[a, :len(table)] = table
                if window_group:
                    wslots[off] = wtable[pos // bs] * bs + pos % bs
                    wtables[a, :len(wtable)] = wtable
                ctx[a] = pos + 1
                cu[a + 1] = off + 1
                logits_idx[len(rows)] = off
                rows.append(Row(seq, None, j))
                off += 1
                a += 1
            continue
        pos = np.arange(start, start + n)
        tokens[off:off + n] = seq.token_ids[start:start + n]
        positions[off:off + n] = pos
        slots[off:off + n] = table[pos // bs] * bs + pos % bs
        tables[a, :len(table)] = table
        if window_group:
            wslots[off:off + n] = wtable[pos // bs] * bs + pos % bs
            wtables[a, :len(wtable)] = wtable
        ctx[a] = start + n
        cu[a + 1] = off + n
        if sc.samples:
            req = seq.request
            for f in (range(req.params.n) if not req.forked else [None]):
                logits_idx[len(rows)] = off + n - 1
                rows.append(Row(seq, f))
        off += n
        a += 1
    cu[a + 1:] = off
    inputs = {"tokens": tokens, "positions": positions, SLOT_MAPPING: slots, BLOCK_TABLES: tables,
              "context_lens": ctx, "cu_q_lens": cu, "logits_indices": logits_idx}
    if window_group:
        inputs |= {WINDOW_SLOT_MAPPING: wslots, WINDOW_BLOCK_TABLES: wtables}
    return StepBatch(bucket, inputs, rows, offsets)


def grammar_bitmask(rows: list[Row], num_rows: int, vocab_size: int) -> np.ndarray | None:
    """The step's allowed-token masks, written on the host before dispatch (overlapping this with
    the previous step on the device is left for later); None when no row is constrained. The n
    first-sample rows of a request all read the parent's matcher: none has a token yet."""
    if all(r.seq.matcher is None for r in rows):
        return None
    bitmask = allocate_bitmask(num_rows, vocab_size)
    for i, r in enumerate(rows):
        if r.seq.matcher is not None:
            r.seq.matcher.fill_bitmask(bitmask, i)
    return bitmask
