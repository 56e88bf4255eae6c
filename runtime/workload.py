"""Seeded synthetic workloads for the benchmarks: long-tailed prompt and output lengths."""

from __future__ import annotations

import numpy as np

WORKLOADS = {
    # name: (prompt median, output median, lognormal sigma)
    "mixed": (96, 64, 0.9),
    "short": (32, 32, 0.5),
    "long-prompt": (384, 32, 0.6),
}


def synthetic_workload(num_prompts: int, seed: int = 0, max_model_len: int = 2048,
                       vocab_size: int = 49152, *, prompt_median: int = 96, output_median: int = 64,
                       sigma: float = 0.9, min_len: int = 4, low_id: int = 100) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) pairs; lengths are lognormal, clipped so each fits max_model_len.

    Token ids are drawn uniformly from [low_id, vocab_size) so no special token appears.
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prompts):
        p = int(np.clip(rng.lognormal(np.log(prompt_median), sigma), min_len, max_model_len // 2))
        o = int(np.clip(rng.lognormal(np.log(output_median), sigma), min_len, max_model_len - p))
        ids = rng.integers(low_id, vocab_size, size=p).tolist()
        out.append((ids, o))
    return out


def make_workload(name: str, num_prompts: int, seed: int, max_model_len: int, vocab_size: int,
                  max_input_len: int | None = None, max_output_len: int | None = None):
    """The named workload of WORKLOADS (the benchmarks' shared table), optionally truncated."""
    pm, om, sigma = WORKLOADS[name]
    work = synthetic_workload(num_prompts, seed, max_model_len, vocab_size, prompt_median=pm, output_median=om,
                              sigma=sigma)
    if max_input_len or max_output_len:
        work = [(ids[:max_input_len or len(ids)], min(o, max_output_len or o)) for ids, o in work]
    return work
