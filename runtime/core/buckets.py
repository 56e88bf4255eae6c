"""The bucket table: the only step shapes the runtime ever compiles or runs."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# A few small powers of two, then even steps (nano-vllm style). Sequence counts step by 4x:
# each extra bucket is a compile at start, and padding a decode batch to the next size wastes less
# than a compile costs.
TOKEN_STEPS = (8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
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

    @property
    def max_tokens(self) -> int:
        return self.token_sizes[-1]

    @property
    def max_seqs(self) -> int:
        return self.seq_sizes[-1]

    def pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, seqs) bucket that `pick` can return.

        A step never has more sequences than tokens, so for t tokens only seq sizes up to the
        first one >= t are reachable.
        """
        out = []
        for t in self.token_sizes:
            for s in self.seq_sizes:
                out.append((t, s))
                if s >= t:
                    break
        return out

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest bucket that holds the step, by one bisect on each axis."""
        j = bisect.bisect_left(self.seq_sizes, num_seqs)
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        if i == len(self.token_sizes) or j == len(self.seq_sizes):
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the largest "
                             f"bucket ({self.max_tokens} tokens / {self.max_seqs} seqs)")
        return self.token_sizes[i], self.seq_sizes[j]

    def to_dict(self) -> dict:
        return {"token_sizes": list(self.token_sizes), "seq_sizes": list(self.seq_sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> "BucketTable":
        return cls(tuple(d["token_sizes"]), tuple(d["seq_sizes"]))
