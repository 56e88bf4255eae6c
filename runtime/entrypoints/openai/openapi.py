"""The server's OpenAPI 3 schema, generated from its pydantic request models, and a /docs page.

Requests are described by the same pydantic models the handlers validate with, so the schema
cannot drift from what the server accepts. Responses are described by hand below: their shapes
are OpenAI's (and vLLM's), written out once here and checked by a schemathesis run in the tests.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _response(object_name: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": object_name},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice},
                           "usage": {"anyOf": [USAGE, {"type": "null"}]}}}


FINISH = {"type": ["string", "null"]}
COMPLETION = _response("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": FINISH,
                   "logprobs": {"type": ["object", "null"]}}})
CHAT = _response("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": FINISH,
                   "message": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"type": "string"},
                                              "content": {"type": ["string", "null"]}}},
                   "logprobs": {"type": ["object", "null"]}}})
MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"},
    "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"],
                                        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                                       "max_model_len": {"type": "integer"}}}}}}
TOKENIZE = {"type": "object", "required": ["count", "tokens", "max_model_len"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
# Anthropic's Messages (/v1/messages: its error body too) and OpenAI's Responses (serving_messages.py,
# serving_responses.py).
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
MESSAGE = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
           "properties": {"id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                          "model": {"type": "string"}, "stop_reason": {"type": ["string", "null"]},
                          "stop_sequence": {"type": ["string", "null"]},
                          "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
                          "usage": {"type": "object", "required": ["input_tokens", "output_tokens"]}}}
COUNT_TOKENS = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}
RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
            "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                           "created_at": {"type": "integer"}, "status": {"type": "string"}, "model": {"type": "string"},
                           "output": {"type": "array", "items": {"type": "object", "required": ["type"]}},
                           "usage": {"type": ["object", "null"]}}}

# Every error the server answers with an OpenAI error body (see runtime.serve.APIError).
ERROR_STATUSES = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model or path",
                  "408": "the request body arrived too slowly", "413": "request or prompt too large",
                  "415": "the body is not application/json", "503": "overloaded, shutting down, or the engine failed"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(schema: str = "Error") -> dict:
    return {code: {"description": why, "content": _json({"$ref": f"#/components/schemas/{schema}"})}
            for code, why in ERROR_STATUSES.items()}


# Fields the handlers require although the models default them (to answer with OpenAI's own
# "missing_required_parameter" error rather than pydantic's).
REQUIRED = {"CompletionRequest": ["prompt"], "ChatCompletionRequest": ["messages"], "ResponsesRequest": ["input"]}


def openapi_schema(request_models: dict[str, type], version: str, title: str = "jaxserve") -> dict:
    """The OpenAPI 3.1 document. `request_models`: the pydantic body model of each POST path."""
    _, defs = models_json_schema([(m, "validation") for m in request_models.values()],
                                 ref_template="#/components/schemas/{model}")
    components = dict(defs.get("$defs", {}), Error=ERROR, AnthropicError=ANTHROPIC_ERROR)
    for name, fields in REQUIRED.items():
        if name in components:
            components[name] = dict(components[name], required=sorted(
                set(components[name].get("required", [])) | set(fields)))

    def post(path: str, summary: str, ok: dict, stream: bool = False, errors: str = "Error") -> dict:
        content = _json(ok)
        if stream:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        return {"post": {
            "summary": summary, "operationId": path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": _json(
                {"$ref": f"#/components/schemas/{request_models[path].__name__}"})},
            "responses": {"200": {"description": "OK", "content": content}, **_errors(errors)}}}

    def get(path: str, summary: str, content: dict) -> dict:
        return {"get": {"summary": summary, "operationId": path.strip("/").replace("/", "_") + "_get",
                        "responses": {"200": {"description": "OK", "content": content}, **_errors()}}}

    paths = {
        "/v1/completions": post("/v1/completions", "Text completion (stream: true sends SSE)", COMPLETION,
                                stream=True),
        "/v1/chat/completions": post("/v1/chat/completions", "Chat completion (stream: true sends SSE)", CHAT,
                                     stream=True),
        "/v1/messages": post("/v1/messages", "Anthropic's Messages API on the chat path (stream: true sends its "
                             "events)", MESSAGE, stream=True, errors="AnthropicError"),
        "/v1/messages/count_tokens": post("/v1/messages/count_tokens", "The prompt tokens of a Messages body",
                                          COUNT_TOKENS, errors="AnthropicError"),
        "/v1/responses": post("/v1/responses", "OpenAI's Responses API, stateless, on the chat path (stream: true "
                              "sends its events)", RESPONSE, stream=True),
        "/tokenize": post("/tokenize", "Token ids of a prompt or of chat messages", TOKENIZE),
        "/detokenize": post("/detokenize", "Text of token ids", DETOKENIZE),
        "/v1/models": get("/v1/models", "The served model names", _json(MODELS)),
        "/health": get("/health", "200 while the engine serves", {}),
        "/version": get("/version", "The server's version, as vLLM's /version",
                        _json({"type": "object", "required": ["version"],
                               "properties": {"version": {"type": "string"}}})),
        "/metrics": get("/metrics", "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
    }
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title} API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{url: "{schema_url}", dom_id: "#ui"}});</script>
<noscript>The schema itself is at <a href="{schema_url}">{schema_url}</a>.</noscript>
</body></html>
"""
