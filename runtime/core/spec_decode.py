"""Speculative decoding, host side: the proposers (n-gram prompt lookup). Their settings are
`SpeculativeConfig` (vLLM's names), an engine setting in config.engine_config."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from config.engine_config import SpeculativeConfig

class Proposer(Protocol):
    """Proposes up to k draft tokens to follow `token_ids` (prompt + output so far); [] for none."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: for n from `prompt_lookup_max` down to `prompt_lookup_min`, find the most
    recent earlier occurrence of the sequence's last n tokens and propose the (up to k) tokens that
    followed it. The longest n with a match wins.

    One pass finds every n at once: the candidates are the positions holding the last token, and
    each further step back keeps those that still match, so the cost is O(len + matches x n),
    vectorised in numpy.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> "NgramProposer":
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        toks = np.asarray(token_ids)
        n_tok = toks.shape[0]
        if k <= 0 or n_tok < self.min_n + 1:
            return []
        # ends[j]: an earlier occurrence of the suffix ends at position ends[j] (< n_tok - 1).
        ends = np.flatnonzero(toks[:-1] == toks[-1])
        length = 1
        while ends.size and length < self.max_n and length < n_tok - 1:
            back = ends - length
            longer = ends[(back >= 0) & (toks[np.maximum(back, 0)] == toks[n_tok - 1 - length])]
            if not longer.size:
                break
            ends, length = longer, length + 1
        if not ends.size or length < self.min_n:
            return []
        start = int(ends[-1]) + 1  # the most recent occurrence of the longest matching n-gram
        return toks[start:start + k].tolist()


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer for `config.method`."""
    if config.method == "ngram":
        return NgramProposer.from_config(config)
    raise ValueError(f"speculative_config.method: {config.method!r} is not supported")
