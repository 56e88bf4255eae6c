"""SamplingParams: vLLM's names and semantics, validated on construction."""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import Any

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


STRUCTURED_PARAM = "structured_outputs"
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
ANY_OBJECT_SCHEMA = {"type": "object"}
# llguidance's Earley parser refuses a row of more items than this (LLParserLimits.max_items_in_row)
# at the first token; a choice list compiles to one such row.
MAX_ALTERNATIVES = 2000


def constraint_field(kind: str, source_param: str) -> str:
    """The request field a constraint came from, e.g. structured_outputs.regex."""
    if source_param == "response_format":
        return "response_format" if kind == "json_object" else "response_format.json_schema"
    return f"{source_param}.{kind}"


def _is_set(value) -> bool:
    return value is not None and value is not False  # json_object=False means unset


@dataclass
class StructuredOutputsParams:
    """One output constraint per request, named as in vLLM: exactly one of `json` (a JSON schema, as a
    dict or a JSON string), `regex`, `choice` (the output is one of these strings), `grammar` (Lark, or
    GBNF/EBNF as llguidance converts it) or `json_object` (any JSON object) must be set.
    `disable_any_whitespace` makes JSON compact (no whitespace between tokens); by default it may have
    at most one newline and 16 spaces or tabs between two (structured_output.JSON_WHITESPACE)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # The request field errors are reported against: "response_format" when built from one.
    source_param: str = field(default=STRUCTURED_PARAM, repr=False, compare=False)
    # Set by a server with a reasoning parser (not a request field): the constraint holds the answer
    # after a think block, "required" (the output thinks first; its "<think>" optional, the prompt may
    # have opened it) or "optional" (it may think first) (structured_output.REASONING_GRAMMARS).
    reasoning: str | None = None

    def __post_init__(self):
        set_ = [name for name in _CONSTRAINTS if _is_set(getattr(self, name))]
        if len(set_) != 1:
            which = ", ".join(set_) if set_ else "none"
            raise RequestError(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)} "
                               f"(got {which})", param=self.source_param)
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestError("disable_any_whitespace must be a boolean", param=self.source_param)
        self._check_value(set_[0])

    def _check_value(self, kind: str) -> None:
        value, err = getattr(self, kind), self.source_param
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise RequestError(f"structured_outputs.json is not valid JSON: {e}", param=err) from None
            if not isinstance(value, (dict, bool)):
                raise RequestError("structured_outputs.json must be a JSON schema (an object)", param=err)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise RequestError(f"structured_outputs.{kind} must be a non-empty string", param=err)
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) for c in value)):
                raise RequestError("structured_outputs.choice must be a non-empty list of strings", param=err)
            self.choice = list(value)
        elif value is not True:
            raise RequestError("structured_outputs.json_object must be true", param=err)

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if _is_set(getattr(self, name)))

    def cache_key(self) -> tuple:
        """What determines the compiled grammar."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif kind == "choice":
            value = tuple(value)
        whitespace = self.disable_any_whitespace if kind in ("json", "json_object") else False
        return kind, value, whitespace, self.reasoning

    def check_size(self, max_chars: int, key: tuple | None = None) -> None:
        """Refuses (RequestError grammar_too_large) a constraint whose text (schema JSON, regex,
        grammar, or all choices) is longer than `max_chars`, or a choice of more than MAX_ALTERNATIVES
        options: checked before any compile. `key`: `cache_key()`, when the caller has it."""
        value = (key or self.cache_key())[1]
        kind, name = self.kind, constraint_field(self.kind, self.source_param)
        if kind == "choice":
            n = sum(len(c) + 1 for c in value)
        else:
            n = len(value) if isinstance(value, str) else 0  # json_object: no text
        if n > max_chars:
            raise RequestError(f"{name} has {n} characters; the limit is {max_chars}", param=self.source_param,
                               code="grammar_too_large")
        if kind == "choice" and len(value) > MAX_ALTERNATIVES:
            raise RequestError(f"{name} has {len(value)} options; the limit is {MAX_ALTERNATIVES}",
                               param=self.source_param, code="grammar_too_large")

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """`value` as StructuredOutputsParams: None, one already, or a dict of its fields (vLLM's
        request field)."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise RequestError(f"structured_outputs must be a StructuredOutputsParams or a dict, got "
                               f"{type(value).__name__}", STRUCTURED_PARAM)
        known = {f for f in cls.__dataclass_fields__ if f not in ("source_param", "reasoning")}
        unknown = sorted(set(value) - known, key=str)
        if unknown:
            raise RequestError(f"structured_outputs has no field {unknown[0]!r} (it takes "
                               f"{', '.join(sorted(known))})", STRUCTURED_PARAM)
        return cls(**value)

    @classmethod
    def from_response_format(cls, response_format: Any) -> "StructuredOutputsParams | None":
        """OpenAI's `response_format`: {"type": "text"} (or None) -> None; {"type": "json_object"};
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        p = "response_format"
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise RequestError("response_format must be an object", param=p)
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True, source_param=p)
        if kind != "json_schema":
            raise RequestError(f"response_format.type must be one of text, json_object, json_schema "
                               f"(got {kind!r})", param=p)
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("response_format.json_schema must be an object", param=p)
        name, strict = spec.get("name"), spec.get("strict")
        if name is not None and not isinstance(name, str):
            raise RequestError("response_format.json_schema.name must be a string", param=p)
        if strict is not None and not isinstance(strict, bool):
            raise RequestError("response_format.json_schema.strict must be a boolean", param=p)
        schema = spec.get("schema", ANY_OBJECT_SCHEMA)  # OpenAI makes it optional
        if not isinstance(schema, (dict, bool)):
            raise RequestError("response_format.json_schema.schema must be an object", param=p)
        return cls(json=schema, source_param=p)


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
    # Output constrained to a JSON schema, regex, choice list or grammar (a dict is converted).
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
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
