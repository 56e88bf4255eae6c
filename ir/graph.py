"""Graph and Node: the immutable SSA data structure every pass reads and rewrites."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

Dim = int | str  # a concrete size, or a symbolic dim bound per bucket (T, S, R, B, M, L)
Shape = tuple[Dim, ...]

DTYPES = ("f32", "bf16", "f16", "i32", "i8", "u8", "bool")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i8": 1, "u8": 1, "bool": 1}

from ir.attrs import ROLE

LEAF_OPS = ("input", "param")


def freeze_attrs(attrs: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    if not attrs:
        return ()
    return tuple(sorted((k, _freeze(v)) for k, v in attrs.items()))


def _freeze(v):
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


@dataclass(frozen=True, eq=False)
class Node:
    """One SSA value. Identity is object identity; structure is compared with `same_structure`."""

    op: str
    inputs: tuple["Node", ...]
    attrs: tuple[tuple[str, Any], ...]
    shape: Shape
    dtype: str

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def name(self) -> str | None:
        """Leaf nodes (graph inputs and params) carry a name; computed values do not."""
        return self.attr("name") if self.op in LEAF_OPS else None

    def __repr__(self) -> str:
        ident = f"%{self.name}" if self.name else f"<{self.op}>"
        return f"Node({ident} : {self.dtype}{list(self.shape)})"


def input_node(name: str, shape: Iterable[Dim], dtype: str) -> Node:
    return Node("input", (), (("name", name),), tuple(shape), dtype)


def param_node(name: str, shape: Iterable[Dim], dtype: str, role: str | None = None) -> Node:
    """A weight; `role` (one of ir.attrs.ROLES) says what it is, independent of its name."""
    attrs = {"name": name} | ({ROLE: role} if role is not None else {})
    return Node("param", (), freeze_attrs(attrs), tuple(shape), dtype)


@dataclass(frozen=True)
class Graph:
    """A model step: named leaves in declaration order, and named outputs.

    `inputs` holds both runtime inputs (op `input`) and weights (op `param`), in the order
    they are printed. Every leaf reachable from an output must be listed there.
    """

    inputs: tuple[Node, ...]
    outputs: tuple[tuple[str, Node], ...]
    meta: tuple[tuple[str, Any], ...] = field(default=())

    def output(self, name: str) -> Node:
        for n, node in self.outputs:
            if n == name:
                return node
        raise KeyError(f"graph has no output {name!r}")

    @property
    def runtime_inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.inputs if n.op == "input")

    @property
    def params(self) -> tuple[Node, ...]:
        return tuple(n for n in self.inputs if n.op == "param")

    def params_with_role(self, role: str) -> tuple[Node, ...]:
        return tuple(n for n in self.inputs if n.op == "param" and n.attr(ROLE) == role)

    def meta_value(self, key: str, default: Any = None) -> Any:
        for k, v in self.meta:
            if k == key:
                return v
        return default

    def nodes(self) -> list[Node]:
        """Every reachable non-leaf node in a deterministic topological order."""
        order: list[Node] = []
        seen: set[int] = set()
        for _, out in self.outputs:
            _post_order(out, seen, order)
        return [n for n in order if n.op not in LEAF_OPS]

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes():
            counts[n.op] = counts.get(n.op, 0) + 1
        return dict(sorted(counts.items()))

    def users(self) -> dict[int, list[Node]]:
        users: dict[int, list[Node]] = {}
        for n in self.nodes():
            for i in n.inputs:
                users.setdefault(id(i), []).append(n)
        return users


def _post_order(root: Node, seen: set[int], order: list[Node]) -> None:
    # Iterative DFS: graphs of 80-layer models are deeper than Python's recursion limit.
    stack: list[tuple[Node, int]] = [(root, 0)]
    while stack:
        node, i = stack.pop()
        if id(node) in seen:
            continue
        if i < len(node.inputs):
            stack.append((node, i + 1))
            child = node.inputs[i]
            if id(child) not in seen:
                stack.append((child, 0))
        else:
            seen.add(id(node))
            order.append(node)


def rewrite(graph: Graph, fn: Callable[[Node, tuple[Node, ...]], Node | None],
            new_inputs: tuple[Node, ...] | None = None,
            extra_outputs: tuple[tuple[str, Node], ...] = ()) -> Graph:
    """Rebuilds the graph bottom-up. `fn(node, new_node_inputs)` returns a replacement or None.

    Nodes whose inputs did not change and for which `fn` returns None are kept as they are,
    so a rewrite that matches nothing returns a graph sharing every node with its input.
    """
    mapping: dict[int, Node] = {}
    order: list[Node] = []
    seen: set[int] = set()
    for _, out in graph.outputs:
        _post_order(out, seen, order)
    for node in order:
        ins = tuple(mapping[id(i)] for i in node.inputs)
        replaced = fn(node, ins)
        if replaced is None:
            if all(a is b for a, b in zip(ins, node.inputs)):
                replaced = node
            else:
                replaced = Node(node.op, ins, node.attrs, node.shape, node.dtype)
        mapping[id(node)] = replaced
    outputs = tuple((name, mapping[id(n)]) for name, n in graph.outputs) + extra_outputs
    inputs = graph.inputs if new_inputs is None else new_inputs
    if new_inputs is None and all(mapping[id(n)] is n for _, n in graph.outputs) and not extra_outputs:
        return graph
    # Drop leaves that are no longer reachable (e.g. a contiguous cache replaced by a pool).
    reachable: set[int] = set()
    _order: list[Node] = []
    for _, out in outputs:
        _post_order(out, reachable, _order)
    inputs = tuple(n for n in inputs if id(n) in reachable)
    return Graph(inputs, outputs, graph.meta)


def add_params(graph: Graph, after: dict[str, tuple[Node, ...]], order: tuple[Node, ...] | None = None) -> Graph:
    """`graph` with new param leaves, each group listed right after the leaf it is named under in
    `order` (default: graph.inputs; a pass that replaced a weight passes its input graph's leaves),
    so a pass's copies of a weight sit next to their source in the printed IR. Leaves no longer
    used drop out."""
    leaves = []
    for leaf in graph.inputs if order is None else order:
        leaves.append(leaf)
        leaves.extend(after.get(leaf.name, ()))
    return rewrite(graph, lambda n, i: None, new_inputs=tuple(leaves))
