"""The numerics of matmul_blocks: weights kept in a GGUF file's own quantization blocks.

A GGUF tensor of a quantized type stores each output column's weights (a row of the file's
[out, in] matrix) as blocks of 32 values along the input axis. Three simple block formats are
read here, each named by its GGML type id:

- Q4_0: f16 d, 16 bytes of 4-bit q;           value = d * (q - 8)
- Q4_1: f16 d, f16 m, 16 bytes of 4-bit q;    value = d * q + m
- Q8_0: f16 d, 32 int8 q;                     value = d * q

A byte of 4-bit q holds value j of its block in its low nibble and value j + 16 in its high one.
A weight in blocks is a u8 array [N, K / 32 * block bytes]: N output columns, K inputs.

Three K-quants are read as tiles only (TILE_ONLY_FORMATS: the rows kernel has no path for them),
each super-block of 256 values repacked exactly, value for value, into tile records per block of 32:

- Q4_K: 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales sc and mins m for its 8 sub-blocks
  of 32, 128 bytes of 4-bit q; value = (d * sc_j) * q - (dmin * m_j). d * sc_j and dmin * m_j are
  exact in f32 (not in f16), so each sub-block is a Q4_1 block with f32 d and m: its tile record
  is Q4_1's with f32 scales (1.0 byte per value where the file has 0.5625).
- Q5_K: 176 bytes: Q4_K's d, dmin and scales, 32 bytes qh (bit j of byte l: the fifth bit of value
  32j + l), 128 bytes of low nibbles (as Q4_K's); value = (d * sc_j) * q - (dmin * m_j), q of 5
  bits. Its record is Q4_K's f32 d and c with the values q as bytes, in Q8_0's layout (1.25 bytes
  per value; the file 0.6875).
- Q6_K: 210 bytes: ql[128] (low nibbles: value 128h + 64s + l in nibble s of byte 64h + l), qh[64]
  (2 high bits: value 128h + 32s + l in bits 2s of byte 32h + l), int8 scales[16] (one per 16
  values), f16 d last; value = d * scale_j * (q - 32), q of 6 bits. A block of 32 holds two
  sub-blocks, so its record keeps the file's f16 d and both int8 scales per column (d * scale is
  exact in f32, made in the kernel) and the values q as bytes in Q8_0's layout (1.125 bytes per
  value; the file 0.8203).

Loaders put a tensor's blocks beside its f32 values under `blocks_name(name, format)`
(models.weights), and the gguf_blocks pass gives the matmuls whose weights have them a second
input, read by decode steps (runtime.worker.kernels), or tiles in their place, and where the
embedding's tiles stand alone the lookup gathers its rows from them (gather_tile_rows). The f32
values are the blocks dequantized, so either input gives x @ w.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

BLOCK_VALUES = 32  # values per block of a tile record, and of every rows format here


@dataclass(frozen=True)
class BlockFormat:
    name: str
    type_id: int  # GGML's type id (gguf.GGMLQuantizationType)
    block_bytes: int
    block_values: int = BLOCK_VALUES  # values per block of the file (a K-quant's super-block: 256)
    # a tile record's bytes of scales per column: f16 d (2), f16 d and m (4; Q6_K: f16 d, two int8
    # scales), f32 d and c (8)
    scale_bytes: int = 2
    value_bits: int = 4  # a tile record's bits per value

    def row_bytes(self, k: int) -> int:
        """Bytes of one output column's K weights."""
        return k // self.block_values * self.block_bytes


# Formats the rows kernel (cpp/block_matmul.cc) and the tiles read.
BLOCK_FORMATS = {f.name: f for f in (BlockFormat("q4_0", 2, 18), BlockFormat("q4_1", 3, 20, scale_bytes=4),
                                      BlockFormat("q8_0", 8, 34, value_bits=8))}
