"""The numerics of matmul_blocks: weights kept in a GGUF file's own quantization blocks.

A GGUF tensor of a quantized type stores each output column's weights (a row of the file's
[out, in] matrix) as blocks of 32 values along the input axis. Three simple block formats are
read here, each named by its GGML type id:

- Q4_0: f16 d, 16 bytes of 4-bit q;           value = d * (q - 8)
- Q4_1: f16 d, f16 m, 16 bytes of 4-bit q;    value = d * q + m
- Q8_0: f16 d, 32 int8 q;                     value = d * q

A byte of 4-bit q holds value j of its block in its low nibble and value j + 16 in its high one.
A weight in blocks is a u8 array [N, K / 32 * block bytes]: N output columns, K inputs.

Loaders put a tensor's blocks beside its f32 values under `blocks_name(name, format)`
(models.weights), and the gguf_blocks pass gives the matmuls whose weights have them a second
input, read by decode steps (runtime.worker.kernels). The f32 values are the blocks dequantized, so
either input gives x @ w; the blocks are a fifth of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

BLOCK_VALUES = 32  # values per block, in every format here


@dataclass(frozen=True)
class BlockFormat:
    name: str
    type_id: int  # GGML's type id (gguf.GGMLQuantizationType)
    block_bytes: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one output column's K weights."""
        return k // BLOCK_VALUES * self.block_bytes


BLOCK_FORMATS = {f.name: f for f in (BlockFormat("q4_0", 2, 18), BlockFormat("q4_1", 3, 20),
                                      BlockFormat("q8_0", 8, 34))}
FORMAT_OF_TYPE = {f.type_id: f.name for f in BLOCK_FORMATS.values()}

# A weights dict's key for tensor `name`'s blocks: "<name>:<format>" (":" is in no tensor's name).
_SEP = ":"


def blocks_name(name: str, fmt: str) -> str:
    return f"{name}{_SEP}{fmt}"


def split_blocks_name(key: str) -> tuple[str, str] | None:
    """(tensor name, format) of a blocks key; None for a plain tensor's key."""
    name, sep, fmt = key.rpartition(_SEP)
    return (name, fmt) if sep and fmt in BLOCK_FORMATS else None


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


def _half(two_bytes):
    """f16 from two little-endian bytes [..., 2] -> f32 [..., 1]."""
    bits = two_bytes[..., 0:1].astype(jnp.uint16) | (two_bytes[..., 1:2].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)

