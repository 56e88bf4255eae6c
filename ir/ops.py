"""The op table: every op's shape rule, verifier, and jnp reference implementation."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp

from ir.blocks import (BLOCK_FORMATS, BLOCK_LAYOUTS, BLOCK_VALUES, KEPT_FORMATS, TILE_ACTIVATIONS, TILE_COLUMNS,
                       blocks_shape, dequantize_tiles, gather_tile_rows, round_q8, tile_record_bytes)
from ir.graph import DTYPES, Dim, Node, Shape, freeze_attrs
from ir.int8 import INT8_ACTIVATIONS, w8a8_matmul, weight_only_matmul
from ir.rope import rope_inv_freq


class IRError(ValueError):
    """A node breaks one of its op's rules."""


@dataclass(frozen=True)
class OpDef:
    name: str
    num_inputs: int | None  # None: variadic
    # (input nodes, attrs) -> (shape, dtype); raises IRError naming the broken rule.
    shape_rule: Callable[[Sequence[Node], dict], tuple[Shape, str]]
    # (input arrays, attrs) -> output array.
    impl: Callable[..., Any] | None
    required_attrs: tuple[str, ...] = ()


OPS: dict[str, OpDef] = {}


def op(name: str, num_inputs: int | None, required_attrs: tuple[str, ...] = ()):
    def register(shape_rule):
        OPS[name] = OpDef(name, num_inputs, shape_rule, None, required_attrs)
        return shape_rule
    return register


def impl(name: str):
    def register(fn):
        d = OPS[name]
        OPS[name] = OpDef(d.name, d.num_inputs, d.shape_rule, fn, d.required_attrs)
        return fn
    return register


def infer(op_name: str, inputs: Sequence[Node], attrs: dict) -> tuple[Shape, str]:
    """Checks arity and attributes, then applies the op's shape rule."""
    d = OPS.get(op_name)
    if d is None:
        raise IRError(f"unknown op {op_name!r}")
    if d.num_inputs is not None and len(inputs) != d.num_inputs:
        raise IRError(f"{op_name} takes {d.num_inputs} inputs, got {len(inputs)}")
    for a in d.required_attrs:
        if a not in attrs:
            raise IRError(f"{op_name} requires attribute {a!r}")
    return d.shape_rule(inputs, attrs)


def make_node(op: str, inputs: Iterable[Node] = (), attrs: Mapping[str, Any] | None = None,
              shape: Iterable[Dim] | None = None, dtype: str | None = None) -> Node:
    """Builds a node; shape and dtype come from the op table's shape rule unless given."""
    inputs = tuple(inputs)
    frozen = freeze_attrs(attrs)
    if shape is None or dtype is None:
        s, d = infer(op, inputs, dict(frozen))
        shape = s if shape is None else shape
        dtype = d if dtype is None else dtype
    return Node(op, inputs, frozen, tuple(shape), dtype)


# ---------------------------------------------------------------------------- dim helpers

_SYM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\+(\d+))?$")


def eval_dim(d: Dim, env: dict[str, int]) -> int:
    """Binds a dim: an int, a symbol like `T`, or `S+1`."""
    if isinstance(d, int):
        return d
    m = _SYM.match(d)
    if not m or m.group(1) not in env:
        raise IRError(f"cannot bind dim {d!r} with {env}")
    return env[m.group(1)] + int(m.group(2) or 0)


def bind_shape(shape: Shape, env: dict[str, int]) -> tuple[int, ...]:
    return tuple(eval_dim(d, env) for d in shape)


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise IRError(msg)


def _float(dtype: str) -> bool:
    return dtype in ("f32", "bf16", "f16")


def _rank(n: Node, r: int, what: str) -> None:
    _need(len(n.shape) == r, f"{what} must have rank {r}, got {n.dtype}{_fmt(n.shape)}")


def _same_dim(a: Dim, b: Dim, msg: str) -> None:
    _need(a == b, f"{msg}: {a} != {b}")


def _int_idx(n: Node, what: str) -> None:
    _need(n.dtype == "i32", f"{what} must be i32, got {n.dtype}")


# ---------------------------------------------------------------------------- leaves

@op("input", 0, ("name",))
def _leaf_input(inputs, attrs):
    raise IRError("input nodes carry their own shape")


@op("param", 0, ("name",))
def _leaf_param(inputs, attrs):
    raise IRError("param nodes carry their own shape")


# ---------------------------------------------------------------------------- dense ops

@op("embedding", 2)
def _embedding(inputs, attrs):
    table, ids = inputs
    _rank(table, 2, "embedding table")
    _int_idx(ids, "embedding ids")
    return tuple(ids.shape) + (table.shape[1],), table.dtype


@impl("embedding")
def _embedding_impl(table, ids):
    return jnp.take(table, ids, axis=0)


