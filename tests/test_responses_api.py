"""/v1/responses (OpenAI's Responses API, stateless) end to end with the unmodified `openai` client over
real HTTP, on the tiny random model of test_tool_calling.py: text, streams (get_final_response),
function calls (required, named) and their outputs sent back, text.format, max_output_tokens, the
400s of a stateless server, and the item builder on a scripted answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import openai.types.responses
import pytest
from pydantic import TypeAdapter

from runtime.entrypoints.openai.protocol import APIError, Prepared
from runtime.entrypoints.openai.serving_responses import ResponseBuilder, Responses, ResponsesRequest
from test_messages_api import sse_events
# The tiny engine, a server with the hermes parser, and an openai client of it: test_tool_calling's fixtures.
from test_tool_calling import SCHEMAS, TOOLS, USER, client, engine, server  # noqa: F401

TOOLS_R = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
            "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]
SCHEMA = SCHEMAS["get_weather"]
JSON_FORMAT = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}


GREEDY = {"model": "tiny", "input": USER[0]["content"], "max_output_tokens": 60, "temperature": 0}


def create(client, **kw):
    return client.responses.create(**GREEDY | kw)


def streamed(client, **kw):
    """(the events, the final response or None where the stream ended otherwise)."""
    with client.responses.stream(**GREEDY | kw) as s:
        events = list(s)
        final = s.get_final_response() if events[-1].type == "response.completed" else None
    return events, final


def without_ids(r) -> list[dict]:
    out = []
    for item in r.model_dump(exclude_none=True)["output"]:
        item.pop("id")
        if item["type"] == "function_call":
            assert item.pop("call_id").startswith("call_")
        item.pop("parsed_arguments", None)
        for part in item.get("content", ()):
            part.pop("parsed", None)
        out.append(item)
    return out


def check_calls(r, names):
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and r.status == "completed"
    for c in calls:
        assert c.name in names and c.id.startswith("fc_") and c.call_id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


def test_text(client):
    r = create(client, max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert isinstance(r.output_text, str) and r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.store is False and r.parallel_tool_calls is True and r.tools == []


def test_instructions_and_message_items_reach_the_prompt(client):
    plain = create(client, max_output_tokens=1).usage.input_tokens
    items = [{"role": "user", "content": [{"type": "input_text", "text": USER[0]["content"]}]}]
    r = create(client, max_output_tokens=1, instructions="Be brief.", input=items)
    assert r.usage.input_tokens > plain and r.instructions == "Be brief."


def test_text_format_json_schema_and_the_stream(client):
    r = create(client, text=JSON_FORMAT)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    events, final = streamed(client, text=JSON_FORMAT)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == r.output_text and without_ids(final) == without_ids(r)
    assert final.usage.output_tokens == r.usage.output_tokens


def test_max_output_tokens_stream_ends_incomplete(client):
    events, _ = streamed(client, max_output_tokens=4)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].status == "incomplete"


@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "get_time"}),
                                           ({"type": "function", "name": "get_time"}, {"get_time"})])
def test_function_calls(client, choice, names):
    r = create(client, tools=TOOLS_R, tool_choice=choice, max_output_tokens=120)
    check_calls(r, names)
    events, final = streamed(client, tools=TOOLS_R, tool_choice=choice, max_output_tokens=120)
    assert without_ids(final) == without_ids(r)
    assert "response.function_call_arguments.delta" in [e.type for e in events]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [json.loads(c.arguments) for c in check_calls(r, names)]


def test_parallel_tool_calls_false_gives_one_call(client):
    r = create(client, tools=TOOLS_R, tool_choice="required", parallel_tool_calls=False, max_output_tokens=120)
    assert len(check_calls(r, {"get_weather", "get_time"})) == 1 and r.parallel_tool_calls is False


@pytest.mark.parametrize("extra", [{"text": JSON_FORMAT}, {"tools": TOOLS_R, "tool_choice": "required"},
                                   {"max_output_tokens": 3}])
def test_bodies_and_events_pass_the_clients_strict_types(server, extra):
    body = GREEDY | extra
    openai.types.responses.Response.model_validate(httpx.post(server.url + "/v1/responses", json=body).json())
    events = sse_events(httpx.post(server.url + "/v1/responses", json=body | {"stream": True}).text)
    for e in events:
        TypeAdapter(openai.types.responses.ResponseStreamEvent).validate_python(e)


def test_function_call_outputs_go_back(client, server):
    r = create(client, tools=TOOLS_R, tool_choice={"type": "function", "name": "get_weather"},
               max_output_tokens=120)
    call = check_calls(r, {"get_weather"})[0]
    items = [{"role": "user", "content": USER[0]["content"]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    after = create(client, input=items, tools=TOOLS_R, tool_choice="none", max_output_tokens=2)
    chat = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    ref = httpx.post(server.url + "/v1/chat/completions",
                     json={"messages": chat, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}).json()
    assert after.usage.input_tokens == ref["usage"]["prompt_tokens"]


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS_R}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": 7}]}, "input.0.content"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters"),
])
def test_bad_requests_are_400_naming_the_field(server, extra, param):
    r = httpx.post(server.url + "/v1/responses", json=GREEDY | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_the_client_raises_them_and_store_is_accepted(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        create(client, previous_response_id="resp_123")
    r = create(client, store=True, metadata={"k": "v"}, user="u1", max_output_tokens=1)
    assert r.store is False and r.metadata == {"k": "v"} and r.user == "u1"


def test_chat_errors_name_the_responses_fields(server):
    r = httpx.post(server.url + "/v1/responses", json=GREEDY | {"input": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.role"
    r = httpx.post(server.url + "/v1/responses", json=GREEDY | {"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


PREP = Prepared("chatcmpl-abc", 0, "tiny", [("chatcmpl-abc-0", [1, 2, 3], None)], [None], 1, True, True, False, 0.0)


def test_builder_orders_items_and_events():
    """Reasoning, text, two calls: one item each, in order; a stream of events numbered from 0."""
    b = ResponseBuilder(PREP, ResponsesRequest(input="hi", tools=TOOLS_R))
    pieces = [("reasoning", "hm"), ("text", "Sure. "), ("call", "chatcmpl-tool-1", "get_time"),
              ("args", '{"zone": "UTC"}'), ("call", "chatcmpl-tool-2", "get_weather"), ("args", '{"city": "Rome"}'),
              ("finish", "tool_calls", None)]
    events = b.start() + [e for p in pieces for e in b.feed(p)]
    b.usage = {"prompt_tokens": 3, "completion_tokens": 9}
    events += b.finish()
    r = b.final()
    assert [i["type"] for i in r["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert r["output"][2] | {"id": None} == {"id": None, "type": "function_call", "call_id": "call_1",
                                             "name": "get_time", "arguments": '{"zone": "UTC"}', "status": "completed"}
    assert r["status"] == "completed" and r["usage"]["total_tokens"] == 12
    assert [e[1]["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e[0] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    assert events[-1][1]["response"] == r


def test_an_engine_failure_mid_stream_is_an_error_event():
    async def chunks():
        yield {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}], "usage": None}
        yield APIError(500, "the engine failed", code="engine_error")

    async def run(api):
        return [e async for e in api.events(PREP, chunks())]

    api = Responses()
    api.body = ResponsesRequest(input="hi")
    out = asyncio.run(run(api))
    assert out[0].startswith(b"event: response.created\n")
    assert out[-1].startswith(b"event: error\ndata: ")
    err = json.loads(out[-1].split(b"data: ", 1)[1])
    assert err == {"type": "error", "code": "engine_error", "message": "the engine failed", "param": None,
                   "sequence_number": len(out) - 1}
