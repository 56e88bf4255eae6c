"""Speculative decoding, host side: SpeculativeConfig (vLLM's names) and the proposers (n-gram prompt lookup)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Protocol, Sequence

import numpy as np

MAX_NUM_SPECULATIVE_TOKENS = 16  # every step verifies k+1 positions per row; more is rarely accepted
MAX_PROMPT_LOOKUP = 64  # the n-gram search costs O(sequence length x n) per row per step
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither bound is given
SUPPORTED_METHODS = ("ngram",)
PLANNED_METHODS = ("draft_model",)  # a small model of the same vocabulary proposes; its q_probs feed the sampler


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (`--speculative-config '{"method": "ngram", ...}'`).

    method: how drafts are proposed; "ngram" (prompt lookup) is the one supported now.
    num_speculative_tokens: k, the drafts proposed and verified per row per step (1..16).
    prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix n-gram searched for. As
    in vLLM: both unset -> 5 and 5; one unset -> it takes the other's value.

    Constructing one validates every field; `from_dict` also rejects unknown keys.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        m = self.method
        if not isinstance(m, str):
            _bad("method", f"must be a string, got {m!r}")
        if m not in SUPPORTED_METHODS:
            planned = f" ({m!r} is planned)" if m in PLANNED_METHODS else ""
            _bad("method", f"{m!r} is not supported{planned}; supported: {', '.join(map(repr, SUPPORTED_METHODS))}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_NUM_SPECULATIVE_TOKENS)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if value is not None:
                _check_int(name, value, 1, MAX_PROMPT_LOOKUP)
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            _bad("prompt_lookup_min", f"{lo} must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, d: "dict | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a dict or a JSON object string (the CLI's form); None (or "") means no speculation."""
        if d is None or isinstance(d, cls):
            return d
        if isinstance(d, str):
            if not d.strip():
                return None
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in d:
                _bad(required, "is required")
        return cls(**d)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _bad(name: str, why: str):
    raise ValueError(f"speculative_config.{name}: {why}")


def _check_int(name: str, v, lo: int, hi: int):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        _bad(name, f"must be an integer, got {v!r}")
    if not lo <= v <= hi:
        _bad(name, f"must be in [{lo}, {hi}], got {v}")


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
