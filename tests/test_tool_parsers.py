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


# ====================================================================== reasoning parsers

from runtime.entrypoints.openai.reasoning_parsers import prompt_opens_thinking, reasoning_parser  # noqa: E402

QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking=False writes this
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"  # DeepSeek-R1's template opens the block itself


@pytest.mark.parametrize("name, prompt, text, reasoning, content", [
    ("qwen3", QWEN3_PROMPT, "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "Hello!"),
    ("qwen3", QWEN3_PROMPT, "Hello!", None, "Hello!"),
    ("qwen3", QWEN3_NO_THINK_PROMPT, "Hello!", None, "Hello!"),
    ("qwen3", QWEN3_PROMPT, "<think>\ncut by max_tokens", "\ncut by max_tokens", None),
    ("qwen3", QWEN3_PROMPT + "<think>\n", "opened by the prompt\n</think>\n\nHi", "opened by the prompt\n", "Hi"),
    ("deepseek_r1", R1_PROMPT, "Greeting.\n</think>\n\nHello!", "Greeting.\n", "Hello!"),
    ("deepseek_r1", "", "<think>\nGreeting.\n</think>\n\nHello!", "\nGreeting.\n", "Hello!"),
    ("deepseek_r1", R1_PROMPT, "never closed", "never closed", None),
    ("deepseek_r1", R1_PROMPT, "a</think>b <think>c</think>", "a", "b <think>c</think>"),
])
def test_reasoning_whole_and_streamed(name, prompt, text, reasoning, content):
    assert reasoning_parser(name, prompt).split(text) == (reasoning, content)
    for step in (1, 3):  # one character at a time, and three
        p, events = reasoning_parser(name, prompt), []
        for i in range(0, len(text), step):
            events += p.feed(text[i:i + step])
        events += p.finish()
        joined = {k: "".join(t for kind, t in events if kind == k) or None for k in ("reasoning", "content")}
        assert (joined["reasoning"], joined["content"]) == (reasoning, content)
        # No piece of the closing tag is ever sent as reasoning.
        assert not any(kind == "reasoning" and t.endswith(("<", "</", "</think")) for kind, t in events)


def test_reasoning_parser_options():
    assert reasoning_parser("qwen3", QWEN3_PROMPT, {"enable_thinking": False}) is None
    assert prompt_opens_thinking(R1_PROMPT) and not prompt_opens_thinking(QWEN3_NO_THINK_PROMPT)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("granite")
