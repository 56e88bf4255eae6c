"""Rewrites matmul(x, param w) into matmul_int8(x, w_int8, scale): per-output-channel symmetric int8."""

from __future__ import annotations

from ir import Graph, Node, add_params, make_node, rewrite
from ir.attrs import INT8_SCALE, QUANTIZE_INT8
from ir.graph import freeze_attrs


def quantize_int8(graph: Graph) -> Graph:
    """Weight-only int8 for every matmul whose weight is a 2-D param; embeddings stay as they are.

    Symmetric per output channel: w ~= w_int8 * scale[None, :], computed at compile time by
    runtime.worker.params from the recipe each new param carries. A tied LM head (a transposed matmul
    on the embedding table) stays: the lookup needs the table in full precision, so an int8
    copy would add bytes rather than save them.

    Both new params keep the source's role (and its other attributes); `quantize_int8=src` marks
    the int8 weight and `int8_scale=src` its scale.
    """
    new_leaves: dict[str, tuple[Node, Node]] = {}

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        if node.op != "matmul" or ins[1].op != "param" or node.attr("transpose_b"):
            return None
        w = ins[1]
        if w.name not in new_leaves:
            # Keep the source's role and recipe (e.g. concat of q/k/v) so the runtime can rebuild it.
            recipe = {k: v for k, v in w.attrs if k != "name"}
            wq = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".int8",
                                                 QUANTIZE_INT8: w.name}), w.shape, "i8")
            sc = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".scale",
                                                 INT8_SCALE: w.name}), (w.shape[1],), "f32")
            new_leaves[w.name] = (wq, sc)
        wq, sc = new_leaves[w.name]
        return make_node("matmul_int8", (ins[0], wq, sc))

    out = rewrite(graph, fn)
    return add_params(out, new_leaves, order=graph.inputs) if new_leaves else graph
