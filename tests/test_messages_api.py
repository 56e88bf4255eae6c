"""/v1/messages (Anthropic's Messages API) end to end with the unmodified `anthropic` client over real
HTTP, on the tiny random model of test_tool_calling.py (a byte-level BPE, a chat template that renders
tools): text, streams, forced tool use, tool results, count_tokens, stop reasons, Anthropic's error
body (the gate's 401 and 503 too), and the block builder on a scripted answer."""

from __future__ import annotations

import asyncio
import json

import anthropic
import anthropic.types
import httpx
import jsonschema
import pytest
from pydantic import TypeAdapter

from runtime.entrypoints.openai.protocol import APIError, Prepared
from runtime.entrypoints.openai.serving_messages import MessageBuilder, Messages
# The tiny engine and a server with the hermes parser (class-scoped: the functions below start their
# own servers, one engine loop at a time): test_tool_calling's fixtures.
from test_tool_calling import SCHEMAS, TOOLS, USER, engine, serve, server  # noqa: F401

TOOLS_A = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
USER_A = [{"role": "user", "content": USER[0]["content"]}]
KEY = "sk-test-key"


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


# This client has no sampling parameters (newer models take none); the server reads them all the same.
GREEDY = {"model": "tiny", "max_tokens": 24, "messages": USER_A, "extra_body": {"temperature": 0}}


def create(client, **kw):
    return client.messages.create(**GREEDY | kw)


def streamed(client, **kw):
    """(the raw event types, the stream's final message)."""
    with client.messages.stream(**GREEDY | kw) as s:
        kinds = [e.type for e in s]
        return kinds, s.get_final_message()


def sse_events(text: str) -> list[dict]:
    """The data of each `event: <type>` of an SSE body, checked to name its own type."""
    out = []
    for block in text.strip().split("\n\n"):
        head, data = block.split("\n", 1)
        obj = json.loads(data.removeprefix("data: "))
        assert head == "event: " + obj["type"], block
        out.append(obj)
    return out


def without_ids(msg) -> dict:
    d = msg.model_dump(exclude_none=True)
    for b in d["content"]:
        if b["type"] == "tool_use":
            assert b.pop("id").startswith("toolu_")
    assert d.pop("id").startswith("msg_")
    return d


def check_tool_uses(blocks, names=None):
    uses = [b for b in blocks if b.type == "tool_use"]
    assert uses, "no tool_use blocks"
    for b in uses:
        assert names is None or b.name in names
        assert isinstance(b.input, dict)
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return uses


