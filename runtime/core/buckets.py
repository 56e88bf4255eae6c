"""The bucket table: the only step shapes the runtime ever compiles or runs."""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

# One token (a lone decoding sequence), a few small powers of two, then even steps (nano-vllm
# style). Sequence counts step by 4x: each extra bucket is a compile at start, and padding a decode
# batch to the next size wastes less than a compile costs. The one-token bucket earns its compile:
# XLA:CPU multiplies one row by a weight matrix at about twice the bytes per second of 2-8 rows
# (a matrix-vector kernel), and batch-1 decode is bound by reading the weights.
TOKEN_STEPS = (1, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
SEQ_STEPS = (4, 16, 64, 256)


@dataclass(frozen=True)
class BucketTable:
    """Token counts and sequence counts; a step (t tokens, s seqs) pads to the smallest fit."""

    token_sizes: tuple[int, ...]
    seq_sizes: tuple[int, ...]

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int,
              token_sizes: tuple[int, ...] | None = None,
              seq_sizes: tuple[int, ...] | None = None) -> "BucketTable":
        tok = token_sizes or tuple(t for t in TOKEN_STEPS if t < max_num_batched_tokens) + (max_num_batched_tokens,)
        seqs = seq_sizes or tuple(s for s in SEQ_STEPS if s < max_num_seqs) + (max_num_seqs,)
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) must not exceed max_num_batched_tokens "
                             f"({max_num_batched_tokens}): every scheduled sequence needs a token")
        return cls(tuple(sorted(set(tok))), tuple(sorted(set(seqs))))

    @classmethod
    def for_engine(cls, engine) -> "BucketTable":
        """The table an engine (EngineConfig) compiles: its token budget by its sequence count, the
        widest seq size raised to the step's rows (`max_step_rows`: speculation's verify rows), so
        speculation adds no bucket to compile."""
        table = cls.build(engine.max_num_batched_tokens, engine.max_num_seqs)
        if engine.max_step_rows > table.max_seqs:
            table = cls(table.token_sizes, table.seq_sizes[:-1] + (engine.max_step_rows,))
        return table

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def max_seqs(self) -> int:
        return self.seq_sizes[-1]

    def pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, seqs) bucket that `pick` can return, by tokens then seqs.

        Attention sequences never outnumber tokens, so for t tokens the seq sizes below t are
        kept, then the first one >= t capped at t (t tokens, 16 seq sizes -> 8x8, and 1 token ->
        1x1). A step whose sampler rows outnumber its tokens (a short prompt forking into n
        samples) takes a larger token size; the largest holds every seq size.
        """
        out = []
        for t in self.token_sizes:
            for s in self.seq_sizes:
                if s >= t and t < self.max_tokens:
                    out.append((t, t))
                    break
                out.append((t, s))
        return out

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest bucket that holds the step: fewest tokens, then fewest seqs."""
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        if i < len(self.token_sizes) and num_seqs <= self.max_seqs:
            for t, s in self._pairs[bisect.bisect_left(self._pairs, (self.token_sizes[i], 0)):]:
                if s >= num_seqs:
                    return t, s
        raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the largest "
                         f"bucket ({self.max_tokens} tokens / {self.max_seqs} seqs)")

    @functools.cached_property
    def _pairs(self) -> list[tuple[int, int]]:
        return self.pairs()

    def to_dict(self) -> dict:
        return {"token_sizes": list(self.token_sizes), "seq_sizes": list(self.seq_sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> "BucketTable":
        return cls(tuple(d["token_sizes"]), tuple(d["seq_sizes"]))
