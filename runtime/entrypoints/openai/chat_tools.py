"""Tools and reasoning in chat completions, as vLLM serves them: the request side (the `tools` list,
`tool_choice`, and the constraint that `required` or a named function puts on the output) and the
output side (`ChatOutput`: one choice's text split into reasoning, content and tool calls, whole or
as a stream). Plain Python: admission (checker processes) imports it.

tool_choice:
    none       tools are rendered into the prompt; the output is plain content.
    auto       the output is parsed by the server's --tool-call-parser (needs --enable-auto-tool-choice).
    required   the output is held by a grammar to a JSON array of one or more calls, each
               {"name": <a tool's name>, "parameters": <that tool's arguments>} (one with
               parallel_tool_calls false), and returned as tool_calls.
    {"type": "function", "function": {"name": N}}   the output is held to N's parameters schema, and
               returned as one call of N.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from runtime.core.sampling_params import ANY_OBJECT_SCHEMA, RequestError, StructuredOutputsParams
from runtime.entrypoints.openai.reasoning_parsers import reasoning_parser
from runtime.entrypoints.openai.tool_parsers import ToolCall, tool_parser

MAX_TOOLS = 128  # OpenAI's own limit on a request's tools
TOOL_CHOICES = ("none", "auto", "required")


def check_tools(tools) -> list[dict]:
    """The request's `tools` as function tools {"type": "function", "function": {"name", "description",
    "parameters"}}: RequestError naming the field otherwise."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"the request has {len(tools)} tools; the limit is {MAX_TOOLS}", "tools",
                           "too_many_tools")
    names = set()
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise RequestError(f"{where}: only function tools are supported ({{\"type\": \"function\", "
                               f"\"function\": {{...}}}})", where, "invalid_type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", f"{where}.function", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if name in names:
            raise RequestError(f"{where}.function.name: {name!r} is named twice", f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema (an object)",
                               f"{where}.function.parameters", "invalid_type")
        if fn.get("description") is not None and not isinstance(fn.get("description"), str):
            raise RequestError(f"{where}.function.description must be a string", f"{where}.function.description",
                               "invalid_type")
    return tools


def tool_names(tools) -> list[str]:
    return [t["function"]["name"] for t in tools or ()]


def choice_mode(tools, tool_choice) -> tuple[str, str | None]:
    """(mode, the named function) of a request: mode one of none, auto, required, named."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise RequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got "
                               f"{tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise RequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise RequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in tool_names(tools):
        raise RequestError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "named", name


def _parameters(tools, name: str) -> dict:
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    return fn.get("parameters") or ANY_OBJECT_SCHEMA


def tool_constraint(r) -> StructuredOutputsParams | None:
    """The constraint `tool_choice` puts on the output (required, or a named function), or None."""
    tools = getattr(r, "tools", None)
    if tools is None and getattr(r, "tool_choice", None) is None:
        return None
    tools = check_tools(tools) if tools is not None else []
    mode, name = choice_mode(tools, r.tool_choice)
    if mode == "named":
        schema = _parameters(tools, name)
    elif mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _parameters(tools, n)},
                  "required": ["name", "parameters"], "additionalProperties": False} for n in tool_names(tools)]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if getattr(r, "parallel_tool_calls", None) is False:
            schema["maxItems"] = 1
    else:
        return None
    # Compact JSON: the arguments are re-serialized anyway, and a call takes the fewest tokens.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, source_param="tools")


# ====================================================================== messages


def template_message(m: dict, i: int) -> dict:
    """The tool parts of a chat message as templates read them: an assistant's `tool_calls` (each
    call's `arguments` as an object, as HF templates expect) and a tool result's `tool_call_id`."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(f"messages[{i}].tool_calls must be a list, on an assistant message",
                               f"messages.{i}.tool_calls", "invalid_type")
        norm = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                   f"\"function\": {{\"name\", \"arguments\"}}}}", f"messages.{i}.tool_calls.{j}")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except (ValueError, RecursionError):
                    raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                       f"messages.{i}.tool_calls.{j}.function.arguments") from None
            norm.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = norm
    if m["role"] == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise RequestError(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                               f"messages.{i}.tool_call_id", "missing_required_parameter")
        out["tool_call_id"] = tid
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def message_chars(m: dict) -> int:
    """The characters a message's tool parts add to the prompt."""
    return sum(len(json.dumps(c["function"]["arguments"])) + len(c["function"]["name"])
               for c in m.get("tool_calls", ()))


# ====================================================================== outputs


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class OutputSpec:
    """How a request's outputs are read: its tool mode, the server's parsers, and its prompt."""

    mode: str = "none"  # none, auto, required, named
    named: str | None = None
    tool_parser: str | None = None  # for auto
    tools: list[str] = field(default_factory=list)
    parallel: bool = True
    reasoning_parser: str | None = None
    prompt: str = ""
    template_kwargs: dict | None = None

    @property
    def plain(self) -> bool:
        return self.mode == "none" and self.reasoning_parser is None

    def constraint_after_reasoning(self) -> str | None:
        """Where an output constraint (structured outputs, a tool_choice's grammar) begins, as vLLM
        applies it: after the thinking ("required": the output thinks first; "optional": it may), or
        from the first token (None: no reasoning parser, or thinking turned off)."""
        parser = reasoning_parser(self.reasoning_parser, self.prompt, self.template_kwargs) \
            if self.reasoning_parser else None
        if parser is None:
            return None
        return "required" if parser.thinks_untagged else "optional"


