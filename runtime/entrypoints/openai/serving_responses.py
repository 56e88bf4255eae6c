"""/v1/responses (OpenAI's Responses API), stateless, translated onto the chat-completions path
(translation.py): a Responses body becomes a chat request, its result comes back as output items
(reasoning, message, function_call) or as the Responses stream events. A mixin of `Server`
(serving.py), which supplies the shared plumbing through `self`.

    input              a string (one user message) or items: messages (content a string or
                       input_text/output_text parts), function_call (an assistant's call),
                       function_call_output (a tool message answering call_id); reasoning items are dropped
    instructions       a system message first
    tools              function tools: name, description, parameters (strict accepted)
    tool_choice        auto, none, required, {"type": "function", "name": N}
    text.format        json_schema and json_object -> response_format; text -> none
    max_output_tokens  max_tokens; reaching it gives status "incomplete"

Stateless: nothing is stored, so `previous_response_id`, `conversation`, `background` and `prompt`
are refused (400 naming them); `store` is accepted and every response says "store": false.
`top_logprobs` is refused too (logprobs are chat completions' own).
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from runtime.entrypoints.openai.protocol import APIError, bad_request
from runtime.entrypoints.openai.translation import Builder, Translation, id_hex, need_str, new_hex, text_of

# What this server cannot do (the first four: it keeps no state), with the value that means "not asked for".
UNSUPPORTED = {"previous_response_id": None, "conversation": None, "background": False, "prompt": None,
               "top_logprobs": 0}
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """OpenAI's Responses body (the fields this server reads; others are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict] = None
    stream: bool = False
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    reasoning: Optional[dict] = None
    previous_response_id: Optional[str] = None
    conversation: Any = None
    background: Optional[bool] = None
    prompt: Any = None
    top_logprobs: Optional[int] = None


class ResponsesServing:
    """Server's /v1/responses handler."""

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, ResponsesRequest, self.prepare_chat, chat=True, api=Responses())


class Responses(Translation):
    model_cls = ResponsesRequest
    list_field = "input"

    def chat_body(self, b: ResponsesRequest) -> dict:
        for name, off in UNSUPPORTED.items():
            if getattr(b, name) not in (None, off):
                why = ("this server keeps no state between responses (send the whole conversation as input)"
                       if name != "top_logprobs" else "use /v1/chat/completions for logprobs")
                raise bad_request(f"{name} is not supported: {why}", name, "unsupported_parameter")
        if b.max_output_tokens is not None and b.max_output_tokens < 1:
            raise bad_request(f"max_output_tokens must be at least 1, got {b.max_output_tokens}", "max_output_tokens")
        messages = [] if b.instructions is None else [{"role": "system", "content": b.instructions}]
        if isinstance(b.input, str):
            messages.append({"role": "user", "content": b.input})
        else:
            for i, item in enumerate(b.input):
                add_item(messages, item, i)
        chat = {"model": b.model, "messages": messages, "max_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "stream": b.stream, "user": b.user,
                "parallel_tool_calls": b.parallel_tool_calls, "response_format": response_format(b.text)}
        if b.stream:
            chat["stream_options"] = {"include_usage": True}
        if b.tools is not None:
            chat["tools"] = [function_tool(t, i) for i, t in enumerate(b.tools)]
        if isinstance(b.tool_choice, dict):
            if b.tool_choice.get("type") != "function":
                raise bad_request('tool_choice must be auto, none, required or {"type": "function", "name": ...}',
                                  "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": need_str(b.tool_choice, "name",
                                                                                     "tool_choice")}}
        elif b.tool_choice is not None:
            chat["tool_choice"] = b.tool_choice
        return chat

    def builder(self, prep) -> "ResponseBuilder":
        return ResponseBuilder(prep, self.body)


def add_item(messages: list[dict], item: dict, i: int) -> None:
    where = f"input.{i}"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}", f"{where}.role")
        messages.append({"role": role, "content": text_of(item.get("content"), f"{where}.content", TEXT_PARTS)})
    elif kind == "function_call":
        args = item.get("arguments")
        if not isinstance(args, str):
            raise bad_request(f"{where}.arguments must be a string of JSON", f"{where}.arguments", "invalid_type")
        call = {"id": need_str(item, "call_id", where), "type": "function",
                "function": {"name": need_str(item, "name", where), "arguments": args}}
        if messages and messages[-1]["role"] == "assistant":  # one turn: its text and its calls
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": need_str(item, "call_id", where),
                         "content": text_of(item.get("output"), f"{where}.output", TEXT_PARTS)})
    elif kind != "reasoning":  # an earlier turn's reasoning is not rendered again
        raise bad_request(f"{where}: {kind!r} items are not supported (message, function_call, "
                          "function_call_output, reasoning)", f"{where}.type", "unsupported_parameter")


