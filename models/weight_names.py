"""What every weight is called in each file format, and the check that a set of weights fits a
config: one declarative table (`WEIGHT_MAP`), as gpt-fast keeps it."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ir.blocks import KEPT_FORMATS, split_blocks_name
from models.config import ModelConfig
from models.llama import weight_shapes

# canonical name -> (HF safetensors name, GGUF name, transposed?). `{}` is the layer index.
# "transposed" means the file stores nn.Linear's [out, in] and we keep [in, out].
WEIGHT_MAP: dict[str, tuple[str, str, bool]] = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight", False),
    "layers.{}.attn_norm": ("model.layers.{}.input_layernorm.weight", "blk.{}.attn_norm.weight", False),
    "layers.{}.wq": ("model.layers.{}.self_attn.q_proj.weight", "blk.{}.attn_q.weight", True),
    "layers.{}.wk": ("model.layers.{}.self_attn.k_proj.weight", "blk.{}.attn_k.weight", True),
    "layers.{}.wv": ("model.layers.{}.self_attn.v_proj.weight", "blk.{}.attn_v.weight", True),
    "layers.{}.bq": ("model.layers.{}.self_attn.q_proj.bias", "blk.{}.attn_q.bias", False),
    "layers.{}.bk": ("model.layers.{}.self_attn.k_proj.bias", "blk.{}.attn_k.bias", False),
    "layers.{}.bv": ("model.layers.{}.self_attn.v_proj.bias", "blk.{}.attn_v.bias", False),
    "layers.{}.q_norm": ("model.layers.{}.self_attn.q_norm.weight", "blk.{}.attn_q_norm.weight", False),
    "layers.{}.k_norm": ("model.layers.{}.self_attn.k_norm.weight", "blk.{}.attn_k_norm.weight", False),
    "layers.{}.wo": ("model.layers.{}.self_attn.o_proj.weight", "blk.{}.attn_output.weight", True),
    "layers.{}.post_attn_norm": ("model.layers.{}.post_attention_layernorm.weight",
                                 "blk.{}.post_attention_norm.weight", False),
    "layers.{}.mlp_norm": ("model.layers.{}.post_attention_layernorm.weight", "blk.{}.ffn_norm.weight", False),
    "layers.{}.w_gate": ("model.layers.{}.mlp.gate_proj.weight", "blk.{}.ffn_gate.weight", True),
    "layers.{}.w_up": ("model.layers.{}.mlp.up_proj.weight", "blk.{}.ffn_up.weight", True),
    "layers.{}.w_down": ("model.layers.{}.mlp.down_proj.weight", "blk.{}.ffn_down.weight", True),
    "layers.{}.post_mlp_norm": ("model.layers.{}.post_feedforward_layernorm.weight", "blk.{}.post_ffw_norm.weight",
                                False),
    # Mixture of experts (Qwen3-MoE's HF names; Mixtral's below): the router, and each layer's experts
    # stacked [E, in, out] from one file tensor per expert (`{{}}`: the expert's index) or per layer (GGUF).
    "layers.{}.router": ("model.layers.{}.mlp.gate.weight", "blk.{}.ffn_gate_inp.weight", True),
    "layers.{}.experts_gate": ("model.layers.{}.mlp.experts.{{}}.gate_proj.weight", "blk.{}.ffn_gate_exps.weight", True),
    "layers.{}.experts_up": ("model.layers.{}.mlp.experts.{{}}.up_proj.weight", "blk.{}.ffn_up_exps.weight", True),
    "layers.{}.experts_down": ("model.layers.{}.mlp.experts.{{}}.down_proj.weight", "blk.{}.ffn_down_exps.weight",
                               True),
    "final_norm": ("model.norm.weight", "output_norm.weight", False),
    "lm_head": ("lm_head.weight", "output.weight", True),
}
# With sandwich norms (Gemma), HF's `post_attention_layernorm` is the norm on the attention's
# output, and the MLP's input norm is `pre_feedforward_layernorm`.
SANDWICH_HF_NAMES = {"layers.{}.mlp_norm": "model.layers.{}.pre_feedforward_layernorm.weight"}
# Mixtral's checkpoints name the MoE block `block_sparse_moe` and its experts' matrices w1 (gate), w3 (up), w2 (down).
MIXTRAL_HF_NAMES = {"layers.{}.router": "model.layers.{}.block_sparse_moe.gate.weight",
                    "layers.{}.experts_gate": "model.layers.{}.block_sparse_moe.experts.{{}}.w1.weight",
                    "layers.{}.experts_up": "model.layers.{}.block_sparse_moe.experts.{{}}.w3.weight",
                    "layers.{}.experts_down": "model.layers.{}.block_sparse_moe.experts.{{}}.w2.weight"}
# The fused layout of transformers 5 (its modules' own state_dict, both families): per layer
# gate_up_proj [E, 2I, H], the gate half first, and down_proj [E, H, I], and the router under
# `mlp.gate` (Mixtral's too). Canonical name -> (tensor, which half of its rows: 0 gate, 1 up, None all).
FUSED_EXPERT_HF_NAMES = {"layers.{}.router": ("model.layers.{}.mlp.gate.weight", None),
                         "layers.{}.experts_gate": ("model.layers.{}.mlp.experts.gate_up_proj", 0),
                         "layers.{}.experts_up": ("model.layers.{}.mlp.experts.gate_up_proj", 1),
                         "layers.{}.experts_down": ("model.layers.{}.mlp.experts.down_proj", None)}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for every tensor `config` needs: the lowering's own table."""
    return weight_shapes(config)


