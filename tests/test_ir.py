"""The IR core: print -> parse round trips, the verifier's rules, op shape rules, parser errors,
and the `python -m ir.dump` tool."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ir import (Graph, IRError, ParseError, VerifyError, bind_shape, eval_dim, input_node,
                make_node, param_node, parse_graph, print_graph, same_structure, verify)
from ir.graph import Node, freeze_attrs
from ir.ops import OPS
from models.config import PRESETS, get_preset
from models.llama import lower
from passes.pipeline import PipelineOptions, run_pipeline

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ round trips

def structure(g: Graph):
    """Everything a graph says, with nodes named by position: independent of the printer."""
    index: dict[int, int] = {}
    leaves = []
    for i, leaf in enumerate(g.inputs):
        index[id(leaf)] = i
        leaves.append((leaf.op, leaf.attrs, leaf.shape, leaf.dtype))
    nodes = []
    for j, n in enumerate(g.nodes(), len(leaves)):
        nodes.append((n.op, n.attrs, n.shape, n.dtype, tuple(index[id(x)] for x in n.inputs)))
        index[id(n)] = j
    outputs = tuple((name, index[id(n)]) for name, n in g.outputs)
    return tuple(leaves), tuple(nodes), outputs, g.meta


def assert_round_trip(g: Graph) -> Graph:
    text = print_graph(g)
    back = parse_graph(text)
    assert print_graph(back) == text
    assert structure(back) == structure(g)
    assert same_structure(back, g)
    verify(back)
    return back


def _final(config, **opts):
    return run_pipeline(lower(config), PipelineOptions(**opts))


def test_round_trip_smollm2_textbook():
    g = lower(get_preset("smollm2-135m"))
    back = assert_round_trip(g)
    assert len(back.nodes()) == len(g.nodes()) == 904
    # Parsing shares nodes the way the original does: one value per SSA name.
    assert len({id(n) for n in back.nodes()}) == len(back.nodes())


def test_round_trip_smollm2_final():
    g = _final(get_preset("smollm2-135m"), max_model_len=512, buckets=((128, 16),))
    back = assert_round_trip(g)
    ops = back.op_counts()
    assert ops["paged_attention"] == ops["kv_write"] // 2 == 30
    assert back.meta_value("num_kv_blocks") == g.meta_value("num_kv_blocks") > 0


def test_round_trip_attribute_kinds():
    # Float, bool, string-list (concat recipes), dict (rope_scaling) attributes, bf16, i8 params,
    # symbolic dims with an offset (S+1), biases.
    config = get_preset("tiny").replace(
        qkv_bias=True, rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                     ("low_freq_factor", 1.0),
                                     ("original_max_position_embeddings", 256),
                                     ("rope_type", "llama3")))
    for g in (lower(config, "bf16"), _final(config, quantization="int8"), lower(get_preset("qwen2-0.5b"))):
        assert_round_trip(g)
    text = print_graph(_final(config, quantization="int8"))
    assert 'param %layers.0.wqkv.int8 : i8[64, 128] {concat=["layers.0.wq", "layers.0.wk", ' in text
    assert "input %cu_q_lens : i32[S+1]" in text
    assert '{scaling={"factor": 8.0, "high_freq_factor": 4.0' in text


def test_printer_is_deterministic_and_numbers_in_order():
    a = print_graph(lower(get_preset("tiny")))
    b = print_graph(lower(get_preset("tiny")))
    assert a == b
    numbered = [line.split(" = ")[0] for line in a.splitlines() if line.startswith("%")]
    assert numbered == [f"%{i}" for i in range(len(numbered))]


# ------------------------------------------------------------------------------ verifier

def _reject(g: Graph, *fragments: str) -> str:
    with pytest.raises(VerifyError) as e:
        verify(g)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in verifier message {msg!r}"
    return msg


def test_verifier_accepts_well_formed_graphs():
    verify(lower(get_preset("tiny")))
    verify(_final(get_preset("tiny")))


def test_verifier_rejects_unknown_op():
    g = parse_graph("""
input %x : f32[T, 8]
%0 = frobnicate(%x) : f32[T, 8]
output y = %0
""")
    _reject(g, "node %0 (frobnicate)", "unknown op")


def test_verifier_rejects_matmul_shape_mismatch():
    g = parse_graph("""
input %x : f32[T, 8]
param %w : f32[4, 4]
%0 = matmul(%x, %w) : f32[T, 4]
output y = %0
""")
    _reject(g, "node %0 (matmul)", "matmul contraction dims must agree: 8 != 4")


def test_verifier_rejects_wrong_declared_type():
    g = parse_graph("""
