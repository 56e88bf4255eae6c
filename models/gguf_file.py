"""GGUF files: the header index (parsed once and cached per file), a tensor's bytes in the mapped file,
the model config a header describes, and the loader (load_gguf): each tensor's f32 values computed
when read (DequantizedTensor), and each matrix in a block format of ir.blocks (Q4_0, Q4_1, Q8_0, and
Q4_K, Q5_K and Q6_K, read as tiles only) kept as the file's own blocks (Q5_0's rewritten as the Q8_0
blocks of the same values), uint8 [rows of the file's matrix, row bytes] under
`blocks_name(name, format)`: the matmuls read those (passes.gguf_blocks). models.weights re-exports
what its callers use."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ir.blocks import KEPT_FORMAT_OF_TYPE, TILE_COLUMNS, TILE_ONLY_FORMATS, blocks_name, repack_blocks
from models.config import ModelConfig, config_from_gguf_fields
from models.user_cache import user_cache_dir
from models.weight_names import source_names, validate_weights

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
        # A copy, never a view of the file: an F32 tensor (a norm) handed to the device as a view
        # would keep the whole mapping, every page the tiles' packing read, resident (636 MiB of a
        # 1B Q4_K_M server's RSS).
        arr = np.array(arr, dtype=np.float32).reshape(self.shape)
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


def _swap_last(arr: np.ndarray) -> np.ndarray:
    """[.., out, in] -> [.., in, out]: a matrix transposed, each expert of a stack on its own."""
    return np.ascontiguousarray(np.swapaxes(arr, -1, -2))
