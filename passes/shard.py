"""Tensor parallelism: annotates every weight and activation with a PartitionSpec over mesh axis `tp`.

Megatron's split, expressed as attributes that the runtime turns into `NamedSharding`s and
`with_sharding_constraint`s (JAX's SPMD partitioner inserts the communication):

    qkv, gate_up      column-split   w {sharding=[null, "tp"]}: each device owns whole heads / FFN columns
    o_proj, down      row-split      w {sharding=["tp", null]}; the matmul carries all_reduce="tp"
    embed             vocab-split    {sharding=["tp", null]}; the lookup carries all_reduce="tp"
    lm_head           vocab-split    logits computed [null, "tp"], then all_gather="tp" (outputs leave
                                     the step replicated, except the KV state)
    k/v pools         kv-head-split  {sharding=[null, null, "tp", null]}
    norms, residual   replicated
    experts           each expert split inside: gate/up [E, H, I] by I {sharding=[null, null, "tp"]},
                      down [E, I, H] by I {sharding=[null, "tp", null]}; or, with expert_parallel,
                      the experts split among the devices: all three {sharding=["tp", null, null]}.
                      moe_experts carries all_reduce="tp" (one psum of [T, hidden], as the dense
                      MLP's down; runtime.worker.moe.moe_experts_on_device); the router replicated

A node's `sharding` is the layout its value has on the mesh (after its collective, for
`all_reduce`; before it, for `all_gather`). A spec lists one entry per dim: null (replicated
along that dim) or "tp".

Fused weights. A plain column split of [wq | wk | wv] would give device 0 only q columns. The
pass instead records a compile-time column layout on the fused param (`tp_layout`, applied by
runtime.worker.params) that stores each shard's parts next to each other, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...],
and rewrites each `slice` of the fused result into reshape [.., tp, per_shard] -> slice -> reshape.
The graph means the same on one device as on many; under the mesh each device computes only
its own q/k/v heads (or gate/up columns) and no activation moves between devices.

Divisibility (checked here, at compile time):
  - intermediate_size must divide by tp (else ValueError);
  - attention is sharded by head when q heads divide by tp and kv heads either divide by tp or
    divide tp. When kv heads < tp, each kv head is replicated tp/kv_heads times (its k/v
    columns repeated in the fused weight, the pools hold tp heads, one per device), as vLLM does;
  - otherwise (SmolLM2: 9 q heads at tp=2 or 4) attention is replicated: every device computes
    all heads and holds the whole KV cache; only the MLP and the vocab are split. The reason is
    recorded in graph meta `tp_notes` and printed with the memory plan;
  - a vocab that does not divide by tp keeps embeddings / LM head replicated (also noted).
"""

from __future__ import annotations

from typing import Any

from ir import Graph, Node, Role, input_node, make_node
from ir.attrs import (ALL_GATHER, ALL_REDUCE, CONCAT, SHARDING, SHARDING_ATTRS, TP_AXIS, TP_LAYOUT,
                      is_int8_scale, role_of)
from ir.graph import freeze_attrs

AXIS = TP_AXIS

# Weights by role (ir.attrs.Role); an int8 weight and its scale keep their source's role.
QKV = (Role.QKV, Role.QKV_BIAS)
ATTN_COLUMN = (Role.Q, Role.K, Role.V, Role.Q_BIAS, Role.K_BIAS, Role.V_BIAS)
KV_COLUMN = (Role.K, Role.V, Role.K_BIAS, Role.V_BIAS)
MLP_COLUMN = (Role.GATE_UP, Role.GATE, Role.UP)
ATTN_ROW = (Role.O,)
MLP_ROW = (Role.DOWN,)
EXPERT_COLUMN = (Role.EXPERT_GATE, Role.EXPERT_UP)  # [E, H, I]: split I (their int8 scales [E, I] too)
EXPERT_ROW = (Role.EXPERT_DOWN,)  # [E, I, H]: split I (its int8 scale [E, H] replicated)
VOCAB_ROWS = (Role.EMBED,)  # [vocab, hidden]
VOCAB_COLUMNS = (Role.LM_HEAD,)  # [hidden, vocab]

Spec = tuple[Any, ...]


def _rep(rank: int) -> Spec:
    return (None,) * rank


def _split(rank: int, dim: int) -> Spec:
    return tuple(AXIS if i == dim % rank else None for i in range(rank))


def _sharded(spec: Spec | None) -> bool:
    return bool(spec) and AXIS in spec


