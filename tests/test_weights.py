import json
from pathlib import Path

import numpy as np
import pytest

from conftest import golden_arrays
from models.config import ModelConfig, get_preset
from tolerances import SAME_MATH_F64
from models.weights import (
    WEIGHT_MAP,
    decode_gguf_fields,
    expected_shapes,
    GGUF_CACHE_ENV,
    find_smollm2_gguf,
    gguf_tensor_data,
    load_gguf,
    load_model,
    load_orbax,
    load_safetensors,
    permute_qk_rows,
    random_weights,
    read_gguf_index,
    save_orbax,
    save_safetensors,
    source_names,
    unpermute_qk_rows,
)


@pytest.fixture(scope="module")
def smollm2():
    """(config, weights, tokenizer) of the bundled GGUF, loaded once for the module."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def gguf_reader():
    import gguf

    return gguf.GGUFReader(str(find_smollm2_gguf()))


# ---------------------------------------------------------------------------------------------- GGUF


def test_gguf_loads_with_expected_shapes(smollm2):
    config, weights, tokenizer = smollm2
    assert config.name == "smollm2-135m"
    assert config.tie_embeddings and "lm_head" not in weights
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.vocab_size) == (30, 576, 3, 49152)
    assert config.rope_theta == 100000.0 and abs(config.rms_eps - 1e-5) < 1e-9
    shapes = expected_shapes(config)
    # Besides the f32 tensors: each matrix's GGUF blocks (tests/test_gguf_blocks.py).
    assert {k for k in weights if ":" not in k} == set(shapes)
    assert {k for k in weights if ":" in k} == {f"{n}:{'q8_0' if n == 'embed' else 'q4_1'}"
                                                 for n, s in shapes.items() if len(s) == 2}
    for name, shape in shapes.items():
        assert weights[name].shape == shape, name
        assert weights[name].dtype == np.float32, name
    assert weights["layers.0.wq"].shape == (576, 576)
    assert weights["layers.0.wk"].shape == (576, 192)
    assert weights["layers.0.w_down"].shape == (1536, 576)
    assert sum(weights[n].size for n in shapes) == config.num_params()
    assert tokenizer is not None and tokenizer.eos_token_id == 2


def test_gguf_metadata_is_plain_python(gguf_reader):
    fields = decode_gguf_fields(gguf_reader)
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == 30 and isinstance(fields["llama.block_count"], int)
    assert isinstance(fields["llama.rope.freq_base"], float)
    assert isinstance(fields["tokenizer.ggml.tokens"], list) and fields["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    assert isinstance(fields["tokenizer.chat_template"], str)
    json.dumps({k: v for k, v in fields.items() if not k.startswith("tokenizer.ggml.")})  # serialisable


def _index_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json")) if directory.exists() else []


def test_gguf_index_cache_serves_the_parse(tmp_path, monkeypatch, gguf_reader):
    """The second read of an unchanged file comes from the JSON index, equal to GGUFReader's own
    parse (values and their Python types, every tensor's bytes), without running the reader."""
    import gguf

    monkeypatch.setenv(GGUF_CACHE_ENV, str(tmp_path / "index"))
    path = find_smollm2_gguf()
    fields, tensors = read_gguf_index(path)
    assert len(_index_files(tmp_path / "index")) == 1
    assert fields == decode_gguf_fields(gguf_reader)

    def no_parse(*a, **k):
        raise AssertionError("the index cache was not used")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    cached_fields, cached_tensors = read_gguf_index(path)
    assert cached_fields == fields and cached_tensors == tensors
    assert [type(v) for v in cached_fields.values()] == [type(v) for v in fields.values()]
    file = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    assert [t.name for t in gguf_reader.tensors] == list(cached_tensors)
    for t in gguf_reader.tensors:
        data = gguf_tensor_data(file, cached_tensors[t.name])
        assert data.dtype == t.data.dtype and data.shape == t.data.shape, t.name
        np.testing.assert_array_equal(data, t.data, err_msg=t.name)


def _write_small_gguf(path: Path, scale: float, rows: int) -> dict[str, np.ndarray]:
    """A GGUF with one f32 and one Q8_0 tensor and a few metadata values."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(rows)
    plain = (rng.standard_normal((rows, 8)) * scale).astype(np.float32)
    quant = (rng.standard_normal((rows, 64)) * scale).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.rows", rows)
    w.add_float32("test.scale", scale)
    w.add_array("test.names", [f"t{i}" for i in range(rows)])
    w.add_tensor("plain", plain)
    w.add_tensor("quant", quantize(quant, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"plain": plain, "quant": quant}


def test_gguf_index_cache_follows_the_file(tmp_path, monkeypatch):
    """A rewritten file gets a new index, a damaged index is parsed again and replaced, and
    JAXSERVE_GGUF_CACHE=none writes nothing."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    index_dir = tmp_path / "index"
    monkeypatch.setenv(GGUF_CACHE_ENV, str(index_dir))
    path = tmp_path / "small.gguf"

    def read_back():
        fields, tensors = read_gguf_index(path)
        file = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
        out = {n: dequantize(gguf_tensor_data(file, t), GGMLQuantizationType(t.tensor_type)).reshape(
            tuple(reversed(t.shape))) for n, t in tensors.items()}
        return fields, out

    for rows, scale in ((4, 1.0), (6, 3.0)):  # the second file replaces the first in place
        want = _write_small_gguf(path, scale, rows)
        for _ in range(2):  # parsed, then from the index
            fields, got = read_back()
            assert fields["test.rows"] == rows and fields["test.names"] == [f"t{i}" for i in range(rows)]
            assert abs(fields["test.scale"] - scale) < 1e-6
            np.testing.assert_array_equal(got["plain"], want["plain"])
            np.testing.assert_allclose(got["quant"], want["quant"], atol=scale * 0.05)
    assert len(_index_files(index_dir)) == 2

    newest = max(_index_files(index_dir), key=lambda f: f.stat().st_mtime_ns)
    newest.write_text("{not json")
    assert read_back()[0]["test.rows"] == 6
    assert json.loads(newest.read_text())["fields"]["test.rows"] == 6

    monkeypatch.setenv(GGUF_CACHE_ENV, "none")
    other = tmp_path / "other"
    monkeypatch.setenv("HOME", str(other))
    _write_small_gguf(path, 2.0, 5)
    assert read_back()[0]["test.rows"] == 5
    assert len(_index_files(index_dir)) == 2 and not other.exists()


def _reference_unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Row-by-row statement of llama.cpp's permutation: GGUF row 2i/2i+1 of a head hold HF rows i, i+d/2."""
    d = w.shape[0] // num_heads
    out = np.empty_like(w)
    for h in range(num_heads):
        for i in range(d // 2):
            out[h * d + i] = w[h * d + 2 * i]
            out[h * d + d // 2 + i] = w[h * d + 2 * i + 1]
    return out


def test_unpermute_inverts_permute():
    rng = np.random.default_rng(0)
    for heads, d, cols in [(9, 64, 5), (3, 64, 1), (2, 8, 3)]:
        w = rng.standard_normal((heads * d, cols)).astype(np.float32)
        assert np.array_equal(unpermute_qk_rows(permute_qk_rows(w, heads), heads), w)
        assert np.array_equal(unpermute_qk_rows(w, heads), _reference_unpermute(w, heads))
    bias = np.arange(16, dtype=np.float32)
    assert np.array_equal(unpermute_qk_rows(bias, 2), _reference_unpermute(bias, 2))


def _rope(x, pos, theta, interleaved):
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        return out
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def test_unpermuted_weights_give_rotate_half_rope():
    """Interleaved RoPE on GGUF-layout q equals rotate-half RoPE on un-permuted q, up to the row order."""
    rng = np.random.default_rng(1)
    heads, d, hidden, t = 3, 16, 12, 5
    w_gguf = rng.standard_normal((heads * d, hidden))  # [out, in] as stored in GGUF
    x = rng.standard_normal((t, hidden))
    pos = np.arange(t, dtype=np.float64)
    q_interleaved = _rope((x @ w_gguf.T).reshape(t, heads, d), pos, 1e4, interleaved=True)
    q_half = _rope((x @ unpermute_qk_rows(w_gguf, heads).T).reshape(t, heads, d), pos, 1e4, interleaved=False)
    back = unpermute_qk_rows(q_interleaved.reshape(t, heads * d).T, heads).T.reshape(t, heads, d)
    np.testing.assert_allclose(back, q_half, **SAME_MATH_F64)
    # Attention scores are invariant to a shared permutation of q and k's head dim.
    assert np.allclose(np.einsum("thd,shd->hts", q_interleaved, q_interleaved),
                       np.einsum("thd,shd->hts", q_half, q_half))


@pytest.mark.parametrize("layer", [0, 17])
def test_qk_unpermutation_matches_transformers(smollm2, gguf_reader, layer):
    from gguf.quants import dequantize

    config, weights, _ = smollm2
    tensors = {t.name: t for t in gguf_reader.tensors}
    raw = {k: dequantize(tensors[f"blk.{layer}.attn_{k}.weight"].data, tensors[f"blk.{layer}.attn_{k}.weight"].tensor_type)
           for k in ("q", "k", "v")}
    # Our loader against a row-by-row restatement of the permutation.
    np.testing.assert_array_equal(weights[f"layers.{layer}.wq"].T, _reference_unpermute(raw["q"], 9))
    np.testing.assert_array_equal(weights[f"layers.{layer}.wk"].T, _reference_unpermute(raw["k"], 3))
    np.testing.assert_array_equal(weights[f"layers.{layer}.wv"].T, raw["v"])  # v is not permuted
    # ... and against transformers' own GGUF tensor processor (what produced the golden outputs).
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc = mod.LlamaTensorProcessor(config={"num_attention_heads": config.num_q_heads,
                                            "num_key_value_heads": config.num_kv_heads})
    for k, canon in (("q", "wq"), ("k", "wk")):
        name = f"blk.{layer}.attn_{k}.weight"
        hf = proc.process(weights=raw[k], name=name).weights
        np.testing.assert_array_equal(weights[f"layers.{layer}.{canon}"], hf.T)


def _reference_forward(config: ModelConfig, w: dict, ids: np.ndarray) -> np.ndarray:
    """Plain numpy Llama forward (rotate-half RoPE, GQA, SwiGLU), float32; returns [T, vocab] logits."""
    def rms(x, g):
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_eps)) * g

    t, hd = len(ids), config.head_dim
    group = config.num_q_heads // config.num_kv_heads
    pos = np.arange(t, dtype=np.float32)
    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
    x = w["embed"][ids]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "attn_norm"])
        q = _rope((h @ w[p + "wq"]).reshape(t, -1, hd), pos, config.rope_theta, False).astype(np.float32)
        k = _rope((h @ w[p + "wk"]).reshape(t, -1, hd), pos, config.rope_theta, False).astype(np.float32)
        v = (h @ w[p + "wv"]).reshape(t, -1, hd)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(hd)) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(t, -1) @ w[p + "wo"]
        h = rms(x, w[p + "mlp_norm"])
        g = h @ w[p + "w_gate"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "w_up"])) @ w[p + "w_down"]
    x = rms(x, w["final_norm"])
    return x @ (w["embed"].T if config.tie_embeddings else w["lm_head"])