# Formats read as tiles only (pack_tiles; the rows kernel has no path for them).
# Q6_K's scale bytes per column: its f16 d and the int8 scales of the block's two sub-blocks of 16.
TILE_ONLY_FORMATS = {f.name: f for f in (BlockFormat("q4_k", 12, 144, 256, scale_bytes=8),
                                          BlockFormat("q5_k", 13, 176, 256, scale_bytes=8, value_bits=8),
                                          BlockFormat("q6_k", 14, 210, 256, scale_bytes=4, value_bits=8))}
KEPT_FORMATS = BLOCK_FORMATS | TILE_ONLY_FORMATS  # every format a loader keeps blocks of
FORMAT_OF_TYPE = {f.type_id: f.name for f in KEPT_FORMATS.values()}  # GGML types kept as they are
# GGML types whose blocks are rewritten, value for value, into a format above (repack_blocks): Q5_0
# (f16 d, 4 bytes of high bits qh, 16 bytes of low nibbles; value = d * (q - 16), q of 5 bits) is
# Q8_0 with q - 16 as its int8, so Gemma 3's Q5_0 projections read the Q8_0 kernels.
REPACKED_TYPES = {6: "q8_0"}
KEPT_FORMAT_OF_TYPE = FORMAT_OF_TYPE | REPACKED_TYPES


# A weights dict's key for tensor `name`'s blocks: "<name>:<format>" (":" is in no tensor's name).
_SEP = ":"


def blocks_name(name: str, fmt: str) -> str:
    return f"{name}{_SEP}{fmt}"


def split_blocks_name(key: str) -> tuple[str, str] | None:
    """(tensor name, format) of a blocks key; None for a plain tensor's key."""
    name, sep, fmt = key.rpartition(_SEP)
    return (name, fmt) if sep and fmt in KEPT_FORMATS else None


def dequantize_blocks(w, fmt: str):
    """w u8 [..., N, K / 32 * block bytes] -> f32 [..., N, K], in jnp: the formats' values, which the
    tests hold the loader and the C++ kernel to."""
    f = BLOCK_FORMATS[fmt]
    lead = w.shape[:-1]
    blocks = w.reshape(lead + (w.shape[-1] // f.block_bytes, f.block_bytes))
    d = _half(blocks[..., 0:2])
    if fmt == "q8_0":
        q = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
        vals = d * q
    else:
        qs = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]
        q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(jnp.float32)
        vals = d * q + _half(blocks[..., 2:4]) if fmt == "q4_1" else d * (q - 8.0)
    return vals.reshape(lead + (-1,))


def repack_blocks(rows, type_id: int):
    """A GGUF tensor's rows of blocks (u8 [N, row bytes]) in KEPT_FORMAT_OF_TYPE[type_id], in numpy:
    the rows themselves for a format of KEPT_FORMATS, Q5_0's as the Q8_0 blocks of the same values."""
    import numpy as np

    rows = np.asarray(rows, np.uint8)
    if type_id in FORMAT_OF_TYPE:
        return rows
    if REPACKED_TYPES.get(type_id) != "q8_0" or rows.shape[-1] % 22:
        raise ValueError(f"repack_blocks: no repacking of GGML type {type_id} rows {rows.shape}")
    b = rows.reshape(rows.shape[:-1] + (-1, 22))
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [..., blocks, 1]: bit j is value j's fifth bit
    qs = b[..., 6:]
    j = np.arange(16, dtype=np.uint32)
    lo = (qs & 0x0F) | (((qh >> j) & 1) << 4).astype(np.uint8)
    hi = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4).astype(np.uint8)
    q = (np.concatenate([lo, hi], axis=-1).astype(np.int16) - 16).astype(np.int8)
    out = np.concatenate([b[..., 0:2], q.view(np.uint8)], axis=-1)
    return np.ascontiguousarray(out.reshape(rows.shape[:-1] + (-1,)))


def _half(two_bytes):
    """f16 from two little-endian bytes [..., 2] -> f32 [..., 1]."""
    bits = two_bytes[..., 0:1].astype(jnp.uint16) | (two_bytes[..., 1:2].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)



