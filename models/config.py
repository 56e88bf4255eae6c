"""Model configuration: one frozen dataclass, a preset table, and builders from HF and GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


LAYER_TYPES = ("full", "sliding")
HIDDEN_ACTS = ("silu", "gelu_tanh")
ROUTER_SCORINGS = ("softmax_topk", "topk_softmax")  # ir.moe_ops' router_weights scorings


@dataclass(frozen=True)
class ModelConfig:
    """A pre-norm decoder config: GQA, RoPE, RMSNorm and a gated MLP. The defaults are Llama's
    (Llama-2/3, Mistral, Qwen2, SmolLM2); the fields after `eos_token_id` are the features of the
    other families (Qwen3: qk_norm; Gemma 2/3: the rest), which the lowering reads one by one.
    """

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
    qk_norm: bool = False  # an RMSNorm per head on q and on k, before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w): Gemma's (1 + w)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> C * tanh(scores / C)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> C * tanh(logits / C)
    sliding_window: int | None = None  # the keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES; None: all full
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rope_theta
    # Mixture of experts (Mixtral, Qwen3-MoE): a sparse layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size (None: intermediate_size), of which a router picks num_experts_per_tok
    # per token, weighted as `router_scoring` says (ir.moe_ops). 0 experts: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    router_scoring: str = "softmax_topk"  # or "topk_softmax" (Mixtral)
    norm_topk_prob: bool = False  # softmax_topk: renormalize the chosen weights to sum to 1
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers that keep a dense MLP
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is sparse when (i + 1) % step == 0
    # HF architecture name (Qwen3ForCausalLM...): which names the weight files use (models.weights).
    architecture: str = "LlamaForCausalLM"

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
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for f in ("embed_scale", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                  "rope_local_theta"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise ValueError(f"ModelConfig.{f} must be None or > 0, got {v!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"ModelConfig.layer_types needs one of {LAYER_TYPES} per layer "
                                 f"({self.num_layers}), got {self.layer_types}")
            if "sliding" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                       and self.sliding_window >= 1):
                raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window is "
                                 f"{self.sliding_window!r}")

        if self.num_experts:
            k = self.num_experts_per_tok
            if not (isinstance(self.num_experts, int) and self.num_experts > 0 and isinstance(k, int)
                    and 1 <= k <= self.num_experts):
                raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                 f"got {k!r}")
            if self.moe_intermediate_size is not None and not self.moe_intermediate_size > 0:
                raise ValueError(f"ModelConfig.moe_intermediate_size must be > 0, got {self.moe_intermediate_size!r}")
            if self.router_scoring not in ROUTER_SCORINGS:
                raise ValueError(f"ModelConfig.router_scoring must be one of {ROUTER_SCORINGS}, "
                                 f"got {self.router_scoring!r}")
            if not (isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step >= 1):
                raise ValueError(f"ModelConfig.decoder_sparse_step must be an int >= 1, got {self.decoder_sparse_step!r}")

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (HF Qwen3-MoE's rule; every layer for Mixtral)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_size(self) -> int:
        """Each expert's intermediate size."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window of `sliding_window` keys."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> tuple[float, tuple | None]:
        """(RoPE base, scaling) of `layer`: Gemma 3's sliding layers take their own base, unscaled."""
        if self.is_sliding(layer) and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes per token of a full-attention cache: K and V, every layer, only the KV
        heads (GQA-aware)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.is_sliding(i) for i in range(self.num_layers))

    def kv_bytes_per_seq(self, seq_len: int, dtype_bytes: int, block_size: int = 16) -> int:
        """KV-cache bytes one sequence of `seq_len` tokens holds in a window-aware cache: full layers
        every token, sliding layers only the blocks their window still sees (at most
        ceil((window - 1) / block_size) + 1 blocks: the window may begin mid-block)."""
        per_layer_token = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        sliding = self.num_sliding_layers
        if not sliding:
            return per_layer_token * self.num_layers * seq_len
        held = min(-(-seq_len // block_size), -(-(self.sliding_window - 1) // block_size) + 1) * block_size
        return per_layer_token * ((self.num_layers - sliding) * seq_len + sliding * min(seq_len, held))

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * h * self.sandwich_norms
        sparse = sum(self.is_moe(j) for j in range(self.num_layers))
        mlps = (self.num_layers - sparse) * 3 * h * i + sparse * self.num_experts * (3 * h * self.expert_size + h)
        embed = v * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + mlps + embed + h

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        d["layer_types"] = list(self.layer_types) if self.layer_types else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = _freeze_scaling(d["rope_scaling"])
        if d.get("layer_types"):
            d["layer_types"] = tuple(d["layer_types"])
        d["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
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


def _qwen3(name, layers, hidden, inter, heads, kv_heads, tie_embeddings=False) -> ModelConfig:
    return ModelConfig(name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter, num_q_heads=heads,
                       num_kv_heads=kv_heads, head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_eps=1e-6,
                       tie_embeddings=tie_embeddings, max_position_embeddings=40960, bos_token_id=151643,
                       eos_token_id=151645, qk_norm=True, architecture="Qwen3ForCausalLM")


def _qwen3_moe(name, layers, hidden, inter, moe_inter, heads, kv_heads) -> ModelConfig:
    return _qwen3(name, layers, hidden, inter, heads, kv_heads).replace(
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=moe_inter, norm_topk_prob=True,
        architecture="Qwen3MoeForCausalLM")


# What every Gemma shares: (1 + w) norms, sandwich norms, GeGLU, tied embeddings.
_GEMMA = dict(rms_eps=1e-6, tie_embeddings=True, bos_token_id=2, eos_token_id=1, norm_offset=1.0,
              sandwich_norms=True, hidden_act="gelu_tanh")


def _gemma3(name, layers, hidden, inter, heads, kv_heads, head_dim, vocab, *, window, scaling=None, qpas=256.0,
            max_pos=131072) -> ModelConfig:
    return ModelConfig(name=name, num_layers=layers, hidden_size=hidden, intermediate_size=inter, num_q_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, rope_theta=1000000.0,
                       rope_scaling=_freeze_scaling({"rope_type": "linear", "factor": scaling}) if scaling else None,
                       max_position_embeddings=max_pos, **_GEMMA, qk_norm=True, embed_scale=hidden ** 0.5,
                       query_pre_attn_scalar=qpas, sliding_window=window,
                       layer_types=tuple("sliding" if (i + 1) % 6 else "full" for i in range(layers)),
                       rope_local_theta=10000.0, architecture="Gemma3ForCausalLM")


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
        # Llama 3.2 (meta-llama/Llama-3.2-1B, -3B): tied embeddings, llama3 RoPE scaling.
        *(_llama(name, layers, hidden, 8192, heads, 8, 128256, rope_theta=500000.0, tie_embeddings=True,
                 max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
                 rope_scaling=_freeze_scaling({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}))
          for name, layers, hidden, heads in (("llama-3.2-1b", 16, 2048, 32), ("llama-3.2-3b", 28, 3072, 24))),
        _llama("mistral-7b", 32, 4096, 14336, 32, 8, 32000, rope_theta=1000000.0,
               max_position_embeddings=32768, bos_token_id=1, eos_token_id=2),
        _llama("qwen2-0.5b", 24, 896, 4864, 14, 2, 151936, rope_theta=1000000.0, rms_eps=1e-6,
               tie_embeddings=True, qkv_bias=True, max_position_embeddings=32768,
               bos_token_id=151643, eos_token_id=151645),
        # Qwen3 dense (configs of Qwen/Qwen3-*): qk-norm, head_dim 128 whatever the width.
        _qwen3("qwen3-0.6b", 28, 1024, 3072, 16, 8, tie_embeddings=True),
        _qwen3("qwen3-1.7b", 28, 2048, 6144, 16, 8, tie_embeddings=True),
        _qwen3("qwen3-4b", 36, 2560, 9728, 32, 8, tie_embeddings=True),
        _qwen3("qwen3-8b", 36, 4096, 12288, 32, 8),
        _qwen3("qwen3-32b", 64, 5120, 25600, 64, 8),
        # Mixture of experts: Mixtral (mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2) and Qwen3-MoE
        # (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B: 128 experts of 768 / 1536, top-8, renormalized).
        _llama("mixtral-8x7b", 32, 4096, 14336, 32, 8, 32000, rope_theta=1000000.0, max_position_embeddings=32768,
               bos_token_id=1, eos_token_id=2, num_experts=8, num_experts_per_tok=2, router_scoring="topk_softmax",
               architecture="MixtralForCausalLM"),
        _qwen3_moe("qwen3-30b-a3b", 48, 2048, 6144, 768, 32, 4),
        _qwen3_moe("qwen3-235b-a22b", 94, 4096, 12288, 1536, 64, 4),
        # Gemma 2 (google/gemma-2-9b): sliding and global layers alternate, softcaps 50 and 30.
        ModelConfig(name="gemma-2-9b", num_layers=42, hidden_size=3584, intermediate_size=14336, num_q_heads=16,
                    num_kv_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                    **_GEMMA, query_pre_attn_scalar=256.0, embed_scale=3584 ** 0.5, attn_logit_softcap=50.0,
                    final_logit_softcap=30.0, sliding_window=4096,
                    layer_types=tuple("sliding" if (i + 1) % 2 else "full" for i in range(42)),
                    architecture="Gemma2ForCausalLM"),
        # Gemma 3 (google/gemma-3-*; the text model of 4b-27b): five sliding layers per global one,
        # qk-norm, RoPE 10k on sliding layers and 1M (linear x8 from 4b up) on global ones.
        _gemma3("gemma-3-270m", 18, 640, 2048, 4, 1, 256, 262144, window=512, max_pos=32768),
        _gemma3("gemma-3-1b", 26, 1152, 6912, 4, 1, 256, 262144, window=512, max_pos=32768),
        _gemma3("gemma-3-4b", 34, 2560, 10240, 8, 4, 256, 262208, window=1024, scaling=8.0),
        _gemma3("gemma-3-12b", 48, 3840, 15360, 16, 8, 256, 262208, window=1024, scaling=8.0),
        _gemma3("gemma-3-27b", 62, 5376, 21504, 32, 16, 128, 262208, window=1024, scaling=8.0, qpas=168.0),
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


# HF architectures this engine lowers, and their defaults where config.json may be silent.
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _hf_layer_types(c: Mapping[str, Any], arch: str, num_layers: int) -> tuple[str, ...] | None:
    """Per layer "full" or "sliding", from `layer_types` (transformers 5 writes it) or the family's
    pattern (Gemma 2: every other layer from the first; Gemma 3: five sliding, then one full)."""
    types = c.get("layer_types")
    if types:
        return tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    if arch == "Gemma2ForCausalLM":
        return tuple("sliding" if (i + 1) % 2 else "full" for i in range(num_layers))
    if arch == "MixtralForCausalLM" and c.get("sliding_window"):  # Mixtral's window, when set, is every layer's
        return ("sliding",) * num_layers
    if arch == "Gemma3ForCausalLM":
        pattern = int(c.get("sliding_window_pattern", 6))
        return tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))
    return None


def _hf_rope(c: Mapping[str, Any], arch: str):
    """(theta, scaling, local theta): transformers 5 keeps RoPE under `rope_parameters`, per layer
    type for Gemma 3 ({"full_attention": {...}, "sliding_attention": {...}}); older configs use
    top-level `rope_theta`, `rope_scaling` and Gemma 3's `rope_local_base_freq`."""
    rope = dict(c.get("rope_parameters") or {})
    local = None
    if "full_attention" in rope or "sliding_attention" in rope:
        local = (rope.get("sliding_attention") or {}).get("rope_theta")
        rope = dict(rope.get("full_attention") or {})
    elif arch == "Gemma3ForCausalLM":
        local = c.get("rope_local_base_freq", 10000.0)
    default = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
    theta = rope.pop("rope_theta", c.get("rope_theta", default))
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return float(theta), _freeze_scaling(scaling), None if local is None else float(local)


def _hf_moe(c: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json ({} for dense families)."""
    if arch == "MixtralForCausalLM":
        return dict(num_experts=c["num_local_experts"], num_experts_per_tok=c["num_experts_per_tok"],
                    router_scoring="topk_softmax")
    if arch == "Qwen3MoeForCausalLM":
        return dict(num_experts=c.get("num_experts") or c["num_local_experts"],
                    num_experts_per_tok=c["num_experts_per_tok"], moe_intermediate_size=c["moe_intermediate_size"],
                    norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                    mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
                    decoder_sparse_step=int(c.get("decoder_sparse_step", 1)))
    return {}


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
    if arch == "Gemma3ForConditionalGeneration" and "text_config" in c:  # the text half of a Gemma 3
        c, arch = {"eos_token_id": c.get("eos_token_id"), **c["text_config"]}, "Gemma3ForCausalLM"
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(HF_ARCHITECTURES)}")
    rope_theta, scaling, local_theta = _hf_rope(c, arch)
    gemma = arch in GEMMA
    try:
        heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        eos = c.get("eos_token_id")
        act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
        layer_types = _hf_layer_types(c, arch, c["num_hidden_layers"])
        sliding = layer_types is not None and "sliding" in layer_types
        return ModelConfig(
            name=name or c.get("_name_or_path") or arch,
            num_layers=c["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=c["intermediate_size"],
            num_q_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or hidden // heads,
            vocab_size=c["vocab_size"],
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
            qkv_bias=bool(c.get("attention_bias", arch == "Qwen2ForCausalLM")),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            hidden_act="gelu_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act,
            embed_scale=float(hidden ** 0.5) if gemma else None,
            query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)) if gemma else None,
            attn_logit_softcap=c.get("attn_logit_softcapping"),
            final_logit_softcap=c.get("final_logit_softcapping"),
            sliding_window=c.get("sliding_window") if sliding else None,
            layer_types=layer_types if sliding else None,
            rope_local_theta=local_theta if sliding else None,
            architecture=arch,
            **_hf_moe(c, arch),
        )
    except KeyError as e:
        raise ValueError(f"HF config is missing required field {e.args[0]!r}") from None


# GGUF architecture -> the HF architecture whose lowering it gets.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM"}


def _gguf_moe(arch: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The experts of a GGUF: llama.cpp writes Mixtral as architecture llama with `expert_count`
    (softmax over the chosen k), and qwen3moe with the experts' own `expert_feed_forward_length` and
    the chosen weights renormalized (llama.cpp's norm_w; `expert_weights_norm` where the file says)."""
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    moe = dict(num_experts=experts, num_experts_per_tok=int(fields[f"{arch}.expert_used_count"]))
    if arch == "qwen3moe":
        return moe | dict(moe_intermediate_size=int(fields[f"{arch}.expert_feed_forward_length"]),
                          norm_topk_prob=bool(fields.get(f"{arch}.expert_weights_norm", True)))
    return moe | dict(router_scoring="topk_softmax", architecture="MixtralForCausalLM")


def _gguf_gemma(arch: str, fields: Mapping[str, Any], num_layers: int, hidden: int, heads: int,
                head_dim: int) -> dict[str, Any]:
    """What a Gemma GGUF leaves out and llama.cpp fills in from the architecture: the sliding
    pattern (Gemma 2 every other layer, Gemma 3 five of six), Gemma 3's 10k RoPE base on sliding
    layers, and query_pre_attn_scalar (head_dim, but hidden / heads for the 27B models: 46 layers
    for Gemma 2, 62 for Gemma 3)."""
    pattern = 2 if arch == "gemma2" else 6
    big = num_layers == (46 if arch == "gemma2" else 62)
    return dict(
        norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=float(hidden ** 0.5),
        query_pre_attn_scalar=float(hidden // heads if big else head_dim), qk_norm=arch == "gemma3",
        attn_logit_softcap=fields.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=fields.get(f"{arch}.final_logit_softcapping"),
        sliding_window=int(fields[f"{arch}.attention.sliding_window"]),
        layer_types=tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers)),
        rope_local_theta=10000.0 if arch == "gemma3" else None)


def config_from_gguf_fields(fields: Mapping[str, Any], name: str = "gguf") -> ModelConfig:
    """Builds a ModelConfig from decoded GGUF metadata (key -> python value)."""
    arch = fields.get("general.architecture", "llama")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

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
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    num_layers = int(get("block_count"))
    scaling = None
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = _freeze_scaling({"rope_type": scaling_type,
                                   "factor": float(fields.get(f"{arch}.rope.scaling.factor", 1.0))})
    family = {}
    if arch in ("gemma2", "gemma3"):
        family = _gguf_gemma(arch, fields, num_layers, hidden, heads, head_dim)
    elif arch in ("qwen3", "qwen3moe"):
        family = dict(qk_norm=True)
    family = dict(architecture=GGUF_ARCHITECTURES[arch]) | family | _gguf_moe(arch, fields)
    return ModelConfig(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_q_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=bool(fields.get("_tied", False)),
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(fields.get(f"{arch}.context_length", 2048)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        **family,
    )
