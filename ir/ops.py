"""The op table: every op's shape rule, verifier, and jnp reference implementation."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp

from ir.blocks import (BLOCK_FORMATS, BLOCK_LAYOUTS, BLOCK_VALUES, TILE_ACTIVATIONS, TILE_COLUMNS, blocks_shape,
                       dequantize_tiles, round_q8)
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


@op("rms_norm", 2, ("eps",))
def _rms_norm(inputs, attrs):
    x, w = inputs
    _rank(w, 1, "rms_norm weight")
    _same_dim(x.shape[-1], w.shape[0], "rms_norm weight size must equal the last dim of x")
    _need(_float(x.dtype), f"rms_norm input must be floating point, got {x.dtype}")
    return x.shape, x.dtype


@impl("rms_norm")
def _rms_norm_impl(x, w, *, eps):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


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
    fmt, layout = BLOCK_FORMATS.get(attrs["format"]), attrs.get("layout", "rows")
    _need(fmt is not None, f"matmul_blocks format must be one of {sorted(BLOCK_FORMATS)}, got {attrs['format']!r}")
    _need(layout in BLOCK_LAYOUTS, f"matmul_blocks layout must be one of {BLOCK_LAYOUTS}, got {layout!r}")
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


# ---------------------------------------------------------------------------- textbook attention

@op("kv_cache_update", 4)
def _kv_cache_update(inputs, attrs):
    cache, new, seq_ids, pos = inputs
    _rank(cache, 4, "contiguous kv cache [S, L, kv_heads, head_dim]")
    _rank(new, 3, "new kv [T, kv_heads, head_dim]")
    _same_dim(cache.shape[2], new.shape[1], "kv_cache_update kv_heads must agree")
    _same_dim(cache.shape[3], new.shape[2], "kv_cache_update head_dim must agree")
    _int_idx(seq_ids, "kv_cache_update seq_ids")
    _int_idx(pos, "kv_cache_update positions")
    _need(cache.dtype == new.dtype, f"kv_cache_update dtypes must agree: {cache.dtype} vs {new.dtype}")
    return cache.shape, cache.dtype


@impl("kv_cache_update")
def _kv_cache_update_impl(cache, new, seq_ids, pos):
    # Padding tokens carry seq_id == S (out of range) and are dropped.
    return cache.at[seq_ids, pos].set(new, mode="drop")


@op("repeat_kv", 1, ("n_rep",))
def _repeat_kv(inputs, attrs):
    (x,) = inputs
    _need(len(x.shape) >= 2, "repeat_kv needs [..., kv_heads, head_dim]")
    h = x.shape[-2]
    _need(isinstance(h, int), "repeat_kv needs a concrete head count")
    return tuple(x.shape[:-2]) + (h * attrs["n_rep"], x.shape[-1]), x.dtype


@impl("repeat_kv")
def _repeat_kv_impl(x, *, n_rep):
    # q head j reads kv head j // n_rep, as HF's repeat_kv does.
    return jnp.repeat(x, n_rep, axis=-2)


_EINSUM = re.compile(r"^([a-z]+),([a-z]+)->([a-z]+)$")


@op("einsum", 2, ("eq",))
def _einsum(inputs, attrs):
    a, b = inputs
    m = _EINSUM.match(attrs["eq"])
    _need(m is not None, f"einsum equation {attrs['eq']!r} must look like 'ab,bc->ac'")
    sa, sb, so = m.groups()
    _need(len(sa) == len(a.shape) and len(sb) == len(b.shape),
          f"einsum {attrs['eq']!r} does not fit operand ranks {len(a.shape)} and {len(b.shape)}")
    sizes: dict[str, Dim] = {}
    for letters, shape in ((sa, a.shape), (sb, b.shape)):
        for ch, d in zip(letters, shape):
            _need(sizes.setdefault(ch, d) == d, f"einsum {attrs['eq']!r}: dim {ch!r} is {sizes[ch]} and {d}")
    _need(all(ch in sizes for ch in so), f"einsum {attrs['eq']!r}: output letter not in inputs")
    return tuple(sizes[ch] for ch in so), a.dtype


@impl("einsum")
def _einsum_impl(a, b, *, eq):
    return jnp.einsum(eq, a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(a.dtype)


@op("causal_mask", 2)
def _causal_mask(inputs, attrs):
    s, pos = inputs
    _rank(s, 3, "causal_mask scores [T, heads, L]")
    _same_dim(s.shape[0], pos.shape[0], "causal_mask needs one position per token")
    _int_idx(pos, "causal_mask positions")
    return s.shape, s.dtype


@impl("causal_mask")
def _causal_mask_impl(s, pos):
    # Token t of a sequence sees cache slots 0..pos[t]; slots of other sequences are never
    # gathered, so this one mask is both the causal and the varlen mask.
    keep = jnp.arange(s.shape[-1])[None, None, :] <= pos[:, None, None]
    return jnp.where(keep, s, jnp.asarray(-jnp.inf, s.dtype))


_elementwise_f32("softmax", lambda x: jax.nn.softmax(x, axis=-1))


@op("attention", 5, ("scale", "causal", "num_kv_heads", "head_dim"))
def _attention(inputs, attrs):
    q, kc, vc, seq_ids, pos = inputs
    _rank(q, 3, "attention q [T, q_heads, head_dim]")
    _rank(kc, 4, "attention k cache [S, L, kv_heads, head_dim]")
    _need(tuple(kc.shape) == tuple(vc.shape), "attention k and v caches must have one shape")
    _same_dim(kc.shape[2], attrs["num_kv_heads"], "attention num_kv_heads attr must match the cache")
    _same_dim(q.shape[2], attrs["head_dim"], "attention head_dim attr must match q")
    _need(isinstance(q.shape[1], int) and q.shape[1] % attrs["num_kv_heads"] == 0,
          "attention q heads must be a multiple of num_kv_heads")
    _int_idx(seq_ids, "attention seq_ids")
    _int_idx(pos, "attention positions")
    return q.shape, q.dtype


@impl("attention")
def attention_reference(q, k_cache, v_cache, seq_ids, pos, *, scale, causal, num_kv_heads, head_dim):
    """Ragged attention over a contiguous per-sequence cache, accumulating in f32."""
    n_rep = q.shape[1] // num_kv_heads
    k = jnp.take(k_cache, seq_ids, axis=0, mode="clip").astype(jnp.float32)  # [T, L, kvh, D]
    v = jnp.take(v_cache, seq_ids, axis=0, mode="clip").astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(q.shape[0], num_kv_heads, n_rep, head_dim)
    s = jnp.einsum("tgrd,tlgd->tgrl", qf, k) * scale
    if causal:
        keep = jnp.arange(k.shape[1])[None, None, None, :] <= pos[:, None, None, None]
        s = jnp.where(keep, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("tgrl,tlgd->tgrd", p, v)
    return o.reshape(q.shape).astype(q.dtype)


# ---------------------------------------------------------------------------- paged KV

@op("kv_write", 3)
def _kv_write(inputs, attrs):
    pool, new, slots = inputs
    _rank(pool, 4, "kv pool [B, block_size, kv_heads, head_dim]")
    _rank(new, 3, "new kv [T, kv_heads, head_dim]")
    _same_dim(pool.shape[2], new.shape[1], "kv_write kv_heads must agree")
    _same_dim(pool.shape[3], new.shape[2], "kv_write head_dim must agree")
    _same_dim(new.shape[0], slots.shape[0], "kv_write needs one slot per token")
    _int_idx(slots, "kv_write slot_mapping")
    # The pool may be narrower than the new K/V (a bf16 KV cache of an f32 model): written rounded.
    _need(_float(pool.dtype) and _float(new.dtype), f"kv_write needs floating point pool and K/V, got "
          f"{pool.dtype} and {new.dtype}")
    return pool.shape, pool.dtype


@impl("kv_write")
def kv_write_reference(pool, new, slots):
    # slot = block * block_size + offset; padding tokens carry slot -1 and are dropped.
    nb, bs = pool.shape[0], pool.shape[1]
    flat = pool.reshape((nb * bs,) + pool.shape[2:])
    slots = jnp.where(slots < 0, nb * bs, slots)
    flat = flat.at[slots].set(new.astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


@op("paged_attention", 6, ("scale", "num_kv_heads", "block_size", "head_dim"))
def _paged_attention(inputs, attrs):
    q, kp, vp, tables, ctx, cu = inputs
    _rank(q, 3, "paged_attention q [T, q_heads, head_dim]")
    _rank(kp, 4, "paged_attention k pool [B, block_size, kv_heads, head_dim]")
    _need(tuple(kp.shape) == tuple(vp.shape), "paged_attention k and v pools must have one shape")
    _same_dim(kp.shape[1], attrs["block_size"], "paged_attention block_size attr must match the pool")
    _same_dim(kp.shape[2], attrs["num_kv_heads"], "paged_attention num_kv_heads attr must match the pool")
    _same_dim(q.shape[2], attrs["head_dim"], "paged_attention head_dim attr must match q")
    _rank(tables, 2, "paged_attention block_tables [S, M]")
    _rank(ctx, 1, "paged_attention context_lens [S]")
    _same_dim(tables.shape[0], ctx.shape[0], "block_tables and context_lens need one row per sequence")
    for n, what in ((tables, "block_tables"), (ctx, "context_lens"), (cu, "cu_q_lens")):
        _int_idx(n, f"paged_attention {what}")
    return q.shape, q.dtype


@impl("paged_attention")
def paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, cu_q_lens, *, scale,
                              num_kv_heads, block_size, head_dim):
    """The op's jnp reference: gather each token's sequence blocks, mask, softmax in f32.

    The executor's chunked lowering is runtime.worker.kernels.paged_attention_xla; the Pallas kernel's
    own reference is pallas_kernels.paged_attention_reference.
    """
    t = q.shape[0]
    s, m = block_tables.shape
    n_rep = q.shape[1] // num_kv_heads
    tok = jnp.arange(t)
    # Sequence of each token from the ragged query offsets; padding tokens get seq s (clipped).
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, s - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = context_lens[seq] - q_len + (tok - cu_q_lens[seq])
    blocks = jnp.take(block_tables, seq, axis=0)  # [T, M]
    k = jnp.take(k_pool, blocks, axis=0, mode="clip").reshape(t, m * block_size, num_kv_heads, head_dim)
    v = jnp.take(v_pool, blocks, axis=0, mode="clip").reshape(t, m * block_size, num_kv_heads, head_dim)
    qf = q.astype(jnp.float32).reshape(t, num_kv_heads, n_rep, head_dim)
    sc = jnp.einsum("tgrd,tlgd->tgrl", qf, k.astype(jnp.float32)) * scale
    keep = jnp.arange(m * block_size)[None, None, None, :] <= pos[:, None, None, None]
    sc = jnp.where(keep, sc, -jnp.inf)
    # Padding tokens may have no visible slot; keep them finite rather than NaN.
    sc = jnp.where(jnp.any(keep, axis=-1, keepdims=True), sc, 0.0)
    p = jax.nn.softmax(sc, axis=-1)
    o = jnp.einsum("tgrl,tlgd->tgrd", p, v.astype(jnp.float32))
    return o.reshape(q.shape).astype(q.dtype)


@op("copy_blocks", 3)
def _copy_blocks(inputs, attrs):
    pool, src, dst = inputs
    _rank(pool, 4, "copy_blocks pool")
    _int_idx(src, "copy_blocks src")
    _int_idx(dst, "copy_blocks dst")
    return pool.shape, pool.dtype


@impl("copy_blocks")
def _copy_blocks_impl(pool, src, dst):
    # Copy-on-write for n > 1: dst[i] <- src[i]; pairs with dst == -1 are padding.
    dst = jnp.where(dst < 0, pool.shape[0], dst)
    return pool.at[dst].set(jnp.take(pool, src, axis=0, mode="clip"), mode="drop")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise IRError(f"unknown dtype {dtype!r}; known: {DTYPES}")