# Tiles: a weight's blocks repacked for int8 products (runtime/worker/cpp/tile_matmul.cc), with the
# activations rounded to 8 bits per block of 32 (round_q8), as llama.cpp multiplies GGUF blocks.
TILE_ACTIVATIONS = ("f32", "q8")  # matmul_blocks' activations attr: as they are, or ir.blocks.round_q8
BLOCK_LAYOUTS = ("rows", "tiles")  # matmul_blocks' layout attr: the file's rows, or pack_tiles
TILE_COLUMNS = 16  # output columns per tile
TILE_BIAS = {"q4_0": 8, "q8_0": 128, "q6_k": 32}  # records without c: value = d * (q - bias), c = -bias * d
# The dtypes of a tile record's scale fields, each for the 16 columns in turn (pack_tiles).
_SCALE_FIELDS = {"q4_0": ("<f2",), "q8_0": ("<f2",), "q4_1": ("<f2", "<f2"), "q4_k": ("<f4", "<f4"),
                 "q5_k": ("<f4", "<f4"), "q6_k": ("<f2", "i1", "i1")}


def blocks_shape(fmt: str, n: int, k: int, layout: str = "rows") -> tuple[int, int]:
    """The u8 shape of an [N outputs, K inputs] weight's blocks in `layout`."""
    if layout == "tiles":
        return n // TILE_COLUMNS, k // BLOCK_VALUES * tile_record_bytes(fmt)
    return n, KEPT_FORMATS[fmt].row_bytes(k)


def tile_record_bytes(fmt: str) -> int:
    """Bytes of one tile's record for one block of 32 inputs: the 16 columns' scales (pack_tiles),
    then the 16 x 32 unsigned values q (4 or 8 bits each)."""
    f = KEPT_FORMATS[fmt]
    return TILE_COLUMNS * f.scale_bytes + TILE_COLUMNS * BLOCK_VALUES * f.value_bits // 8


