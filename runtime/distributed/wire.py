"""The frames of runtime.distributed's control channel (rank 0's device calls and the replies).

A frame: two lengths (header, payload), a JSON header, then the arrays' bytes back to back. The
header describes each value: an ndarray as {"nd": [dtype, shape]}, a tuple as {"tu": [...]}, a
dict as {"di": [[key, value], ...]}; JSON's own types as themselves. No pickle: a follower
decodes only data.
"""

from __future__ import annotations

import json
import socket
import struct

import jax
import numpy as np

# Values that cannot change are sent once: a jax.Array (the sampler's all-allowed mask, kept on
# the device) or a read-only ndarray (the empty penalty history), cached for a bucket's rows,
# goes with a reference number {"rf": k} the first time and as {"rf": k} alone after that; the
# follower keeps it (a jax.Array back on its device): for a 64-row step at max_model_len 2048
# they are 0.9 MB, nearly all of the frame (docs/benchmarks/2026-12-06-scale-out.md).
_LENGTHS = struct.Struct("!II")
MAX_REFS = 1024  # beyond it constant values are sent whole each time (a leak guard, not a size)


class Encoder:
    """Frames for the other side; `refs`: send constant values once (one Encoder per connection set)."""

    def __init__(self, refs: bool = False):
        self._refs: dict[int, tuple[int, object]] | None = {} if refs else None

    def frame(self, kind: str, **fields) -> bytes:
        parts: list = []

        def enc(x):
            if isinstance(x, (np.ndarray, np.generic)) or _is_jax_array(x):
                ref = self._ref(x)
                if ref is not None and ref[1]:
                    return {"rf": ref[0]}
                a = np.asarray(x)
                if not a.flags.c_contiguous:
                    a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d value 1-d)
                parts.append(a.reshape(-1).view(np.uint8).data if a.size else b"")
                out = {"nd": [a.dtype.str, list(a.shape)]}
                if ref is not None:
                    out["rf"], out["dev"] = ref[0], _is_jax_array(x)
                return out
            if isinstance(x, dict):
                return {"di": [[k, enc(v)] for k, v in x.items()]}
            if isinstance(x, tuple):
                return {"tu": [enc(v) for v in x]}
            if isinstance(x, list):
                return [enc(v) for v in x]
            if x is None or isinstance(x, (bool, int, float, str)):
                return x
            raise TypeError(f"cannot send a {type(x).__name__} to the other ranks")

        header = json.dumps({"k": kind, "f": enc(fields)}, separators=(",", ":")).encode()
        payload = b"".join(parts)
        return _LENGTHS.pack(len(header), len(payload)) + header + payload

    def _ref(self, x) -> tuple[int, bool] | None:
        """(reference number, sent before) for a value that cannot change; None for others."""
        if self._refs is None or not (_is_jax_array(x) or (isinstance(x, np.ndarray) and not x.flags.writeable)):
            return None
        got = self._refs.get(id(x))
        if got is not None and got[1] is x:
            return got[0], True
        if len(self._refs) >= MAX_REFS:
            return None
        self._refs[id(x)] = (len(self._refs), x)  # holding x keeps its id from being reused
        return len(self._refs) - 1, False


def _is_jax_array(x) -> bool:
    return isinstance(x, jax.Array)


def encode(kind: str, **fields) -> bytes:
    """One frame of `kind` with `fields` (nested dicts, tuples, lists, numbers, strings, arrays)."""
    return Encoder().frame(kind, **fields)


class Decoder:
    def __init__(self):
        self.refs: dict[int, object] = {}

    def decode(self, header: bytes, payload: bytearray) -> tuple[str, dict]:
        offset = 0

        def dec(x):
            nonlocal offset
            if isinstance(x, dict):
                if "rf" in x and "nd" not in x:
                    return self.refs[x["rf"]]
                if "nd" in x:
                    dtype, shape = np.dtype(x["nd"][0]), tuple(x["nd"][1])
                    n = int(np.prod(shape, dtype=np.int64))
                    a = np.frombuffer(payload, dtype, count=n, offset=offset).reshape(shape)
                    offset += n * dtype.itemsize
                    if "rf" in x:
                        a = a.copy()
                        a.flags.writeable = False
                        if x["dev"]:
                            a = jax.device_put(a)  # uncommitted, as rank 0's
                        self.refs[x["rf"]] = a
                    return a
                ((tag, v),) = x.items()
                if tag == "tu":
                    return tuple(dec(i) for i in v)
                return {k: dec(i) for k, i in v}
            if isinstance(x, list):
                return [dec(i) for i in x]
            return x

        msg = json.loads(header)
        return msg["k"], dec(msg["f"])


def decode(header: bytes, payload: bytearray) -> tuple[str, dict]:
    return Decoder().decode(header, payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return buf


def _check_lengths(nh: int, np_: int, max_bytes: int | None) -> None:
    if max_bytes is not None and nh + np_ > max_bytes:
        raise ValueError(f"a frame of {nh + np_} bytes, over the {max_bytes} expected here")


def recv_raw(sock: socket.socket, max_bytes: int | None = None) -> tuple[bytes, bytearray]:
    """The next frame's (header, payload); EOFError when the other side closed the connection,
    ValueError when the frame says it is longer than `max_bytes` (before reading it)."""
    nh, np_ = _LENGTHS.unpack(_recv_exact(sock, _LENGTHS.size))
    _check_lengths(nh, np_, max_bytes)
    return bytes(_recv_exact(sock, nh)), _recv_exact(sock, np_)


def recv_frame(sock: socket.socket, decoder: Decoder | None = None,
               max_bytes: int | None = None) -> tuple[str, dict]:
    """The next frame, decoded; EOFError when the other side closed the connection (ValueError as
    recv_raw, or for a header that is not a frame's)."""
    return (decoder or Decoder()).decode(*recv_raw(sock, max_bytes))


def split_frame(buf: bytes | bytearray, max_bytes: int) -> tuple[bytes, bytearray, int] | None:
    """The first frame in `buf`, read so far from a non-blocking socket: (header, payload, bytes it
    took), or None while it is incomplete; ValueError if it says it is longer than `max_bytes`."""
    if len(buf) < _LENGTHS.size:
        return None
    nh, np_ = _LENGTHS.unpack_from(buf)
    _check_lengths(nh, np_, max_bytes)
    end = _LENGTHS.size + nh + np_
    if len(buf) < end:
        return None
    return bytes(buf[_LENGTHS.size:_LENGTHS.size + nh]), bytearray(buf[_LENGTHS.size + nh:end]), end