def test_weights_reproduce_golden_logits(smollm2):
    """End to end: numpy forward on our weights matches transformers' logits for a golden prompt."""
    config, weights, _ = smollm2
    g = golden_arrays("p1_fibonacci")
    logits = _reference_forward(config, weights, g["prompt_ids"])
    assert np.abs(logits[-1] - g["last_logits"]).max() < 1e-3
    top1 = logits.argmax(-1)
    np.testing.assert_array_equal(top1, g["prompt_topk_ids"][:, 0])
    assert top1[-1] == g["gen_ids"][0]


def test_truncated_gguf_names_file(tmp_path):
    src = find_smollm2_gguf()
    for num_bytes in (2_000, 3_000_000):  # inside the metadata; inside the tensor data
        bad = tmp_path / f"cut{num_bytes}.gguf"
        with open(src, "rb") as f:
            bad.write_bytes(f.read(num_bytes))
        with pytest.raises(ValueError, match=f"cut{num_bytes}.gguf.*(truncated|corrupt)"):
            load_gguf(bad)


def test_bad_gguf_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_gguf(junk)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(junk)


# ---------------------------------------------------------------------------------------------- safetensors

QWEN_TINY = get_preset("tiny").replace(name="tiny-bias", qkv_bias=True, tie_embeddings=True)


