"""Decode steps reading a GGUF model's own quantization blocks (ir.blocks, passes.gguf_blocks,
cpp/block_matmul.cc): the kernel against gguf's own dequantization, the op's reference, the pass,
the loader's blocks against its f32 weights, and engines with and without the blocks."""

from __future__ import annotations

import conftest
from conftest import cpu_target_cases
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from ir import OPS, verify
from ir.attrs import BLOCK_FORMAT, GGUF_BLOCKS, Role, role_of
from ir.blocks import BLOCK_FORMATS, KEPT_FORMATS, blocks_name, dequantize_blocks, split_blocks_name
from models.config import get_preset
from models.weights import expected_shapes, random_weights
from runtime import SamplingParams
from config.engine_config import EngineConfig
from runtime.core.buckets import BucketTable
from runtime.entrypoints.llm import LLM
from runtime.engine.plan import build_graph, compile_plan
from runtime.worker import cpp_kernels

FORMATS = tuple(BLOCK_FORMATS)
needs_kernel = pytest.mark.skipif(not cpp_kernels.available(), reason="the C++ kernels do not build here")


def _quantized(rows_by_k: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks u8 [N, row bytes], their f32 values [N, K], gguf's dequantization) of a [N, K] f32
    matrix; Q4_K (K a multiple of 256) by quantize_q4_k, gguf having no Q4_K quantizer."""
    qtype = gguf.GGMLQuantizationType(KEPT_FORMATS[fmt].type_id)
    rows_by_k = np.asarray(rows_by_k, np.float32)
    blocks = quantize_q4_k(rows_by_k) if fmt == "q4_k" else quantize(rows_by_k, qtype)
    return blocks, dequantize(blocks, qtype).astype(np.float32)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """A plain Q4_K encoding of [N, K] f32 rows (K a multiple of 256) -> u8 [N, K / 256 * 144], for
    tests: per sub-block of 32, the step (max - min) / 15 and the offset -min (min clipped to 0 or
    below) as 6-bit multiples of the super-block's f16 d and dmin; q rounded into 0-15. Written from
    ggml's layout (d, dmin, 12 bytes of scales, 128 of nibbles: sub-blocks 2i and 2i + 1 in the low
    and high nibbles of bytes 32i to 32i + 31); gguf's dequantize is the check of the values."""
    n, k = rows.shape
    x = rows.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    step, offset = (x.max(-1) - lo) / 15, -lo  # [N, nsb, 8]
    d, dmin = (step.max(-1) / 63).astype(np.float16), (offset.max(-1) / 63).astype(np.float16)

    def six_bits(v, unit):
        unit = unit.astype(np.float32)[..., None]
        return np.clip(np.rint(v / np.where(unit > 0, unit, 1)), 0, 63).astype(np.uint8)

    sc, m = six_bits(step, d), six_bits(offset, dmin)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.rint((x + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], axis=-1)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(n, k // 256, 128)
    halves = [a.view(np.uint8).reshape(n, -1, 2) for a in (d, dmin)]
    return np.concatenate(halves + [scales, qs], axis=-1).reshape(n, -1)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n,cpu_target", cpu_target_cases(
    [(1, 32, 1), (1, 64, 17), (2, 96, 50), (4, 576, 33), (5, 128, 64), (8, 1536, 19), (11, 64, 7), (16, 160, 3)],
    extra=[(1, 64, 17), (3, 96, 50), (5, 128, 64), (11, 576, 7)]), indirect=["cpu_target"])
