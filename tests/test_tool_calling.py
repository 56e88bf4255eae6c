"""Tool calling and reasoning output in /v1/chat/completions, end to end with the `openai` client over
real HTTP, on the tiny random model (a byte-level BPE, a chat template that renders tools). A random
model writes a real call where a grammar holds it: `tool_choice` required and named do that
themselves; `auto` is held to the hermes format by a `structured_outputs` regex, and reasoning to a
think block the same way, so the parsers read what a model would write."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

import conftest
from runtime.serve import ServerThread, build_app

# Renders the tools' names, the assistant's calls in hermes tags, and tool results: short, so that
# prompts of bytes stay within the tiny model's context.
TEMPLATE = (
    "{%- if tools %}<|system|>tools: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n"
    "{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}"
    "{%- else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def engine():
    from models.config import get_preset

    tok = conftest.tiny_bpe_tokenizer()
    tok.chat_template = TEMPLATE
    cfg = replace(get_preset("tiny"), name="tiny-bpe", vocab_size=300, eos_token_id=tok.eos_token_id)
    llm = conftest.tiny_llm(seed=0, config=cfg, tokenizer=tok, max_model_len=512, max_num_seqs=4,
                            max_num_batched_tokens=256, num_kv_blocks=160)
    return llm.engine


def serve(engine, **chat):
    app = build_app(engine, served_model_names=["tiny"], log_stats_interval=0, **chat)
    return ServerThread(app)


@pytest.fixture(scope="class")
def server(engine):
    with serve(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as st:
        yield st
    assert not engine.has_unfinished_requests()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def check_calls(calls, names=None):
    assert calls, "no tool calls"
    for c in calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(client, **kw):
    """(content, {index: [id, name, arguments]}, finish_reason) joined from a chat stream."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or ():
            call = calls.setdefault(tc.index, [None, None, ""])
            if tc.id:
                assert call[0] is None, "a call's id comes once, in its first delta"
                call[0], call[1] = tc.id, tc.function.name
            call[2] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return content, calls, reason


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                          max_tokens=120, **kw)


class TestToolChoice:
    def test_required_returns_calls_of_known_tools(self, client):
        r = chat(client, tool_choice="required")
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content is None
        check_calls(msg.tool_calls, {"get_weather", "get_time"})

    def test_required_without_parallel_calls_gives_one(self, client):
        r = chat(client, tool_choice="required", parallel_tool_calls=False)
        assert len(r.choices[0].message.tool_calls) == 1

    def test_named_function_is_called_with_its_schema(self, client):
        r = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        check_calls(calls)
        assert r.choices[0].finish_reason == "tool_calls"

    @pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
    def test_streamed_calls_join_to_the_same_calls(self, client, choice):
        whole = chat(client, tool_choice=choice).choices[0].message.tool_calls
        content, calls, reason = streamed(client, model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                          max_tokens=120, tool_choice=choice)
        assert reason == "tool_calls" and content == ""
        assert [(n, json.loads(a)) for _, n, a in calls.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in whole]
        assert all(i.startswith("chatcmpl-tool-") for i, _, _ in calls.values())

    def test_none_renders_tools_and_answers_in_text(self, client, engine):
        r = chat(client, tool_choice="none")
        msg = r.choices[0].message
        assert not msg.tool_calls and isinstance(msg.content, str)
        assert r.choices[0].finish_reason in ("stop", "length")

    def test_tools_reach_the_template(self, server):
        with_tools = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()["count"]
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": USER, "tools": TOOLS, "max_tokens": 1, "tool_choice": "none"}).json()
        assert r["usage"]["prompt_tokens"] > with_tools  # the tools' names were rendered

    def test_auto_parses_the_models_call(self, client):
        so = {"regex": "It is sunny\\. " + HERMES_CALL}
        r = chat(client, tool_choice="auto", extra_body={"structured_outputs": so})
        msg = r.choices[0].message
        assert msg.content == "It is sunny. "
        check_calls(msg.tool_calls, {"get_weather"})
        assert r.choices[0].finish_reason == "tool_calls"
        content, calls, reason = streamed(client, model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                          max_tokens=120, extra_body={"structured_outputs": so})
        assert content == "It is sunny. " and reason == "tool_calls"
        assert [(n, json.loads(a)) for _, n, a in calls.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]

    def test_auto_without_a_call_is_content(self, client):
        r = chat(client, extra_body={"structured_outputs": {"regex": "No tool needed\\."}})
        assert r.choices[0].message.content == "No tool needed."
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"

    def test_a_malformed_call_stays_content_and_is_counted(self, client, server):
        bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
        r = chat(client, extra_body={"structured_outputs": {"regex": bad.replace("{", "\\{").replace("}", "\\}")}})
        assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
        metrics = httpx.get(server.url + "/metrics").text
        assert 'jaxserve:tool_call_outputs_total{mode="auto",model_name="tiny",outcome="malformed"}' in metrics
        assert 'outcome="parsed"' in metrics

    def test_the_conversation_goes_on_with_tool_results(self, client):
        call = chat(client, tool_choice="required").choices[0].message.tool_calls[0]
        messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=4)
        assert r.choices[0].message.content is not None
        prompt = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize",
                            json={"messages": messages, "return_token_strs": False}).json()
        assert prompt["count"] > 0


