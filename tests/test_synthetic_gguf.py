"""models/synthetic_gguf.py: GGUF files of a user-sized model's shape with random weights, the stand-in
for the files users download (the 1B benchmark's Q4_K_M). Checked on a small shape: every tensor in
the type the file type gives it, every block valid (finite values of about the scale asked for), and
the loader keeping f32 values only as a DequantizedTensor, computed when read."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest

from models.config import get_preset
from models.synthetic_gguf import random_blocks, tensor_type, write
from models.weights import DequantizedTensor, load_model, read_gguf_index

# Every matrix's K a multiple of the K-quants' 256; 16 layers, so that Q4_K_M's layer rule shows.
SHAPE = dataclasses.replace(get_preset("tiny"), name="k-shape", num_layers=16, hidden_size=256, head_dim=64,
                            intermediate_size=512)


def test_q4_k_m_follows_the_quantizers_layer_rule():
    more = [i for i in range(16) if tensor_type(f"blk.{i}.attn_v.weight", "q4_k_m", 16) == "q6_k"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]  # the first and last eighth, and every third between
    assert tensor_type("blk.3.ffn_down.weight", "q4_k_m", 16) == "q4_k"
    assert tensor_type("token_embd.weight", "q4_k_m", 16) == "q6_k"
    assert tensor_type("blk.3.attn_q.weight", "q4_k_m", 16) == "q4_k"
    assert tensor_type("blk.3.attn_norm.weight", "q8_0", 16) == "f32"


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0"])
def test_random_blocks_are_valid_blocks_of_their_type(fmt):
    rows = random_blocks(np.random.default_rng(0), fmt, 8, 512)
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[fmt.upper()])
    assert values.shape == (8, 512) and np.all(np.isfinite(values))
    assert 0.002 < float(np.std(values)) < 0.2


@pytest.mark.slow  # reads SmolLM2's tokenizer from its GGUF
@pytest.mark.parametrize("file_type", ["q4_k_m", "q8_0"])
def test_a_written_file_loads_with_no_f32_copy(tmp_path, file_type):
    path = tmp_path / f"k-{file_type}.gguf"
    info = write(path, SHAPE, file_type)
    _, tensors = read_gguf_index(path)
    for name, t in tensors.items():
        assert gguf.GGMLQuantizationType(t.tensor_type).name.lower() == tensor_type(name, file_type, 16), name
    config, weights, _ = load_model(str(path))
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (16, 256, 49152)
    wq = weights["layers.0.wq"]
    assert isinstance(wq, DequantizedTensor) and wq.shape == (256, 256)
    # The file's values, its q rows unpermuted and transposed: the same multiset, computed when read.
    file_values = gguf.quants.dequantize(wq.raw, gguf.GGMLQuantizationType(tensors["blk.0.attn_q.weight"].tensor_type))
    np.testing.assert_array_equal(np.sort(np.asarray(wq), axis=None), np.sort(file_values, axis=None))
    assert np.isfinite(np.asarray(wq)).all() and np.asarray(wq).std() > 0
    assert info["tensor_bytes"] <= info["bytes"]
