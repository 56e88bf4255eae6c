"""The engine configuration the A/B benchmarks share, and their KEY=VALUE engine fields. No runtime
import here: benchmarks/bench_seqs64.py imports this before it puts the checkout it runs on the path."""

from __future__ import annotations

# The 64-sequence case's engine: the defaults' batch limits, enough KV blocks for every case, and no
# prefix caching (every round's prompts are new anyway).
COMMON = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=2000,
              enable_prefix_caching=False)


def parse_pairs(pairs: list[str]) -> dict:
    """EngineConfig fields from KEY=VALUE strings: true/false, integers, else strings."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {pair!r}")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                out[key] = value
    return out
