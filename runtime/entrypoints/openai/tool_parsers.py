"""Tool calls in a model's text, in the formats of the families we serve (vLLM's `--tool-call-parser`
names): each parser turns a finished output into content and calls (`parse`), or a stream of
text deltas into content deltas and whole calls (`feed`, then `finish`).

    hermes       Qwen 2.5/3 and many fine-tunes:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.1-3.3:  {"name": ..., "parameters": {...}}, optionally after <|python_tag|>,
                 several joined by ";"
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...}
    pythonic     Llama 3.2/4 and Gemma-style prompts:  [get_weather(city="Paris"), other()]

A call is kept only when it parses whole, names one of the request's tools, and its arguments are
a JSON object; anything else stays in the content, as the model wrote it (a malformed call is
never an error). A stream holds each call until it is complete, then sends it in one piece, so
what a client joins is always valid JSON; the text around the calls streams as it comes, less a
tail that may be the start of a call's marker.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Parsed:
    content: str | None  # None when the text was only calls
    calls: list[ToolCall]


class ToolParser:
    """The base: a format is a way to find calls (`_split`) and, for a stream, where a call may begin."""

    name = ""
    starts: tuple[str, ...] = ()  # markers that begin a call mid-text (the stream holds their prefixes)
    leading = False  # calls only at the start of the output (the whole output is then held)

    def __init__(self, tool_names=None):
        self.tool_names = None if tool_names is None else set(tool_names)
        self._text = ""
        self._sent = 0  # characters of _text handed out as content or calls
        self._plain = False  # a leading-calls format whose output began as text

    # ------------------------------------------------------------ whole outputs

    def parse(self, text: str) -> Parsed:
        pieces = self._split(text)
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        content = "".join(p for p in pieces if isinstance(p, str))
        if calls and not content.strip():
            content = None
        return Parsed(content, calls)

    def _split(self, text: str) -> list:
        """The text as content strings and ToolCalls, in order."""
        raise NotImplementedError

    def _call(self, name, arguments) -> ToolCall | None:
        if not isinstance(name, str) or (self.tool_names is not None and name not in self.tool_names):
            return None
        if isinstance(arguments, str):  # some fine-tunes send the object as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    # ------------------------------------------------------------ streams

    def feed(self, delta: str) -> list:
        """Content strings and whole ToolCalls that this delta completes, in order."""
        self._text += delta
        return self._drain(final=False)

    def finish(self) -> list:
        """What is still held when the output ends."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list:
        text = self._text
        if self.leading and not self._plain:
            head = text.lstrip()
            if final or any(s.startswith(head[:len(s)]) or head.startswith(s) for s in self.starts):
                if not final:
                    return []  # it may be calls: held to the end
                out = self._split(text[self._sent:])
                self._sent = len(text)
                return [p for p in out if p != ""]
            self._plain = True  # it began as text: no calls follow in this format
        if self._plain:
            out, self._sent = text[self._sent:], len(text)
            return [out] if out else []
        # Everything before a call that has not closed; a tail that may begin a marker waits.
        end = len(text) if final else self._stable_end(text)
        out = self._split(text[self._sent:end]) if end > self._sent else []
        self._sent = max(self._sent, end)
        return [p for p in out if p != ""]

    def _stable_end(self, text: str) -> int:
        """How much of `text` can be handed out now: up to an open call, or a tail that may open one."""
        open_at = self._open_call(text)
        if open_at is not None:
            return open_at
        for k in range(min(len(text), max(map(len, self.starts), default=0)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.starts):
                return len(text) - k
        return len(text)

    def _open_call(self, text: str) -> int | None:
        """Where a call begins that has not ended yet, or None."""
        return None


class HermesParser(ToolParser):
    name = "hermes"
    starts = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def _split(self, text):
        out, pos = [], 0
        for m in self._CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except (ValueError, RecursionError):
                obj = None
            call = self._call(obj.get("name"), obj.get("arguments", obj.get("parameters"))) \
                if isinstance(obj, dict) else None
            out += [text[pos:m.start()], call if call is not None else m.group(0)]
            pos = m.end()
        return out + [text[pos:]]

    def _open_call(self, text):
        start = text.rfind("<tool_call>")
        return start if start >= 0 and text.find("</tool_call>", start) < 0 else None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts = ("<|python_tag|>", "{")
    leading = True

    def _split(self, text):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return [text]
        calls, dec, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return [text]
            call = self._call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) \
                if isinstance(obj, dict) else None
            if call is None:
                return [text]
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return calls


class MistralParser(ToolParser):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def _split(self, text):
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return [text]
        rest = text[at + len("[TOOL_CALLS]"):]
        calls = self._array(rest) if rest.lstrip().startswith("[") else self._named(rest)
        return [text[:at], *calls] if calls else [text]

    def _array(self, rest: str) -> list[ToolCall] | None:
        try:
            items = json.loads(rest)
        except (ValueError, RecursionError):
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [self._call(i.get("name"), i.get("arguments", i.get("parameters"))) if isinstance(i, dict)
                 else None for i in items]
        return None if None in calls else calls

    def _named(self, rest: str) -> list[ToolCall] | None:
        """name[ARGS]{...}, repeated after further [TOOL_CALLS] markers (newer Mistral tokenizers)."""
        calls, dec = [], json.JSONDecoder()
        for part in rest.split("[TOOL_CALLS]"):
            m = self._NAMED.match(part)
            if m is None:
                return None
            try:
                args, end = dec.raw_decode(part, m.end())
            except (ValueError, RecursionError):
                return None
            call = self._call(m.group(1), args)
            if call is None or part[end:].strip():
                return None
            calls.append(call)
        return calls

    def _open_call(self, text):
        at = text.find("[TOOL_CALLS]")
        return at if at >= 0 else None  # everything after the marker is calls: held to the end


class PythonicParser(ToolParser):
    name = "pythonic"
    starts = ("[", "<|python_start|>")
    leading = True

    def _split(self, text):
        body = text.strip()
        for tag in ("<|python_start|>", "<|python_end|>"):
            body = body.replace(tag, "")
        body = body.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return [text]
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return [text]
        if not isinstance(tree, ast.List) or not tree.elts:
            return [text]
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))) or node.args:
                return [text]
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return [text]
            if len(args) != len(node.keywords):  # **kwargs
                return [text]
            call = self._call(ast.unparse(node.func), args)
            if call is None:
                return [text]
            calls.append(call)
        return calls


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}


def tool_parser(name: str, tool_names=None) -> ToolParser:
    """A fresh parser (one per output: a stream's parser keeps state) for `--tool-call-parser NAME`."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; ours are {', '.join(sorted(PARSERS))}")
    return PARSERS[name](tool_names)