@pytest.mark.parametrize("config", [get_preset("tiny"), QWEN_TINY], ids=["tiny", "bias-tied"])
def test_safetensors_single_roundtrip(tmp_path, config):
    w = random_weights(config, seed=3)
    save_safetensors(w, tmp_path / "model.safetensors")
    for spec in (tmp_path, tmp_path / "model.safetensors"):
        got = load_safetensors(spec, config)
        assert set(got) == set(w)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])


def _write_sharded(directory: Path, config: ModelConfig, weights: dict, num_shards: int = 3) -> dict:
    from safetensors.numpy import save_file

    names = source_names(config, "hf")
    hf = {names[k][0]: np.ascontiguousarray(v.T if names[k][1] else v) for k, v in weights.items()}
    keys = sorted(hf)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {k: hf[k] for k in keys[s::num_shards]}
        save_file(part, str(directory / shard))
        weight_map.update({k: shard for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_safetensors_sharded_roundtrip(tmp_path):
    config = get_preset("tiny")
    w = random_weights(config, seed=4)
    _write_sharded(tmp_path, config, w)
    got = load_safetensors(tmp_path, config)
    for k in w:
        np.testing.assert_array_equal(got[k], w[k])
    got = load_safetensors(tmp_path / "model.safetensors.index.json", config)
    assert set(got) == set(w)


def test_safetensors_bf16_and_untied_extra_lm_head(tmp_path):
    """BF16 files (numpy has no bf16) load as float32; a tied model ignores a stray lm_head."""
    config = QWEN_TINY
    w = random_weights(config, seed=5)
    names = source_names(config, "hf")
    header, blobs, offset = {}, [], 0
    tensors = {names[k][0]: (v.T if names[k][1] else v) for k, v in w.items()}
    tensors["lm_head.weight"] = w["embed"]
    expected = {}
    for src, arr in tensors.items():
        bits = (np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        expected[src] = (bits.astype(np.uint32) << 16).view(np.float32)
        blob = bits.tobytes()
        header[src] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    got = load_safetensors(tmp_path, config)
    assert "lm_head" not in got
    for k, (src, transposed) in names.items():
        np.testing.assert_array_equal(got[k], expected[src].T if transposed else expected[src])


def test_missing_shard_names_the_shard(tmp_path):
    config = get_preset("tiny")
    weight_map = _write_sharded(tmp_path, config, random_weights(config))
    missing = sorted(set(weight_map.values()))[1]
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_safetensors(tmp_path, config)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    config = get_preset("tiny")
    w = random_weights(config)
    w["layers.1.wk"] = np.zeros((64, 48), np.float32)  # expected (64, 32)
    save_safetensors(w, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.wk.*\(64, 48\).*expected \(64, 32\)") as e:
        load_safetensors(tmp_path, config)
    assert "model.safetensors" in str(e.value) and "k_proj" in str(e.value)


def test_missing_tensor_and_missing_files(tmp_path):
    config = get_preset("tiny")
    w = random_weights(config)
    del w["layers.0.w_up"]
    save_safetensors(w, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.0\.w_up'.*up_proj"):
        load_safetensors(tmp_path, config)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_safetensors(empty, config)
    (tmp_path / "trunc.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match="trunc.safetensors"):
        load_safetensors(tmp_path / "trunc.safetensors", config)


def test_load_model_hf_directory(tmp_path):
    config = get_preset("tiny")
    w = random_weights(config, seed=9)
    hf_cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    save_safetensors(w, tmp_path / "model.safetensors")
    got_config, got, tok = load_model(tmp_path)
    assert tok is None
    assert got_config.replace(name="tiny") == config
    for k in w:
        np.testing.assert_array_equal(got[k], w[k])


def test_load_model_presets_and_errors(tmp_path):
    config, w, tok = load_model("tiny")
    assert config == get_preset("tiny") and tok is None
    assert set(w) == set(expected_shapes(config))
    with pytest.raises(FileNotFoundError, match="not bundled"):
        load_model("llama-2-7b")
    with pytest.raises(FileNotFoundError, match="not a preset"):
        load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


# ---------------------------------------------------------------------------------------------- orbax, random


def test_orbax_roundtrip(tmp_path):
    config = QWEN_TINY
    w = random_weights(config, seed=7)
    save_orbax(w, tmp_path / "ckpt")
    got = load_orbax(tmp_path / "ckpt")
    assert set(got) == set(w)
    for k in w:
        assert isinstance(got[k], np.ndarray) and got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], w[k])
    with pytest.raises(FileNotFoundError, match="missing_ckpt"):
        load_orbax(tmp_path / "missing_ckpt")


def test_orbax_says_nothing_at_info(tmp_path, caplog):
    """Serving a plan printed about ten of Orbax's INFO lines (its version, barrier settings)."""
    import logging

    w = random_weights(get_preset("tiny"), seed=1)
    with caplog.at_level(logging.INFO):
        save_orbax(w, tmp_path / "ckpt")
        load_orbax(tmp_path / "ckpt")
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno < logging.WARNING]
    assert logging.getLogger("absl").level == logging.NOTSET  # put back as it was
    with caplog.at_level(logging.DEBUG):
        load_orbax(tmp_path / "ckpt")
    assert [r for r in caplog.records if r.name == "absl"]  # --log-level debug still shows them


def test_random_weights_deterministic():
    config = get_preset("tiny")
    a, b, c = random_weights(config, seed=0), random_weights(config, seed=0), random_weights(config, seed=1)
    assert list(a) == list(expected_shapes(config))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].shape == expected_shapes(config)[k]
    assert not np.array_equal(a["layers.0.wq"], c["layers.0.wq"])
    assert abs(a["layers.0.attn_norm"].mean() - 1) < 0.02 and a["layers.0.attn_norm"].std() > 0
    assert abs(a["layers.0.wq"].std() - 0.02) < 0.005
    half = random_weights(config, seed=0, dtype=np.float16)
    assert half["embed"].dtype == np.float16
    biased = random_weights(QWEN_TINY)
    assert "layers.0.bq" in biased and "lm_head" not in biased
    assert np.abs(biased["layers.1.bv"]).max() < 0.2


def test_weight_map_covers_every_name():
    for config in (get_preset("tiny"), QWEN_TINY, get_preset("smollm2-135m")):
        for fmt in ("hf", "gguf"):
            names = source_names(config, fmt)
            assert set(names) == set(expected_shapes(config))
            assert len({src for src, _ in names.values()}) == len(names)
    assert WEIGHT_MAP["layers.{}.wq"] == ("model.layers.{}.self_attn.q_proj.weight", "blk.{}.attn_q.weight", True)
