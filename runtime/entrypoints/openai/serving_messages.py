"""/v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, translated onto the
chat-completions path (translation.py): a Messages body becomes a chat request, its result comes
back as content blocks (text, thinking, tool_use) or as Anthropic's stream events. A mixin of
`Server` (serving.py), which supplies the shared plumbing through `self`.

    system             a system message first (a string or text blocks)
    messages           text, tool_use (an assistant's call: its input as the call's arguments JSON),
                       tool_result (a tool message answering tool_use_id); thinking blocks of earlier
                       turns are dropped; a last assistant message is continued (prefill)
    tools              custom tools: name, description, input_schema -> function tools
    tool_choice        auto -> auto, any -> required, tool -> the named function, none -> none;
                       disable_parallel_tool_use -> parallel_tool_calls false
    stop_sequences     stop; a match ends with stop_reason "stop_sequence"
    output_config.format  {"type": "json_schema", "schema"} -> response_format (structured outputs)
    metadata, thinking accepted (the server's --reasoning-parser decides whether thinking is split out)
"""

from __future__ import annotations

import json
import time
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from runtime.entrypoints.openai.protocol import APIError, bad_request, json_response
from runtime.entrypoints.openai.translation import (Builder, Translation, anthropic_error_body, arguments_object,
                                                    id_hex, need_str, text_of)

# The chat's finish_reason as Anthropic's stop_reason. "abort" (the server ended the request, at
# shutdown) is a turn cut short: "pause_turn", which a client answers by sending the turn back.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "pause_turn"}


class MessagesRequest(BaseModel):
    """Anthropic's Messages body (the fields this server reads; others are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    messages: list[dict]
    max_tokens: int
    system: Optional[Union[str, list[dict]]] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[dict] = None
    metadata: Optional[dict] = None
    thinking: Optional[dict] = None
    output_config: Optional[dict] = None


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a Messages body without max_tokens."""

    max_tokens: Optional[int] = None


class MessagesServing:
    """Server's /v1/messages handlers."""

    async def messages(self, request: Request) -> Response:
        return await self._generate(request, MessagesRequest, self.prepare_chat, chat=True, api=Messages())

    async def count_tokens(self, request: Request) -> Response:
        """{"input_tokens": N}: the templated prompt's tokens, tools included, as /v1/messages counts them."""
        return await self.off_loop(self._count_tokens, await self.read_body(request), CountTokensRequest)

    def _count_tokens(self, raw: bytes, model_cls=CountTokensRequest) -> Response:
        r = Messages(count_only=True).parse(raw, self.cfg)
        return json_response({"input_tokens": len(self.prepare_chat(r, time.monotonic()).items[0][1])})


class Messages(Translation):
    model_cls = MessagesRequest

    def __init__(self, count_only: bool = False):
        super().__init__()
        self.count_only = count_only  # count_tokens: no max_tokens, and tool_choice does not change the prompt
        self.model_cls = CountTokensRequest if count_only else MessagesRequest

    def chat_body(self, b: MessagesRequest) -> dict:
        messages = [] if b.system is None else [{"role": "system", "content": text_of(b.system, "system")}]
        for i, m in enumerate(b.messages):
            messages += chat_messages(m, i)
        chat = {"model": b.model, "messages": messages, "max_tokens": b.max_tokens, "temperature": b.temperature,
                "top_p": b.top_p, "top_k": b.top_k, "stop": b.stop_sequences, "stream": b.stream}
        if b.stream:
            chat["stream_options"] = {"include_usage": True}
        fmt = (b.output_config or {}).get("format")
        if fmt is not None:  # structured outputs: the text is held to a JSON schema
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                  "output_config.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        if messages and messages[-1]["role"] == "assistant":  # prefill: the answer continues it
            chat |= {"add_generation_prompt": False, "continue_final_message": True}
        if b.tools is not None:
            chat["tools"] = [function_tool(t, i) for i, t in enumerate(b.tools)]
        if b.tool_choice is not None and not self.count_only:
            chat["tool_choice"] = tool_choice(b.tool_choice)
            if b.tool_choice.get("disable_parallel_tool_use") is True:
                chat["parallel_tool_calls"] = False
        return chat

    def builder(self, prep) -> "MessageBuilder":
        return MessageBuilder(prep)