input %x : f32[T, 8]
param %w : f32[8, 4]
%0 = matmul(%x, %w) : f32[T, 4]
%1 = silu(%0) : f32[T, 5]
output y = %1
""")
    _reject(g, "node %1 (silu)", "declared type f32['T', 5]", "shape rule gives f32['T', 4]")
    g = parse_graph(print_graph(g).replace("silu(%0) : f32[T, 5]", "silu(%0) : bf16[T, 4]"))
    _reject(g, "node %1 (silu)", "declared type bf16", "shape rule gives f32")


def test_verifier_rejects_undeclared_leaf():
    x = input_node("x", ("T", 8), "f32")
    w = param_node("layers.0.wq", (8, 8), "f32")
    y = make_node("matmul", (x, w))
    g = Graph((x,), (("y", y),))
    _reject(g, "node %0 (matmul)", "input 1 is leaf %layers.0.wq", "does not declare")
    # An output that is itself an undeclared leaf.
    _reject(Graph((x,), (("y", y), ("w", w))), "node %0 (matmul)")
    _reject(Graph((x, w), (("w2", param_node("w2", (1,), "f32")),)), "output w2", "undeclared leaf %w2")


def test_verifier_rejects_duplicate_leaf_name():
    x = input_node("x", ("T", 8), "f32")
    x2 = input_node("x", ("T", 8), "f32")
    g = Graph((x, x2), (("y", make_node("add", (x, x2))),))
    _reject(g, "leaf %x", "name declared twice")


def test_verifier_rejects_dtype_mismatch():
    g = parse_graph("""
input %a : f32[T, 8]
input %b : bf16[T, 8]
%0 = add(%a, %b) : f32[T, 8]
output y = %0
""")
    _reject(g, "node %0 (add)", "add dtypes must agree: f32 vs bf16")


def test_verifier_rejects_bad_rank():
    g = parse_graph("""
input %x : f32[T, 64]
input %positions : i32[T]
%0 = rope(%x, %positions) {theta=10000.0} : f32[T, 64]
output y = %0
""")
    _reject(g, "node %0 (rope)", "rope input [T, heads, head_dim] must have rank 3, got f32[T, 64]")


def test_verifier_rejects_missing_attribute_and_arity():
    g = parse_graph("""
input %x : f32[T, 8]
param %w : f32[8]
%0 = rms_norm(%x, %w) : f32[T, 8]
output y = %0
""")
    _reject(g, "node %0 (rms_norm)", "rms_norm requires attribute 'eps'")
    g = parse_graph("""
input %x : f32[T, 8]
%0 = silu(%x, %x) : f32[T, 8]
output y = %0
""")
    _reject(g, "node %0 (silu)", "silu takes 1 inputs, got 2")


def test_verifier_rejects_bad_index_dtype_and_unknown_dtype():
    g = parse_graph("""
input %ids : f32[T]
param %embed : f32[16, 8]
%0 = embedding(%embed, %ids) : f32[T, 8]
output y = %0
""")
    _reject(g, "node %0 (embedding)", "embedding ids must be i32, got f32")
    g = parse_graph("""
input %x : f64[T, 8]
output y = %x
""")
    _reject(g, "leaf %x", "unknown dtype 'f64'")


def test_verifier_rejects_paged_attention_attr_mismatch():
    g = parse_graph("""
