"""Rewrites matmul(x, f32 param w) into matmul_bf16(x, w, w_bf16): wide steps multiply in bf16.

`matmul_precision=bfloat16` on an f32 plan. XLA:CPU runs a bf16 x bf16 -> f32 GEMM at 2-3x its
f32 rate on CPUs with bf16 units (avx512_bf16, AMX), but its one-row bf16 product is slower than
the f32 one. So each weight keeps its f32 value for narrow steps (batch-1 decode) and gains a bf16
copy for steps of at least `min_rows` rows (prefill chunks, wide decode batches): weight memory
grows by half, and the memory plan counts it. Norms, attention, the residual stream and the
sampler stay f32; only the matmul inputs of wide steps are rounded to bf16.
"""

from __future__ import annotations

from ir import Graph, Node, add_params, make_node, rewrite
from ir.attrs import BF16_COPY, BF16_TRANSPOSED, ROLE, Role, role_of
from ir.graph import freeze_attrs

# Rows from which a step's matmuls take the bf16 path (docs/benchmarks/, "bf16 matmuls for wide
# steps", benchmarks/bench_cpu_matmul.py): on the 2-core CI machine bf16 is 7x slower at one row,
# about even at two, and ahead from three or four.
BF16_MIN_ROWS = 4


def bf16_matmuls(graph: Graph, min_rows: int = BF16_MIN_ROWS) -> Graph:
    """Every matmul whose weight is an f32 2-D param (but a MoE router) becomes a matmul_bf16 that
    also reads a bf16 copy of the weight, stored [in, out] (a tied LM head's copy is the transposed
    embedding, with the LM head's role). The copy keeps its source's recipe (concat, role), so runtime.worker.params
    rebuilds it and the shard pass splits it like its source."""
    copies: dict[str, Node] = {}

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        if node.op != "matmul" or ins[1].op != "param" or ins[1].dtype != "f32" or role_of(ins[1]) == Role.ROUTER:
            return None  # a MoE router stays f32: its logits pick the experts
        w = ins[1]
        tb = bool(node.attr("transpose_b"))
        if w.name not in copies:
            recipe = {k: v for k, v in w.attrs if k != "name"}
            if tb:
                recipe[BF16_TRANSPOSED] = True
                if role_of(w) == Role.EMBED:
                    recipe[ROLE] = Role.LM_HEAD
            shape = (w.shape[1], w.shape[0]) if tb else tuple(w.shape)
            copies[w.name] = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".bf16",
                                                             BF16_COPY: w.name}), shape, "bf16")
        attrs = dict(node.attrs) | {"min_rows": min_rows}
        return make_node("matmul_bf16", (ins[0], w, copies[w.name]), attrs)

    out = rewrite(graph, fn)
    if not copies:
        return graph
    return add_params(out, {name: (copy,) for name, copy in copies.items()}, order=graph.inputs)