class TestBadTools:
    """Each a 400 naming the field, before any step."""

    @pytest.mark.parametrize("body, param", [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER] * 1000}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
        ({"messages": USER + [{"role": "tool", "content": "no id"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
         "messages.0.tool_calls.0.function.arguments"),
    ])
    def test_bad_tools_are_400(self, server, body, param):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text

    def test_ten_thousand_tool_results_are_refused_by_the_message_cap(self, server):
        results = [{"role": "tool", "tool_call_id": f"call_{i}", "content": "21 C"} for i in range(10_000)]
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER + results, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text

    def test_schemas_the_grammar_refuses_are_400_and_the_server_goes_on(self, server, engine):
        big = {"type": "function", "function": {"name": "big", "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                             for i in range(10_000)}}}}
        recursive = {"type": "function", "function": {"name": "r", "parameters": {
            "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}
        hostile = [big, recursive, {"type": "function", "function": {"name": "t", "parameters": {"$ref": "#/nope"}}}]
        health: list[float] = []
        done = threading.Event()

        def probe():  # /health answers fast while the hostile bodies are refused
            while not done.is_set():
                t0 = time.monotonic()
                assert httpx.get(server.url + "/health", timeout=10).status_code == 200
                health.append(time.monotonic() - t0)
                time.sleep(0.02)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            for tool in hostile:
                r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                               json={"messages": USER, "tools": [tool], "tool_choice": "required", "max_tokens": 4})
                assert r.status_code in (400, 413), r.text
                assert r.json()["error"]["param"] in ("tools", "messages"), r.text
        finally:
            done.set()
            prober.join()
        assert health and max(health) < 2.0, max(health)
        ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert ok.status_code == 200


def test_auto_without_the_flag(engine):
    with serve(engine) as st:
        r = httpx.post(st.url + "/v1/chat/completions",
                       json={"messages": USER, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 4})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(st.url + "/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


def test_reasoning_output_through_the_server(engine):
    """The tiny model never writes </think>: under deepseek_r1 (thinking from the first token) its
    whole output is reasoning, under qwen3 (thinking only inside a think block) all content, and the
    stream splits it the same way. The tags themselves: tests/test_tool_parsers.py."""
    kw = dict(model="tiny", messages=USER, max_tokens=12, temperature=0)
    with serve(engine) as st:
        text = openai.OpenAI(base_url=st.url + "/v1", api_key="none").chat.completions.create(**kw) \
            .choices[0].message.content
    assert text and "</think>" not in text
    for parser, want in [("deepseek_r1", {"reasoning_content": text, "reasoning": text, "content": None}),
                         ("qwen3", {"reasoning_content": None, "reasoning": None, "content": text})]:
        with serve(engine, reasoning_parser=parser) as st:
            client = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0)
            msg = client.chat.completions.create(**kw).choices[0].message.model_dump()
            assert {k: msg[k] for k in want} == want, parser
            joined = {"reasoning_content": "", "content": ""}
            for chunk in client.chat.completions.create(stream=True, **kw):
                d = chunk.choices[0].delta.model_dump()
                for k in joined:
                    joined[k] += d.get(k) or ""
            assert joined == {k: want[k] or "" for k in joined}, parser


@pytest.mark.parametrize("argv, words", [
    (["--tool-parser-plugin", "my_parser.py"], "plugins are not supported"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--chat-template", "no/such/file.jinja"], "no such file"),
    (["--chat-template", "{% for m in messages %}"], "does not compile"),
])
def test_bad_chat_flags_are_one_error_line(argv, words):
    from runtime.entrypoints.openai.api_server import chat_options, parse_args
    from runtime.errors import UserError

    with pytest.raises(UserError, match=words):
        chat_options(parse_args(argv)[1])


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    from runtime.entrypoints.openai.api_server import chat_options, parse_args

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert chat_options(parse_args(["--chat-template", str(f)])[1])["chat_template"] == TEMPLATE
    opts = chat_options(parse_args(["--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser",
                                    "pythonic", "--default-chat-template-kwargs", '{"enable_thinking": false}'])[1])
    assert opts["chat_template"] == TEMPLATE and opts["tool_call_parser"] == "pythonic"
    assert opts["default_chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("mode, accepted", [
    ("required", ['<think>ab</think>\n\n{"city":"Rome"}', 'x</think>{"city":"Paris"}']),
    ("optional", ['<think>ab</think>\n\n{"city":"Rome"}', '{"city":"Paris"}', '<think>\n</think>{"city":"Rome"}']),
])
def test_a_constraint_holds_the_answer_after_the_thinking(mode, accepted):
    """With a reasoning parser, structured outputs and tool grammars begin where the thinking ends
    (vLLM's rule): thinking is free text up to the first </think>, then the constraint."""
    import llguidance

    from runtime.core.sampling_params import StructuredOutputsParams
    from runtime.core.structured_output import GrammarCompiler

    tok = conftest.tiny_bpe_tokenizer()
    compiler = GrammarCompiler(tok, 300)
    so = StructuredOutputsParams(json=SCHEMAS["get_weather"], disable_any_whitespace=True, reasoning=mode)
    grammar = GrammarCompiler._serialize(so)
    rejected = ['{"city":"Oslo"}', '<think>a</think>b</think>{"city":"Rome"}', '<think>a</think>']
    rejected += {"required": ['{"city":"Paris"}'], "optional": ['x</think>{"city":"Paris"}']}[mode]
    for text, want in [(t, True) for t in accepted] + [(t, False) for t in rejected]:
        m = llguidance.LLMatcher(compiler.ll_tokenizer, grammar)
        ok = all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()
        assert ok == want, text
    assert compiler.compile(so) is not None  # the engine's own compile takes it
    assert so.cache_key() != StructuredOutputsParams(json=SCHEMAS["get_weather"], disable_any_whitespace=True).cache_key()


def test_named_tool_with_a_reasoning_parser(engine):
    with serve(engine, reasoning_parser="qwen3") as st:
        client = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0)
        r = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert r.choices[0].finish_reason == "tool_calls", r
        check_calls(r.choices[0].message.tool_calls, {"get_weather"})


def test_the_agents_sdk_runs_a_tool(engine):
    """The OpenAI Agents SDK's Runner, unmodified, over this server, through chat completions and
    through the Responses API: the first turn must call the tool
    (tool_choice required), the SDK runs it and sends the result back, and the next turn (tool_choice
    reset to auto, read by the hermes parser) answers in text."""
    agents = pytest.importorskip("agents")
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    with serve(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as st:
        client = openai.AsyncOpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0)
        # The SDK's two model classes: over chat completions (the tool's result goes back for a text
        # answer), and over /v1/responses, its default (the run stops at the tool's result: the
        # tiny model's free text would end at max_tokens, which the SDK takes as a failed response).
        for model, behavior in ((OpenAIChatCompletionsModel(model="tiny", openai_client=client), "run_llm_again"),
                                (OpenAIResponsesModel(model="tiny", openai_client=client), "stop_on_first_tool")):
            seen.clear()
            agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                          tool_use_behavior=behavior,
                          model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0))
            result = Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
            assert len(seen) == 1 and seen[0] in ("Paris", "Rome"), type(model).__name__
            kinds = [item.type for item in result.new_items]
            assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
            if behavior == "stop_on_first_tool":
                assert result.final_output == f"sunny in {seen[0]}"
            else:
                assert isinstance(result.final_output, str) and kinds[-1] == "message_output_item"
    assert agents is not None


# ====================================================================== the real SmolLM2 (slow: the smol_llm fixture)

# SmolLM2's own template ignores tools; this one (ChatML, as SmolLM2's, with Qwen's way of listing
# tools and calls) is served with --chat-template.
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions, one per <tool_call></tool_call> tag:\n"
    "{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_smollm2_tools_with_the_openai_client(smol_llm):
    """Each tool_choice on the real model: calls valid against their tools' schemas, whole and
    streamed; a tool result sent back; auto parsing the model's own hermes call (its format held
    by a regex, the arguments the model's)."""
    tools = [WEATHER, {"type": "function", "function": {
        "name": "add", "description": "add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    app = build_app(smol_llm.engine, served_model_names=["smollm2-135m"], log_stats_interval=0,
                    enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=CHATML_TOOLS)
    ask = [{"role": "user", "content": "What is 2 plus 3? Use the add function."}]
    with ServerThread(app) as st:
        client = openai.OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model="smollm2-135m", messages=ask, tools=tools, temperature=0, max_tokens=64)
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            r = client.chat.completions.create(tool_choice=choice, **kw)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls, r
            for c in calls:
                jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
            content, streamed_calls, reason = streamed(client, tool_choice=choice, **kw)
            assert reason == "tool_calls"
            assert [(n, json.loads(a)) for _, n, a in streamed_calls.values()] == \
                [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        call = calls[0]
        follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        r = client.chat.completions.create(model="smollm2-135m", messages=follow, tools=tools, tool_choice="none",
                                           temperature=0, max_tokens=16)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
        regex = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
        r = client.chat.completions.create(extra_body={"structured_outputs": {"regex": regex}}, **kw)
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["add"] and r.choices[0].message.content is None
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas["add"])
    assert not smol_llm.engine.has_unfinished_requests()
