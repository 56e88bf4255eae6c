"""The translation layer: the agent APIs served on the chat-completions path, /v1/messages (Anthropic's
Messages, serving_messages.py) and /v1/responses (OpenAI's Responses, serving_responses.py).

A `Translation` turns its API's body into a ChatCompletionRequest, which then goes the chat's way
(`Server._generate`: prepare_chat, the admission limits, the grammar compile, the engine): no second
copy of sampling, limits or admission. The chat result comes back as pieces, the same for a whole
chat.completion (`message_pieces`) and for its stream chunks (`chunk_pieces`), and one `Builder` per
API folds them into that API's content (blocks or output items), emitting its stream events as it
goes: so a streamed answer and a whole one are built by the same code. Also here: the error body
each path answers with (`error_response`), which the gate and the app's handlers use."""

from __future__ import annotations

import contextlib
import json
import re
import uuid

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from runtime.entrypoints.openai import admission
from runtime.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, bad_request, check_json_text, dumps,
                                                 may_hold_surrogates, validation_error)

ANTHROPIC_PREFIX = "/v1/messages"  # its paths answer errors in Anthropic's shape
RESPONSES_PREFIX = "/v1/responses"
# Anthropic's error types by status (others: api_error from 500 on, invalid_request_error below).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
# The chat's parameter names as a Responses body names them, for its 400s (longest prefix first).
RESPONSES_PARAMS = (("response_format", "text.format"), ("max_tokens", "max_output_tokens"), ("messages", "input"))
_TOOL_FIELD = re.compile(r"^tools\.(\d+)\.function\.")


# ====================================================================== errors


def anthropic_error_body(err: APIError) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: APIError, path: str) -> Response:
    """`err` as the path's API answers errors: Anthropic's body on /v1/messages*, OpenAI's elsewhere
    (on /v1/responses with its own parameter names)."""
    if path.startswith(ANTHROPIC_PREFIX):
        return Response(dumps(anthropic_error_body(err)), err.status, headers=err.headers,
                        media_type="application/json")
    if path.startswith(RESPONSES_PREFIX) and err.param:
        for chat_name, name in RESPONSES_PARAMS:
            if err.param == chat_name or err.param.startswith(chat_name + "."):
                err.param = name + err.param[len(chat_name):]
                break
        err.param = _TOOL_FIELD.sub(r"tools.\1.", err.param)  # a Responses tool has no "function" level
    return err.response()


# ====================================================================== requests


def new_hex() -> str:
    return uuid.uuid4().hex


def id_hex(chat_id: str) -> str:
    """The unique part of a chat id ("chatcmpl-<hex>", "chatcmpl-tool-<hex>"), for an API's own prefix."""
    return chat_id.rpartition("-")[2]


def text_of(content, where: str, kinds=("text",)) -> list[dict]:
    """A content that is a string or a list of text parts, as the chat's text parts; 400 otherwise."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where, "invalid_type")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.{j}: only text is supported here ({', '.join(kinds)}), got {kind!r}",
                              f"{where}.{j}", "unsupported_parameter")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def need_str(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not v:
        raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}",
                          "missing_required_parameter" if v is None else "invalid_type")
    return v


class Translation:
    """One request of an API served on the chat path (a new one per request: it keeps the API's
    body for the response). `model_cls`: the API's pydantic body; `list_field`: its list of turns,
    counted against --max-chat-messages before anything walks it."""

    model_cls: type[BaseModel]
    list_field = "messages"

    def __init__(self):
        self.body = None

    def parse(self, raw: bytes, limits) -> ChatCompletionRequest:
        """The API's body -> the ChatCompletionRequest it means, held to the chat's admission checks."""
        obj = admission.load_json(raw)
        admission.check_num_messages(obj.get(self.list_field), limits.max_chat_messages)
        check_json_text(obj, surrogates=may_hold_surrogates(raw))
        try:
            self.body = self.model_cls.model_validate(obj)
            chat = ChatCompletionRequest.model_validate(self.chat_body(self.body))
        except ValidationError as e:
            raise validation_error(e) from None
        admission.check_sizes(chat, limits)
        return chat

    def chat_body(self, body) -> dict:
        """The chat request's fields for the API's (validated) body."""
        raise NotImplementedError

    def builder(self, prep) -> "Builder":
        raise NotImplementedError

    def response(self, chat: dict, prep) -> dict:
        """The API's response for a whole chat.completion object."""
        b = self.builder(prep)
        b.usage = chat["usage"]
        for piece in message_pieces(chat["choices"][0]):
            b.feed(piece)
        b.finish()
        return b.final()

    async def events(self, prep, chunks):
        """The API's SSE events for the chat's stream chunks (dicts, or the APIError that ended it)."""
        b = self.builder(prep)
        async with contextlib.aclosing(chunks):
            for e in b.start():
                yield sse_event(e)
            async for obj in chunks:
                if isinstance(obj, APIError):
                    yield sse_event(b.error(obj))
                    return
                b.usage = obj.get("usage") or b.usage
                for piece in chunk_pieces(obj):
                    for e in b.feed(piece):
                        yield sse_event(e)
        for e in b.finish():
            yield sse_event(e)


