"""Parses the text that `ir.printer.print_graph` writes back into a Graph."""

from __future__ import annotations

import json
import re
from typing import Any

from ir.attrs import ROLE
from ir.graph import Graph, Node, freeze_attrs

_TYPE = re.compile(r"^([a-z0-9]+)\[(.*)\]$")
_NODE = re.compile(r"^%(\d+) = ([a-z_0-9]+)\((.*?)\)(.*) : ([a-z0-9]+\[.*?\])$")
_LEAF = re.compile(r"^(input|param) %([^\s]+) : ([a-z0-9]+\[.*?\])(.*)$")
_ROLE = re.compile(r"\s+role=([A-Za-z_][A-Za-z0-9_]*)$")
_OUT = re.compile(r"^output ([^\s]+) = %([^\s]+)$")


class ParseError(ValueError):
    pass


def _parse_type(text: str, lineno: int) -> tuple[tuple, str]:
    m = _TYPE.match(text.strip())
    if not m:
        raise ParseError(f"line {lineno}: bad type {text!r}")
    dims = []
    for d in filter(None, (x.strip() for x in m.group(2).split(","))):
        dims.append(int(d) if re.fullmatch(r"-?\d+", d) else d)
    return tuple(dims), m.group(1)


def _thaw(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_thaw(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _thaw(x)) for k, x in v.items()))
    return v


def _parse_attrs(text: str, lineno: int) -> dict[str, Any]:
    text = text.strip()
    if not text:
        return {}
    if not (text.startswith("{") and text.endswith("}")):
        raise ParseError(f"line {lineno}: bad attributes {text!r}")
    body, attrs, i = text[1:-1], {}, 0
    dec = json.JSONDecoder()
    while i < len(body):
        m = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)=").match(body, i)
        if not m:
            raise ParseError(f"line {lineno}: bad attribute at {body[i:]!r}")
        key, i = m.group(1), m.end()
        try:
            value, i = dec.raw_decode(body, i)
        except json.JSONDecodeError as e:
            raise ParseError(f"line {lineno}: bad value for attribute {key!r}: {e}") from None
        attrs[key] = _thaw(value)
        m = re.compile(r"\s*,?\s*").match(body, i)
        i = m.end()
    return attrs


def _strip_comment(line: str) -> str:
    # Trailing `# ...` annotations (e.g. sharding specs) are documentation, not IR.
    cut = line.find("  # ")
    return (line[:cut] if cut >= 0 else line).strip()


def parse_graph(text: str) -> Graph:
    """Reads printed IR text. Raises ParseError naming the line on malformed input."""
    env: dict[str, Node] = {}
    inputs: list[Node] = []
    outputs: list[tuple[str, Node]] = []
    meta: dict[str, Any] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = _strip_comment(raw)
        if not line:
            continue
        if line.startswith("meta"):
            meta = _parse_attrs(line[4:], lineno)
            continue
        if m := _LEAF.match(line):
            kind, name, ty, attrs = m.groups()
            shape, dtype = _parse_type(ty, lineno)
            role = _ROLE.search(attrs)
            if role:
                attrs = attrs[:role.start()]
            a = {"name": name, **_parse_attrs(attrs, lineno)} | ({ROLE: role.group(1)} if role else {})
            node = Node(kind, (), freeze_attrs(a), shape, dtype)
            if name in env:
                raise ParseError(f"line {lineno}: leaf %{name} declared twice")
            env[name] = node
            inputs.append(node)
        elif m := _NODE.match(line):
            idx, op, args, attrs, ty = m.groups()
            shape, dtype = _parse_type(ty, lineno)
            ins = []
            for a in filter(None, (x.strip() for x in args.split(","))):
                if not a.startswith("%") or a[1:] not in env:
                    raise ParseError(f"line {lineno}: use of undefined value {a}")
                ins.append(env[a[1:]])
            env[idx] = Node(op, tuple(ins), freeze_attrs(_parse_attrs(attrs, lineno)), shape, dtype)
        elif m := _OUT.match(line):
            name, ref = m.groups()
            if ref not in env:
                raise ParseError(f"line {lineno}: output {name} refers to undefined %{ref}")
            outputs.append((name, env[ref]))
        else:
            raise ParseError(f"line {lineno}: cannot parse {line!r}")
    return Graph(tuple(inputs), tuple(outputs), freeze_attrs(meta))
