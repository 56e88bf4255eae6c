"""Incremental detokenization and stop-string matching for streaming output.

Text is emitted only once it decodes to complete characters: a multi-byte character split
across tokens is held back (the decoder yields U+FFFD for the incomplete tail) until the
token that completes it arrives, or the sequence finishes without one (then `flush` gives the
decoder's U+FFFD, as decoding the whole output does).
"""

from __future__ import annotations

from dataclasses import dataclass

# Re-decode a few tokens of left context so that tokens whose text depends on their
# neighbour (leading-space markers, byte fallback) render as they would in the full text.
_CONTEXT_TOKENS = 5


@dataclass
class DetokState:
    prefix_offset: int  # start of the left-context window (in output tokens)
    read_offset: int  # output tokens already turned into emitted text


def new_state() -> DetokState:
    return DetokState(0, 0)


def step(tokenizer, output_ids: list[int], state: DetokState, skip_special_tokens: bool) -> str:
    """Returns the text newly completed by `output_ids` since the last call; updates `state`."""
    prefix = tokenizer.decode(output_ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(output_ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""  # nothing new, or a character is still incomplete
    new_text = full[len(prefix):] if full.startswith(prefix) else full[len(prefix):]
    state.read_offset = len(output_ids)
    state.prefix_offset = max(0, len(output_ids) - _CONTEXT_TOKENS)
    return new_text


def flush(tokenizer, output_ids: list[int], state: DetokState, skip_special_tokens: bool) -> str:
    """The text still held back for an incomplete character, as the decoder renders it (U+FFFD),
    once no token can complete it (the sequence finished): the text then decodes from the same
    ids as the whole output does."""
    if state.read_offset >= len(output_ids):
        return ""
    prefix = tokenizer.decode(output_ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(output_ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    state.read_offset = len(output_ids)
    return full[len(prefix):] if len(full) > len(prefix) else ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last `new_len` chars: (start index, stop)."""
    best = None
    for s in stops:
        lo = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, lo)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def holdback(text: str, stops: list[str]) -> int:
    """How many trailing chars could still become a stop string, so must not be streamed yet."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n
