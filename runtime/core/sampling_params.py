"""SamplingParams: vLLM's names and semantics, validated on construction."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's range; sharper or flatter than that is rarely what anyone means
MAX_BIAS_VALUE = 100  # OpenAI's logit_bias range
MAX_STOP_CHARS = 1024  # the stop-string scan runs on the engine thread every step, O(len(stop)^2)

# Bits of the signed integer each int field is stored in (the sampler packs some into int32
# arrays; the rest stay Python ints but are bounded like vLLM's int64 fields).
INT_FIELD_BITS = {"n": 32, "top_k": 32, "min_tokens": 32, "logprobs": 32, "prompt_logprobs": 32,
                  "max_tokens": 64, "seed": 64, "priority": 64}
TOKEN_ID_BITS = 32  # stop_token_ids and logit_bias keys: int32 in the sampler's arrays


def int_in_width(value, bits: int) -> bool:
    """True when `value` is an int (not a bool) that fits a signed `bits`-bit integer."""
    if isinstance(value, bool):
        return False
    try:
        v = operator.index(value)  # ints and numpy ints, not floats
    except TypeError:
        return False
    return -(1 << (bits - 1)) <= v < (1 << (bits - 1))


class RequestError(ValueError):
    """A request the engine cannot serve, with the request field it is about (`param`, named as in
    the OpenAI API) and an error code. SamplingParams checks value ranges; the engine checks what
    depends on the model (vocabulary, context length, max_num_seqs). The HTTP server turns it into
    OpenAI's error body; offline callers get it as a ValueError."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass
class SamplingParams:
    """Per-request sampling options. `temperature=0` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    detokenize: bool = True
    trace: bool = False  # return the request's path through the engine (RequestOutput.trace)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def bad(name, why):
            raise RequestError(f"{name} {why}, got {getattr(self, name)!r}", name)

        for name, bits in INT_FIELD_BITS.items():
            v = getattr(self, name)
            if v is not None and not int_in_width(v, bits):
                bad(name, f"must be an int that fits in {bits} bits")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            for t in ids:
                if not int_in_width(t, TOKEN_ID_BITS) or t < 0:
                    raise RequestError(f"{name} token ids must be non-negative ints that fit in "
                                       f"{TOKEN_ID_BITS} bits, got {t!r}", name)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an int >= 1")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE}]")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be -1, 0 (off) or a positive int")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", "must be in (0, 10]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an int >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an int in [0, {MAX_LOGPROBS}]")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        for v in (self.logit_bias or {}).values():
            if not -MAX_BIAS_VALUE <= v <= MAX_BIAS_VALUE:
                raise RequestError(f"logit_bias values must be in [-{MAX_BIAS_VALUE}, {MAX_BIAS_VALUE}], "
                                   f"got {v}", "logit_bias")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an int")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise RequestError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got "
                               f"{max(len(s) for s in self.stop)}", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)