input %q : f32[T, 4, 16]
input %k_pool : f32[B, 16, 2, 16]
input %v_pool : f32[B, 16, 2, 16]
input %block_tables : i32[S, M]
input %context_lens : i32[S]
input %cu_q_lens : i32[S+1]
%0 = paged_attention(%q, %k_pool, %v_pool, %block_tables, %context_lens, %cu_q_lens) {block_size=8, head_dim=16, num_kv_heads=2, scale=0.25} : f32[T, 4, 16]
output o = %0
""")
    _reject(g, "node %0 (paged_attention)", "block_size attr must match the pool: 16 != 8")


def test_verifier_names_the_node_in_a_real_graph():
    # Break one matmul deep inside SmolLM2's graph: the message points at that node's number.
    g = lower(get_preset("tiny"))
    text = print_graph(g)
    bad = text.replace("param %layers.1.wo : f32[64, 64]", "param %layers.1.wo : f32[32, 64]")
    line = next(l for l in bad.splitlines() if "%layers.1.wo)" in l)
    num = line.split(" = ")[0]
    _reject(parse_graph(bad), f"node {num} (matmul)", "contraction dims must agree: 64 != 32")


# ------------------------------------------------------------------------------ op shape rules

def _in(name, shape, dtype="f32"):
    return input_node(name, shape, dtype)


def test_op_shape_rules():
    x = _in("x", ("T", 64))
    ids = _in("ids", ("T",), "i32")
    pos = _in("pos", ("T",), "i32")
    w = param_node("w", (64, 32), "f32")
    emb = param_node("embed", (100, 64), "f32")
    cases = [
        (("embedding", (emb, ids)), (("T", 64), "f32")),
        (("rms_norm", (x, param_node("n", (64,), "f32")), {"eps": 1e-5}), (("T", 64), "f32")),
        (("matmul", (x, w)), (("T", 32), "f32")),
        (("matmul", (x, emb), {"transpose_b": True}), (("T", 100), "f32")),
        (("matmul_int8", (x, param_node("q", (64, 32), "i8"), param_node("s", (32,), "f32"))),
         (("T", 32), "f32")),
        (("add", (x, param_node("b", (64,), "f32"))), (("T", 64), "f32")),
        (("reshape", (x,), {"shape": ("T", 4, 16)}), (("T", 4, 16), "f32")),
        (("slice", (x,), {"start": 16, "stop": 48}), (("T", 32), "f32")),
        (("gather_rows", (x, _in("rows", ("R",), "i32"))), (("R", 64), "f32")),
        (("repeat_kv", (_in("kv", ("T", "L", 2, 16)),), {"n_rep": 3}), (("T", "L", 6, 16), "f32")),
        (("einsum", (_in("q", ("T", 4, 16)), _in("k", ("T", "L", 4, 16))), {"eq": "thd,tlhd->thl"}),
         (("T", 4, "L"), "f32")),
        (("kv_write", (_in("pool", ("B", 16, 2, 16)), _in("k", ("T", 2, 16)), ids)),
         (("B", 16, 2, 16), "f32")),
        (("rope", (_in("q", ("T", 4, 16)), pos), {"theta": 1e4}), (("T", 4, 16), "f32")),
    ]
    for args, (shape, dtype) in cases:
        n = make_node(*args)
        assert (n.shape, n.dtype) == (shape, dtype), args[0]
    q = _in("q", ("T", 4, 16))
    pool = _in("k_pool", ("B", 16, 2, 16))
    pa = make_node("paged_attention", (q, pool, pool, _in("bt", ("S", "M"), "i32"),
                                       _in("cl", ("S",), "i32"), _in("cu", ("S+1",), "i32")),
                   {"scale": 0.25, "num_kv_heads": 2, "block_size": 16, "head_dim": 16})
    assert pa.shape == ("T", 4, 16)
    cache = _in("k_cache", ("S", "L", 2, 16))
    att = make_node("attention", (q, cache, cache, ids, pos),
                    {"scale": 0.25, "causal": True, "num_kv_heads": 2, "head_dim": 16})
    assert att.shape == ("T", 4, 16)


@pytest.mark.parametrize("op,inputs,attrs,rule", [
    ("matmul", (("T", 64), (32, 8)), {}, "matmul contraction dims must agree: 64 != 32"),
    ("add", (("T", 64), ("T", 32)), {}, "add operands must match"),
    ("mul", (("T", 64), ("T", 32)), {}, "mul operands must have one shape"),
    ("reshape", (("T", 64),), {"shape": ("T", 4, 8)}, "reshape must keep the element count"),
    ("slice", (("T", 64),), {"start": 60, "stop": 70}, "slice [60:70] out of range for last dim 64"),
    ("rope", (("T", 4, 15), ("T",)), {"theta": 1e4}, "rope positions must be i32"),
    ("einsum", (("T", 4), ("T", 4)), {"eq": "bad"}, "must look like 'ab,bc->ac'"),
])
def test_op_shape_rules_reject(op, inputs, attrs, rule):
    nodes = [_in(f"x{i}", s) for i, s in enumerate(inputs)]
    if op == "matmul":
        nodes[1] = param_node("w", inputs[1], "f32")
    with pytest.raises(IRError, match=rule.replace("[", r"\[").replace("(", r"\(")):
        make_node(op, nodes, attrs)


def test_every_op_has_a_rule_and_an_implementation():
    for name, d in OPS.items():
        assert callable(d.shape_rule), name
        if name not in ("input", "param"):
            assert d.impl is not None, f"op {name} has no jnp implementation"


def test_symbolic_dims_bind():
    assert eval_dim("S+1", {"S": 4}) == 5
    assert bind_shape(("T", 3, "S+1"), {"T": 8, "S": 2}) == (8, 3, 3)
    with pytest.raises(IRError, match="cannot bind dim 'Q'"):
        eval_dim("Q", {"T": 1})


# ------------------------------------------------------------------------------ parser errors

@pytest.mark.parametrize("text,lineno,what", [
    ("input %x : f32[T, 8]\n%0 = silu(%y) : f32[T, 8]\n", 2, "use of undefined value %y"),
    ("input %x : f32[T, 8]\n\ninput %x : f32[T, 8]\n", 3, "leaf %x declared twice"),
    ("input %x : f32[T, 8]\n%0 = silu(%x) : f32(T, 8)\n", 2, "cannot parse"),
    ("input %x : f32[T, 8]\n%0 = scale(%x) {value=} : f32[T, 8]\n", 2, "bad value for attribute 'value'"),
    ("input %x : f32[T, 8]\n%0 = scale(%x) value=1 : f32[T, 8]\n", 2, "bad attributes"),
    ("input %x : f32[T, 8]\noutput y = %3\n", 2, "output y refers to undefined %3"),
    ("meta {model=\"m\"}\ninput %x : f32[T, 8]\nthis is not IR\n", 3, "cannot parse 'this is not IR'"),
])
def test_parser_errors_name_the_line(text, lineno, what):
    with pytest.raises(ParseError) as e:
        parse_graph(text)
    assert f"line {lineno}:" in str(e.value)
    assert what in str(e.value)


def test_parser_ignores_trailing_comments():
    text = print_graph(lower(get_preset("tiny")))
    annotated = "\n".join(l + "  # sharded P(None, 'tp')" if l.startswith("param") else l
                          for l in text.splitlines())
    assert print_graph(parse_graph(annotated)) == text


# ------------------------------------------------------------------------------ layering

def test_ir_core_imports_nothing_from_the_project():
    for path in sorted((ROOT / "ir").glob("*.py")):
        if path.name == "dump.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                assert m.split(".")[0] not in ("models", "passes", "runtime", "pallas_kernels"), \
                    f"{path.name} imports {m}"


# ------------------------------------------------------------------------------ ir.dump

def _dump(capsys, *argv) -> str:
    from ir import dump

    assert dump.main(list(argv)) == 0
    return capsys.readouterr().out


def test_dump_final_ir_by_default_and_round_trips(capsys):
    out = _dump(capsys, "--model", "tiny")
    assert out.startswith("IR after plan_memory:\n")
    assert out.count("IR after") == 1
    body = out.split("\n", 1)[1]
    assert print_graph(parse_graph(body)) == body
    assert "paged_attention(" in body and "%layers.0.wqkv" in body


def test_dump_after_each_and_after_one(capsys, tmp_path):
    out = _dump(capsys, "--model", "tiny", "--after-each", "--dump-dir", str(tmp_path))
    headers = [l for l in out.splitlines() if l.startswith("IR after ")]
    names = ["lower", "fuse_attention", "insert_paged_kv", "fuse_matmuls", "gguf_blocks", "quantize_int8",
             "bf16_matmuls", "shard", "plan_memory"]
    assert headers == [f"IR after {n}:" for n in names]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{i:02d}-{n}.txt" for i, n in enumerate(names)]
    assert (tmp_path / "00-lower.txt").read_text() == print_graph(lower(get_preset("tiny")))
    one = _dump(capsys, "--model", "tiny", "--after", "fuse_attention")
    assert one == "IR after fuse_attention:\n" + (tmp_path / "01-fuse_attention.txt").read_text()
    assert "softmax" not in one and "attention(" in one
    with pytest.raises(SystemExit):
        _dump(capsys, "--model", "tiny", "--after", "no_such_pass")


def test_dump_stats_is_deterministic(capsys):
    args = ("--model", "smollm2-135m", "--stats", "--bucket", "tokens=128,seqs=16", "--max-model-len", "512",
            "--quantization", "int8", "--dtype", "bf16")
    a = _dump(capsys, *args)
    b = _dump(capsys, *args)
    assert a == b
    assert "op counts per pass" in a and "memory plan" in a
    row = next(l for l in a.splitlines() if l.startswith("matmul_int8"))
    assert row.split()[1:] == ["0", "0", "0", "0", "0", "120", "120", "120", "120"]  # lower .. plan_memory
    assert any(l.split()[:3] == ["128", "x", "16"] for l in a.splitlines())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dump_every_preset_without_weights(capsys, name):
    out = _dump(capsys, "--model", name, "--stats", "--no-ir")
    assert "memory plan" in out and "paged_attention" in out


def test_the_dumps_note_on_the_servers_weights_holds(capsys):
    """The dump says why the server's weights may differ, with SmolLM2's numbers: check them."""
    from ir.dump import MACHINE_NOTE

    def weights(*flags):
        out = _dump(capsys, "--model", "smollm2-135m", "--stats", "--no-ir", *flags)
        assert MACHINE_NOTE in out
        return next(l.split()[-2] for l in out.splitlines() if l.strip().startswith("- weights"))

    plain, tiles = weights(), weights("--gguf-tiles", "true")
    assert f"SmolLM2's {round(float(plain))} MiB become\n{round(float(tiles))} MiB" in MACHINE_NOTE, (plain, tiles)
