"""Rewrites matmul(x, f32 param w) into matmul_blocks(x, w, w_blocks) where the loader kept w's
GGUF quantization blocks: decode steps read the blocks, a fifth of f32's bytes.

A GGUF model's weights arrive as f32 (its blocks dequantized) and, for the block formats in
ir.blocks, as the file's own blocks too. Wide steps (prefill chunks, many decoding sequences) are
bound by the f32 GEMM and keep w; steps of at most `max_rows` rows are bound by the weight bytes
they stream, and read the blocks (runtime.worker.kernels, our C++ kernel). The values are the same,
so the outputs differ only by the order of f32 sums. Weight memory grows by the blocks' bytes
(84 MB on SmolLM2-135M's 538 MB of f32), and the memory plan counts them. A tile-only format
(ir.blocks.TILE_ONLY_FORMATS: the K-quants Q4_K, Q5_K and Q6_K) has no rows kernel: where its weight
would keep the file's rows it stays a plain matmul on w.

With `tiles` the blocks are repacked into tiles of 16 columns (ir.blocks.pack_tiles) and every
step, prefill chunks included, multiplies by them. Where a kernel reads them (`tiles_alone`: the cpp
backend with the tiles' vector path) they replace w, whose f32 copy then leaves the graph, and the
embedding lookup gathers its rows from the table's tiles (ir.blocks.gather_tile_rows; a tied LM
head's tiles serve both), so no f32 copy of a tiled matrix stays. Elsewhere w stays, and the backend multiplies
by it. `tiles="q8"` (EngineConfig.gguf_activations) multiplies in int8, its activations rounded
per block of 32 to 8 bits as llama.cpp does: against
the f32 blocks, 1.1x at one row, 2.8x at 64 and 4x at 512 (docs/benchmarks/, "Int8 products on GGUF
blocks"). `tiles="f32"` (EngineConfig.gguf_tiles; by default where the CPU has AMX-BF16) keeps the
activations as they are: the kernel multiplies three exact bf16 parts of each, so the product is
f32's up to the order of its sums (docs/benchmarks/, "f32 products on AMX"). A weight whose N is not
a multiple of 16 keeps the file's rows.
"""

from __future__ import annotations

from typing import Mapping

from ir import Graph, Node, add_params, make_node, rewrite
from ir.attrs import BLOCK_FORMAT, BLOCK_LAYOUT, CONCAT, GGUF_BLOCKS, ROLE, Role, role_of
from ir.blocks import BLOCK_FORMATS, KEPT_FORMATS, TILE_ACTIVATIONS, TILE_COLUMNS, blocks_shape
from ir.graph import freeze_attrs

# Rows up to which a step's matmuls read the blocks: every decode bucket of the default engine (64
# sequences); prefill chunks of 128+ tokens keep f32 (docs/benchmarks/, "Decode steps from the GGUF's own blocks").
BLOCKS_MAX_ROWS = 64
# Tiles serve every step (a bound above any bucket's rows).
TILES_MAX_ROWS = 1 << 30


def gguf_blocks(graph: Graph, formats: Mapping[str, str], max_rows: int = BLOCKS_MAX_ROWS,
                tiles: str | None = None, tiles_alone: bool = True) -> Graph:
    """Every matmul whose weight is an f32 2-D param made of source weights that all have blocks
    of one format (`formats`: source name -> format) becomes a matmul_blocks that also reads a
    u8 param of those blocks, [N, K / 32 * block bytes], the sources' rows stacked in the order
    of the param's concat. A tied LM head's blocks are the embedding's (its rows are the vocab),
    with the LM head's role. `tiles` ("f32" or "q8", the products' activations): in the tiles layout
    where N allows, for every step, and with `tiles_alone` (a kernel reads them) in place of w;
    otherwise beside it, for a backend that multiplies by w. With tiles standing alone, an
    embedding lookup whose table has them becomes embedding_tiles on them (a tied LM head's own),
    so no f32 table stays."""
    if tiles not in (None, *TILE_ACTIVATIONS):
        raise ValueError(f"gguf_blocks tiles must be None or one of {TILE_ACTIVATIONS}, got {tiles!r}")
    copies: dict[tuple[str, bool], Node] = {}
    # Tables a matmul reads transposed (a tied LM head): their lookup shares the head's tiles.
    tied = {n.inputs[1].name for n in graph.nodes() if n.op == "matmul" and n.attr("transpose_b")}

    def blocks_of(w: Node, tb: bool):
        """(format, K, N, layout) of the blocks that can stand for w (read transposed: tb), or None."""
        if w.op != "param" or w.dtype != "f32" or len(w.shape) != 2:
            return None
        fmts = {formats.get(s) for s in (w.attr(CONCAT) or (w.name,))}
        if len(fmts) != 1 or None in fmts:
            return None
        fmt = KEPT_FORMATS[fmts.pop()]
        k, n = (w.shape[1], w.shape[0]) if tb else tuple(w.shape)
        if not isinstance(k, int) or k % fmt.block_values:
            return None
        layout = "tiles" if tiles and n % TILE_COLUMNS == 0 else "rows"
        if layout == "rows" and fmt.name not in BLOCK_FORMATS:  # a tile-only format (a K-quant) keeps w alone
            return None
        return fmt, k, n, layout

    def copy(w: Node, tb: bool, fmt, k: int, n: int, layout: str) -> Node:
        key = (w.name, tb)
        if key not in copies:
            recipe = {a: v for a, v in w.attrs if a != "name"}
            if tb and role_of(w) == Role.EMBED:
                recipe[ROLE] = Role.LM_HEAD
            attrs = {**recipe, "name": f"{w.name}.{fmt.name}", GGUF_BLOCKS: w.name, BLOCK_FORMAT: fmt.name}
            if layout == "tiles":
                attrs |= {"name": f"{w.name}.{fmt.name}_tiles", BLOCK_LAYOUT: layout}
            copies[key] = Node("param", (), freeze_attrs(attrs), blocks_shape(fmt.name, n, k, layout), "u8")
        return copies[key]

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        if node.op == "embedding":  # the lookup from tiles that stand alone: the table's rows are the N
            found = blocks_of(ins[0], True) if tiles and tiles_alone else None
            if found is None or found[3] != "tiles":
                return None
            tiles_param = copy(ins[0], ins[0].name in tied, *found)
            return make_node("embedding_tiles", (tiles_param, ins[1]), {"format": found[0].name})
        if node.op != "matmul":
            return None
        w = ins[1]
        tb = bool(node.attr("transpose_b"))
        found = blocks_of(w, tb)
        if found is None:
            return None
        fmt, k, n, layout = found
        blocks = copy(w, tb, *found)
        attrs = dict(node.attrs) | {"format": fmt.name, "max_rows": max_rows}
        if layout == "tiles":  # the tiles serve every step: they replace w where a kernel reads them
            attrs |= {"layout": layout, "activations": tiles, "max_rows": TILES_MAX_ROWS}
            if tiles_alone:
                attrs = {a: v for a, v in attrs.items() if a != "transpose_b"}
                return make_node("matmul_blocks", (ins[0], blocks), attrs)
        return make_node("matmul_blocks", (ins[0], w, blocks), attrs)

    out = rewrite(graph, fn)
    if not copies:
        return graph
    after: dict[str, tuple[Node, ...]] = {}
    for (name, _), copy in copies.items():
        after[name] = after.get(name, ()) + (copy,)
    return add_params(out, after, order=graph.inputs)