def pattern_of(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) == 3:
        return f"layers.{{}}.{parts[2]}", int(parts[1])
    return name, None


def file_name(canon: str, fmt: str, sandwich_norms: bool = False, architecture: str | None = None) -> tuple[str, bool]:
    """(name in a file of format 'hf' or 'gguf', transposed?) of canonical weight `canon`. A stacked
    expert weight's HF name keeps a `{}` for the expert's index (`expert_names`); "transposed" swaps
    the last two axes (each expert's [out, in] in the file)."""
    pattern, layer = pattern_of(canon)
    hf, gguf, transposed = WEIGHT_MAP[pattern]
    if fmt == "hf" and sandwich_norms:
        hf = SANDWICH_HF_NAMES.get(pattern, hf)
    if fmt == "hf" and architecture == "MixtralForCausalLM":
        hf = MIXTRAL_HF_NAMES.get(pattern, hf)
    src = {"hf": hf, "gguf": gguf}[fmt]
    return (src if layer is None else src.format(layer)), transposed


def source_names(config: ModelConfig, fmt: str) -> dict[str, tuple[str, bool]]:
    """Canonical name -> (name in the file, transposed?) for fmt 'hf' or 'gguf'."""
    return {name: file_name(name, fmt, config.sandwich_norms, config.architecture) for name in expected_shapes(config)}


def expert_names(src: str, num_experts: int) -> list[str]:
    """The per-expert file names of a stacked expert weight's name (itself alone if it has no `{}`)."""
    return [src.format(e) for e in range(num_experts)] if "{}" in src else [src]


def fused_expert_name(canon: str) -> tuple[str, int | None] | None:
    """(transformers-5 fused tensor, half) holding stacked expert weight `canon`, or None."""
    pattern, layer = pattern_of(canon)
    if pattern not in FUSED_EXPERT_HF_NAMES:
        return None
    name, half = FUSED_EXPERT_HF_NAMES[pattern]
    return name.format(layer), half


def validate_weights(weights: Mapping[str, np.ndarray], config: ModelConfig, source: str = "weights",
                     names: Mapping[str, str] | None = None) -> None:
    """Raises ValueError naming the tensor if one is missing, unexpected, or has the wrong shape."""
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        src = f" ({names[name]})" if names and name in names else ""
        if name not in weights:
            raise ValueError(f"{source}: missing tensor {name!r}{src}")
        actual = tuple(weights[name].shape)
        if actual != shape:
            raise ValueError(f"{source}: tensor {name!r}{src} has shape {actual}, expected {shape} "
                             f"for config {config.name!r}")
    for key in weights:  # GGUF blocks: [rows of the file's matrix, row bytes]
        split = split_blocks_name(key)
        if split is None:
            continue
        name, fmt = split
        want = None
        if name in shapes and len(shapes[name]) == 2:
            rows, k = shapes[name] if name == "embed" else shapes[name][::-1]  # the file's [out, in]
            want = (rows, KEPT_FORMATS[fmt].row_bytes(k))
        if want is None or tuple(weights[key].shape) != want or weights[key].dtype != np.uint8:
            raise ValueError(f"{source}: {fmt} blocks {key!r} are {weights[key].dtype}{tuple(weights[key].shape)}, "
                             f"expected uint8{want} for config {config.name!r}")
    extra = sorted(k for k in set(weights) - set(shapes) if split_blocks_name(k) is None)
    if extra:
        raise ValueError(f"{source}: unexpected tensors for config {config.name!r}: {extra[:8]}")