class TPPlan:
    """What gets split at this tp, and why the rest does not."""

    def __init__(self, graph: Graph, tp: int, expert_parallel: bool = False):
        self.tp = tp
        self.expert_parallel = expert_parallel
        self.notes: list[str] = []
        attn = [n for n in graph.nodes() if n.op in ("paged_attention", "attention")]
        down = next((p for p in graph.params_with_role(Role.DOWN) if not is_int8_scale(p)), None)
        inter = down.shape[0] if down is not None else None
        if inter is not None and inter % tp:
            raise ValueError(
                f"tensor_parallel_size={tp}: intermediate_size {inter} must divide by tp to split "
                f"the MLP (gate/up by column, down by row); choose tp among "
                f"{[d for d in range(1, inter + 1) if inter % d == 0 and d <= 64]}")
        for p in graph.params_with_role(Role.EXPERT_DOWN):
            if is_int8_scale(p):
                continue
            if expert_parallel and p.shape[0] % tp:
                raise ValueError(f"tensor_parallel_size={tp}: the {p.shape[0]} experts must divide by tp to split "
                                 f"them among the devices (expert parallelism)")
            if not expert_parallel and p.shape[1] % tp:
                raise ValueError(f"tensor_parallel_size={tp}: the experts' intermediate size {p.shape[1]} must "
                                 f"divide by tp to split each expert (gate/up by column, down by row)")
        self.num_q_heads = attn[0].inputs[0].shape[1] if attn else None
        self.num_kv_heads = attn[0].attr("num_kv_heads") if attn else None
        self.head_dim = attn[0].attr("head_dim") if attn else None
        hq, kvh = self.num_q_heads, self.num_kv_heads
        self.shard_attention = bool(attn) and hq % tp == 0 and (kvh % tp == 0 or tp % kvh == 0)
        self.kv_repeat = tp // kvh if self.shard_attention and kvh < tp else 1
        if attn and not self.shard_attention:
            why = (f"{hq} q heads do not divide by tp={tp}" if hq % tp else
                   f"{kvh} kv heads neither divide by tp={tp} nor divide it")
            self.notes.append(
                f"attention replicated: {why} (heads must divide by tp to split attention); every "
                f"device computes all heads and holds the whole KV cache; the MLP and the vocab "
                f"are split {tp} ways")
        elif self.kv_repeat > 1:
            self.notes.append(
                f"kv heads replicated: {kvh} kv heads < tp={tp}, so each kv head is stored on "
                f"{self.kv_repeat} devices (the KV pools hold {kvh * self.kv_repeat} heads, one "
                f"per device; KV memory per device is that of one head)")
        embed = next(iter(graph.params_with_role(Role.EMBED)), None)
        vocab = embed.shape[0] if embed is not None else None
        self.shard_vocab = vocab is not None and vocab % tp == 0
        if vocab is not None and not self.shard_vocab:
            self.notes.append(f"vocab replicated: vocab size {vocab} does not divide by tp={tp}")

    def column_layout(self, p: Node) -> dict | None:
        """The compile-time column reorder of a column-split param (None: a plain split works)."""
        role = role_of(p)
        concat = p.attr(CONCAT)
        if role in QKV:
            if not self.shard_attention:
                return None
            q, kv = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
            r = self.kv_repeat
            return {"parts": (q, kv, kv), "repeat": (1, r, r), "head_dim": self.head_dim,
                    "shards": self.tp}
        if role in KV_COLUMN and self.shard_attention and self.kv_repeat > 1:
            return {"parts": (p.shape[-1],), "repeat": (self.kv_repeat,), "head_dim": self.head_dim,
                    "shards": self.tp}
        if concat and role in MLP_COLUMN:
            half = p.shape[-1] // len(concat)
            return {"parts": (half,) * len(concat), "repeat": (1,) * len(concat), "head_dim": 1,
                    "shards": self.tp}
        return None

    def param_spec(self, p: Node) -> Spec:
        rule = PARAM_RULES.get(role_of(p))
        return rule(self, p, len(p.shape)) if rule else _rep(len(p.shape))


def _attn_column(plan: TPPlan, p: Node, rank: int) -> Spec:
    return _split(rank, -1) if plan.shard_attention else _rep(rank)


def _mlp_column(plan: TPPlan, p: Node, rank: int) -> Spec:
    return _split(rank, -1)


