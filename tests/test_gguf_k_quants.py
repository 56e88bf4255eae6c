"""Q6_K and Q5_K matrices kept as the file stores them (ir.blocks, repacked into tile records of
8-bit values) and multiplied by the C++ tile kernels: the formats against an f64 reference written
from the spec (and gguf's dequantization against it), the tiles against both, the kernel on every
CPU class the tests build, the loader and the memory plan on a GGUF written by the gguf package, and
greedy tokens from that file against the same model's dequantized f32 weights."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize

from conftest import EXTRA_CPU_TARGETS, cpu_target_cases
from config.engine_config import EngineConfig
from ir.blocks import (KEPT_FORMATS, TILE_COLUMNS, blocks_name, blocks_shape, dequantize_tiles,
                       pack_tiles, round_q8, split_blocks_name, tile_record_bytes)
from models.config import get_preset
from runtime import SamplingParams
from runtime.engine.plan import compile_plan
from runtime.entrypoints.llm import LLM
from runtime.worker import cpp_kernels

K_QUANTS = ("q6_k", "q5_k")
needs_kernel = pytest.mark.skipif(not cpp_kernels.available(), reason="the C++ kernels do not build here")


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float64)


def q6_k_reference(rows: np.ndarray) -> np.ndarray:
    """Q6_K rows u8 [N, K / 256 * 210] -> f64 [N, K], from the spec: per 128 values h of a
    super-block, value 32s + l (s 0-3, l 0-31) takes nibble s // 2 of ql[64h + 32(s % 2) + l] and
    bits 2s of qh[32h + l] as q (6 bits), and is d * scales[(32s + l) // 16 + 8h] * (q - 32)."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 210).astype(np.int64)
    ql, qh, scales, d = b[..., :128], b[..., 128:192], rows.reshape(n, -1, 210)[..., 192:208].view(np.int8), \
        _f16(rows.reshape(n, -1, 210)[..., 208:210])
    out = np.zeros(b.shape[:2] + (256,))
    for h in range(2):
        for s in range(4):
            for l in range(32):
                low = (ql[..., 64 * h + 32 * (s % 2) + l] >> (4 * (s // 2))) & 15
                high = (qh[..., 32 * h + l] >> (2 * s)) & 3
                i = 128 * h + 32 * s + l
                out[..., i] = d * scales[..., i // 16].astype(np.float64) * ((low | (high << 4)) - 32)
    return out.reshape(n, -1)


def q5_k_reference(rows: np.ndarray) -> np.ndarray:
    """Q5_K rows u8 [N, K / 256 * 176] -> f64 [N, K], from the spec: d, dmin (f16), 12 bytes of
    6-bit scales and mins (sub-block j < 4: the low 6 bits of bytes j and j + 4; j >= 4: the nibbles
    of byte j + 4 with the top 2 bits of bytes j - 4 and j), qh[32], qs[128]; value 64p + 32u + l
    (pair p, u 0-1) takes nibble u of qs[32p + l] and bit 2p + u of qh[l] as q (5 bits), and is
    d * sc * q - dmin * m of sub-block 2p + u."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 176)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s, qh, qs = b[..., 4:16].astype(np.int64), b[..., 16:48].astype(np.int64), b[..., 48:].astype(np.int64)
    out = np.zeros(b.shape[:2] + (256,))
    for j in range(8):
        if j < 4:
            sc, m = s[..., j] & 63, s[..., j + 4] & 63
        else:
            sc = (s[..., j + 4] & 15) | ((s[..., j - 4] >> 6) << 4)
            m = (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)
        p, u = divmod(j, 2)
        for l in range(32):
            q = ((qs[..., 32 * p + l] >> (4 * u)) & 15) | (((qh[..., l] >> j) & 1) << 4)
            out[..., 32 * j + l] = d * sc * q - dmin * m
    return out.reshape(n, -1)


REFERENCE = {"q6_k": q6_k_reference, "q5_k": q5_k_reference}


def k_quant_rows(rng, fmt: str, n: int, k: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(rows u8 [N, K / 256 * block bytes], their f64 values [N, K]): every bit of the values and
    scales random, the super-blocks' f16 d (and dmin) picked for values of about `scale`."""
    f = KEPT_FORMATS[fmt]
    rows = rng.integers(0, 256, (n, k // 256, f.block_bytes), dtype=np.uint8)
    d = (scale * rng.uniform(0.5, 1.5, (n, k // 256, 1)) / (600 if fmt == "q6_k" else 500)).astype("<f2")
    if fmt == "q6_k":
        rows[..., 208:210] = d.view(np.uint8)
    else:
        rows[..., 0:2] = d.view(np.uint8)
        rows[..., 2:4] = (d * np.float16(8)).view(np.uint8)  # dmin: the mins' offsets near the values' middle
    rows = rows.reshape(n, -1)
    return rows, REFERENCE[fmt](rows)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_gguf_dequantization_is_the_spec(fmt):
    """gguf's dequantization (the loader's) equals the f64 reference rounded once to f32, on rows
    whose every bit is random, including negative Q6_K scales."""
    rows, want = k_quant_rows(np.random.default_rng(4), fmt, 24, 768)
    got = dequantize(rows, gguf.GGMLQuantizationType(KEPT_FORMATS[fmt].type_id))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 768), (32, 1280)])
def test_tiles_hold_the_spec_values_exactly(fmt, n, k):
    """pack_tiles' record (8-bit q; Q6_K: the file's f16 d and int8 scales, Q5_K: f32 d and c)
    read back by dequantize_tiles (the op's reference, plain and stacked) gives the spec's values bit
    for bit, on K of 1, 3 and 5 super-blocks; its bytes are 1.125 (Q6_K) or 1.25 (Q5_K) per value;
    N off the tiles' 16 is refused."""
    rows, want = k_quant_rows(np.random.default_rng(n + k), fmt, n, k)
    tiles = pack_tiles(rows, fmt)
    assert tiles.shape == blocks_shape(fmt, n, k, "tiles") == (n // TILE_COLUMNS, k // 32 * tile_record_bytes(fmt))
    assert tiles.nbytes / (n * k) == {"q6_k": 1.125, "q5_k": 1.25}[fmt]
    assert rows.nbytes / (n * k) == {"q6_k": 210 / 256, "q5_k": 176 / 256}[fmt]
    np.testing.assert_array_equal(np.asarray(dequantize_tiles(jnp.asarray(tiles), fmt)), want.T.astype(np.float32))
    stacked = np.asarray(dequantize_tiles(jnp.asarray(np.stack([tiles] * 2)), fmt))
    np.testing.assert_array_equal(stacked[1], want.T.astype(np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_tiles(rows[:n - 8], fmt)


@needs_kernel
@pytest.mark.parametrize("fmt,activations,cpu_target", cpu_target_cases(
    [(f, a) for f in K_QUANTS for a in ("f32", "q8")]), indirect=["cpu_target"])
def test_kernel_multiplies_k_quant_tiles(fmt, activations, cpu_target):
    """cpp_kernels.tile_matmul on Q6_K and Q5_K tiles against the f64 product of the spec's values
    (q8: of the rounded activations): rows 1, 5 (the short rows' integer path), 8, 13 and 33, K of
    1, 3 and 5 super-blocks, N of one to five tiles, plain and from a layer stack, on this machine's
    build and the AVX2 and AVX-512 (no VNNI) ones; an all-zero row stays zero."""
    rng = np.random.default_rng(11)
    for n, k in ((16, 256), (48, 768), (80, 1280)):
        stack = [k_quant_rows(rng, fmt, n, k, 0.1) for _ in range(2)]
        for m in (1, 5, 8, 13, 33):
            x = rng.standard_normal((m, k)).astype(np.float32)
            x[m // 2] = 0.0
            for layer in (None, 1):
                rows, values = stack[layer or 0]
                w = pack_tiles(rows, fmt) if layer is None else np.stack([pack_tiles(r, fmt) for r, _ in stack])
                got = np.asarray(jax.jit(lambda a, b, i: cpp_kernels.tile_matmul(
                    a, b, fmt, layer=i, activations=activations))(x, w, None if layer is None else jnp.int32(layer)))
                assert got.shape == (m, n) and not got[m // 2].any()
                if activations == "q8":
                    want = np.asarray(round_q8(jnp.asarray(x))).astype(np.float64) @ values.T
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
                else:
                    want = x.astype(np.float64) @ values.T
                    bound = np.abs(x).astype(np.float64) @ np.abs(values.T)
                    assert np.all(np.abs(got - want) <= 1e-6 * bound + 1e-30), (m, n, k, layer)


# ---------------------------------------------------------------------- a GGUF file written by gguf

# The tiny Llama widened so that every matrix's K is a multiple of the K-quants' 256.
K_CFG = dataclasses.replace(get_preset("tiny"), hidden_size=256, head_dim=64, intermediate_size=256)


def write_k_quant_gguf(path, types: dict[str, str], seed: int = 0, cfg=K_CFG) -> None:
    """A tiny Llama GGUF (`cfg`) with the gguf package: the tensors whose GGUF name ends in a key
    of `types` (`attn_v.weight`, ...) in that K-quant (random bits, values about 0.05), the rest f32;
    an output tensor unless `cfg` ties it to the embedding."""
    from models.weight_names import source_names
    from models.weights import random_weights

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": cfg.num_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_q_heads, "attention.head_count_kv": cfg.num_kv_heads,
                       "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                       "vocab_size": cfg.vocab_size}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_float32("llama.rope.freq_base", cfg.rope_theta)
    weights = random_weights(cfg, seed=seed)
    for canon, (src, transposed) in source_names(cfg, "gguf").items():
        arr = weights[canon].T if transposed else weights[canon]  # the file's [out, in]
        fmt = next((f for suffix, f in types.items() if src == suffix or src.endswith("." + suffix)), None)
        if fmt is None:
            w.add_tensor(src, np.ascontiguousarray(arr, np.float32))
            continue
        rows, _ = k_quant_rows(rng, fmt, arr.shape[0], arr.shape[1], 0.05)
        w.add_tensor(src, rows, raw_dtype=gguf.GGMLQuantizationType(KEPT_FORMATS[fmt].type_id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Q6_K for q, k, v (fused into one wqkv of one format), ffn_down and the untied output (a Q4_K_M
# file's Q6_K: attn_v, half of ffn_down, often the output); Q5_K for the rest.
FILE_TYPES = {"attn_q.weight": "q6_k", "attn_k.weight": "q6_k", "attn_v.weight": "q6_k", "ffn_down.weight": "q6_k",
              "output.weight": "q6_k", "attn_output.weight": "q5_k", "ffn_gate.weight": "q5_k",
              "ffn_up.weight": "q5_k"}
ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=16,
              device_memory=1 << 30, kernel_backend="cpp", gguf_tiles=True, gguf_activations="f32")


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    from models.weights import load_gguf

    path = tmp_path_factory.mktemp("k-quants") / "tiny-k.gguf"
    write_k_quant_gguf(path, FILE_TYPES)
    config, weights, _ = load_gguf(path)
    return path, config, weights


def test_loader_keeps_k_quant_rows(k_quant_file):
    """load_gguf keeps every Q6_K and Q5_K matrix's rows as the file has them (its f32 values are
    gguf's dequantization of them); gguf_block_formats says the same from the header; a matrix of N
    off the tiles' 16 keeps none."""
    from models.weights import GGUFTensor, _blocks_format, gguf_block_formats

    path, config, weights = k_quant_file
    kept = dict(filter(None, map(split_blocks_name, weights)))
    assert kept == gguf_block_formats(path)
    layers = [f"layers.{i}." for i in range(config.num_layers)]
    assert {n for n, f in kept.items() if f == "q6_k"} == {"lm_head"} | {
        p + m for p in layers for m in ("wq", "wk", "wv", "w_down")}
    assert {n for n, f in kept.items() if f == "q5_k"} == {p + m for p in layers for m in ("wo", "w_gate", "w_up")}
    for name, fmt in kept.items():
        values = dequantize(weights[blocks_name(name, fmt)], gguf.GGMLQuantizationType(KEPT_FORMATS[fmt].type_id))
        np.testing.assert_array_equal(values, weights[name].T)
    q6_k = int(gguf.GGMLQuantizationType.Q6_K)
    assert _blocks_format("layers.0.wv", GGUFTensor("t", q6_k, (256, 264), 0, 0), True) is None


def _llm(weights, config, **engine) -> LLM:
    plan = compile_plan(None, EngineConfig(**(ENGINE | engine)), weights=weights, config=config)
    return LLM.from_plan(plan, check_invariants=True)


@needs_kernel
@pytest.mark.parametrize("cpu_target", [None, *EXTRA_CPU_TARGETS], indirect=True)
def test_file_serves_from_tiles_alone_with_the_f32_models_tokens(k_quant_file, cpu_target):
    """The engine on the file reads every Q6_K and Q5_K matrix as tiles in place of its f32 copy:
    the memory plan's weight bytes are the tiles' (1.125 bytes per Q6_K value, 1.25 per Q5_K) plus
    the f32 embedding and norms, no f32 copy of a K-quant matrix; its greedy tokens (decode, chunked
    prefill) equal those of the same model from its dequantized f32 weights (the XLA engine); on
    this machine's build and the AVX2 and AVX-512 (no VNNI) ones."""
    from runtime.worker import executor

    _, config, weights = k_quant_file
    if not executor.tiles_in_kernel(EngineConfig(**ENGINE)):
        pytest.skip("this build multiplies no tiles alone (no vector path)")
    llm = _llm(weights, config)
    tiled = [n for n in llm.plan.graph.nodes() if n.op == "matmul_blocks"]
    assert {n.attr("format") for n in tiled} == set(K_QUANTS) and all(len(n.inputs) == 2 for n in tiled)
    assert not [p for p in llm.plan.graph.params if p.dtype == "f32" and len(p.shape) == 2 and p.name != "embed"]
    kept = dict(filter(None, map(split_blocks_name, weights)))
    tile_bytes = sum(int(np.prod(blocks_shape(fmt, weights[n].shape[1], weights[n].shape[0], "tiles")))
                     for n, fmt in kept.items())
    f32 = {k: v for k, v in weights.items() if split_blocks_name(k) is None}
    rest = sum(v.nbytes for k, v in f32.items() if k not in kept)
    assert llm.plan.memory.weight_bytes == tile_bytes + rest
    prompts = [list(range(10, 50)), [5, 6, 7, 8], list(range(100, 103))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in _llm(f32, config, kernel_backend="xla", gguf_tiles=None).generate(prompts, sp)]
    assert got == want


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"])
def test_embedding_rows_gathered_from_tiles_are_the_tables(fmt):
    """gather_tile_rows (embedding_tiles' reference) gives the f32 table's rows bit for bit, for ids
    of any shape across tiles; the op's shape rule takes u8 tiles and int ids and refuses a row of
    part of a record."""
    from ir import Node, make_node
    from ir.blocks import gather_tile_rows
    from test_gguf_blocks import _quantized

    rng = np.random.default_rng(5)
    n, k = 48, 512
    if fmt in K_QUANTS:
        rows, values = k_quant_rows(rng, fmt, n, k)
    else:
        rows, values = _quantized(rng.standard_normal((n, k)), fmt)
    table = np.asarray(dequantize_tiles(jnp.asarray(pack_tiles(rows, fmt)), fmt)).T  # [N, K]
    np.testing.assert_array_equal(table, values.astype(np.float32))
    ids = np.array([[0, 17, 47], [16, 15, 33]], np.int32)
    got = np.asarray(gather_tile_rows(jnp.asarray(pack_tiles(rows, fmt)), jnp.asarray(ids), fmt))
    np.testing.assert_array_equal(got, table[ids])
    t = Node("param", (), (("name", "t"),), blocks_shape(fmt, n, k, "tiles"), "u8")
    i = Node("param", (), (("name", "i"),), (2, 3), "i32")
    assert make_node("embedding_tiles", (t, i), dict(format=fmt)).shape == (2, 3, k)
    bad = Node("param", (), (("name", "b"),), (3, tile_record_bytes(fmt) + 1), "u8")
    with pytest.raises(ValueError, match="whole records"):
        make_node("embedding_tiles", (bad, i), dict(format=fmt))


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    """The K-quant file with its LM head tied to a Q6_K token_embd (as Q4_K_M files often store it)."""
    from models.weights import load_gguf

    path = tmp_path_factory.mktemp("k-quants-tied") / "tiny-k-tied.gguf"
    write_k_quant_gguf(path, FILE_TYPES | {"token_embd.weight": "q6_k"}, seed=1,
                       cfg=dataclasses.replace(K_CFG, tie_embeddings=True))
    config, weights, _ = load_gguf(path)
    assert config.tie_embeddings and blocks_name("embed", "q6_k") in weights
    return config, weights


@needs_kernel
@pytest.mark.parametrize("cpu_target", [None, *EXTRA_CPU_TARGETS], indirect=True)
def test_tied_embedding_reads_the_lm_heads_tiles(tied_file, cpu_target):
    """With tiles standing alone, the lookup of a tied Q6_K embedding gathers its rows from the LM
    head's own tiles (one param, read by embedding_tiles and the head's matmul_blocks): no f32
    table stays, the memory plan holds the tiles and the norms only, and the greedy tokens equal the
    f32 model's (XLA, the f32 table); on this machine's build and the AVX2 and AVX-512 ones."""
    from runtime.worker import executor

    config, weights = tied_file
    if not executor.tiles_in_kernel(EngineConfig(**ENGINE)):
        pytest.skip("this build multiplies no tiles alone (no vector path)")
    llm = _llm(weights, config)
    graph = llm.plan.graph
    (lookup,) = [n for n in graph.nodes() if n.op == "embedding_tiles"]
    head = [n for n in graph.nodes() if n.op == "matmul_blocks" and n.inputs[-1] is lookup.inputs[0]]
    assert len(head) == 1 and lookup.inputs[0].name == "embed.q6_k_tiles" and lookup.attr("format") == "q6_k"
    assert not [n for n in graph.nodes() if n.op == "embedding"]
    assert all(p.dtype == "u8" or len(p.shape) == 1 for p in graph.params)
    kept = dict(filter(None, map(split_blocks_name, weights)))
    tile_bytes = sum(int(np.prod(blocks_shape(fmt, *(weights[n].shape if n == "embed" else weights[n].shape[::-1]),
                                              "tiles"))) for n, fmt in kept.items())
    norms = sum(v.nbytes for k, v in weights.items() if v.ndim == 1)
    assert llm.plan.memory.weight_bytes == tile_bytes + norms
    f32 = {k: v for k, v in weights.items() if split_blocks_name(k) is None}
    prompts = [list(range(10, 50)), [5, 6, 7, 8], list(range(100, 103))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in _llm(f32, config, kernel_backend="xla", gguf_tiles=None).generate(prompts, sp)]
    assert got == want