class ChatOutput:
    """One choice's text as events: ("reasoning", text), ("content", text), ("call", id, name) to open a
    tool call, ("args", text) for its arguments (fragments that join to a JSON object). Fed the text's
    deltas in order (`feed`), then `finish`; the whole text at once gives the same events."""

    def __init__(self, spec: OutputSpec):
        self.spec = spec
        self.reasoning = (reasoning_parser(spec.reasoning_parser, spec.prompt, spec.template_kwargs)
                          if spec.reasoning_parser else None)
        self.parser = tool_parser(spec.tool_parser, spec.tools) if spec.mode == "auto" else None
        self._held = ""  # required: the whole JSON array, parsed at the end
        self._named_open = False
        self.num_calls = 0
        self._content_text = ""  # the content handed out, for `outcome`

    def feed(self, delta: str) -> list[tuple]:
        return self._after_reasoning(self.reasoning.feed(delta) if self.reasoning else [("content", delta)], False)

    def finish(self) -> list[tuple]:
        return self._after_reasoning(self.reasoning.finish() if self.reasoning else [], True)

    def _after_reasoning(self, pieces, final: bool) -> list[tuple]:
        out = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(("reasoning", text))
            else:
                out += self._content(text)
        if final:
            out += self._content_end()
        self._content_text += "".join(e[1] for e in out if e[0] == "content")
        return [e for e in out if e[0] in ("call",) or e[-1]]

    def outcome(self) -> str | None:
        """How the output read as tool calls, for the metrics: parsed (one call or more), malformed
        (a call's marker, or a constrained output, that gave no call), no_call; None without tools."""
        if self.spec.mode == "none":
            return None
        if self.num_calls:
            return "parsed"
        if self.spec.mode != "auto" or any(len(m) > 1 and m in self._content_text for m in self.parser.starts):
            return "malformed"
        return "no_call"

    def _content(self, text: str) -> list[tuple]:
        mode = self.spec.mode
        if mode == "auto":
            return self._calls(self.parser.feed(text))
        if mode == "required":
            self._held += text
            return []
        if mode == "named":
            out = []
            if not self._named_open and text:
                self._named_open = True
                self.num_calls += 1
                out.append(("call", new_call_id(), self.spec.named))
            return out + [("args", text)]
        return [("content", text)]

    def _content_end(self) -> list[tuple]:
        if self.spec.mode == "auto":
            return self._calls(self.parser.finish())
        if self.spec.mode == "required":
            return self._required(self._held)
        return []

    def _calls(self, pieces) -> list[tuple]:
        out = []
        for p in pieces:
            if isinstance(p, ToolCall):
                if not self.spec.parallel and self.num_calls:
                    continue  # parallel_tool_calls false keeps the first
                self.num_calls += 1
                out += [("call", new_call_id(), p.name), ("args", p.arguments)]
            else:
                out.append(("content", p))
        return out

    def _required(self, text: str) -> list[tuple]:
        """The grammar's JSON array as calls; text that is not one (cut by max_tokens) stays content."""
        try:
            calls = json.loads(text)
            ok = isinstance(calls, list) and all(isinstance(c, dict) and c.get("name") in self.spec.tools
                                                 and isinstance(c.get("parameters", {}), dict) for c in calls)
        except (ValueError, RecursionError):
            ok = False
        if not ok or not calls:
            return [("content", text)]
        return self._calls(ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                           for c in calls)


def message_from_events(events, role: str, echo: str = "") -> tuple[dict, int]:
    """A chat message (content, tool_calls, reasoning_content) from one choice's events, and its number
    of tool calls."""
    content = echo + "".join(e[1] for e in events if e[0] == "content")
    reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
    calls: list[dict] = []
    for e in events:
        if e[0] == "call":
            calls.append({"id": e[1], "type": "function", "function": {"name": e[2], "arguments": ""}})
        elif e[0] == "args":
            calls[-1]["function"]["arguments"] += e[1]
    # No content (only calls, or only thinking) is null, as vLLM sends it.
    msg = {"role": role, "content": content if (content or not (calls or reasoning)) else None, "tool_calls": calls}
    return msg, len(calls)


def reasoning_fields(events) -> dict:
    """reasoning_content (and `reasoning`, newer vLLM's name) from a choice's events."""
    text = "".join(e[1] for e in events if e[0] == "reasoning") or None
    return {"reasoning_content": text, "reasoning": text}


def delta_from_events(events, num_calls: int) -> list[dict]:
    """Stream deltas for `events` (in order: content, reasoning and tool-call deltas as vLLM streams
    them). `num_calls`: the calls the choice has opened, these events' included (ChatOutput.num_calls)."""
    deltas: list[dict] = []
    index = num_calls - sum(e[0] == "call" for e in events) - 1  # the call open before these events
    for e in events:
        if e[0] == "content":
            deltas.append({"content": e[1]})
        elif e[0] == "reasoning":
            deltas.append({"reasoning_content": e[1], "reasoning": e[1]})
        elif e[0] == "call":
            index += 1
            deltas.append({"tool_calls": [{"index": index, "id": e[1], "type": "function",
                                           "function": {"name": e[2], "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": e[1]}}]})
    return deltas