@op("embedding_tiles", 2, ("format",))
def _embedding_tiles(inputs, attrs):
    tiles, ids = inputs
    fmt = KEPT_FORMATS.get(attrs["format"])
    _need(fmt is not None, f"embedding_tiles format must be one of {sorted(KEPT_FORMATS)}, got {attrs['format']!r}")
    _need(tiles.dtype == "u8" and len(tiles.shape) == 2, f"embedding_tiles' table must be u8 tiles [N / 16, row bytes], "
          f"got {tiles}")
    _int_idx(ids, "embedding_tiles ids")
    rec = tile_record_bytes(fmt.name)
    _need(tiles.shape[1] % rec == 0, f"embedding_tiles' {fmt.name} tile rows must be whole records of {rec} bytes")
    return tuple(ids.shape) + (tiles.shape[1] // rec * BLOCK_VALUES,), "f32"


@impl("embedding_tiles")
def _embedding_tiles_impl(tiles, ids, *, format):
    """The embedding's rows `ids` from its GGUF tiles (ir.blocks.gather_tile_rows): the values of
    the f32 table the loader dequantized, exactly."""
    return gather_tile_rows(tiles, ids, format)


@op("rms_norm", 2, ("eps",))
def _rms_norm(inputs, attrs):
    x, w = inputs
    _rank(w, 1, "rms_norm weight")
    _same_dim(x.shape[-1], w.shape[0], "rms_norm weight size must equal the last dim of x")
    _need(_float(x.dtype), f"rms_norm input must be floating point, got {x.dtype}")
    _need(isinstance(attrs.get("offset", 0.0), int | float), "rms_norm offset must be a number")
    return x.shape, x.dtype


@impl("rms_norm")
def _rms_norm_impl(x, w, *, eps, offset=0.0):
    """Over the last dim (a [T, heads, head_dim] input: each head on its own, Qwen3's and Gemma 3's
    qk-norm), scaled by `offset` + w: Gemma's norms store w and scale by (1 + w)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (w.astype(jnp.float32) + offset)).astype(x.dtype)


@op("matmul", 2)
def _matmul(inputs, attrs):
    x, w = inputs
    _rank(w, 2, "matmul weight")
    _need(len(x.shape) >= 1, "matmul lhs must have rank >= 1")
    k, n = (w.shape[1], w.shape[0]) if attrs.get("transpose_b") else w.shape
    _same_dim(x.shape[-1], k, "matmul contraction dims must agree")
    _need(_float(x.dtype), f"matmul lhs must be floating point, got {x.dtype}")
    return tuple(x.shape[:-1]) + (n,), x.dtype


@impl("matmul")
def _matmul_impl(x, w, *, transpose_b=False):
    w = w.T if transpose_b else w
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


@op("matmul_bf16", 3, required_attrs=("min_rows",))
def _matmul_bf16(inputs, attrs):
    x, w, wb = inputs
    shape, dtype = _matmul((x, w), attrs)
    _rank(wb, 2, "matmul_bf16 bf16 weight")
    _need(wb.dtype == "bf16", f"matmul_bf16's third input must be bf16, got {wb.dtype}")
    _same_dim(wb.shape[0], x.shape[-1], "matmul_bf16's bf16 weight is [in, out]: its rows")
    _same_dim(wb.shape[1], shape[-1], "matmul_bf16's bf16 weight is [in, out]: its columns")
    _need(int(attrs["min_rows"]) >= 1, "matmul_bf16's min_rows must be >= 1")
    return shape, dtype


@impl("matmul_bf16")
def _matmul_bf16_impl(x, w, w_bf16, *, min_rows, transpose_b=False):
    """x @ w. With at least `min_rows` rows (static: a bucket's shape), the product is taken in bf16
    from `w_bf16` ([in, out], w's bf16 copy) with f32 accumulation, where CPUs with bf16 units
    (avx512_bf16, AMX) run 2-3x the f32 GEMM rate; fewer rows keep the f32 weight, whose
    one-row product XLA:CPU runs faster than the bf16 one."""
    if math.prod(x.shape[:-1]) < min_rows:
        return _matmul_impl(x, w, transpose_b=transpose_b)
    y = jnp.matmul(x.astype(jnp.bfloat16), w_bf16, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


@op("matmul_blocks", None, required_attrs=("format", "max_rows"))
def _matmul_blocks(inputs, attrs):
    fmt, layout = KEPT_FORMATS.get(attrs["format"]), attrs.get("layout", "rows")
    _need(fmt is not None, f"matmul_blocks format must be one of {sorted(KEPT_FORMATS)}, got {attrs['format']!r}")
    _need(layout in BLOCK_LAYOUTS, f"matmul_blocks layout must be one of {BLOCK_LAYOUTS}, got {layout!r}")
    _need(layout == "tiles" or fmt.name in BLOCK_FORMATS,
          f"matmul_blocks' {fmt.name} blocks are read as tiles only (layout=\"tiles\"), got layout {layout!r}")
    n = len(inputs)  # tiles: (x, w, tiles), or (x, tiles) in w's place
    _need(n == 3 or (n == 2 and layout == "tiles"), f"matmul_blocks in {layout} takes (x, w, blocks), got {n} inputs")
    x, wb, k = inputs[0], inputs[-1], inputs[0].shape[-1]
    _need(wb.dtype == "u8" and len(wb.shape) == 2, f"matmul_blocks' blocks must be u8 [N, row bytes], got {wb}")
    _need(isinstance(k, int) and k % BLOCK_VALUES == 0, f"matmul_blocks needs K a multiple of {BLOCK_VALUES}, got {k}")
    _need(n == 3 or (_float(x.dtype) and not attrs.get("transpose_b")), "matmul_blocks' tiles alone: float x, no transpose_b")
    shape, dtype = _matmul(inputs[:2], attrs) if n == 3 else ((*x.shape[:-1], wb.shape[0] * TILE_COLUMNS), x.dtype)
    _need(layout == "rows" or shape[-1] % TILE_COLUMNS == 0, f"matmul_blocks' tiles need N a multiple of {TILE_COLUMNS}")
    want = blocks_shape(fmt.name, shape[-1], k, layout)
    _need(tuple(wb.shape) == want, f"matmul_blocks' {fmt.name} blocks in {layout} must be {want}, got {tuple(wb.shape)}")
    _need(int(attrs["max_rows"]) >= 1, "matmul_blocks' max_rows must be >= 1")
    _need((acts := attrs.get("activations", "f32")) in TILE_ACTIVATIONS,
          f"matmul_blocks activations must be one of {TILE_ACTIVATIONS}, got {acts!r}")
    _need(acts == "f32" or layout == "tiles", "matmul_blocks' q8 activations need the tiles layout")
    return shape, dtype


@impl("matmul_blocks")
def _matmul_blocks_impl(x, *weights, format, max_rows, transpose_b=False, layout="rows", activations="f32"):
    """x @ w: (x, w, w_blocks) in the file's rows, which a kernel (cpp) reads in steps of at most
    `max_rows` rows; in tiles (ir.blocks.pack_tiles), read in every step, the same or (x, w_tiles)
    with no f32 copy. This reference multiplies by w, or the tiles' values; q8 activations (tiles
    only) first round x per block of 32 to 8 bits (ir.blocks.round_q8): round_q8(x) @ w."""
    x = round_q8(x) if activations == "q8" else x
    if len(weights) == 1:
        return _matmul_impl(x, dequantize_tiles(weights[0], format))
    return _matmul_impl(x, weights[0], transpose_b=transpose_b)


@op("matmul_int8", 3)
def _matmul_int8(inputs, attrs):
    x, w, scale = inputs
    _rank(w, 2, "matmul_int8 weight")
    _need(w.dtype == "i8", f"matmul_int8 weight must be i8, got {w.dtype}")
    _rank(scale, 1, "matmul_int8 scale")
    _same_dim(x.shape[-1], w.shape[0], "matmul_int8 contraction dims must agree")
    _same_dim(scale.shape[0], w.shape[1], "matmul_int8 needs one scale per output channel")
    _need(attrs.get("activations") in (None, INT8_ACTIVATIONS),
          f"matmul_int8 activations must be absent or {INT8_ACTIVATIONS!r}, got {attrs.get('activations')!r}")
    return tuple(x.shape[:-1]) + (w.shape[1],), x.dtype


@impl("matmul_int8")
def _matmul_int8_impl(x, w, scale, *, activations=None):
    if activations is None:
        return weight_only_matmul(x, w, scale)  # weight-only int8 (ir.int8)
    return w8a8_matmul(x, w, scale)  # activations="i8": W8A8 (ir.int8)


def _broadcastable_suffix(a: Shape, b: Shape) -> bool:
    return len(b) <= len(a) and tuple(a[len(a) - len(b):]) == tuple(b)


@op("add", 2)
def _add(inputs, attrs):
    a, b = inputs
    _need(_broadcastable_suffix(a.shape, b.shape),
          f"add operands must match or the second must be a suffix of the first: "
          f"{_fmt(a.shape)} vs {_fmt(b.shape)}")
    _need(a.dtype == b.dtype, f"add dtypes must agree: {a.dtype} vs {b.dtype}")
    return a.shape, a.dtype


@impl("add")
def _add_impl(a, b):
    return a + b


@op("mul", 2)
def _mul(inputs, attrs):
    a, b = inputs
    _need(tuple(a.shape) == tuple(b.shape), f"mul operands must have one shape: "
          f"{_fmt(a.shape)} vs {_fmt(b.shape)}")
    _need(a.dtype == b.dtype, f"mul dtypes must agree: {a.dtype} vs {b.dtype}")
    return a.shape, a.dtype


@impl("mul")
def _mul_impl(a, b):
    return a * b


def _elementwise_f32(name: str, fn) -> None:
    """A one-input op on floating point values that keeps the shape and dtype, computed in f32."""

    def shape_rule(inputs, attrs):
        (x,) = inputs
        _need(_float(x.dtype), f"{name} input must be floating point, got {x.dtype}")
        return x.shape, x.dtype

    op(name, 1)(shape_rule)
    impl(name)(lambda x: fn(x.astype(jnp.float32)).astype(x.dtype))


_elementwise_f32("silu", jax.nn.silu)
# GELU with the tanh approximation (HF's gelu_pytorch_tanh): Gemma's gated MLP.
_elementwise_f32("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True))


@op("softcap", 1, ("cap",))
def _softcap(inputs, attrs):
    (x,) = inputs
    _need(_float(x.dtype), f"softcap input must be floating point, got {x.dtype}")
    cap = attrs["cap"]
    _need(isinstance(cap, int | float) and not isinstance(cap, bool) and cap > 0,
          f"softcap cap must be a positive number, got {cap!r}")
    return x.shape, x.dtype


@impl("softcap")
def _softcap_impl(x, *, cap):
    """cap * tanh(x / cap), in f32: Gemma 2's attention-score and final-logit softcapping."""
    return (jnp.tanh(x.astype(jnp.float32) / cap) * cap).astype(x.dtype)


@op("scale", 1, ("value",))
def _scale(inputs, attrs):
    (x,) = inputs
    _need(_float(x.dtype), f"scale input must be floating point, got {x.dtype}")
    return x.shape, x.dtype


@impl("scale")
def _scale_impl(x, *, value):
    return x * jnp.asarray(value, x.dtype)


def _sym_product(shape: Shape) -> tuple[int, tuple[str, ...]]:
    n, syms = 1, []
    for d in shape:
        if isinstance(d, int):
            n *= d
        else:
            syms.append(d)
    return n, tuple(sorted(syms))


@op("reshape", 1, ("shape",))
def _reshape(inputs, attrs):
    (x,) = inputs
    new = tuple(attrs["shape"])
    _need(sum(isinstance(d, str) for d in new) <= 1, "reshape allows at most one symbolic dim")
    _need(_sym_product(x.shape) == _sym_product(new),
          f"reshape must keep the element count: {_fmt(x.shape)} -> {_fmt(new)}")
    return new, x.dtype


@impl("reshape")
def _reshape_impl(x, *, shape):
    return x.reshape(tuple(-1 if isinstance(d, str) else d for d in shape))


@op("slice", 1, ("start", "stop"))
def _slice(inputs, attrs):
    (x,) = inputs
    start, stop = attrs["start"], attrs["stop"]
    last = x.shape[-1]
    _need(isinstance(last, int), "slice works on a concrete last dim")
    _need(0 <= start < stop <= last, f"slice [{start}:{stop}] out of range for last dim {last}")
    return tuple(x.shape[:-1]) + (stop - start,), x.dtype


@impl("slice")
def _slice_impl(x, *, start, stop):
    return x[..., start:stop]


@op("rope", 2, ("theta",))
def _rope(inputs, attrs):
    x, pos = inputs
    _rank(x, 3, "rope input [T, heads, head_dim]")
    _rank(pos, 1, "rope positions")
    _int_idx(pos, "rope positions")
    _same_dim(x.shape[0], pos.shape[0], "rope needs one position per token")
    _need(isinstance(x.shape[2], int) and x.shape[2] % 2 == 0, "rope head_dim must be even")
    return x.shape, x.dtype


@impl("rope")
def _rope_impl(x, pos, *, theta, scaling=None):
    # Rotate-half convention (HF Llama): pairs are (i, i + head_dim/2).
    d = x.shape[-1]
    inv = rope_inv_freq(d, theta, scaling)
    ang = pos.astype(jnp.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, None, :]
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


@op("gather_rows", 2)
def _gather_rows(inputs, attrs):
    x, idx = inputs
    _rank(idx, 1, "gather_rows indices")
    _int_idx(idx, "gather_rows indices")
    return (idx.shape[0],) + tuple(x.shape[1:]), x.dtype


@impl("gather_rows")
def _gather_rows_impl(x, idx):
    return jnp.take(x, idx, axis=0, mode="clip")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise IRError(f"unknown dtype {dtype!r}; known: {DTYPES}")
