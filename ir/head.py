"""The LM head of a step graph as a graph of its own, cut from the step after every pass.

A step graph (models/llama.py) outputs `hidden`, every token's final hidden state, and `logits`,
computed from the rows gathered out of `hidden` at `logits_indices`: final norm, then the LM head.
`head_graph` cuts that path out with the gathered rows as its input, so prompt logprobs run the
step's own head, with whatever the passes made of it (int8 weights, tensor-parallel sharding).
"""

from __future__ import annotations

from ir.graph import Graph, Node, input_node, rewrite

HEAD_INPUT = "rows"  # [R, hidden]: the final hidden states to score


def head_graph(graph: Graph) -> Graph:
    """`rows` [R, hidden] -> `logits` [R, vocab], through the nodes of `graph` between the rows it
    gathers from its `hidden` output and its `logits` output."""
    outs = dict(graph.outputs)
    if "hidden" not in outs or "logits" not in outs:
        raise ValueError("the graph has no `hidden` and `logits` outputs to cut a head from")
    hidden = outs["hidden"]
    cuts = [n for n in graph.nodes() if n.op == "gather_rows" and n.inputs[0] is hidden]
    if len(cuts) != 1:
        raise ValueError(f"expected one gather_rows of the `hidden` output, found {len(cuts)}")
    cut = cuts[0]
    rows = input_node(HEAD_INPUT, ("R",) + tuple(cut.shape[1:]), cut.dtype)
    logits = dict(rewrite(graph, lambda n, ins: rows if n is cut else None).outputs)["logits"]
    leaves: dict[int, Node] = {}

    def visit(n: Node) -> None:
        if id(n) in leaves or n is hidden:
            return
        if not n.inputs and n.op in ("input", "param"):
            leaves[id(n)] = n
        for i in n.inputs:
            visit(i)

    visit(logits)
    inputs = [rows] + [n for n in leaves.values() if n.op == "param"]
    if any(n.op == "input" and n is not rows for n in leaves.values()):
        raise ValueError("the LM head reads a runtime input other than its rows")
    return Graph(tuple(inputs), (("logits", logits),), graph.meta)
