"""Param roles (ir/attrs.py): every lowered param has one, they survive printing and every pass,
and the passes and the runner find weights by role, so renaming every param changes nothing."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest

from ir import ROLE, ROLES, Node, Role, VerifyError, parse_graph, print_graph, rewrite, verify
from ir.attrs import CONCAT, INT8_SCALE, QUANTIZE_INT8
from ir.graph import freeze_attrs
from models.config import get_preset
from models.llama import lower
from passes.pipeline import PipelineOptions, run_pipeline
from tolerances import SAME_MATH_F32

TINY = get_preset("tiny")
CONFIGS = {
    "tiny": TINY,  # untied LM head
    "tiny_bias": TINY.replace(qkv_bias=True),
    "tiny_8q4kv": TINY.replace(num_q_heads=8, num_kv_heads=4, head_dim=8),
    "smollm2": get_preset("smollm2-135m").replace(num_layers=2),  # tied, 9 q / 3 kv heads
}


def options(tp: int = 1, quantization=None) -> PipelineOptions:
    return PipelineOptions(block_size=16, max_model_len=128, buckets=((16, 4),), num_kv_blocks=32,
                           tensor_parallel_size=tp, quantization=quantization)


def test_every_lowered_smollm2_param_has_a_role():
    g = lower(get_preset("smollm2-135m"))
    roles = [p.attr(ROLE) for p in g.params]
    assert all(r in ROLES for r in roles), [p.name for p in g.params if p.attr(ROLE) not in ROLES]
    assert roles.count(Role.Q) == 30 and roles.count(Role.DOWN) == 30
    assert {Role.EMBED, Role.FINAL_NORM} <= set(roles) and Role.LM_HEAD not in roles  # tied
    assert [p.name for p in g.params_with_role(Role.FINAL_NORM)] == ["final_norm"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("tp,quantization", [(1, None), (1, "int8"), (2, "int8"), (4, None)])
def test_roles_survive_printing_and_every_pass(name, tp, quantization):
    seen = []

    def check(i, pass_name, g):
        seen.append(pass_name)
        bad = [p.name for p in g.params if p.attr(ROLE) not in ROLES]
        assert not bad, f"after {pass_name}: params without a role: {bad}"
        text = print_graph(g)
        assert print_graph(verify(parse_graph(text))) == text
        assert [p.attr(ROLE) for p in parse_graph(text).params] == [p.attr(ROLE) for p in g.params]

    g = run_pipeline(lower(CONFIGS[name]), options(tp, quantization), on_pass=check)
    assert seen[-1] == "plan_memory"
    fused = {p.attr(ROLE) for p in g.params if p.attr(CONCAT)}
    assert fused == ({Role.QKV, Role.GATE_UP} | ({Role.QKV_BIAS} if name == "tiny_bias" else set()))
    if quantization:
        # An int8 weight and its scale keep their source's role; the recipe attribute tells them apart.
        q = {p.attr(ROLE) for p in g.params if p.attr(QUANTIZE_INT8)}
        s = {p.attr(ROLE) for p in g.params if p.attr(INT8_SCALE)}
        assert q == s and Role.QKV in q and Role.DOWN in q


def test_role_syntax_and_closed_set():
    text = "param %w : f32[4, 4] {concat=[\"a role=x\"]} role=gate_up\ninput %x : f32[T, 4]\n" \
           "%0 = matmul(%x, %w) : f32[T, 4]\noutput y = %0\n"
    g = verify(parse_graph(text))
    assert g.params[0].attr(ROLE) == "gate_up" and g.params[0].attr(CONCAT) == ("a role=x",)
    assert print_graph(g) == text
    with pytest.raises(VerifyError, match="role 'wq' is not a param role"):
        verify(parse_graph(text.replace("role=gate_up", "role=wq")))
    with pytest.raises(VerifyError, match="is not a param role"):
        verify(parse_graph(text.replace("input %x : f32[T, 4]", "input %x : f32[T, 4] role=q")))


def test_paged_attention_records_new_kv_written():
    g = run_pipeline(lower(TINY), options(), stop_after="insert_paged_kv")
    attn = [n for n in g.nodes() if n.op == "paged_attention"]
    assert attn and all(n.attr("new_kv_written") is True for n in attn)


# --------------------------------------------------------------- the same graphs as before roles

# sha256 (first 16 hex digits) of the IR after `shard`, printed by the pipeline as it was before
# params had roles (commit b5a8ccb), with this change's additions (` role=...` on params and
# `new_kv_written=true` on paged_attention) taken out: fuse_matmuls and shard make the same graphs.
BEFORE_ROLES = {
    ("tiny", 2, "int8"): "1df4474df4f1342b",
    ("tiny_bias", 2, None): "4fbe54125c4c543e",
    ("tiny", 4, None): "c935ea1f76713716",
    ("smollm2", 3, None): "cd56db9ca2ab5fd6",
    ("smollm2", 2, "int8"): "05081a8236f17660",
    ("tiny_8q4kv", 4, "int8"): "46c2e412c26f0141",
}


@pytest.mark.parametrize("name,tp,quantization", sorted(BEFORE_ROLES, key=str))
def test_fused_and_sharded_graphs_unchanged(name, tp, quantization):
    g = run_pipeline(lower(CONFIGS[name]), options(tp, quantization), stop_after="shard")
    text = re.sub(r" role=[a-z_]+", "", print_graph(g)).replace(", new_kv_written=true", "")
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == BEFORE_ROLES[(name, tp, quantization)]


# --------------------------------------------------------------- renamed params, same roles

def renamed(g):
    """Every param renamed `t<i>` (nothing like the lowering's names); roles kept."""
    names = {p.name: f"t{i}" for i, p in enumerate(g.params)}
    return _rename_leaves(g, names, {}), names


def _rename_leaves(g, names: dict[str, str], refs: dict[str, dict[str, str]]):
    """Params renamed by `names`; name-valued attributes (concat, int8 sources) mapped by `refs`."""
    new = {}
    for leaf in g.inputs:
        a = dict(leaf.attrs)
        if leaf.op == "param":
            a["name"] = names[leaf.name]
            for key, m in refs.items():
                if key in a:
                    a[key] = tuple(m[x] for x in a[key]) if isinstance(a[key], tuple) else m[a[key]]
        new[id(leaf)] = Node(leaf.op, (), freeze_attrs(a), leaf.shape, leaf.dtype)
    return rewrite(g, lambda n, ins: new.get(id(n)), new_inputs=tuple(new[id(x)] for x in g.inputs))


def canonical(g, sources: dict[str, str], fused: dict[str, str]) -> str:
    """Printed with params named by position, concat sources by `sources`, int8 sources by `fused`."""
    names = {p.name: f"P{i}" for i, p in enumerate(g.params)}
    return print_graph(_rename_leaves(g, names, {CONCAT: sources, QUANTIZE_INT8: fused, INT8_SCALE: fused}))


def _compile(g, opts):
    after = {}
    out = run_pipeline(g, opts, on_pass=lambda i, n, x: after.setdefault(n, x), stop_after="shard")
    return after["fuse_matmuls"], out


@pytest.mark.parametrize("name", ["tiny", "tiny_bias", "smollm2"])
@pytest.mark.parametrize("tp,quantization", [(2, "int8"), (4, None)])
def test_renamed_params_fuse_and_shard_the_same(name, tp, quantization):
    if name == "smollm2" and tp == 4:
        tp = 3  # 9 q heads: tp=3 splits attention
    textbook = lower(CONFIGS[name])
    other, to_new = renamed(textbook)
    assert not set(to_new) & set(to_new.values())
    results = []
    for g, src in ((textbook, {n: f"S{i}" for i, n in enumerate(to_new)}),
                   (other, {n: f"S{i}" for i, n in enumerate(to_new.values())})):
        fused, out = _compile(g, options(tp, quantization))
        fused_names = {p.name: f"F{i}" for i, p in enumerate(fused.params)}
        results.append((canonical(fused, src, fused_names), canonical(out, src, fused_names)))
    assert results[0][0] == results[1][0]  # fuse_matmuls: the same groups, roles and layouts
    assert results[0][1] == results[1][1]  # shard: the same specs, layouts and collectives
    assert 'sharding=[null, "tp"]' in results[1][1] and 'all_reduce="tp"' in results[1][1]


@pytest.mark.parametrize("name,quantization", [("tiny", None), ("tiny", "int8"), ("smollm2", None)])
def test_the_lm_head_cut_from_a_renamed_graph(name, quantization):
    """ir.head.head_graph on a graph whose params are all renamed: its params are the final norm and
    the LM head (or the tied embedding) by role, and running it gives the final norm then the head,
    computed here from the params found by role."""
    import jax.numpy as jnp

    from ir.head import HEAD_INPUT, head_graph
    from runtime.worker.executor import build_step

    cfg = CONFIGS[name].replace(vocab_size=64) if name == "smollm2" else CONFIGS[name]
    g = run_pipeline(renamed(lower(cfg))[0], options(1, quantization))
    head = head_graph(g)
    assert {p.attr(ROLE) for p in head.params} <= {Role.FINAL_NORM, Role.LM_HEAD, Role.EMBED}
    rng = np.random.default_rng(0)
    params = {p.name: (rng.integers(-127, 128, p.shape).astype(np.int8) if p.dtype == "i8"
                       else (rng.random(p.shape) / 127).astype(np.float32) if p.attr(INT8_SCALE) is not None
                       else rng.standard_normal(p.shape).astype(np.float32)) for p in head.params}
    rows = rng.standard_normal((5, cfg.hidden_size)).astype(np.float32)
    outs, _ = build_step(head, "xla")({k: jnp.asarray(v) for k, v in params.items()}, {}, {HEAD_INPUT: rows})
    (norm,) = head.params_with_role(Role.FINAL_NORM)
    heads = head.params_with_role(Role.LM_HEAD)
    if not heads:
        w = params[head.params_with_role(Role.EMBED)[0].name].T
    elif quantization:
        q, s_ = sorted(heads, key=lambda p: p.attr(INT8_SCALE) is not None)
        w = params[q.name].astype(np.float32) * params[s_.name][None, :]
    else:
        w = params[heads[0].name]
    h = rows / np.sqrt(np.mean(rows * rows, axis=-1, keepdims=True) + cfg.rms_eps) * params[norm.name]
    np.testing.assert_allclose(np.asarray(outs["logits"]), h @ w, **SAME_MATH_F32)
