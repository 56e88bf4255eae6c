"""Prints a Graph as deterministic SSA text that `ir.parser.parse_graph` reads back.

    input %tokens : i32[T]
    param %layers.0.wq : f32[576, 576] role=q
    %0 = embedding(%embed, %tokens) : f32[T, 576]
    %1 = rms_norm(%0, %layers.0.attn_norm) {eps=1e-05} : f32[T, 576]
    output logits = %57
"""

from __future__ import annotations

import json
from typing import Any

from ir.attrs import ROLE
from ir.graph import Graph, Node


def format_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, tuple):
        if v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
            # A frozen mapping (e.g. rope_scaling): keep it readable as {k: v}.
            return "{" + ", ".join(f"{json.dumps(k)}: {format_value(x)}" for k, x in v) + "}"
        return "[" + ", ".join(format_value(x) for x in v) + "]"
    return json.dumps(v)


def format_type(node: Node) -> str:
    return f"{node.dtype}[{', '.join(str(d) for d in node.shape)}]"


def format_attrs(attrs, skip=("name",)) -> str:
    items = [(k, v) for k, v in attrs if k not in skip]
    if not items:
        return ""
    return " {" + ", ".join(f"{k}={format_value(v)}" for k, v in items) + "}"


def print_graph(graph: Graph, annotate: dict[int, str] | None = None) -> str:
    """Renders the graph. `annotate` maps id(node) to a trailing `# ...` comment."""
    lines = []
    if graph.meta:
        lines.append("meta" + format_attrs(graph.meta, skip=()))
    names: dict[int, str] = {}
    for leaf in graph.inputs:
        names[id(leaf)] = f"%{leaf.name}"
        # A leaf's role is written after its attributes, outside the braces: `... {sharding=[..]} role=q`.
        role = leaf.attr(ROLE)
        line = (f"{leaf.op} %{leaf.name} : {format_type(leaf)}{format_attrs(leaf.attrs, skip=('name', ROLE))}"
                + (f" {ROLE}={role}" if role is not None else ""))
        if annotate and id(leaf) in annotate:
            line += f"  # {annotate[id(leaf)]}"
        lines.append(line)
    for i, node in enumerate(graph.nodes()):
        names[id(node)] = f"%{i}"
        args = ", ".join(names.get(id(x), f"%<undeclared {x.op}>") for x in node.inputs)
        line = f"%{i} = {node.op}({args}){format_attrs(node.attrs, skip=())} : {format_type(node)}"
        if annotate and id(node) in annotate:
            line += f"  # {annotate[id(node)]}"
        lines.append(line)
    for name, node in graph.outputs:
        lines.append(f"output {name} = {names.get(id(node), '%<undeclared>')}")
    return "\n".join(lines) + "\n"


def same_structure(a: Graph, b: Graph) -> bool:
    """Structural equality: same leaves, outputs, ops, attrs, shapes and dtypes."""
    return print_graph(a) == print_graph(b)
