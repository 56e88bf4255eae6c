"""Materializes the weights a compiled graph's params name, applying the passes' recorded transforms.

Passes never touch weight values: a fused or quantized param records where it comes from
(`concat=[...]`, `quantize_int8=name`, `int8_scale=name` (with `int8_transposed` for a tied
head's W8A8 copy, quantized per vocab column), `bf16_copy=name` (with
`bf16_transposed` for a tied head's copy), `gguf_blocks=name` (with `block_format`: the loader's GGUF
blocks of the source, rows stacked for a concat; `block_layout=tiles`: repacked by ir.blocks.pack_tiles), and the `shard` pass's column order
`tp_layout={...}`), and this module computes it once.
"""

from __future__ import annotations

import numpy as np

from ir import Graph, Node
from ir.attrs import (BF16_COPY, BF16_TRANSPOSED, BLOCK_FORMAT, BLOCK_LAYOUT, CONCAT, GGUF_BLOCKS, INT8_SCALE,
                      INT8_TRANSPOSED, QUANTIZE_INT8, TP_LAYOUT)
from ir.blocks import blocks_name, pack_tiles


def quantize_int8_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8 for a [in, out] weight: w ≈ q * scale[None, :]; for stacked
    experts [E, in, out], per expert and output channel: w[e] ≈ q[e] * scale[e][None, :]."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-2)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return q, scale


def tp_column_layout(w: np.ndarray, parts, repeat, head_dim: int, shards: int) -> np.ndarray:
    """Reorders the last axis [p0 | p1 | ...] into per-shard groups [p0_0 p1_0 .. | p0_1 p1_1 .. | ...].

    Part i is first widened by repeating each of its heads (`head_dim` columns) `repeat[i]`
    times (kv heads replicated when there are fewer than shards). Works for [in, out] weights
    and for [out] biases and int8 scales alike.
    """
    cols = np.split(np.asarray(w), np.cumsum(parts)[:-1], axis=-1)
    pieces = []
    for c, r in zip(cols, repeat):
        if r > 1:
            heads = c.reshape(c.shape[:-1] + (-1, head_dim))
            c = np.repeat(heads, r, axis=-2).reshape(c.shape[:-1] + (-1,))
        pieces.append(np.split(c, shards, axis=-1))
    return np.concatenate([p[d] for d in range(shards) for p in pieces], axis=-1)


def materialize(graph: Graph, weights: dict[str, np.ndarray],
                progress=None) -> dict[str, np.ndarray]:
    """Returns {param name: array} for every param of the graph (host numpy, f32, int8 or u8
    blocks; a bf16 copy is cast when it goes to the device)."""
    int8_cache: dict[tuple[str, bool], tuple[np.ndarray, np.ndarray]] = {}

    def blocks(node: Node) -> np.ndarray:
        fmt = node.attr(BLOCK_FORMAT)
        keys = [blocks_name(s, fmt) for s in (node.attr(CONCAT) or (node.attr(GGUF_BLOCKS),))]
        missing = [k for k in keys if k not in weights]
        if missing:
            raise KeyError(f"weights have no {fmt} blocks {missing} for param %{node.name}")
        v = weights[keys[0]] if len(keys) == 1 else np.concatenate([weights[k] for k in keys])
        return pack_tiles(v, fmt) if node.attr(BLOCK_LAYOUT) == "tiles" else v

    def base(node: Node) -> np.ndarray:
        src = node.attr(QUANTIZE_INT8) or node.attr(INT8_SCALE) or node.attr(BF16_COPY) or node.name
        if node.attr(CONCAT):
            return np.concatenate([np.asarray(weights[s]) for s in node.attr(CONCAT)], axis=-1)
        if src not in weights:
            raise KeyError(f"weights have no tensor {src!r} for param %{node.name}")
        return np.asarray(weights[src])  # a loader's DequantizedTensor is computed here

    out = {}
    params = list(graph.params)
    for p in (progress(params) if progress else params):
        src = p.attr(QUANTIZE_INT8) or p.attr(INT8_SCALE)
        if p.attr(GGUF_BLOCKS):
            v = blocks(p)
        elif src:
            key = (src, bool(p.attr(INT8_TRANSPOSED)))
            if key not in int8_cache:
                w = base(p)
                int8_cache[key] = quantize_int8_weight(np.asarray(w).T if key[1] else w)
            v = int8_cache[key][0 if p.attr(QUANTIZE_INT8) else 1]
        else:
            v = base(p)
        if p.attr(BF16_TRANSPOSED):
            v = np.ascontiguousarray(np.asarray(v).T)
        if p.attr(TP_LAYOUT):
            lay = dict(p.attr(TP_LAYOUT))
            v = tp_column_layout(v, lay["parts"], lay["repeat"], lay["head_dim"], lay["shards"])
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"param %{p.name}: materialized shape {v.shape} != declared {p.shape}")
        out[p.name] = v
    return out
