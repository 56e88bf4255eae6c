"""Admitting a request body: the checks that run before any heavy work (tokenizing, chat templates,
grammar compiles), in order: the JSON parse and its depth and text, the message count, the request
model, then the sizes (prompt characters, messages, the constraint's size). `admit` is the one
implementation: the server runs it on each body (`Server.parse`), and its body checker processes
(checker.py) run it first on large bodies, so that a large bad body is refused without the server
parsing it. Plain Python (json, pydantic, the protocol models): no jax, no tokenizer."""

from __future__ import annotations

import json

from pydantic import ValidationError

from runtime.core.sampling_params import RequestError, StructuredOutputsParams
from runtime.entrypoints.openai.chat_tools import message_chars, template_message, tool_constraint
from runtime.entrypoints.openai.protocol import (MAX_JSON_DEPTH, APIError, bad_request, check_json_text,
                                                 may_hold_surrogates, validation_error)

# The limits `admit` reads from its `limits` object (the ServerConfig, or the checker's copy of them).
LIMIT_FIELDS = ("max_prompt_chars", "max_chat_messages", "max_grammar_chars")


def admit(raw: bytes, model_cls, limits):
    """JSON body -> request model (`model_cls`), or the APIError that refuses it. `limits` has the
    LIMIT_FIELDS attributes."""
    obj = load_json(raw)
    check_num_messages(obj.get("messages"), limits.max_chat_messages)  # before walking them all
    check_json_text(obj, surrogates=may_hold_surrogates(raw))
    for name, off in getattr(model_cls, "UNSUPPORTED", {}).items():
        if name in obj and obj[name] is not None and obj[name] != off:
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    try:
        r = model_cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    check_sizes(r, limits)
    return r


def load_json(raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except ValueError as e:  # bad UTF-8, bad JSON, an integer past Python's 4300-digit limit
        raise bad_request(f"could not parse the JSON body of the request: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", None,
                          "invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return obj


def check_sizes(r, limits) -> None:
    """The size limits a request model is held to before tokenizing, templating or compiling."""
    prompt = getattr(r, "prompt", None)
    if prompt is not None:
        check_prompt_chars(prompt_chars(prompt), limits.max_prompt_chars, "prompt")
    if getattr(r, "messages", None) is not None:
        chat_messages(r.messages, limits)
    if hasattr(r, "structured_outputs"):
        try:
            so = request_constraint(r)  # a chat's tools are checked there (chat_tools.tool_constraint)
            if so is not None:
                so.check_size(limits.max_grammar_chars)
        except RequestError as e:
            raise bad_request(e.message, e.param, e.code) from None
    if getattr(r, "tools", None) is not None:  # rendered into the prompt
        check_prompt_chars(len(json.dumps(r.tools)), limits.max_prompt_chars, "tools")


def prompt_chars(prompt) -> int:
    """Characters in a completion's prompt: a string, or the strings of a list (token ids count none)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0


def check_prompt_chars(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise APIError(413, f"the prompt has {n} characters; the limit is {limit} characters", param=param,
                       code="prompt_too_long")


def check_num_messages(messages, limit: int) -> None:
    """Many messages cost time to walk and to render even when they are empty: counted first."""
    if isinstance(messages, list) and len(messages) > limit:
        raise bad_request(f"the request has {len(messages)} messages; the limit is {limit}", "messages",
                          "too_many_messages")


def chat_messages(messages, limits) -> list[dict]:
    """A chat's messages as the template takes them ({"role", "content": str}; text parts joined,
    "developer" as "system"; an assistant's tool_calls and a tool result's tool_call_id as
    chat_tools.template_message reads them), within the message count and the prompt character cap."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages",
                          "missing_required_parameter" if messages is None else "invalid_value")
    check_num_messages(messages, limits.max_chat_messages)  # before the template renders them
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages.{i}", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:  # any other role string goes to the template, as in vLLM
            raise bad_request(f"messages[{i}].role must be a non-empty string; got {role!r}",
                              f"messages.{i}.role", "invalid_type")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                      f"messages.{i}.content.{j}", "unsupported_parameter")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              f"messages.{i}.content", "invalid_type")
        try:
            tool_parts = template_message(m, i)
        except RequestError as e:
            raise bad_request(e.message, e.param, e.code) from None
        out.append({"role": "system" if role == "developer" else role, "content": content, **tool_parts})
    check_prompt_chars(sum(len(m["content"]) + message_chars(m) for m in out), limits.max_prompt_chars, "messages")
    return out


def request_constraint(r) -> StructuredOutputsParams | None:
    """The request's output constraint, from `response_format` (OpenAI's), `structured_outputs`
    (vLLM's), or a chat's `tool_choice` (required, or a named function): one of them, RequestError
    otherwise."""
    so = StructuredOutputsParams.from_response_format(r.response_format)
    if so is not None and r.structured_outputs is not None:
        raise RequestError("response_format and structured_outputs cannot both constrain the output; give one",
                           "structured_outputs")
    so = so if so is not None else StructuredOutputsParams.of(r.structured_outputs)
    tools = tool_constraint(r) if hasattr(r, "tool_choice") else None
    if tools is not None and so is not None:
        raise RequestError(f"tool_choice {r.tool_choice!r} constrains the output, and so does "
                           f"{so.source_param}; give one", "tool_choice")
    return tools if tools is not None else so
