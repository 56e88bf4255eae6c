"""verify(graph): every node obeys its op's rules, and the graph is closed and well named."""

from __future__ import annotations

from ir.attrs import ROLE, ROLES
from ir.graph import DTYPES, LEAF_OPS, Graph
from ir.ops import OPS, IRError, infer


class VerifyError(ValueError):
    """The graph is malformed; the message names the node and the rule it breaks."""


def verify(graph: Graph) -> Graph:
    """Checks the graph and returns it; raises VerifyError on the first broken rule."""
    declared: dict[int, str] = {}
    names: set[str] = set()
    for leaf in graph.inputs:
        if leaf.op not in LEAF_OPS:
            raise VerifyError(f"graph input {leaf!r}: only input/param nodes may be graph inputs")
        if not leaf.name:
            raise VerifyError(f"graph input {leaf!r}: leaf has no name")
        if leaf.name in names:
            raise VerifyError(f"leaf %{leaf.name}: name declared twice")
        if leaf.dtype not in DTYPES:
            raise VerifyError(f"leaf %{leaf.name}: unknown dtype {leaf.dtype!r}")
        role = leaf.attr(ROLE)
        if role is not None and (leaf.op != "param" or role not in ROLES):
            raise VerifyError(f"leaf %{leaf.name}: role {role!r} is not a param role; known: {sorted(ROLES)}")
        names.add(leaf.name)
        declared[id(leaf)] = leaf.name
    if not graph.outputs:
        raise VerifyError("graph has no outputs")
    out_names = [n for n, _ in graph.outputs]
    if len(set(out_names)) != len(out_names):
        raise VerifyError(f"graph outputs have duplicate names: {out_names}")

    for i, node in enumerate(graph.nodes()):
        where = f"node %{i} ({node.op})"
        if node.op not in OPS:
            raise VerifyError(f"{where}: unknown op")
        for j, x in enumerate(node.inputs):
            if x.op in LEAF_OPS and id(x) not in declared:
                raise VerifyError(f"{where}: input {j} is leaf %{x.name}, which the graph does not declare")
        if node.dtype not in DTYPES:
            raise VerifyError(f"{where}: unknown dtype {node.dtype!r}")
        try:
            shape, dtype = infer(node.op, node.inputs, node.attr_dict)
        except IRError as e:
            raise VerifyError(f"{where}: {e}") from None
        if tuple(shape) != tuple(node.shape) or dtype != node.dtype:
            raise VerifyError(
                f"{where}: declared type {node.dtype}{list(node.shape)} but the shape rule gives "
                f"{dtype}{list(shape)}")
    for name, out in graph.outputs:
        if out.op in LEAF_OPS and id(out) not in declared:
            raise VerifyError(f"output {name}: refers to undeclared leaf %{out.name}")
    return graph
