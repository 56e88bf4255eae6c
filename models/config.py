"""Model configuration: one frozen dataclass, a preset table, and builders from HF and GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder config (Llama-2/3, Mistral, Qwen2, SmolLM2): GQA, RoPE, RMSNorm, SwiGLU."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict frozen as sorted (key, value) pairs; None means plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "intermediate_size", "num_q_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_eps > 0:
            raise ValueError(f"ModelConfig.rms_eps must be > 0, got {self.rms_eps}")
        if self.rope_scaling is not None:
            rs = dict(self.rope_scaling)
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in ("linear", "llama3", "dynamic", "default"):
                raise ValueError(f"ModelConfig.rope_scaling type {kind!r} is not supported "
                                 "(supported: linear, llama3, dynamic, default)")
            if kind != "default" and not float(rs.get("factor", 0)) > 0:
                raise ValueError(f"ModelConfig.rope_scaling needs a positive 'factor', got {rs}")

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Exact KV-cache bytes per token: K and V, every layer, only the KV heads (GQA-aware)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        embed = v * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = _freeze_scaling(d["rope_scaling"])
        return cls(**d)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _freeze_scaling(rs: Mapping[str, Any] | None):
    if not rs:
        return None
    return tuple(sorted((str(k), v) for k, v in rs.items()))


def _llama(name, layers, hidden, inter, heads, kv_heads, vocab, **kw) -> ModelConfig:
    return ModelConfig(name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter,
                       num_q_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       vocab_size=vocab, **kw)


PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in [
        _llama("smollm2-135m", 30, 576, 1536, 9, 3, 49152, rope_theta=100000.0, tie_embeddings=True,
               max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
        _llama("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, max_position_embeddings=4096,
               rms_eps=1e-5, bos_token_id=1, eos_token_id=2),
        _llama("llama-2-13b", 40, 5120, 13824, 40, 40, 32000, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2),
        _llama("llama-2-70b", 80, 8192, 28672, 64, 8, 32000, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2),
        _llama("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, rope_theta=500000.0,
               max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001),
        _llama("mistral-7b", 32, 4096, 14336, 32, 8, 32000, rope_theta=1000000.0,
               max_position_embeddings=32768, bos_token_id=1, eos_token_id=2),
        _llama("qwen2-0.5b", 24, 896, 4864, 14, 2, 151936, rope_theta=1000000.0, rms_eps=1e-6,
               tie_embeddings=True, qkv_bias=True, max_position_embeddings=32768,
               bos_token_id=151643, eos_token_id=151645),
        # Tiny random model for tests: GQA (4 q heads over 2 kv heads), 2 layers, small vocab.
        ModelConfig(name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_q_heads=4,
                    num_kv_heads=2, head_dim=16, vocab_size=256, rope_theta=10000.0, rms_eps=1e-5,
                    tie_embeddings=False, max_position_embeddings=512, bos_token_id=1,
                    eos_token_id=2),
    ]
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None


def config_from_hf(config: Mapping[str, Any] | str | Path, name: str | None = None) -> ModelConfig:
    """Builds a ModelConfig from an HF `config.json` (a path, or its parsed dict)."""
    if not isinstance(config, Mapping):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: HF config.json not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        name = name or path.parent.name
    c = dict(config)
    arch = (c.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        raise ValueError(f"unsupported architecture {arch!r}; supported: Llama, Mistral, Qwen2")
    # transformers 5 writes rope settings under `rope_parameters` (theta included); older
    # configs use top-level `rope_theta` and `rope_scaling`.
    rope = dict(c.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    try:
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        eos = c.get("eos_token_id")
        return ModelConfig(
            name=name or c.get("_name_or_path") or arch,
            num_layers=c["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=c["intermediate_size"],
            num_q_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or hidden // heads,
            vocab_size=c["vocab_size"],
            rope_theta=float(rope_theta),
            rope_scaling=_freeze_scaling(scaling),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", arch == "Qwen2ForCausalLM")),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
    except KeyError as e:
        raise ValueError(f"HF config is missing required field {e.args[0]!r}") from None


def config_from_gguf_fields(fields: Mapping[str, Any], name: str = "gguf") -> ModelConfig:
    """Builds a ModelConfig from decoded GGUF metadata (key -> python value)."""
    arch = fields.get("general.architecture", "llama")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")

    def get(key, default=None):
        v = fields.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    head_dim = fields.get(f"{arch}.attention.key_length") or hidden // heads
    scaling = None
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = _freeze_scaling({"rope_type": scaling_type,
                                   "factor": float(fields.get(f"{arch}.rope.scaling.factor", 1.0))})
    return ModelConfig(
        name=name,
        num_layers=int(get("block_count")),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_q_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        vocab_size=int(vocab),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=bool(fields.get("_tied", False)),
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(fields.get(f"{arch}.context_length", 2048)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )
