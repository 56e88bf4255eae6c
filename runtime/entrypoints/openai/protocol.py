"""The OpenAI protocol: request models (pydantic), the error body, JSON helpers, and the logprob shapes of
completion and chat responses."""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import Response

from runtime.core.sampling_params import SamplingParams

MAX_JSON_DEPTH = 64
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


# ====================================================================== errors


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self.TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(dumps(self.body()), self.status, headers=self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def dumps(obj) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate somewhere: \u-escape it rather than fail
        return json.dumps(obj, separators=(",", ":")).encode()


_CONTAINERS = (dict, list)
# json.loads decodes with "surrogatepass": a lone surrogate comes from a \\uD800-\\uDFFF escape, or
# from its three UTF-8 bytes (ED A0-BF ..), or from a UTF-16/32 body. Two searches, not one
# alternation: each runs at memchr speed (2 ms for 4 MB, holding the GIL), the alternation 15x slower.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_UTF8 = re.compile(rb"\xed[\xa0-\xbf]")


def may_hold_surrogates(raw: bytes) -> bool:
    return (b"\x00" in raw[:4] or raw[:2] in (b"\xff\xfe", b"\xfe\xff") or _SURROGATE_ESCAPE.search(raw) is not None
            or _SURROGATE_UTF8.search(raw) is not None)


def check_json_text(obj, max_depth: int = MAX_JSON_DEPTH, surrogates: bool = True) -> None:
    """Rejects a parsed JSON body nested deeper than `max_depth`, or holding a string that is not
    valid Unicode (a lone surrogate from a \\ud800 escape), which the tokenizer cannot take.
    `surrogates=False` (the raw body has no such escape: `may_hold_surrogates`) checks the depth only,
    visiting containers alone: a body of many small strings costs a fraction of the full walk."""
    if surrogates:
        _check_strings(obj, max_depth)
        return
    level, depth = [obj], 1
    while level:
        if depth > max_depth:
            raise bad_request(f"the JSON body is nested more than {max_depth} levels deep", None, "invalid_json")
        below = []
        for x in level:
            below += [v for v in (x.values() if type(x) is dict else x) if type(v) in _CONTAINERS]
        level, depth = below, depth + 1


def _check_strings(obj, max_depth: int) -> None:
    stack = [(obj, (), 1)]
    while stack:
        x, path, depth = stack.pop()
        if depth > max_depth:
            raise bad_request(f"the JSON body is nested more than {max_depth} levels deep", None, "invalid_json")
        if isinstance(x, dict):
            for k, v in x.items():
                stack.append((k, path, depth + 1))
                stack.append((v, path + (k,), depth + 1))
        elif isinstance(x, list):
            stack.extend((v, path + (i,), depth + 1) for i, v in enumerate(x))
        elif isinstance(x, str) and not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                param = ".".join(str(p) for p in path if isinstance(p, (str, int))).encode(
                    "utf-8", "backslashreplace").decode() or None
                raise bad_request(f"{param or 'the body'}: text must be valid Unicode (no lone surrogates)",
                                  param, "invalid_text") from None


def json_response(obj, status: int = 200) -> Response:
    return Response(dumps(obj), status, media_type="application/json")


async def sse_data(chunks):
    """OpenAI's SSE stream of chunk objects (an APIError as its error body), ended by [DONE]."""
    async with contextlib.aclosing(chunks):
        async for obj in chunks:
            yield b"data: " + dumps(obj.body() if isinstance(obj, APIError) else obj) + b"\n\n"
    yield b"data: [DONE]\n\n"


# ====================================================================== request bodies

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


# vLLM request options this server does not implement, with the value that means "off": any other
# value is answered 400 naming the option (never accepted and ignored).
VLLM_UNSUPPORTED = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    "prompt_embeds": None, "logits_processors": None, "mm_processor_kwargs": None, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None, "spaces_between_special_tokens": True,
    "chat_template": None, "documents": None, "reasoning_effort": None,
}