def test_kernel_matches_gguf_dequantization(fmt, m, k, n, cpu_target):
    """Ragged rows (1-16, past the kernel's 8-row passes of AVX-512 and 4-row ones of AVX2),
    output columns off its 2-column pairs, and K of 1 to 48 blocks, plain and from a layer stack;
    an f64 product of gguf's own dequantized values is the reference. The x86-64-v3 (AVX2) and
    x86-64-v4 builds too."""
    rng = np.random.default_rng(m * 1000 + k + n)
    stack = [_quantized(rng.standard_normal((n, k)) * 0.1, fmt) for _ in range(3)]
    x = rng.standard_normal((m, k)).astype(np.float32)
    for layer in (None, 0, 2):
        blocks, values = stack[layer or 0]
        w = blocks if layer is None else np.stack([b for b, _ in stack])
        got = np.asarray(jax.jit(lambda a, b, i: cpp_kernels.block_matmul(a, b, fmt, layer=i))(
            x, w, None if layer is None else jnp.int32(layer)))
        want = x.astype(np.float64) @ values.T.astype(np.float64)
        assert got.shape == (m, n)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_jnp_dequantization_matches_gguf(fmt):
    rng = np.random.default_rng(3)
    blocks, values = _quantized(rng.standard_normal((5, 96)), fmt)
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(jnp.asarray(blocks), fmt)), values)
    assert np.asarray(dequantize_blocks(jnp.asarray(np.stack([blocks] * 2)), fmt)).shape == (2, 5, 96)


