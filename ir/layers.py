"""Finds the repeated decoder layers of a graph, so a lowering can compile one layer and loop it.

The IR keeps one node per op per layer (that is what `ir.dump` prints and what passes rewrite).
A graph is "layered" when its nodes split into
    pre    nodes that read no per-layer leaf (the embedding),
    L identical layers, each reading the previous layer's output (the residual stream) and its
           own per-layer leaves (`layers.{i}.*` weights, `*.{i}` KV pools),
    post   what follows the last layer (final norm, LM head).
"Identical" is checked node by node: same op, attrs, shape and dtype, and every input is the
same thing relative to its layer (the same position inside the layer, the carried value, the
same per-layer role, or the same shared leaf). Anything else returns None and the graph runs
unrolled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ir.graph import Graph, Node

# Per-layer leaf names: `layers.{i}.<rest>` (weights) and `<base>.{i}` (KV pools, caches).
_LAYER_PARAM = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_INPUT = re.compile(r"^(.+)\.(\d+)$")


def leaf_role(leaf: Node) -> tuple[int | None, str]:
    """(layer index, role) of a leaf: `layers.3.wqkv` -> (3, `layers.*.wqkv`), `k_pool.3` ->
    (3, `k_pool.*`); a shared leaf -> (None, its name)."""
    name = leaf.name
    m = _LAYER_PARAM.match(name)
    if m:
        return int(m.group(1)), f"layers.*.{m.group(2)}"
    m = _LAYER_INPUT.match(name)
    if m and leaf.op == "input":
        return int(m.group(2)), f"{m.group(1)}.*"
    return None, name


@dataclass(frozen=True)
class Layers:
    """The layer structure of a graph (see the module docstring)."""

    num_layers: int
    pre: tuple[Node, ...]
    template: tuple[Node, ...]  # layer 0's nodes, in execution order
    post: tuple[Node, ...]
    carry_in: Node  # the pre node layer 0 reads as its residual input
    carry_out: int  # position in the template of the value the next layer reads
    # Per layer i: role -> leaf (weights and state of that layer).
    leaves: tuple[dict[str, Node], ...]
    layer_nodes: tuple[tuple[Node, ...], ...]  # every layer's nodes, aligned with the template

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.leaves[0])

    def last_output(self) -> Node:
        return self.layer_nodes[-1][self.carry_out]


def find_layers(graph: Graph) -> Layers | None:
    """The repeated-layer structure of `graph`, or None when it has none (or it is irregular)."""
    nodes = graph.nodes()
    layer_of: dict[int, int] = {}
    leaf_info: dict[int, tuple[int | None, str]] = {}
    for leaf in graph.inputs:
        leaf_info[id(leaf)] = leaf_role(leaf)
        layer_of[id(leaf)] = leaf_info[id(leaf)][0] if leaf_info[id(leaf)][0] is not None else -1
    for n in nodes:
        layer_of[id(n)] = max((layer_of[id(x)] for x in n.inputs), default=-1)
    num_layers = max((layer_of[id(n)] for n in nodes), default=-1) + 1
    if num_layers < 2:
        return None
    groups: list[list[Node]] = [[] for _ in range(num_layers + 1)]  # [pre, layer 0, ...]
    for n in nodes:
        groups[layer_of[id(n)] + 1].append(n)
    pre, per_layer = groups[0], groups[1:]
    size = len(per_layer[0])
    if size == 0 or any(len(g) != size for g in per_layer[:-1]) or len(per_layer[-1]) < size:
        return None
    post = per_layer[-1][size:]
    per_layer[-1] = per_layer[-1][:size]

    # The carry: the one non-leaf value each layer reads from outside itself.
    def outside_inputs(i: int) -> set[int]:
        inside = {id(n) for n in per_layer[i]}
        return {id(x) for n in per_layer[i] for x in n.inputs
                if id(x) not in inside and x.op not in ("input", "param")}

    carries = [outside_inputs(i) for i in range(num_layers)]
    if any(len(c) != 1 for c in carries):
        return None
    by_id = {id(n): n for n in nodes}
    carry_in = by_id[next(iter(carries[0]))]
    pos = [{id(n): j for j, n in enumerate(g)} for g in per_layer]
    carry_out = pos[0].get(next(iter(carries[1])))
    if carry_out is None:
        return None
    for i in range(1, num_layers - 1):
        if pos[i].get(next(iter(carries[i + 1]))) != carry_out:
            return None

    leaves: list[dict[str, Node]] = [dict() for _ in range(num_layers)]

    def token(i: int, x: Node):
        if id(x) in pos[i]:
            return ("node", pos[i][id(x)])
        if id(x) in carries[i]:
            return ("carry",)
        if x.op in ("input", "param"):
            li, role = leaf_info[id(x)]
            if li is None:
                return ("shared", role)
            if li != i or leaves[i].setdefault(role, x) is not x:
                return None
            return ("leaf", role)
        return None

    for i in range(num_layers):
        for a, b in zip(per_layer[0], per_layer[i]):
            if (a.op, a.attrs, a.shape, a.dtype) != (b.op, b.attrs, b.shape, b.dtype):
                return None
            ta = [token(0, x) for x in a.inputs]
            tb = [token(i, x) for x in b.inputs]
            if None in tb or ta != tb:
                return None
    if any(set(d) != set(leaves[0]) for d in leaves):
        return None
    # Post nodes read the last layer only through its output (and shared leaves).
    last = {id(n) for n in per_layer[-1]}
    out_id = id(per_layer[-1][carry_out])
    for n in post:
        if any(id(x) in last and id(x) != out_id for x in n.inputs):
            return None
    return Layers(num_layers, tuple(pre), tuple(per_layer[0]), tuple(post), carry_in, carry_out,
                  tuple(leaves), tuple(tuple(g) for g in per_layer))


def matrices_are_blocks(graph: Graph) -> bool:
    """Whether `graph` has repeated layers whose weight matrices (params of two or more dims) are all
    GGUF blocks or tiles (passes.gguf_blocks, the tiles standing alone): the C++ kernels read those
    from a layer stack in place, so a scanned step copies no layer's weights, where an f32 matrix
    would be sliced out of its stack (a copy of it) wherever no in-place f32 kernel takes it."""
    from ir.attrs import GGUF_BLOCKS

    layers = find_layers(graph)
    return layers is not None and all(leaf.attr(GGUF_BLOCKS) for d in layers.leaves for leaf in d.values()
                                      if leaf.op == "param" and len(leaf.shape) >= 2)