class SamplingFields(BaseModel):
    """Fields shared by both generation endpoints: OpenAI's, then vLLM's extras."""

    model_config = _STRICT
    UNSUPPORTED: ClassVar[dict] = VLLM_UNSUPPORTED
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    prompt_logprobs: Optional[int] = None
    return_token_ids: bool = False  # adds token_ids (and prompt_token_ids) to each choice
    trace: bool = False  # returns each prompt's path through the engine (RequestTrace) with the response
    return_tokens_as_token_ids: bool = False  # logprob tokens named "token_id:<id>"
    truncate_prompt_tokens: Optional[int] = None  # keep only this many prompt tokens (-1: max_model_len)
    truncation_side: Optional[str] = None  # "left" (default: keep the last ones) or "right"
    # Structured outputs: OpenAI's {"type": "text" | "json_object" | "json_schema", ...}, or vLLM's
    # {"json" | "regex" | "choice" | "grammar": ...}; not both.
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None


class CompletionRequest(SamplingFields):
    prompt: Any = None
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatCompletionRequest(SamplingFields):
    messages: Any = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one call
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open and continue it
    chat_template_kwargs: Optional[dict] = None
    echo: bool = False  # the response starts with the last message's content (when its role answers)


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict] = None
    add_special_tokens: bool = True  # for a prompt, as completions encode it (vLLM's default)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: Optional[str] = None
    tokens: list[int]


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    # Drop pydantic's union-member tags ('str', 'list[str]') from the location.
    loc = [x for x in err["loc"] if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))]
    param = ".".join(str(x) for x in loc) or None
    return bad_request(f"{param}: {err['msg']}" if param else err["msg"], param,
                       "invalid_type" if err["type"].endswith("_type") else "invalid_value")


# ====================================================================== metrics

# ====================================================================== output formatting


class Detok:
    """Token text and bytes for logprobs (byte-level BPE tokens map back to their exact bytes)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self._text[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s

    def bytes(self, tid: int) -> list[int]:
        b = self._bytes.get(tid)
        if b is None:
            b = self._bytes[tid] = list(self.tok.token_bytes(tid))
        return b


class TokenIdNames:
    """Detok's interface naming each token "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""

    @staticmethod
    def text(tid: int) -> str:
        return f"token_id:{tid}"

    def bytes(self, tid: int) -> list[int]:
        return list(self.text(tid).encode())


def clamp_logprob(x: float) -> float:
    return MIN_LOGPROB if not math.isfinite(x) else max(float(x), MIN_LOGPROB)


def completion_logprobs(dt: Detok, token_ids, logprobs, offset: int, prompt_part: bool = False):
    """OpenAI's completions format, for `token_ids` with `logprobs[i]` = {id: logprob} (or None)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, logprobs):
        s = dt.text(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(clamp_logprob(d.get(tid, MIN_LOGPROB)))
            tops.append({dt.text(k): clamp_logprob(v) for k, v in d.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(dt: Detok, token_ids, logprobs, k: int) -> list[dict]:
    """OpenAI's chat format: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    content = []
    for tid, d in zip(token_ids, logprobs):
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
        content.append({"token": dt.text(tid), "logprob": clamp_logprob(d.get(tid, MIN_LOGPROB)), "bytes": dt.bytes(tid),
                        "top_logprobs": [{"token": dt.text(a), "logprob": clamp_logprob(b), "bytes": dt.bytes(a)}
                                         for a, b in top]})
    return content


@dataclass
class Prepared:
    """A validated generation request: one (id, prompt ids, params) per prompt."""

    request_id: str
    created: int
    model: str
    items: list[tuple[str, list[int], SamplingParams]]
    prompt_texts: list[str | None]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    arrival_time: float
    extra: dict = field(default_factory=dict)
    done: set = field(default_factory=set)  # prompt indices whose request has ended


@dataclass
class ChoiceState:
    """What has been sent for one choice of a streamed response."""

    text_len: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    finish_reason: str | None = None
    output: Any = None  # a chat choice's ChatOutput (chat_tools), where tools or reasoning are parsed