class TestMessages:
    def test_text(self, client):
        m = create(client)
        assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
        assert [b.type for b in m.content] in (["text"], [])
        assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
        assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24

    def test_system_and_text_blocks_reach_the_prompt(self, client):
        plain = create(client, max_tokens=1).usage.input_tokens
        with_system = create(client, max_tokens=1, system=[{"type": "text", "text": "Be brief."}],
                             messages=[{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}])
        assert with_system.usage.input_tokens > plain

    def test_stream_gives_the_same_message(self, client):
        whole = create(client)
        kinds, final = streamed(client)
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
        assert without_ids(final) == without_ids(whole)

    def test_max_tokens_and_stop_sequences(self, client):
        m = create(client, max_tokens=3)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
        text = create(client, max_tokens=12).content[0].text
        stop = text[4:6]
        cut = create(client, max_tokens=12, stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[:text.index(stop)]
        _, final = streamed(client, max_tokens=12, stop_sequences=[stop])
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)

    @pytest.mark.parametrize("choice, names", [({"type": "any"}, {"get_weather", "get_time"}),
                                               ({"type": "tool", "name": "get_time"}, {"get_time"})])
    def test_forced_tool_use(self, client, choice, names):
        m = create(client, tools=TOOLS_A, tool_choice=choice, max_tokens=120)
        assert m.stop_reason == "tool_use"
        check_tool_uses(m.content, names)
        kinds, final = streamed(client, tools=TOOLS_A, tool_choice=choice, max_tokens=120)
        assert without_ids(final) == without_ids(m)
        assert "content_block_start" in kinds and "content_block_stop" in kinds

    def test_disable_parallel_tool_use_gives_one_call(self, client):
        m = create(client, tools=TOOLS_A, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   max_tokens=120)
        assert len(check_tool_uses(m.content)) == 1

    def test_tool_results_go_back(self, client, server):
        m = create(client, tools=TOOLS_A, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=120)
        use = check_tool_uses(m.content)[0]
        turn = [*USER_A, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
        r = create(client, tools=TOOLS_A, tool_choice={"type": "none"}, messages=turn, max_tokens=4)
        assert r.stop_reason in ("end_turn", "max_tokens")
        # The prompt is the chat of the same turn: the call's arguments and the tool's answer.
        chat = [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}]
        tok = httpx.post(server.url + "/v1/chat/completions",
                         json={"messages": chat, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}).json()
        assert r.usage.input_tokens == tok["usage"]["prompt_tokens"]

    def test_count_tokens(self, client, server):
        n = client.messages.count_tokens(model="tiny", messages=USER_A, system="Be brief.")
        chat = [{"role": "system", "content": "Be brief."}, *USER]
        assert n.input_tokens == httpx.post(server.url + "/tokenize", json={"messages": chat}).json()["count"]
        with_tools = client.messages.count_tokens(model="tiny", messages=USER_A, tools=TOOLS_A,
                                                  tool_choice={"type": "any"})
        assert with_tools.input_tokens == create(client, tools=TOOLS_A, max_tokens=1).usage.input_tokens
        assert with_tools.input_tokens > n.input_tokens - 4  # the tools' names are rendered

    def test_output_config_format_holds_the_text_to_a_schema(self, client):
        schema = SCHEMAS["get_weather"]
        m = create(client, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
        assert m.stop_reason == "end_turn"
        jsonschema.validate(json.loads(m.content[0].text), schema)

    @pytest.mark.parametrize("extra", [{}, {"tools": TOOLS_A, "tool_choice": {"type": "any"}}])
    def test_bodies_and_events_pass_the_clients_strict_types(self, server, extra):
        body = {"model": "tiny", "max_tokens": 60, "messages": USER_A, "temperature": 0} | extra
        anthropic.types.Message.model_validate(httpx.post(server.url + "/v1/messages", json=body).json())
        events = sse_events(httpx.post(server.url + "/v1/messages", json=body | {"stream": True}).text)
        for e in events:
            TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python(e)

    def test_prefill_continues_the_assistant_turn(self, client):
        m = create(client, messages=[*USER_A, {"role": "assistant", "content": "It is"}], max_tokens=4)
        assert m.usage.output_tokens > 0


class TestErrors:
    """Each in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

    @pytest.mark.parametrize("body, words", [
        ({"model": "tiny", "messages": USER_A}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 4, "messages": "hi"}, "messages"),
        ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "tiny", "max_tokens": 4, "messages": USER_A, "tools": TOOLS_A,
          "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, "image"),
        ({"model": "tiny", "max_tokens": 4, "messages": USER_A, "tools": [{"type": "web_search_20250305",
                                                                          "name": "web_search"}]}, "custom tools"),
        ({"model": "tiny", "max_tokens": 0, "messages": USER_A}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 4, "messages": USER_A, "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "max_tokens": 4, "messages": USER_A, "output_config": {"format": {"type": "xml"}}},
         "output_config.format"),
    ])
    def test_bad_bodies_are_400(self, server, body, words):
        r = httpx.post(server.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert words in err["error"]["message"]

    def test_the_client_raises_them(self, client):
        with pytest.raises(anthropic.BadRequestError) as e:
            create(client, tools=TOOLS_A, tool_choice={"type": "tool", "name": "nope"})
        assert e.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError) as e:
            create(client, model="claude-unknown")
        assert e.value.body["error"]["type"] == "not_found_error"

    def test_not_json_and_unknown_paths(self, server):
        r = httpx.post(server.url + "/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.get(server.url + "/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = httpx.post(server.url + "/v1/messages/nothing", json={})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

    def test_a_prompt_too_long_is_request_too_large(self, server):
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 40_000}]}
        r = httpx.post(server.url + "/v1/messages", json=body)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        r = httpx.post(server.url + "/v1/messages/count_tokens", json=body)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def test_openapi_lists_both_apis(self, server):
        paths = httpx.get(server.url + "/openapi.json").json()["paths"]
        assert {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses"} <= set(paths)
        err = paths["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert err == {"$ref": "#/components/schemas/AnthropicError"}

    def test_draining_is_overloaded(self, server):
        app_server = server.app.state.server
        app_server.draining = True
        try:
            r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 1, "messages": USER_A})
            chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        finally:
            app_server.draining = False
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        assert r.headers["retry-after"] == "1"
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "server_shutting_down"


def test_api_key_by_x_api_key_or_bearer(engine):  # noqa: F811
    body = {"model": "tiny", "max_tokens": 1, "messages": USER_A}
    with serve(engine, api_key=KEY) as st:
        url = st.url + "/v1/messages"
        for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": r.json()["error"]["message"]}}
        assert httpx.post(url, json=body, headers={"x-api-key": KEY}).status_code == 200
        r = httpx.post(url, json=body, headers=[("x-api-key", KEY), ("x-api-key", KEY)])
        assert r.status_code == 400
        # The unmodified client, and the chat path with Anthropic's header.
        m = anthropic.Anthropic(base_url=st.url, api_key=KEY, max_retries=0).messages.create(**body)
        assert m.type == "message"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=st.url, api_key="wrong", max_retries=0).messages.create(**body)
        r = httpx.post(st.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1},
                       headers={"x-api-key": KEY})
        assert r.status_code == 200
        r = httpx.post(st.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there


def test_reasoning_is_thinking_blocks_and_reasoning_items(engine):  # noqa: F811
    """deepseek_r1 reads an output that never closes its thinking as all thinking: a thinking block in
    /v1/messages, a reasoning item in /v1/responses, whole and streamed alike."""
    with serve(engine, reasoning_parser="deepseek_r1") as st:
        client = anthropic.Anthropic(base_url=st.url, api_key="none", max_retries=0)
        kw = GREEDY | {"max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024}}
        m = client.messages.create(**kw)
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].signature == ""
        with client.messages.stream(**kw) as s:
            assert "thinking_delta" in [e.delta.type for e in s if e.type == "content_block_delta"]
            assert without_ids(s.get_final_message()) == without_ids(m)
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 8, "temperature": 0}
        r = httpx.post(st.url + "/v1/responses", json=body).json()
        assert [i["type"] for i in r["output"]] == ["reasoning"] and r["status"] == "incomplete"
        events = sse_events(httpx.post(st.url + "/v1/responses", json=body | {"stream": True}).text)
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert deltas == r["output"][0]["content"][0]["text"] and events[-1]["type"] == "response.incomplete"


def _prep():
    return Prepared("chatcmpl-abc", 0, "tiny", [("chatcmpl-abc-0", [1, 2, 3], None)], [None], 1, True, True,
                    False, 0.0)


def test_builder_orders_blocks_and_events():
    """Thinking, text, two calls: one block each, in order; the events rebuild the same blocks."""
    b = MessageBuilder(_prep())
    pieces = [("reasoning", "hm"), ("reasoning", "m"), ("text", "Sure. "), ("call", "chatcmpl-tool-1", "get_time"),
              ("args", '{"zone": '), ("args", '"UTC"}'), ("call", "chatcmpl-tool-2", "get_weather"),
              ("args", '{"city": "Rome"}'), ("finish", "tool_calls", None)]
    events = b.start() + [e for p in pieces for e in b.feed(p)]
    b.usage = {"completion_tokens": 9}
    events += b.finish()
    msg = b.final()
    assert [blk["type"] for blk in msg["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg["content"][0]["thinking"] == "hmm" and msg["content"][1]["text"] == "Sure. "
    assert msg["content"][2] == {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
    assert msg["stop_reason"] == "tool_use" and msg["usage"] == {"input_tokens": 3, "output_tokens": 9}
    names = [e[0] for e in events]
    assert names.count("content_block_start") == names.count("content_block_stop") == 4
    assert names[-2:] == ["message_delta", "message_stop"] and names[0] == "message_start"
    starts = [e[1]["content_block"] for e in events if e[0] == "content_block_start"]
    assert starts[2] == {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}
    assert "".join(e[1]["delta"].get("partial_json", "") for e in events
                   if e[0] == "content_block_delta" and e[1]["index"] == 2) == '{"zone": "UTC"}'


async def _events(api, prep, chunks) -> list[bytes]:
    return [e async for e in api.events(prep, chunks)]


def test_an_engine_failure_mid_stream_is_an_error_event():
    async def chunks():
        yield {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}], "usage": None}
        yield APIError(500, "the engine failed", code="engine_error")

    out = asyncio.run(_events(Messages(), _prep(), chunks()))
    assert out[0].startswith(b"event: message_start\n") and b'"text_delta"' in out[2]
    assert out[-1] == (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                       b'"message":"the engine failed"}}\n\n')
