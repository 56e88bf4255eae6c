"""KV-cache size per preset and sequence length: `python -m models.kv_table`."""

from __future__ import annotations

from typing import Iterable, Sequence

from ir.kv_groups import window_blocks_per_seq
from config.flags import ArgumentParser
from models.config import PRESETS, ModelConfig

SEQ_LENS: tuple[int, ...] = tuple(256 << i for i in range(7))  # 256 .. 16384
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4}


def format_bytes(num_bytes: float) -> str:
    """Binary units: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def kv_cache_bytes(config: ModelConfig, seq_len: int, dtype_bytes: int, num_seqs: int = 1) -> int:
    """KV-cache bytes for `num_seqs` sequences of `seq_len` tokens (GQA-aware, exact)."""
    return config.kv_bytes_per_token(dtype_bytes) * seq_len * num_seqs


def windowed_kv_cache_bytes(config: ModelConfig, seq_len: int, dtype_bytes: int, block_size: int = 32,
                            num_seqs: int = 1) -> int:
    """KV-cache bytes that the engine's window-aware cache (vLLM's hybrid KV cache manager; the
    window group of ir.kv_groups) holds for `num_seqs` decoding sequences of `seq_len` tokens, in
    whole blocks: full layers a block per `block_size` tokens, sliding layers the blocks of their
    window and the one being filled (ir.kv_groups.window_blocks_per_seq)."""
    per_layer_block = 2 * config.num_kv_heads * config.head_dim * dtype_bytes * block_size
    full = -(-seq_len // block_size)
    blocks = sum(window_blocks_per_seq(config.sliding_window, block_size, seq_len) if config.is_sliding(i) else full
                 for i in range(config.num_layers))
    return per_layer_block * blocks * num_seqs


def paged_kv_cache_bytes(config: ModelConfig, seq_len: int, dtype_bytes: int, block_size: int = 32) -> int:
    """KV-cache bytes of one sequence in a paged cache that keeps every layer's blocks."""
    return kv_cache_bytes(config, -(-seq_len // block_size) * block_size, dtype_bytes)


def _format_rows(rows: list[list[str]], left: int = 2) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def windowed_kv_table(configs: Iterable[ModelConfig], seq_lens: Sequence[int] = SEQ_LENS, dtype: str = "bf16",
                      block_size: int = 32) -> str:
    """Text table for the models with sliding-window layers: what the engine's window-aware cache
    holds for one sequence, and its share of a cache that keeps every layer's blocks."""
    head = ["model", "dtype", "sliding/layers", "window"] + [f"{n}" for n in seq_lens]
    rows = [head]
    for c in configs:
        if not c.num_sliding_layers:
            continue
        nbytes = DTYPE_BYTES[dtype]
        rows.append([c.name, dtype, f"{c.num_sliding_layers}/{c.num_layers}", str(c.sliding_window)]
                    + [f"{format_bytes(windowed_kv_cache_bytes(c, n, nbytes, block_size))} "
                       f"({100 * windowed_kv_cache_bytes(c, n, nbytes, block_size) / paged_kv_cache_bytes(c, n, nbytes, block_size):.1f}%)"
                       for n in seq_lens])
    return _format_rows(rows) if len(rows) > 1 else ""


def kv_table(configs: Iterable[ModelConfig] | None = None, seq_lens: Sequence[int] = SEQ_LENS,
             dtypes: Sequence[str] = tuple(DTYPE_BYTES)) -> str:
    """Text table: one row per (preset, dtype), one column per sequence length (one sequence)."""
    configs = list(PRESETS.values()) if configs is None else list(configs)
    head = ["model", "dtype", "kv/q heads", "per token"] + [f"{n}" for n in seq_lens]
    rows = [head]
    for c in configs:
        for dt in dtypes:
            nbytes = DTYPE_BYTES[dt]
            rows.append([c.name, dt, f"{c.num_kv_heads}/{c.num_q_heads}",
                         format_bytes(c.kv_bytes_per_token(nbytes))]
                        + [format_bytes(kv_cache_bytes(c, n, nbytes)) for n in seq_lens])
    return _format_rows(rows)


def main(argv: Sequence[str] = ()) -> int:
    """`argv` is the flags only (the module form passes sys.argv[1:])."""
    ap = ArgumentParser(prog="python -m models.kv_table", description=__doc__)
    ap.add_argument("--model", action="append", choices=sorted(PRESETS), metavar="PRESET",
                    help="only these presets (repeatable; default: every preset)")
    args = ap.parse_args(argv)
    print("KV-cache size for one sequence (K and V, all layers; 2 x layers x kv_heads x head_dim x bytes)")
    configs = [PRESETS[m] for m in args.model] if args.model else list(PRESETS.values())
    print(kv_table(configs))
    windowed = windowed_kv_table(configs)
    if windowed:
        print()
        print("With the engine's window-aware cache (KV cache groups: the sliding layers' own pools and block "
              "tables): full layers keep every 32-token block, sliding layers the blocks of their window and "
              "the one being filled; in brackets, the share of a cache that keeps every layer's blocks")
        print(windowed)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