def sse_event(event: tuple[str, dict]) -> bytes:
    return b"event: " + event[0].encode() + b"\ndata: " + dumps(event[1]) + b"\n\n"


# ====================================================================== results


class Builder:
    """Folds the pieces of one answer into an API's content, returning its stream events (name, data)
    as it goes. Pieces: ("reasoning", text), ("text", text), ("call", chat call id, name), ("args",
    text: the open call's arguments), ("finish", finish_reason, stop_reason)."""

    usage: dict | None = None
    finish_reason: str | None = None
    stop_reason = None

    def start(self) -> list:
        return []

    def feed(self, piece: tuple) -> list:
        if piece[0] == "finish":
            self.finish_reason, self.stop_reason = piece[1], piece[2]
            return []
        return self.add(piece)

    def add(self, piece: tuple) -> list:
        """The events of a piece of content (reasoning, text, call, args)."""
        raise NotImplementedError

    def finish(self) -> list:
        raise NotImplementedError

    def error(self, err: APIError) -> tuple[str, dict]:
        raise NotImplementedError

    def final(self) -> dict:
        raise NotImplementedError

    @property
    def num_output(self) -> int:
        return self.usage["completion_tokens"] if self.usage else 0


def chunk_pieces(chunk: dict) -> list[tuple]:
    """The pieces of one chat stream chunk."""
    pieces = []
    for ch in chunk["choices"]:
        d = ch["delta"]
        if d.get("reasoning_content"):
            pieces.append(("reasoning", d["reasoning_content"]))
        if d.get("content"):
            pieces.append(("text", d["content"]))
        for tc in d.get("tool_calls") or ():
            if tc.get("id"):
                pieces.append(("call", tc["id"], tc["function"]["name"]))
            if tc["function"].get("arguments"):
                pieces.append(("args", tc["function"]["arguments"]))
        if ch.get("finish_reason"):
            pieces.append(("finish", ch["finish_reason"], ch.get("stop_reason")))
    return pieces


def message_pieces(choice: dict) -> list[tuple]:
    """The pieces of a whole chat choice: its reasoning, its content, its calls."""
    m = choice["message"]
    pieces = [("reasoning", m["reasoning_content"])] if m.get("reasoning_content") else []
    if m.get("content"):
        pieces.append(("text", m["content"]))
    for c in m.get("tool_calls") or ():
        pieces.append(("call", c["id"], c["function"]["name"]))
        if c["function"]["arguments"]:
            pieces.append(("args", c["function"]["arguments"]))
    return pieces + [("finish", choice["finish_reason"], choice.get("stop_reason"))]


def arguments_object(text: str) -> dict:
    """A call's arguments as an object; {} where they are not one (cut short by max_tokens)."""
    try:
        args = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        return {}
    return args if isinstance(args, dict) else {}
