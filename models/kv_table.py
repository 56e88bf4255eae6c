"""KV-cache size per preset and sequence length: `python -m models.kv_table`."""

from __future__ import annotations

from typing import Iterable, Sequence

from models.cli import ArgumentParser
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
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> int:
    """`argv` is the flags only (the module form passes sys.argv[1:])."""
    ap = ArgumentParser(prog="python -m models.kv_table", description=__doc__)
    ap.add_argument("--model", action="append", choices=sorted(PRESETS), metavar="PRESET",
                    help="only these presets (repeatable; default: every preset)")
    args = ap.parse_args(argv)
    print("KV-cache size for one sequence (K and V, all layers; 2 x layers x kv_heads x head_dim x bytes)")
    print(kv_table([PRESETS[m] for m in args.model] if args.model else None))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