def pack_tiles(blocks, fmt: str):
    """GGUF blocks u8 [N, row bytes] of format `fmt` (N a multiple of 16) -> tiles u8
    [N / 16, K / 32 * tile_record_bytes(fmt)], in numpy: for each tile of 16 columns and each block
    of 32 inputs, the columns' scales, value = d * q + c:
      - Q4_0 and Q8_0: d f16[16] (c = -bias * d: -8 d, -128 d);
      - Q4_1: d f16[16], then c f16[16] (the file's m);
      - Q4_K, Q5_K: d f32[16], then c f32[16] (d * sc and -dmin * m, exact in f32, not in f16);
      - Q6_K: the super-block's d f16[16], then the int8 scales of inputs 0-15 [16] and of inputs
        16-31 [16]: value = d * scale * (q - 32), d * scale exact in f32;
    then q in the order the int8 product reads it: 4-bit formats keep Q4's nibble bytes (byte t:
    value t low, value t + 16 high), a vector j of 64 bytes holding byte 4j + t of column col's block
    at 4 * col + t; 8-bit ones (Q8_0's values + 128, unsigned; Q5_K's and Q6_K's q) a vector j
    holding value 4j + t of column col at 4 * col + t. The values are the blocks' exactly, from the
    file's own bytes of scales (Q4_K's and Q5_K's dequantization aside): d * q + c =
    dequantize_blocks (for the K-quants, gguf's dequantization)."""
    import numpy as np

    f = KEPT_FORMATS[fmt]
    blocks = np.asarray(blocks, np.uint8)
    n, row = blocks.shape
    if n % TILE_COLUMNS or row % f.block_bytes:
        raise ValueError(f"pack_tiles needs [N, K / {f.block_values} * {f.block_bytes}] {fmt} blocks with N a "
                         f"multiple of {TILE_COLUMNS}, got {blocks.shape}")
    fields, q = _blocks_of_32(blocks.reshape(n, row // f.block_bytes, f.block_bytes), fmt)  # [N, nb](, bytes)
    nb, g = q.shape[1], n // TILE_COLUMNS
    vectors = q.shape[-1] // 4
    q = q.reshape(g, TILE_COLUMNS, nb, vectors, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, -1)
    scales = [np.ascontiguousarray(a.reshape(g, TILE_COLUMNS, nb).transpose(0, 2, 1).astype(dtype)).view(np.uint8)
              for a, dtype in zip(fields, _SCALE_FIELDS[fmt])]  # from the file's f16s, int8s or exact f32s
    return np.ascontiguousarray(np.concatenate([*scales, q], axis=-1).reshape(g, -1))


def _blocks_of_32(b, fmt: str):
    """A format's blocks u8 [N, blocks, block bytes] as blocks of 32 values, in numpy: the record's
    scale fields (_SCALE_FIELDS: each [N, K / 32], values exact in its dtype) and q u8 [N, K / 32,
    bytes] in the tile format's byte layout (pack_tiles)."""
    import numpy as np

    half = lambda two: np.ascontiguousarray(two).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    n, nsb = b.shape[:2]
    if fmt in ("q4_k", "q5_k"):
        sc, m = _q4_k_scales(b[..., 4:16])  # [N, nsb, 8] each, 6 bits
        d = half(b[..., 0:2])[..., None] * sc.astype(np.float32)  # exact: 11-bit x 6-bit mantissas
        c = -(half(b[..., 2:4])[..., None] * m.astype(np.float32))
        qs = b[..., -128:].reshape(n, nsb, 4, 1, 32)  # 32 bytes per pair of sub-blocks: 2i low, 2i + 1 high
        v = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, nsb * 8, 32)
        if fmt == "q4_k":
            return (d.reshape(n, -1), c.reshape(n, -1)), v[..., :16] | (v[..., 16:] << 4)
        bit = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)  # qh's bit j: sub-block j's fifth bits
        high = (b[..., 16:48].reshape(n, nsb, 1, 32) >> bit) & 1
        return (d.reshape(n, -1), c.reshape(n, -1)), v | (high.reshape(n, nsb * 8, 32) << 4)
    if fmt == "q6_k":
        low = (b[..., :128].reshape(n, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        high = (b[..., 128:192].reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        q = low.reshape(n, nsb * 8, 32) | (high.reshape(n, nsb * 8, 32) << 4)
        scale = b[..., 192:208].view(np.int8).reshape(n, nsb * 8, 2)  # [N, K / 32, sub-block]
        d = np.repeat(half(b[..., 208:210]), 8, axis=1)
        return (d, scale[..., 0], scale[..., 1]), q
    d = half(b[..., 0:2])
    if fmt == "q4_1":
        return (d, half(b[..., 2:4])), b[..., 4:]
    if fmt == "q4_0":
        return (d,), b[..., 2:]
    return (d,), b[..., 2:] ^ np.uint8(0x80)  # Q8_0: int8 + 128 as unsigned


def _q4_k_scales(s):
    """Q4_K's 12 bytes of scales u8 [..., 12] -> (sc, m) u8 [..., 8]: sub-blocks 0-3 take the low 6
    bits of bytes 0-3 (sc) and 4-7 (m); sub-blocks 4-7 their low 4 bits from bytes 8-11 (sc low
    nibble, m high) and their top 2 bits from the top bits of bytes 0-3 (sc) and 4-7 (m)."""
    import numpy as np

    a, b, lo = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (lo & 0x0F) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 0x3F, (lo >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def dequantize_tiles(t, fmt: str):
    """Tiles u8 [..., N / 16, K / 32 * tile_record_bytes(fmt)] (pack_tiles) -> f32 [..., K, N], in
    jnp: d * q + c per value, the same values as dequantize_blocks (for the K-quants gguf's
    dequantization) of the blocks they were packed from (d * q is exact in f32, and the one sum
    rounds as theirs does), laid out for x @ w."""
    f = KEPT_FORMATS[fmt]
    lead, (g, row) = t.shape[:-2], t.shape[-2:]
    rec_bytes = tile_record_bytes(fmt)
    nb = row // rec_bytes
    rec = t.reshape(lead + (g, nb, rec_bytes))

    fields, at = [], 0
    for dtype in _SCALE_FIELDS[fmt]:  # each field -> f32 [..., g, nb, 16]
        width = jnp.dtype(dtype).itemsize
        b = rec[..., at:at + TILE_COLUMNS * width].reshape(lead + (g, nb, TILE_COLUMNS, width))
        fields.append(jax.lax.bitcast_convert_type(b[..., 0] if width == 1 else b, jnp.dtype(dtype)).astype(jnp.float32))
        at += TILE_COLUMNS * width
    q = rec[..., at:]
    vectors = q.shape[-1] // (4 * TILE_COLUMNS)  # of 64 bytes: byte 4 * col + t of vector j
    q = q.reshape(lead + (g, nb, vectors, TILE_COLUMNS, 4))
    q = jnp.moveaxis(q, -2, -3).reshape(lead + (g, nb, TILE_COLUMNS, 4 * vectors))  # [.., col, 4j + t]
    if f.value_bits == 4:  # low nibbles are values 0-15 of the block, high ones 16-31
        q = jnp.concatenate([q & 0x0F, q >> 4], axis=-1)
    q = q.astype(jnp.float32)
    if fmt == "q6_k":  # d * scale per sub-block of 16 (exact in f32), times q - 32 (exact)
        d, s0, s1 = fields
        ds = jnp.repeat(jnp.stack([d * s0, d * s1], axis=-1), BLOCK_VALUES // 2, axis=-1)  # [..., 16 col, 32]
        vals = ds * (q - float(TILE_BIAS[fmt]))
    else:
        d = fields[0]
        c = fields[1] if len(fields) == 2 else -float(TILE_BIAS[fmt]) * d
        vals = d[..., None] * q + c[..., None]  # [..., g, nb, 16 col, 32]
    n = len(lead)
    vals = vals.transpose(tuple(range(n)) + (n + 1, n + 3, n, n + 2))  # [..., nb, 32, g, 16 col]
    return vals.reshape(lead + (nb * BLOCK_VALUES, g * TILE_COLUMNS))


def gather_tile_rows(t, ids, fmt: str):
    """Rows `ids` (int [...]) of the [N, K] matrix whose tiles t (u8 [N / 16, K / 32 *
    tile_record_bytes(fmt)], pack_tiles of its file rows) hold -> f32 [..., K], in jnp: an embedding
    lookup from the tiles a tied LM head multiplies by, with no f32 table. Each id's tile is
    dequantized whole (16 rows: dequantize_tiles' values exactly) and its row taken from it."""
    ids = jnp.asarray(ids)
    tiles = jnp.take(t, ids // TILE_COLUMNS, axis=0)  # [..., row bytes]
    vals = dequantize_tiles(tiles[..., None, :], fmt)  # [..., K, 16]
    col = (ids % TILE_COLUMNS)[..., None, None]
    return jnp.take_along_axis(vals, jnp.broadcast_to(col, vals.shape[:-1] + (1,)), axis=-1)[..., 0]


def round_q8(x):
    """x [..., K] (K a multiple of 32) as a tiles product multiplies by it, in jnp: rounded per block
    of 32 to s * xq, with xq = round(x / s) in [-127, 127] and s = max|x| / 127 (llama.cpp's Q8
    activations), in f32."""
    xb = x.astype(jnp.float32).reshape(x.shape[:-1] + (-1, BLOCK_VALUES))
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    return (jnp.round(xb * inv) * (amax / 127.0)).reshape(x.shape).astype(x.dtype)
