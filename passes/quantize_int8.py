"""Rewrites matmul(x, param w) into matmul_int8(x, w_int8, scale): per-output-channel symmetric int8.

Two modes (EngineConfig.quantization):
- "int8", weight-only: the weights are stored in int8 and widened to the activations' dtype in
  the product. A quarter of f32's weight bytes. XLA:CPU's widened product is slower than f32;
  decode steps take our C++ kernel instead under kernel_backend=cpp (runtime.worker.kernels).
- "w8a8": the same int8 weights, and each row of the activations quantized to int8 at run time
  (`activations="i8"` on the op), so the product is int8 x int8 with int32 accumulation. CPUs
  with VNNI/AMX-INT8 run it 1.5-3x faster than f32 (docs/benchmarks/, "W8A8"). A tied LM head also
  gets an int8 copy, of the transposed embedding, since its product is a fifth of a small
  model's weight reads per token.
Either way EngineConfig.quantize_lm_head can force the LM head into int8 or keep it in full
precision (`lm_head` below).
"""

from __future__ import annotations

from ir import Graph, Node, add_params, make_node, rewrite
from ir.attrs import INT8_SCALE, INT8_TRANSPOSED, QUANTIZE_INT8, ROLE, Role, role_of
from ir.graph import freeze_attrs


def quantize_int8(graph: Graph, activations: str | None = None, lm_head: bool | None = None) -> Graph:
    """Int8 weights for every matmul whose weight is a 2-D param, and for the stacked experts of every
    moe_experts (per expert and output channel); embeddings and MoE routers stay as they are.

    Symmetric per output channel: w ~= w_int8 * scale[None, :], computed at compile time by
    runtime.worker.params from the recipe each new param carries. A tied LM head (a transposed
    matmul on the embedding table) is rewritten from an int8 copy of the transposed table
    ([hidden, vocab], `int8_transposed`, the LM head's role); the lookup keeps the table.

    `lm_head` (EngineConfig.quantize_lm_head): True rewrites the LM head, tied or not; False keeps
    it in full precision. None is each mode's default: W8A8 (`activations="i8"`) rewrites it;
    weight-only rewrites an untied head but leaves a tied one, whose int8 copy adds bytes to the
    weights rather than saving them (it saves bytes read per token instead: docs/benchmarks/).

    Both new params keep the source's role (and its other attributes); `quantize_int8=src` marks
    the int8 weight and `int8_scale=src` its scale.
    """
    new_leaves: dict[str, tuple[Node, Node]] = {}

    def int8_pair(w: Node) -> tuple[Node, Node]:
        """The int8 copy of stacked expert weight `w` [E, in, out] and its scales [E, out]."""
        if w.name not in new_leaves:
            recipe = {k: v for k, v in w.attrs if k != "name"}
            wq = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".int8", QUANTIZE_INT8: w.name}),
                      tuple(w.shape), "i8")
            sc = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".scale", INT8_SCALE: w.name}),
                      (w.shape[0], w.shape[2]), "f32")
            new_leaves[w.name] = (wq, sc)
        return new_leaves[w.name]

    def fn(node: Node, ins: tuple[Node, ...]) -> Node | None:
        if node.op == "moe_experts" and len(ins) == 6 and all(w.op == "param" for w in ins[3:]):
            # Experts: per expert and output channel; the op takes the scales as three more inputs.
            pairs = [int8_pair(w) for w in ins[3:]]
            return make_node("moe_experts", ins[:3] + tuple(q for q, _ in pairs) + tuple(s for _, s in pairs),
                             dict(node.attrs))
        if node.op != "matmul" or ins[1].op != "param" or role_of(ins[1]) == Role.ROUTER:
            # The router stays in full precision: rounding its logits could change which experts run.
            return None
        transposed = bool(node.attr("transpose_b"))
        w = ins[1]
        if transposed or role_of(w) == Role.LM_HEAD:
            wanted = lm_head if lm_head is not None else (activations is not None or not transposed)
            if not wanted:
                return None
        if w.name not in new_leaves:
            # Keep the source's role and recipe (e.g. concat of q/k/v) so the runtime can rebuild it.
            recipe = {k: v for k, v in w.attrs if k != "name"}
            shape = tuple(w.shape)
            if transposed:
                recipe[INT8_TRANSPOSED] = True
                shape = shape[::-1]
                if role_of(w) == Role.EMBED:
                    recipe[ROLE] = Role.LM_HEAD
            wq = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".int8",
                                                 QUANTIZE_INT8: w.name}), shape, "i8")
            sc = Node("param", (), freeze_attrs({**recipe, "name": w.name + ".scale",
                                                 INT8_SCALE: w.name}), (shape[1],), "f32")
            new_leaves[w.name] = (wq, sc)
        wq, sc = new_leaves[w.name]
        attrs = {"activations": activations} if activations else {}
        return make_node("matmul_int8", (ins[0], wq, sc), attrs)

    out = rewrite(graph, fn)
    return add_params(out, new_leaves, order=graph.inputs) if new_leaves else graph