def chat_messages(m, i: int) -> list[dict]:
    """One Anthropic message as chat messages: tool results become tool messages, in their place."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content",
                          "invalid_type")
    out, text, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text must be a string", f"{at}.text", "invalid_type")
            text.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use" and role == "assistant":
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{at}.input must be an object", f"{at}.input", "invalid_type")
            calls.append({"id": need_str(block, "id", at), "type": "function",
                          "function": {"name": need_str(block, "name", at), "arguments": json.dumps(args)}})
        elif kind == "tool_result" and role == "user":
            if text:  # text before a result keeps its place
                out.append({"role": "user", "content": text})
                text = []
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": need_str(block, "tool_use_id", at),
                        "content": text_of(result, f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier turns' thinking is not rendered again
        else:
            raise bad_request(f"{at}: {kind!r} blocks are not supported in a {role} message (text"
                              f"{', tool_use' if role == 'assistant' else ', tool_result'})", f"{at}.type",
                              "unsupported_parameter")
    if text or calls or not out:
        out.append({"role": role, "content": text, **({"tool_calls": calls} if calls else {})})
    return out


def function_tool(t, i: int) -> dict:
    where = f"tools.{i}"
    if not isinstance(t, dict) or t.get("type", "custom") != "custom":
        kind = t.get("type") if isinstance(t, dict) else None
        raise bad_request(f"{where}: only custom tools (name, description, input_schema) are supported, got "
                          f"type {kind!r}", f"{where}.type", "unsupported_parameter")
    schema = t.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.input_schema must be a JSON schema (an object)", f"{where}.input_schema",
                          "invalid_type")
    fn = {"name": need_str(t, "name", where), "parameters": schema}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def tool_choice(tc: dict):
    kind = tc.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": need_str(tc, "name", "tool_choice")}}
    raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


# ====================================================================== results


class MessageBuilder(Builder):
    """Content blocks from the chat's pieces, and Anthropic's stream events for them."""

    def __init__(self, prep):
        self.id = "msg_" + id_hex(prep.request_id)
        self.model = prep.model
        self.num_input = len(prep.items[0][1])
        self.blocks: list[dict] = []
        self.open: dict | None = None
        self.args = ""  # the open tool_use block's input JSON

    def message(self, content: list, stop_reason, stop_sequence, num_output: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.num_input, "output_tokens": num_output}}

    def start(self) -> list:
        return [("message_start", {"type": "message_start", "message": self.message([], None, None, 0)})]

    def add(self, piece: tuple) -> list:
        kind = piece[0]
        if kind == "args":
            self.args += piece[1]
            return [self._delta({"type": "input_json_delta", "partial_json": piece[1]})]
        events = []
        if kind == "call":
            events += self._close() + self._open({"type": "tool_use", "id": "toolu_" + id_hex(piece[1]),
                                                  "name": piece[2], "input": {}})
        elif kind == "text":
            if self.open is None or self.open["type"] != "text":
                events += self._close() + self._open({"type": "text", "text": ""})
            self.open["text"] += piece[1]
            events.append(self._delta({"type": "text_delta", "text": piece[1]}))
        else:
            if self.open is None or self.open["type"] != "thinking":
                events += self._close() + self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.open["thinking"] += piece[1]
            events.append(self._delta({"type": "thinking_delta", "thinking": piece[1]}))
        return events

    def _open(self, block: dict) -> list:
        self.open = block
        self.blocks.append(block)
        return [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                         "content_block": dict(block)})]

    def _delta(self, delta: dict) -> tuple:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list:
        if self.open is None:
            return []
        if self.open["type"] == "tool_use":
            self.open["input"] = arguments_object(self.args)
            self.args = ""
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _stop(self) -> tuple[str, str | None]:
        if self.finish_reason == "stop" and isinstance(self.stop_reason, str):
            return "stop_sequence", self.stop_reason
        return STOP_REASONS.get(self.finish_reason, "end_turn"), None

    def finish(self) -> list:
        reason, sequence = self._stop()
        return self._close() + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": {"input_tokens": self.num_input, "output_tokens": self.num_output}}),
            ("message_stop", {"type": "message_stop"})]

    def error(self, err: APIError) -> tuple:
        return "error", anthropic_error_body(err)

    def final(self) -> dict:
        return self.message(self.blocks, *self._stop(), self.num_output)
