import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import kv_table
from models.config import PRESETS, ModelConfig, config_from_gguf_fields, config_from_hf, get_preset

REPO = Path(__file__).resolve().parents[1]

SMOLLM2_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True, "vocab_size": 49152,
}


def _cfg(**kw) -> ModelConfig:
    base = dict(name="t", num_layers=2, hidden_size=64, intermediate_size=128, num_q_heads=4,
                num_kv_heads=2, head_dim=16, vocab_size=256)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kw, match", [
    (dict(num_q_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(hidden_size=True), "hidden_size must be a positive int"),
    (dict(vocab_size=2.0), "vocab_size must be a positive int"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rms_eps=-1e-5), "rms_eps"),
    (dict(rope_scaling=(("rope_type", "yarn"), ("factor", 2.0))), "not supported"),
    (dict(rope_scaling=(("rope_type", "linear"),)), "positive 'factor'"),
])
def test_validation_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_presets():
    assert {"smollm2-135m", "tiny", "llama-2-7b", "llama-2-70b", "llama-3-8b", "qwen2-0.5b"} <= set(PRESETS)
    c = get_preset("smollm2-135m")
    assert (c.num_layers, c.hidden_size, c.num_q_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert c.num_params() == 134_515_008  # element count of the GGUF's tensors
    for name, preset in PRESETS.items():
        assert preset.name == name
        assert preset.num_q_heads * preset.head_dim > 0
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        get_preset("nope")


def test_config_from_hf_dict_and_file(tmp_path):
    c = config_from_hf(SMOLLM2_HF_CONFIG, name="smollm2-135m")
    preset = get_preset("smollm2-135m")
    for f in ("num_layers", "hidden_size", "intermediate_size", "num_q_heads", "num_kv_heads", "head_dim",
              "vocab_size", "rope_theta", "tie_embeddings", "qkv_bias", "max_position_embeddings",
              "bos_token_id", "eos_token_id"):
        assert getattr(c, f) == getattr(preset, f), f
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_HF_CONFIG))
    assert config_from_hf(tmp_path).num_layers == 30
    assert config_from_hf(tmp_path / "config.json").name == tmp_path.name


def test_config_from_hf_variants_and_errors(tmp_path):
    qwen = dict(SMOLLM2_HF_CONFIG, architectures=["Qwen2ForCausalLM"], eos_token_id=[7, 8],
                rope_scaling={"type": "linear", "factor": 2.0})
    c = config_from_hf(qwen)
    assert c.qkv_bias and c.eos_token_id == 7
    assert dict(c.rope_scaling) == {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_dict(c.to_dict()) == c
    no_kv = {k: v for k, v in SMOLLM2_HF_CONFIG.items() if k != "num_key_value_heads"}
    assert config_from_hf(no_kv).num_kv_heads == 9
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        config_from_hf({k: v for k, v in SMOLLM2_HF_CONFIG.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="unsupported architecture"):
        config_from_hf(dict(SMOLLM2_HF_CONFIG, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(FileNotFoundError, match="config.json"):
        config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        config_from_hf(tmp_path)


def test_config_from_gguf_fields():
    fields = {
        "general.architecture": "llama", "llama.block_count": 30, "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536, "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
        "llama.rope.freq_base": 100000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 8192, "llama.vocab_size": 49152, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "_tied": True,
    }
    c = config_from_gguf_fields(fields, name="smollm2-135m")
    assert c == get_preset("smollm2-135m")
    scaled = config_from_gguf_fields(dict(fields, **{"llama.rope.scaling.type": "linear",
                                                     "llama.rope.scaling.factor": 4.0}))
    assert dict(scaled.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="block_count"):
        config_from_gguf_fields({k: v for k, v in fields.items() if k != "llama.block_count"})
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        config_from_gguf_fields(dict(fields, **{"general.architecture": "mamba"}))


def test_kv_bytes_gqa():
    l7, l70 = get_preset("llama-2-7b"), get_preset("llama-2-70b")
    assert l7.kv_bytes_per_token(2) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert l70.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2 == 327_680
    # GQA: the 70B model (8 KV heads) needs less KV cache per token than the 7B (32 KV heads).
    assert l70.kv_bytes_per_token(2) < l7.kv_bytes_per_token(2)
    assert get_preset("smollm2-135m").kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4
    assert kv_table.kv_cache_bytes(l7, 4096, 2) == 2 * 1024**3


def test_format_bytes():
    assert kv_table.format_bytes(512) == "512 B"
    assert kv_table.format_bytes(1536) == "1.5 KiB"
    assert kv_table.format_bytes(2 * 1024**3) == "2.0 GiB"


def test_kv_table_runs(capsys):
    kv_table.main()
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert "16384" in out and "bf16" in out and "fp32" in out
    # llama-2-7b, bf16, 4096 tokens: 2 GiB
    row = next(line for line in out.splitlines() if line.startswith("llama-2-7b ") and " bf16 " in line)
    assert "2.0 GiB" in row


def test_kv_table_module_cli():
    res = subprocess.run([sys.executable, "-m", "models.kv_table"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "smollm2-135m" in res.stdout


def test_windowed_kv_bytes_and_table(capsys):
    """What the engine's window-aware cache holds (issue 50, ir.kv_groups): full layers every block,
    sliding layers the blocks of their window and the one being filled. gemma-3-27b at 8k: 10
    global and 52 sliding layers of 33 blocks of 32 tokens, 26.9% of a cache that keeps every
    layer's blocks (the issue's bar: at most 30%)."""
    g27 = get_preset("gemma-3-27b")
    per_layer_token = 2 * 16 * 128 * 2
    assert kv_table.windowed_kv_cache_bytes(g27, 8192, 2) == per_layer_token * (10 * 8192 + 52 * 33 * 32)
    assert kv_table.windowed_kv_cache_bytes(g27, 8192, 2) <= 0.30 * kv_table.kv_cache_bytes(g27, 8192, 2)
    assert kv_table.windowed_kv_cache_bytes(g27, 1000, 2) == kv_table.kv_cache_bytes(g27, 1024, 2)
    assert kv_table.paged_kv_cache_bytes(g27, 1000, 2) == kv_table.kv_cache_bytes(g27, 1024, 2)
    llama = get_preset("llama-3-8b")
    assert kv_table.windowed_kv_cache_bytes(llama, 8192, 2) == kv_table.kv_cache_bytes(llama, 8192, 2)
    kv_table.main(["--model", "gemma-3-27b", "--model", "llama-3-8b"])
    out = capsys.readouterr().out
    head, windowed = out.split("With the engine's window-aware cache", 1)
    assert "not in the engine yet" not in out
    row = next(line for line in windowed.splitlines() if line.startswith("gemma-3-27b"))
    assert row.split()[:4] == ["gemma-3-27b", "bf16", "52/62", "1024"] and "1.0 GiB (26.9%)" in row
    assert "llama-3-8b" not in windowed
    kv_table.main(["--model", "llama-3-8b"])
    assert "window-aware" not in capsys.readouterr().out