def function_tool(t: dict, i: int) -> dict:
    where = f"tools.{i}"
    if t.get("type") != "function":
        raise bad_request(f"{where}: only function tools are supported, got type {t.get('type')!r}",
                          f"{where}.type", "unsupported_parameter")
    fn = {"name": need_str(t, "name", where)}
    for key in ("description", "parameters"):
        if t.get(key) is not None:
            fn[key] = t[key]
    return {"type": "function", "function": fn}


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                      "text.format.type")


# ====================================================================== results


class ResponseBuilder(Builder):
    """Output items from the chat's pieces, and the Responses stream events for them."""

    def __init__(self, prep, body: ResponsesRequest):
        self.id = "resp_" + id_hex(prep.request_id)
        self.prep, self.body = prep, body
        self.items: list[dict] = []
        self.open: dict | None = None
        self.seq = 0

    def event(self, kind: str, **fields) -> tuple:
        self.seq += 1
        return kind, {"type": kind, **fields, "sequence_number": self.seq - 1}

    def response(self, status: str) -> dict:
        b, length = self.body, self.finish_reason == "length"
        tools = [function_tool(t, i)["function"] | {"type": "function", "strict": t.get("strict")}
                 for i, t in enumerate(b.tools or ())]
        return {"id": self.id, "object": "response", "created_at": self.prep.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" and length else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
                "model": self.prep.model, "output": copy.deepcopy(self.items) if status != "in_progress" else [],
                "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": b.reasoning or {"effort": None, "summary": None}, "store": False,
                "temperature": 1.0 if b.temperature is None else b.temperature,
                "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
                "tool_choice": b.tool_choice or "auto", "tools": tools,
                "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled",
                "usage": self._usage() if status != "in_progress" else None, "user": b.user}

    def _usage(self) -> dict:
        u = self.usage or {"prompt_tokens": len(self.prep.items[0][1]), "completion_tokens": 0}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}

    @property
    def status(self) -> str:
        return "completed" if self.finish_reason in ("stop", "tool_calls") else "incomplete"

    def start(self) -> list:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def add(self, piece: tuple) -> list:
        kind = piece[0]
        if kind == "args":
            self.open["arguments"] += piece[1]
            return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                               output_index=len(self.items) - 1, delta=piece[1])]
        events = []
        if kind == "call":
            return self._close("completed") + self._open({
                "id": "fc_" + id_hex(piece[1]), "type": "function_call", "call_id": "call_" + id_hex(piece[1]),
                "name": piece[2], "arguments": ""})
        item_type = "message" if kind == "text" else "reasoning"
        if self.open is None or self.open["type"] != item_type:
            events += self._close("completed")
            if kind == "text":
                events += self._open_message()
            else:
                events += self._open({"id": "rs_" + new_hex(), "type": "reasoning", "summary": [],
                                      "content": [{"type": "reasoning_text", "text": ""}]})
        part = self.open["content"][0]
        part["text"] += piece[1]
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "text":
            return events + [self.event("response.output_text.delta", **where, delta=piece[1], logprobs=[])]
        return events + [self.event("response.reasoning_text.delta", **where, delta=piece[1])]

    def _open_message(self) -> list:
        return self._open({"id": "msg_" + new_hex(), "type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]})

    def _open(self, item: dict) -> list:
        self.open = item
        self.items.append(item)
        added = dict(item, status="in_progress")
        if "content" in item:
            added["content"] = []
        events = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]
        if "content" in item:
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part=dict(item["content"][0], text="")))
        return events

    def _close(self, status: str) -> list:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", **at, name=item["name"],
                                 arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self.event(done, **at, content_index=0, text=part["text"], **extra),
                      self.event("response.content_part.done", **at, content_index=0, part=dict(part))]
        return events + [self.event("response.output_item.done", output_index=at["output_index"],
                                    item=copy.deepcopy(item))]

    def finish(self) -> list:
        status = self.status
        events = [] if self.items else self._open_message()  # an empty answer is an empty message
        events += self._close("completed" if status == "completed" else "incomplete")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=self.response(status))]

    def error(self, err: APIError) -> tuple:
        return self.event("error", code=err.code, message=err.message, param=err.param)

    def final(self) -> dict:
        return self.response(self.status)