def _row(plan: TPPlan, p: Node, rank: int) -> Spec:
    if role_of(p) in ATTN_ROW and not plan.shard_attention:
        return _rep(rank)
    # The scale of a row-split int8 weight is per output column: replicated.
    return _rep(rank) if is_int8_scale(p) else _split(rank, 0)


def _vocab(plan: TPPlan, p: Node, rank: int) -> Spec:
    if not plan.shard_vocab:
        return _rep(rank)
    return _split(rank, 0) if role_of(p) in VOCAB_ROWS else _split(rank, -1)


def _expert_column(plan: TPPlan, p: Node, rank: int) -> Spec:
    return _split(rank, 0) if plan.expert_parallel else _split(rank, -1)


def _expert_row(plan: TPPlan, p: Node, rank: int) -> Spec:
    if plan.expert_parallel:
        return _split(rank, 0)  # the experts [E, I, H], and their scales [E, H]
    return _rep(rank) if is_int8_scale(p) else _split(rank, 1)


# role -> (plan, param, rank) -> its spec; a role not listed (norms, the router) is replicated.
PARAM_RULES = ({r: _attn_column for r in QKV + ATTN_COLUMN} | {r: _mlp_column for r in MLP_COLUMN}
               | {r: _row for r in ATTN_ROW + MLP_ROW} | {r: _vocab for r in VOCAB_ROWS + VOCAB_COLUMNS}
               | {r: _expert_column for r in EXPERT_COLUMN} | {r: _expert_row for r in EXPERT_ROW})


def _with_attrs(node: Node, **extra) -> Node:
    attrs = {k: v for k, v in node.attrs if k not in extra} | extra
    return Node(node.op, node.inputs, freeze_attrs(attrs), node.shape, node.dtype)


def _resized(p: Node, layout: dict | None) -> tuple[int, ...]:
    if not layout:
        return tuple(p.shape)
    total = sum(n * r for n, r in zip(layout["parts"], layout["repeat"]))
    return tuple(p.shape[:-1]) + (total,)


def _reshape_spec(in_shape, spec: Spec, out_shape, tp: int) -> Spec:
    """Carries a one-dim split through a reshape: the out dim whose outer extent matches."""
    rank = len(out_shape)
    if not _sharded(spec):
        return _rep(rank)
    i = spec.index(AXIS)
    outer_in = in_shape[:i]
    for j in range(rank):
        d = out_shape[j]
        if _same_extent(outer_in, out_shape[:j]) and isinstance(d, int) and d % tp == 0:
            if _extent(in_shape[i:]) == _extent(out_shape[j:]):
                return _split(rank, j)
    raise ValueError(f"shard: cannot carry split dim {i} of {list(in_shape)} through reshape to "
                     f"{list(out_shape)}")


def _extent(dims) -> tuple[int, tuple]:
    n, syms = 1, []
    for d in dims:
        if isinstance(d, int):
            n *= d
        else:
            syms.append(d)
    return n, tuple(sorted(syms))


def _same_extent(a, b) -> bool:
    return _extent(a) == _extent(b)