@pytest.mark.parametrize("shape", [(1, 32), (3, 96), (17, 64), (5, 640)])
def test_q5_0_repacks_into_the_q8_0_blocks_of_its_values(shape):
    """Q5_0 rows (Gemma 3's q, k, gate and up) become Q8_0 blocks of the same values, exactly:
    gguf's own quantizer and dequantizer on random rows, every bit of qh exercised, ragged N."""
    from ir.blocks import KEPT_FORMAT_OF_TYPE, repack_blocks

    q5 = gguf.GGMLQuantizationType.Q5_0
    assert KEPT_FORMAT_OF_TYPE[int(q5)] == "q8_0"
    rng = np.random.default_rng(shape[0] * 7 + shape[1])
    raw = quantize(rng.standard_normal(shape).astype(np.float32), q5)
    raw.reshape(shape[0], -1, 22)[..., 2:6] = rng.integers(0, 256, raw.shape[:-1] + (shape[1] // 32, 4))
    blocks = repack_blocks(raw, int(q5))
    assert blocks.shape == (shape[0], shape[1] // 32 * 34)
    np.testing.assert_array_equal(np.asarray(dequantize_blocks(jnp.asarray(blocks), "q8_0")),
                                  dequantize(raw, q5).astype(np.float32))
    np.testing.assert_array_equal(repack_blocks(blocks, int(gguf.GGMLQuantizationType.Q8_0)), blocks)
    with pytest.raises(ValueError, match="no repacking"):
        repack_blocks(raw, int(gguf.GGMLQuantizationType.Q2_K))


def test_loader_keeps_q4_k_rows_only_where_tiles_can_hold_them():
    """A matrix's Q4_K (Q5_K, Q6_K) rows are kept where its rows (the outputs) are a multiple of the
    tiles' 16; the other kept formats everywhere; Q2_K, and vectors, never."""
    from models.weights import GGUFTensor, _blocks_format

    def kept(type_id, shape, canon="layers.0.wo", transposed=True):
        return _blocks_format(canon, GGUFTensor("t", type_id, shape, 0, 0), transposed)

    q4_k, q8_0, q6_k, q2_k = (int(t) for t in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q8_0,
                                               gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q2_K))
    assert kept(q4_k, (1024, 640)) == "q4_k" and kept(q4_k, (256, 264), "embed", False) is None
    assert kept(q4_k, (1024, 648)) is None and kept(q8_0, (1024, 648)) == "q8_0"
    assert kept(q6_k, (2048, 640)) == "q6_k" and kept(q6_k, (2048, 648)) is None
    assert kept(q2_k, (2048, 640)) is None and kept(q4_k, (1024,)) is None


@needs_kernel
@pytest.mark.parametrize("transpose_b,cpu_target", cpu_target_cases([False, True], extra=[False]),
                         indirect=["cpu_target"])
def test_lowerings_read_the_blocks_only_for_few_rows(transpose_b, cpu_target):
    """The op's reference, and every backend but cpp, multiply by w; cpp's lowering reads the
    blocks for up to max_rows rows where the kernel has its vector path. A w that differs from the
    blocks' values shows which one each product read. AVX2 builds have the vector path too."""
    from runtime.worker.kernels import matmul_blocks_cpp

    if cpu_target in ("x86-64-v3", "x86-64-v4"):
        assert cpp_kernels.blocks_vectorized()

    rng = np.random.default_rng(0)
    blocks, values = _quantized(rng.standard_normal((24, 64)), "q4_1")  # [N, K]
    other = np.zeros_like(values.T) + 1.0  # [K, N], not the blocks' values
    w = other.T if transpose_b else other
    attrs = dict(format="q4_1", max_rows=4, transpose_b=transpose_b)
    for rows in (1, 4, 5, 9):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(OPS["matmul_blocks"].impl(x, w, blocks, **attrs)), x @ other,
                                   rtol=1e-5, atol=1e-4)
        want = x @ (values.T if rows <= 4 and cpp_kernels.blocks_vectorized() else other)
        np.testing.assert_allclose(np.asarray(jax.jit(lambda a: matmul_blocks_cpp(a, w, blocks, **attrs))(x)), want,
                                   rtol=1e-5, atol=1e-4)
    # The build's own bound: AVX2's (and NEON's) 4-row passes read the blocks for up to 16 rows.
    cap = cpp_kernels.blocks_max_rows()
    assert cap == {"x86-64-v3": 16, "x86-64-v4": 64}.get(cpu_target, cap)
    for rows in {cap, cap + 1} - {0}:
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        got = jax.jit(lambda a: matmul_blocks_cpp(a, w, blocks, **(attrs | dict(max_rows=64))))(x)
        want = x @ (values.T if rows <= cap else other)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def block_weights(cfg, seed: int, formats: dict[str, str]) -> dict[str, np.ndarray]:
    """Random weights for `cfg` whose matrices, by name suffix (`wq`, `embed`...) in `formats`, are
    made of GGUF blocks: the f32 tensor is the blocks' values, and the blocks sit beside it under
    blocks_name, in the file's [out, in] layout (the embedding's [vocab, hidden]), as load_gguf
    gives them."""
    weights = random_weights(cfg, seed=seed)
    for name in list(weights):
        fmt = formats.get(name.rsplit(".", 1)[-1])
        if fmt is None or weights[name].ndim != 2:
            continue
        rows = weights[name] if name == "embed" else weights[name].T  # the file's layout
        blocks, values = _quantized(rows * 4.0, fmt)
        weights[name] = np.ascontiguousarray(values if name == "embed" else values.T)
        weights[blocks_name(name, fmt)] = blocks
    return weights


ALL_Q4_1 = {k: "q4_1" for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")} | {"lm_head": "q8_0"}
# The file's rows (gguf_tiles=False): by default, CPUs with AMX-BF16 get the tiles (test_gguf_tiles.py).
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, device_memory=1 << 30, gguf_tiles=False)


def served_graph(weights, **engine):
    cfg = get_preset("tiny")
    from runtime.engine.plan import weight_block_formats

    graph, memory, _ = build_graph(cfg, EngineConfig(**(ENGINE | engine)), BucketTable.build(32, 8),
                                   device_memory=1 << 30, keep_pass_texts=False,
                                   block_formats=weight_block_formats(weights))
    return verify(graph), memory


def test_pass_rewrites_the_matmuls_whose_sources_all_have_blocks():
    """Fused q/k/v with one format: blocks; gate/up with two formats: not fused (fuse_matmuls keeps
    them apart), each with its own format's blocks; the untied LM head: blocks with its role. The
    memory plan counts the blocks' bytes."""
    formats = dict(ALL_Q4_1, w_up="q8_0")
    weights = block_weights(get_preset("tiny"), 0, formats)
    graph, memory = served_graph(weights, gguf_blocks=True)
    blocked = {n.inputs[1].name: n.inputs[2] for n in graph.nodes() if n.op == "matmul_blocks"}
    plain = {n.inputs[1].name for n in graph.nodes() if n.op == "matmul"}
    assert {"layers.0.wqkv", "layers.1.wo", "layers.0.w_down", "lm_head"} <= set(blocked)
    assert "layers.0.w_gate_up" not in plain | set(blocked)
    assert (blocked["layers.0.w_gate"].attr(BLOCK_FORMAT), blocked["layers.0.w_up"].attr(BLOCK_FORMAT)) == \
        ("q4_1", "q8_0")
    qkv = blocked["layers.0.wqkv"]
    assert (qkv.dtype, qkv.shape, qkv.attr(BLOCK_FORMAT)) == ("u8", (64 + 32 + 32, 64 // 32 * 20), "q4_1")
    assert qkv.attr(GGUF_BLOCKS) == "layers.0.wqkv" and role_of(qkv) == Role.QKV
    assert blocked["lm_head"].attr(BLOCK_FORMAT) == "q8_0" and role_of(blocked["lm_head"]) == Role.LM_HEAD
    _, without = served_graph(weights, gguf_blocks=False)
    extra = sum(int(np.prod(p.shape)) for p in graph.params if p.dtype == "u8")
    assert memory.weight_bytes == without.weight_bytes + extra


def test_engine_config_refuses_what_blocks_do_not_combine_with():
    for bad in (dict(quantization="int8"), dict(matmul_precision="bfloat16"), dict(dtype="bfloat16")):
        with pytest.raises(ValueError, match="gguf_blocks does not combine"):
            EngineConfig(gguf_blocks=True, **bad)
    EngineConfig(gguf_blocks=None, quantization="int8")  # auto: just off
    with pytest.raises(ValueError, match="no GGUF blocks"):
        compile_plan(None, EngineConfig(gguf_blocks=True, **ENGINE), weights=random_weights(get_preset("tiny")),
                     config=get_preset("tiny"))


def test_loader_blocks_are_its_f32_weights(smollm2_weights):
    """Every SmolLM2 matrix (Q4_1, its tied embedding Q8_0) comes with its blocks, rows in the
    file's [out, in] order with llama.cpp's q/k permutation undone: they dequantize to the f32
    weights exactly."""
    config, weights = smollm2_weights
    shapes = expected_shapes(config)
    blocks = {split_blocks_name(k): k for k in weights if split_blocks_name(k)}
    assert {name for name, _ in blocks} == {n for n, s in shapes.items() if len(s) == 2}
    for (name, fmt), key in blocks.items():
        if name.startswith("layers.") and int(name.split(".")[1]) not in (0, 29):
            continue
        assert fmt == ("q8_0" if name == "embed" else "q4_1"), name
        values = np.asarray(dequantize_blocks(jnp.asarray(weights[key]), fmt))
        np.testing.assert_array_equal(values, weights[name] if name == "embed" else weights[name].T, err_msg=name)


def test_plan_before_the_weights_counts_their_blocks(smollm2_weights):
    """The pre-flight's and dry run's memory plan (no weights loaded) knows the blocks from the GGUF
    header index, so it sizes the KV pool as the real compile does."""
    from runtime.entrypoints.args import model_block_formats, plan_without_weights
    from runtime.engine.plan import weight_block_formats

    config, weights = smollm2_weights
    formats = model_block_formats("smollm2-135m")
    assert formats == weight_block_formats(weights)
    assert model_block_formats("tiny") == {} and model_block_formats("/no/such.gguf") == {}
    engine = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    before = plan_without_weights(config, engine, formats)[1]
    real = compile_plan(None, engine, weights=weights, config=config).memory
    assert (before.weight_bytes, before.num_kv_blocks) == (real.weight_bytes, real.num_kv_blocks)


@pytest.fixture(scope="module")
def smollm2_weights():
    from models.weights import load_model

    config, weights, _ = load_model("smollm2-135m")
    return config, weights


def tiny_block_llm(weights, **engine) -> LLM:
    cfg = get_preset("tiny")
    plan = compile_plan(None, EngineConfig(**(dict(ENGINE, num_kv_blocks=40) | engine)), weights=weights, config=cfg)
    return LLM.from_plan(plan, check_invariants=True)


def engine_workload():
    """Tiny Q4_1 weights, and prompts that make decode batches, short and 100-token prefills and a
    prefix hit; greedy with logprobs."""
    weights = block_weights(get_preset("tiny"), 5, ALL_Q4_1)
    shared = list(range(10, 50))
    prompts = [shared + [3, 4], list(range(5, 9)), shared + [7], list(range(130, 230))] + \
              [[i, i + 1, i + 2] for i in range(120, 124)]
    return weights, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_engine_with_blocks_matches_f32(scan):
    """Steps of up to 64 rows (decode batches and short prefills: the blocks) and a 128-token step
    (a 100-token prompt: f32), a prefix hit: the same greedy tokens as the engine without the
    blocks, logprobs within f32 rounding, and no recompiles."""
    weights, prompts, params = engine_workload()
    got = {}
    for blocks in (False, True):
        llm = tiny_block_llm(weights, gguf_blocks=blocks, scan_layers=scan, max_num_batched_tokens=128)
        ops = {n.op for n in llm.plan.graph.nodes()}
        assert ("matmul_blocks" in ops) == blocks
        got[blocks] = llm.generate(prompts, params)
        assert llm.engine.stats().num_recompiles == 0
    for a, b in zip(got[False], got[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert abs(la[tok] - lb[tok]) < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_tokens_with_and_without_blocks():
    """The bundled GGUF: the same greedy tokens with the blocks read as with the f32 weights, batch 1
    and a batch of 3. (Where the kernel lacks its vector path, the blocks are in the plan but the
    products take the f32 weights: the tokens agree all the same.)"""
    prompts = ["The capital of France is", "def fibonacci(n):", "Three colors of the rainbow are"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for blocks in (True, False):
        llm = LLM("smollm2-135m", gguf_blocks=blocks, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=64, num_kv_blocks=64)
        assert ("matmul_blocks" in {n.op for n in llm.plan.graph.nodes()}) == blocks
        outs[blocks] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        outs[blocks].append(llm.generate(prompts[0], params)[0].outputs[0].token_ids)
        del llm
    assert outs[True] == outs[False]


def test_safetensors_from_weights_with_blocks(tmp_path):
    """An HF safetensors file written from a GGUF's weights (as `runtime.tools.bench --baseline hf` does)
    holds the f32 tensors only: blocks have no HF name."""
    from models.weights import load_safetensors, save_safetensors

    cfg = get_preset("tiny")
    weights = block_weights(cfg, 1, ALL_Q4_1)
    save_safetensors(weights, tmp_path / "model.safetensors")
    back = load_safetensors(tmp_path / "model.safetensors", cfg)
    assert set(back) == {k for k in weights if split_blocks_name(k) is None}
    for name, arr in back.items():
        np.testing.assert_array_equal(arr, weights[name])


@pytest.mark.slow
def test_saved_plan_keeps_the_blocks(tmp_path):
    """A plan saved with its blocks (u8 params in the Orbax checkpoint) loads and decodes as before."""
    from runtime.engine.plan import Plan

    cfg = get_preset("tiny")
    plan = compile_plan(None, EngineConfig(**dict(ENGINE, num_kv_blocks=40, gguf_blocks=True)),
                        weights=block_weights(cfg, 2, ALL_Q4_1), config=cfg)
    blocks = {name: w for name, w in plan.weights.items() if w.dtype == np.uint8}
    assert blocks and all(name.endswith((".q4_1", ".q8_0")) for name in blocks)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM.from_plan(plan).generate([[5, 6, 7], [9, 10]], params)]
    plan.save(tmp_path / "plan")
    loaded = Plan.load(tmp_path / "plan")
    for name, w in blocks.items():
        np.testing.assert_array_equal(loaded.weights[name], w)
    assert [o.outputs[0].token_ids for o in LLM.from_plan(loaded).generate([[5, 6, 7], [9, 10]], params)] == want


def test_dump_shows_the_blocks_when_asked(capsys):
    """`ir.dump --gguf-blocks true` plans SmolLM2 with its blocks from the GGUF header (no weights
    loaded); by default a dump stays machine-independent and shows none."""
    from ir import dump

    assert dump.main(["--model", "smollm2-135m", "--after", "gguf_blocks", "--gguf-blocks", "true"]) == 0
    out = capsys.readouterr().out
    assert "matmul_blocks(" in out and "%layers.0.wqkv.q4_1" in out and "%embed.q8_0" in out
    assert dump.main(["--model", "smollm2-135m", "--after", "gguf_blocks"]) == 0
    assert "matmul_blocks(" not in capsys.readouterr().out
    from config.flags import UserError

    with pytest.raises(UserError, match="brings no GGUF blocks"):
        dump.main(["--model", "tiny", "--gguf-blocks", "true"])
