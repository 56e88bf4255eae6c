"""Fuses matmuls that read the same activation (q/k/v -> qkv, gate/up -> gate_up) into one."""

from __future__ import annotations

from typing import Mapping

from ir import Graph, Node, make_node, rewrite
from ir.attrs import CONCAT, FUSED_ROLES, ROLE, Role
from ir.graph import freeze_attrs

# The fused param's name, by its role: `layers.0.` + `wqkv`. Names are only labels (the role is
# what later passes read); a group with no known fused role joins its parts' names instead.
FUSED_NAMES = {Role.QKV: "wqkv", Role.QKV_BIAS: "bqkv", Role.GATE_UP: "w_gate_up"}


def _fused_name(names: list[str], role: str | None, taken: set[str]) -> str:
    prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
    if not all(n.startswith(prefix) for n in names):
        prefix = ""
    parts = [n[len(prefix):] for n in names]
    name = prefix + FUSED_NAMES[role] if role in FUSED_NAMES else prefix + "_".join(parts)
    return name if name not in taken else "_".join(names)


def _concat_param(params: list[Node], taken: set[str]) -> Node:
    """A new param whose value is its sources concatenated on the last axis, at compile time."""
    names = [p.name for p in params]
    role = FUSED_ROLES.get(tuple(p.attr(ROLE) for p in params))
    shape = tuple(params[0].shape[:-1]) + (sum(p.shape[-1] for p in params),)
    name = _fused_name(names, role, taken)
    taken.add(name)
    attrs = {"name": name, CONCAT: tuple(names)} | ({ROLE: role} if role else {})
    return Node("param", (), freeze_attrs(attrs), shape, params[0].dtype)


def fuse_matmuls(graph: Graph, formats: Mapping[str, str] | None = None) -> Graph:
    """Groups `matmul(x, param)` sharing x into one matmul on concatenated weights plus slices.
    `formats` (source weight -> GGUF block format, passes.gguf_blocks): a group whose weights the
    file stores in different formats stays unfused, so that each keeps its own blocks (a Q4_K_M
    file's Q4_K attn_q/attn_k and Q6_K attn_v), where one fused weight could be neither."""
    users = graph.users()
    groups: dict[int, list[Node]] = {}
    for n in graph.nodes():
        if (n.op == "matmul" and n.inputs[1].op == "param" and not n.attr("transpose_b")
                and len(n.inputs[1].shape) == 2):
            groups.setdefault(id(n.inputs[0]), []).append(n)
    formats = formats or {}
    groups = {k: v for k, v in groups.items()
              if len(v) > 1 and len({formats.get(m.inputs[1].name) for m in v}) == 1}
    if not groups:
        return graph

    replace: dict[int, tuple[int, list[Node], Node | None]] = {}  # matmul id -> (index, group, bias)
    new_params: list[Node] = []
    taken = {leaf.name for leaf in graph.inputs}
    fused_w: dict[int, Node] = {}
    fused_b: dict[int, Node | None] = {}
    for key, group in groups.items():
        fused_w[key] = _concat_param([m.inputs[1] for m in group], taken)
        new_params.append(fused_w[key])
        # Fuse the biases too when every member feeds exactly one add(·, param bias).
        biases = []
        for m in group:
            us = users.get(id(m), [])
            if len(us) == 1 and us[0].op == "add" and us[0].inputs[0] is m and us[0].inputs[1].op == "param":
                biases.append(us[0])
        fused_b[key] = None
        if len(biases) == len(group):
            fused_b[key] = _concat_param([a.inputs[1] for a in biases], taken)
            new_params.append(fused_b[key])
        for i, m in enumerate(group):
            replace[id(m)] = (i, group, biases[i] if fused_b[key] is not None else None)

    built: dict[int, Node] = {}
    bias_adds: dict[int, Node] = {}

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        if id(node) in bias_adds:
            return bias_adds[id(node)]
        if id(node) not in replace:
            return None
        i, group, bias_add = replace[id(node)]
        key = id(group[0].inputs[0])
        if key not in built:
            y = make_node("matmul", (ins[0], fused_w[key]))
            if fused_b[key] is not None:
                y = make_node("add", (y, fused_b[key]))
            built[key] = y
        start = sum(m.inputs[1].shape[-1] for m in group[:i])
        sl = make_node("slice", (built[key],), {"start": start, "stop": start + node.shape[-1]})
        if bias_add is not None:
            bias_adds[id(bias_add)] = sl
            return Node(node.op, ins, node.attrs, node.shape, node.dtype)  # now dead
        return sl

    out = rewrite(graph, fn)
    # New params go right after the last of the ones they replace (a dict, not a scan per leaf:
    # an 80-layer model has hundreds of each).
    after: dict[str, list[Node]] = {}
    for p in new_params:
        after.setdefault(p.attr(CONCAT)[-1], []).append(p)
    leaves, placed = [], set()
    for leaf in graph.inputs:
        leaves.append(leaf)
        for p in after.get(leaf.name, ()):
            if p.name not in placed:
                leaves.append(p)
                placed.add(p.name)
    return rewrite(out, lambda n, i: None, new_inputs=tuple(leaves))
