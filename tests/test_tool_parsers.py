"""The tool-call parsers (runtime/entrypoints/openai/tool_parsers.py) on the strings each family
emits, whole and streamed one character at a time: the same content and calls either way, and a
malformed call (broken JSON, an unknown tool, a call cut short) kept as content."""

from __future__ import annotations

import json

import pytest

from runtime.entrypoints.openai.tool_parsers import PARSERS, ToolCall, tool_parser

TOOLS = {"get_weather", "get_time"}
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
NOW = ToolCall("get_time", "{}")

# (parser, model output, content, calls): the formats as the families' chat templates and model
# cards describe them.
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.\n\n", [PARIS, NOW]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None, [PARIS]),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}', None, [PARIS, NOW]),
    ("llama3_json", 'The JSON is {"name": "get_time", "parameters": {}}',
     'The JSON is {"name": "get_time", "parameters": {}}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [PARIS, NOW]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Checking.", [PARIS]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}", None, [PARIS, NOW]),
    ("pythonic", '[get_weather(city="Paris"), get_time()]', None, [PARIS, NOW]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [PARIS]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
]
# Malformed calls: each stays in the content, as written.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>'),  # not one of the tools
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut by max_tokens
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),  # arguments not an object
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", "[TOOL_CALLS]unknown_tool[ARGS]{}"),
    ("pythonic", '[get_weather(city="Paris"'),
    ("pythonic", "[get_weather(city=open('/etc/passwd'))]"),  # not a literal: never evaluated
    ("pythonic", "[" * 5000 + "]" * 5000),
    ("hermes", "<tool_call>" + "[" * 100000 + "</tool_call>"),
]


def _stream(name: str, text: str) -> tuple[str, list[ToolCall]]:
    p = tool_parser(name, TOOLS)
    pieces = []
    for ch in text:
        pieces += p.feed(ch)
    pieces += p.finish()
    return "".join(x for x in pieces if isinstance(x, str)), [x for x in pieces if isinstance(x, ToolCall)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_each_format_whole_and_streamed(name, text, content, calls):
    got = tool_parser(name, TOOLS).parse(text)
    assert (got.content, got.calls) == (content, calls)
    streamed_content, streamed_calls = _stream(name, text)
    assert (streamed_content, streamed_calls) == (content or "", calls)
    for call in got.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("name,text", MALFORMED)
def test_a_malformed_call_stays_content(name, text):
    got = tool_parser(name, TOOLS).parse(text)
    assert got.calls == [] and got.content == text
    assert _stream(name, text) == (text, [])


def test_a_stream_sends_text_before_a_call_at_once_and_holds_a_markers_prefix():
    p = tool_parser("hermes", TOOLS)
    assert p.feed("Sure, ") == ["Sure, "]
    assert p.feed("<tool") == []  # may begin a call
    assert p.feed('_call>{"name": "get_time", "arguments": {}}') == []  # a call not yet closed
    assert p.feed("</tool_call>") == [NOW]
    assert p.feed(" Done.") == [" Done."]
    assert p.finish() == []


def test_without_a_tool_list_any_name_is_a_call_and_unknown_parsers_are_refused():
    assert tool_parser("hermes").parse('<tool_call>{"name": "x", "arguments": {}}</tool_call>').calls == \
        [ToolCall("x", "{}")]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        tool_parser("granite")
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
