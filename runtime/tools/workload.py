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


# Words the shared-prefix workload's text is made of: common English, so any BPE tokenizer keeps
# about one token per word.
_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had "
          "by word but not what all were we when your can said there use an each which she do how their if will "
          "up other about out many then them these so some her would make like him into time has look two more "
          "write go see number no way could people my than first water been call who oil its now find long down "
          "day did get come made may part").split()


def shared_prefix_workload(num_prompts: int, num_prefixes: int = 8, seed: int = 0, *, prefix_words: int = 200,
                           question_words: int = 12, output_len: int = 16) -> list[tuple[str, int]]:
    """(text prompt, max_tokens) pairs: `num_prefixes` long system prompts, each shared by
    num_prompts / num_prefixes users with a short question of their own, the users' arrivals
    interleaved in a seeded random order (a fixed rotation would let round robin keep each prefix
    on one replica by accident): the workload where a router that keeps a prefix on one replica
    makes that replica's prefix cache hit."""
    rng = np.random.default_rng(seed)
    words = np.array(_WORDS)
    systems = [f"System {k}: " + " ".join(rng.choice(words, prefix_words)) for k in range(num_prefixes)]
    order = rng.permutation(np.arange(num_prompts) % num_prefixes)
    out = []
    for i, k in enumerate(order):
        question = " ".join(rng.choice(words, question_words))
        out.append((f"{systems[k]}\nUser {i}: {question}?\nAssistant:", output_len))
    return out
