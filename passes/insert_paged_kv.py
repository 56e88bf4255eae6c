"""Replaces contiguous per-sequence KV caches with paged pools: kv_write + paged_attention."""

from __future__ import annotations

from ir import Graph, Node, input_node, make_node, rewrite
from ir.attention_ops import SOFTCAP, WINDOW
from ir.attrs import NEW_KV_WRITTEN
from ir.kv_groups import (BLOCK_TABLES, BLOCKS_DIM, SLOT_MAPPING, WINDOW_BLOCK_TABLES, WINDOW_BLOCKS_DIM,
                          WINDOW_SLOT_MAPPING)

# Bucket-bound dims of the paged step: tokens, sequences, blocks per sequence (KV blocks: ir.kv_groups).
T, S, M = "T", "S", "M"


def insert_paged_kv(graph: Graph, block_size: int = 16, kv_dtype: str | None = None) -> Graph:
    """kv_cache_update/attention on [S, L, h, d] caches -> kv_write/paged_attention on [B, bs, h, d] pools.

    The pools take `kv_dtype` (None: the caches' own dtype). kv_write rounds the new K/V to it, and
    paged_attention reads the pools whatever their dtype, computing in f32.

    Each paged_attention records `new_kv_written=true`: the pools it reads are the kv_write results
    of this step's own k/v, so a kernel may find the new tokens' keys and values in the pool.

    When sliding-window attention sits beside full attention, the windowed layers' pools form the
    window group (ir.kv_groups): [BW, ...] pools, their own slot mapping and block tables, so that
    the runtime can hold only the blocks their window still sees.
    """
    attn = [n for n in graph.nodes() if n.op == "attention"
            and n.inputs[1].op == "kv_cache_update" and n.inputs[2].op == "kv_cache_update"]
    if not attn:
        return graph
    slot_mapping = input_node(SLOT_MAPPING, (T,), "i32")
    block_tables = input_node(BLOCK_TABLES, (S, M), "i32")
    context_lens = input_node("context_lens", (S,), "i32")
    cu_q_lens = input_node("cu_q_lens", ("S+1",), "i32")
    # Caches read only by windowed attention, beside some read by full attention: the window group.
    full_caches = {u.inputs[0].name for a in attn if a.attr(WINDOW) is None for u in a.inputs[1:3]}
    windowed = {u.inputs[0].name for a in attn if a.attr(WINDOW) is not None
                for u in a.inputs[1:3]} - full_caches if full_caches else set()
    window_slots = input_node(WINDOW_SLOT_MAPPING, (T,), "i32")
    window_tables = input_node(WINDOW_BLOCK_TABLES, (S, M), "i32")
    pools: dict[str, Node] = {}  # cache input name -> pool input
    pool_inputs: list[Node] = []
    for a in attn:
        for upd in a.inputs[1:3]:
            cache = upd.inputs[0]
            if cache.name in pools:
                continue
            pool_name = cache.name.replace("_cache", "_pool")
            dim = WINDOW_BLOCKS_DIM if cache.name in windowed else BLOCKS_DIM
            pool = input_node(pool_name, (dim, block_size) + tuple(cache.shape[2:]), kv_dtype or cache.dtype)
            pools[cache.name] = pool
            pool_inputs.append(pool)

    written: dict[int, Node] = {}

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        if node.op == "kv_cache_update" and node.inputs[0].name in pools:
            slots = window_slots if node.inputs[0].name in windowed else slot_mapping
            new = make_node("kv_write", (pools[node.inputs[0].name], ins[1], slots))
            written[id(node)] = new
            return new
        if node.op == "attention" and id(node.inputs[1]) in written:
            attrs = {"scale": node.attr("scale"), "num_kv_heads": node.attr("num_kv_heads"),
                     "block_size": block_size, "head_dim": node.attr("head_dim"),
                     NEW_KV_WRITTEN: id(node.inputs[1]) in written and id(node.inputs[2]) in written}
            # A sliding window and a softcap carry over as they are (ir.attention_ops).
            attrs |= {k: node.attr(k) for k in (WINDOW, SOFTCAP) if node.attr(k) is not None}
            tables = window_tables if node.inputs[1].inputs[0].name in windowed else block_tables
            return make_node("paged_attention", (ins[0], ins[1], ins[2], tables, context_lens, cu_q_lens), attrs)
        return None

    # The paged inputs go right after `positions` (or after the last runtime input when the
    # graph has none of that name); the contiguous caches they replace drop out.
    kept = [leaf for leaf in graph.inputs if leaf.name not in pools]
    names = [leaf.name for leaf in kept]
    if "positions" in names:
        at = names.index("positions") + 1
    else:
        at = max((i + 1 for i, leaf in enumerate(kept) if leaf.op == "input"), default=0)
    group = [window_slots, window_tables] if windowed else []
    leaves = kept[:at] + [slot_mapping, block_tables] + group + [context_lens, cu_q_lens] + pool_inputs + kept[at:]
    out = rewrite(graph, fn, new_inputs=tuple(leaves))
    renamed = tuple((name.replace("_cache", "_pool") if name in pools else name, node)
                    for name, node in out.outputs)
    return Graph(out.inputs, renamed, out.meta)