class _Sharder:
    """One shard() run: the spec of every new node, and which values hold fused column results."""

    def __init__(self, tp: int, out_ids: set[int], layouts: dict[int, dict]):
        self.tp = tp
        self.out_ids = out_ids  # ids of the old graph's output nodes
        self.layouts = layouts  # new param id -> its column layout
        self.specs: dict[int, Spec] = {}
        self.fused: dict[int, dict] = {}  # new node id -> layout of the fused column result it holds
        self.interleaved: dict[int, Node] = {}  # fused result id -> its [.., tp, per_shard] view

    def emit(self, op: str, ins: tuple[Node, ...], attrs: dict, spec: Spec, **coll) -> Node:
        node = make_node(op, ins, {**attrs, **coll, SHARDING: spec})
        self.specs[id(node)] = spec
        return node

    def split_fused_slice(self, y: Node, attrs: dict) -> Node:
        """slice of [.., p0 | p1 | ...] stored per shard -> reshape [.., tp, per] -> slice -> reshape."""
        tp, layout = self.tp, self.fused[id(y)]
        parts, repeat = layout["parts"], layout["repeat"]
        starts = [sum(parts[:i]) for i in range(len(parts))]
        if attrs["start"] not in starts or attrs["stop"] - attrs["start"] != parts[starts.index(attrs["start"])]:
            raise ValueError(f"shard: slice [{attrs['start']}:{attrs['stop']}] is not one part of "
                             f"a fused weight with parts {list(parts)}")
        i = starts.index(attrs["start"])
        sizes = [n * r for n, r in zip(parts, repeat)]
        per = [n // tp for n in sizes]
        lead = tuple(y.shape[:-1])
        if id(y) not in self.interleaved:
            self.interleaved[id(y)] = self.emit("reshape", (y,), {"shape": lead + (tp, sum(per))},
                                                _rep(len(lead)) + (AXIS, None))
        view = self.interleaved[id(y)]
        start = sum(per[:i])
        part = self.emit("slice", (view,), {"start": start, "stop": start + per[i]},
                         _rep(len(lead)) + (AXIS, None))
        return self.emit("reshape", (part,), {"shape": lead + (sizes[i],)}, _rep(len(lead)) + (AXIS,))


# ---- per-op rules: (sharder, old node, new inputs, attrs without sharding, input specs) -> new node

def _matmul(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    w = ins[1]
    tb = bool(attrs.get("transpose_b"))
    wk, wn = (s[1][1], s[1][0]) if tb else (s[1][0], s[1][1])
    xk = s[0][-1]
    if xk == AXIS and wk == AXIS:
        return sh.emit(node.op, ins, attrs, s[0][:-1] + (None,), **{ALL_REDUCE: AXIS})
    if xk is not None or wk is not None:
        raise ValueError(f"shard: matmul with x split {s[0]} and weight split {s[1]} "
                         f"has no Megatron form")
    out = sh.emit(node.op, ins, attrs, s[0][:-1] + (wn,),
                  **({ALL_GATHER: AXIS} if wn == AXIS and id(node) in sh.out_ids else {}))
    if id(w) in sh.layouts:
        sh.fused[id(out)] = sh.layouts[id(w)]
    return out


def _embedding(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    coll = {ALL_REDUCE: AXIS} if s[0][0] == AXIS else {}
    return sh.emit(node.op, ins, attrs, _rep(len(node.shape)), **coll)


def _add(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    a, b = s
    if tuple(a[len(a) - len(b):]) != tuple(b):
        raise ValueError(f"shard: add of splits {a} and {b}")
    out = sh.emit(node.op, ins, attrs, a)
    if id(ins[0]) in sh.fused:
        sh.fused[id(out)] = sh.fused[id(ins[0])]
    return out


def _whole_last_dim(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if s[0][-1] is not None:
        raise ValueError(f"shard: {node.op} over a split last dim {s[0]}")
    return sh.emit(node.op, ins, attrs, s[0])


def _slice(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if id(ins[0]) in sh.fused:
        return sh.split_fused_slice(ins[0], attrs)
    return _whole_last_dim(sh, node, ins, attrs, s)


def _reshape(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    shape = tuple(attrs["shape"])
    old_in, new_in = node.inputs[0], ins[0]
    if new_in.shape != old_in.shape:  # k/v heads repeated: grow the heads dim
        ratio = new_in.shape[-1] // old_in.shape[-1]
        shape = shape[:-2] + (shape[-2] * ratio, shape[-1])
        attrs["shape"] = shape
    return sh.emit(node.op, ins, attrs, _reshape_spec(new_in.shape, s[0], shape, sh.tp))


def _elementwise(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if any(x != s[0] for x in s):
        raise ValueError(f"shard: {node.op} of different splits {s}")
    return sh.emit(node.op, ins, attrs, s[0])


def _gather_rows(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if s[0][0] is not None:
        raise ValueError(f"shard: gather_rows over a split dim 0 {s[0]}")
    return sh.emit(node.op, ins, attrs, s[0])


def _kv_write(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if s[1][1] != s[0][2]:
        raise ValueError(f"shard: {node.op} writes heads split {s[1]} into a cache split {s[0]}")
    return sh.emit(node.op, ins, attrs, s[0])


def _attention(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if s[0][1] != s[1][2]:
        raise ValueError(f"shard: {node.op} with q split {s[0]} and KV split {s[1]}")
    attrs["num_kv_heads"] = ins[1].shape[2]
    return sh.emit(node.op, ins, attrs, s[0])


def _moe_experts(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    """Tokens, ids and router weights replicated; each expert split by its intermediate dim, or the
    experts among the devices: every device sums its share of the tokens' expert outputs, and one
    all-reduce adds the shares."""
    if any(_sharded(x) for x in s[:3]):
        raise ValueError(f"shard: moe_experts with split tokens or routing {s[:3]}")
    if list(s[3:6]) in ([_split(3, -1), _split(3, -1), _split(3, 1)], [_split(3, 0)] * 3):
        return sh.emit(node.op, ins, attrs, _rep(2), **{ALL_REDUCE: AXIS})
    return _replicated(sh, node, ins, attrs, s)


def _replicated(sh: _Sharder, node: Node, ins, attrs: dict, s: list[Spec]) -> Node:
    if any(_sharded(x) for x in s):
        raise ValueError(f"shard: no sharding rule for op {node.op!r} with split inputs {s}")
    return sh.emit(node.op, ins, attrs, _rep(len(node.shape)))


# op -> rule; an op not listed must see only replicated inputs (_replicated).
OP_RULES = {
    "matmul": _matmul, "matmul_int8": _matmul, "matmul_bf16": _matmul,
    "embedding": _embedding,
    "add": _add,
    "slice": _slice, "rope": _whole_last_dim, "rms_norm": _whole_last_dim,
    "reshape": _reshape,
    "mul": _elementwise, "silu": _elementwise, "scale": _elementwise,
    "gather_rows": _gather_rows,
    "kv_write": _kv_write, "kv_cache_update": _kv_write,
    "paged_attention": _attention, "attention": _attention,
    "moe_experts": _moe_experts,
}


def shard(graph: Graph, tp: int = 1, expert_parallel: bool = False) -> Graph:
    """Megatron split over `tp` devices (MoE experts among them with `expert_parallel`); a no-op at tp=1."""
    if tp == 1:
        return graph
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    plan = TPPlan(graph, tp, expert_parallel)
    specs: dict[int, Spec] = {}
    old_to_new: dict[int, Node] = {}

    # ---- leaves: params (with layouts) and runtime inputs (KV state split by kv head)
    state_ids = {id(n.inputs[0]) for n in graph.nodes() if n.op in ("kv_write", "kv_cache_update")}
    leaves = []
    layouts: dict[int, dict] = {}  # new param id -> column layout
    for leaf in graph.inputs:
        if leaf.op == "param":
            layout = plan.column_layout(leaf)
            spec = plan.param_spec(leaf)
            extra = {SHARDING: spec}
            if layout:
                extra[TP_LAYOUT] = layout
            new = _with_attrs(leaf, **extra)
            new = Node(new.op, (), new.attrs, _resized(leaf, layout), new.dtype)
            if layout:
                layouts[id(new)] = layout
        elif id(leaf) in state_ids:
            shape = tuple(leaf.shape)
            if plan.kv_repeat > 1:
                shape = shape[:2] + (shape[2] * plan.kv_repeat,) + shape[3:]
            spec = _split(len(shape), 2) if plan.shard_attention else _rep(len(shape))
            new = input_node(leaf.name, shape, leaf.dtype)
            new = _with_attrs(new, **{SHARDING: spec})
        else:
            spec = _rep(len(leaf.shape))
            new = _with_attrs(leaf, **{SHARDING: spec})
        specs[id(new)] = spec
        old_to_new[id(leaf)] = new
        leaves.append(new)

    # ---- computed values, each by its op's rule
    sh = _Sharder(tp, {id(n) for _, n in graph.outputs}, layouts)
    sh.specs.update(specs)
    for node in graph.nodes():
        ins = tuple(old_to_new[id(i)] for i in node.inputs)
        attrs = {k: v for k, v in node.attrs if k not in SHARDING_ATTRS}
        rule = OP_RULES.get(node.op, _replicated)
        old_to_new[id(node)] = rule(sh, node, ins, attrs, [sh.specs[id(i)] for i in ins])

    state_names = {leaf.name for leaf in graph.runtime_inputs}
    outputs = tuple((name, old_to_new[id(n)]) for name, n in graph.outputs)
    for name, n in outputs:
        if name not in state_names and _sharded(sh.specs[id(n)]) and n.attr(ALL_GATHER) is None:
            raise ValueError(f"shard: output {name} would leave the step split {sh.specs[id(n)]}")
    meta = dict(graph.meta) | {"tp": tp, "tp_attention": "split" if plan.shard_attention else "replicated"}
    if expert_parallel and graph.params_with_role(Role.EXPERT_DOWN):
        meta["tp_experts"] = "expert_parallel"
    if plan.kv_repeat > 1:
        meta["tp_kv_repeat"] = plan.kv_repeat
    if plan.notes:
        meta["tp_notes"] = tuple(plan.notes)
    return Graph(tuple(leaves), outputs, freeze_attrs(meta))
