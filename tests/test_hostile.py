"""Hostile clients (issue 11): no request can kill or hang the engine, streams end cleanly on
SIGTERM, and slow or huge clients cannot starve the server.

Engine-level cases run on the tiny random model. HTTP cases run a real uvicorn server on loopback
over the session's SmolLM2 engine (one in-process server at a time, as in test_serve.py), with
httpx or raw sockets as the client. SIGTERM runs on one `python -m runtime.serve` subprocess that
shares the session's compile cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_engine import tiny_llm
from test_serve import MODEL, assert_kv_idle, start_cli_server, wait_idle

from runtime.core.sampling_params import RequestError, SamplingParams, StructuredOutputsParams
from runtime.core.structured_output import GrammarCompiler, GrammarLimits
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from runtime.entrypoints.openai.serving import BULK_BODY_BYTES, ServerConfig
from runtime.serve import APIError, ServerThread, build_app

CHAT = [{"role": "user", "content": "Say hi."}]
EOS = 2  # SmolLM2's <|im_end|>, and the tiny model's eos


def run_bounded(llm, prompts, params, max_steps: int = 200):
    """Steps the engine until every request finished; fails (rather than hangs) past `max_steps`."""
    engine = llm.engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) == len(ids):
            return [done[i] for i in ids]
    pytest.fail(f"{len(ids) - len(done)} of {len(ids)} requests never finished (still running: "
                f"{len(engine.scheduler.running)}, waiting: {len(engine.scheduler.waiting)})")


def assert_engine_idle(engine):
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_used == 0, f"{bm.num_used} KV blocks still in use"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    bm.check_invariants([])


# ====================================================================== engine level (tiny model)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llm()


WIDE = [("top_k", dict(top_k=2 ** 31)), ("n", dict(n=2 ** 31)), ("logprobs", dict(logprobs=2 ** 40)),
        ("min_tokens", dict(min_tokens=2 ** 31, max_tokens=None)), ("max_tokens", dict(max_tokens=2 ** 63)),
        ("seed", dict(seed=2 ** 63)), ("seed", dict(seed=-2 ** 63 - 1)), ("priority", dict(priority=2 ** 63)),
        ("stop_token_ids", dict(stop_token_ids=[2 ** 31])), ("logit_bias", dict(logit_bias={2 ** 32: 1.0})),
        ("logit_bias", dict(logit_bias={-1: 1.0}))]


@pytest.mark.parametrize("field,kw", WIDE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(WIDE)])
def test_params_reject_ints_wider_than_their_storage(field, kw):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**kw)


def test_params_accept_the_edges_of_their_widths():
    SamplingParams(top_k=2 ** 31 - 1, seed=2 ** 63 - 1, priority=-2 ** 63, max_tokens=2 ** 63 - 1,
                   stop_token_ids=[2 ** 31 - 1], logit_bias={0: 1.0})


@pytest.mark.slow
def test_top_k_int32_max_samples(tiny):
    """The largest top_k that fits its int32 slot runs through the sampler (top-k is then off)."""
    out = run_bounded(tiny, [[5, 6, 7]], SamplingParams(max_tokens=3, top_k=2 ** 31 - 1, seed=1, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert_engine_idle(tiny.engine)


@pytest.mark.parametrize("what,params", [
    ("max_tokens=1", SamplingParams(n=2, max_tokens=1, seed=3)),
    ("eos first", SamplingParams(n=3, max_tokens=5, seed=3, logit_bias={EOS: 100.0})),
    ("greedy max_tokens=1", SamplingParams(n=2, max_tokens=1, temperature=0)),
])
def test_n_forks_when_the_parent_finishes_on_its_first_token(tiny, what, params):
    outs = run_bounded(tiny, [[5, 6, 7], [9, 10]], params)
    for out in outs:
        assert [c.index for c in out.outputs] == list(range(params.n))
        for c in out.outputs:
            assert len(c.token_ids) == 1
            assert c.finish_reason == ("stop" if params.logit_bias else "length")
    assert_engine_idle(tiny.engine)
    # And through LLM.generate (which would hang if a fork were lost).
    again = tiny.generate([[5, 6, 7]], params)
    assert len(again[0].outputs) == params.n
    assert_engine_idle(tiny.engine)


def test_step_error_fails_only_the_requests_it_touched(tiny):
    engine = tiny.engine
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # A fills the step's token budget (max_num_batched_tokens=64), so B waits and is not touched.
    a = engine.add_request(None, list(range(3, 67)), greedy)
    b = engine.add_request(None, [7, 8, 9], greedy)
    real = engine.runner.execute

    def boom(*args, **kwargs):
        raise RuntimeError("injected device failure")

    engine.runner.execute = boom
    try:
        outs = engine.step()
    finally:
        engine.runner.execute = real
    assert [o.request_id for o in outs] == [a]
    assert outs[0].finished and "injected device failure" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    engine.block_manager.check_invariants([s for r in engine.requests.values() for s in r.seqs])
    assert list(engine.requests) == [b]  # B survived, and finishes normally
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[b].error is None and len(done[b].outputs[0].token_ids) == 4
    assert_engine_idle(engine)
    # The engine goes on serving.
    again = tiny.generate([list(range(3, 67))], greedy)
    assert len(again[0].outputs[0].token_ids) == 4
    assert_engine_idle(engine)


# ====================================================================== grammars refused at admission (tiny BPE)

_LOOP = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
# (what, structured_outputs): each passed admission and then failed inside a step (500 engine_error),
# or compiled for seconds, before admission checked grammars fully (issue 48).
HOSTILE_GRAMMARS = [
    ("regex matching nothing", {"regex": "[^\\s\\S]"}),
    ("regex (a{1000}){1000}", {"regex": "(a{1000}){1000}"}),
    ("json $ref #", {"json": {"$ref": "#"}}),
    ("json $defs referring to each other", {"json": {"$defs": _LOOP, "$ref": "#/$defs/a"}}),
    ("json required field of such $defs", {"json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                     "required": ["x"], "$defs": _LOOP}}),
    ("lark s: s", {"grammar": "start: s\ns: s"}),
    ("lark a then s: s", {"grammar": 'start: "a" s\ns: s'}),
    ("choice of one 1,000,000-char string", {"choice": ["x" * 1_000_000]}),
    ("lark of 20,000 alternatives", {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20_000))}),
    ("lark of 3,000 alternatives", {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(3_000))}),
    ("choice of 100,000 strings", {"choice": [f"option {i}" for i in range(100_000)]}),
]
GRAMMAR_IDS = [g[0] for g in HOSTILE_GRAMMARS]


def assert_short_grammar_error(message: str, field: str) -> None:
    """A 400's message names the field, in one short line: no Rust panic, stack or parser state."""
    assert field in message and len(message) < 300 and "\n" not in message, message
    assert not any(w in message for w in ("panic", "backtrace", "<state>", ".rs:", "/")), message


@pytest.fixture(scope="module")
def bpe_compiler():
    from conftest import tiny_bpe_tokenizer

    return GrammarCompiler(tiny_bpe_tokenizer())


def count_compiles(monkeypatch, compiler: GrammarCompiler) -> list:
    """The grammars `compiler` hands to llguidance from now on (the real compile still runs). A
    repeat that is answered from the refusal cache, or by the size check, adds none."""
    calls, real = [], compiler._compile

    def counted(params, key):
        calls.append(key[0])
        return real(params, key)

    monkeypatch.setattr(compiler, "_compile", counted)
    return calls


@pytest.mark.parametrize("what,so", HOSTILE_GRAMMARS, ids=GRAMMAR_IDS)
def test_hostile_grammar_is_refused_at_admission(bpe_compiler, monkeypatch, what, so):
    compiles = count_compiles(monkeypatch, bpe_compiler)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as e:
        bpe_compiler.compile(StructuredOutputsParams(**so))
    assert e.value.param == "structured_outputs"
    assert_short_grammar_error(e.value.message, f"structured_outputs.{next(iter(so))}")
    assert time.monotonic() - t0 < 3.0  # the size limit, llguidance's fuel or the probe, not the budget
    # Refusals are cached (or refused by size again, before any compile): a repeat compiles nothing.
    # Counted, not timed: a lookup of 100,000 choices took 60 ms on a loaded CI machine.
    first = len(compiles)
    with pytest.raises(RequestError) as again:
        bpe_compiler.compile(StructuredOutputsParams(**so))
    assert again.value.message == e.value.message and len(compiles) == first <= 1


def test_good_grammars_still_compile_after_the_checks(bpe_compiler):
    for so in ({"regex": "[a-z]{1,8}"}, {"choice": ["ab", "12", "x" * 5000]}, {"json_object": True},
               {"grammar": 'start: "a" s\ns: "b" | s "c"'},
               {"json": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"],
                         "$defs": {"n": {"type": "integer"}}}}):
        assert bpe_compiler.compile(StructuredOutputsParams(**so)).matcher() is not None


def test_grammar_compile_budget_is_a_400_and_cached(monkeypatch):
    """A grammar within the size limit whose compile takes longer than the budget is refused, and so
    is every repeat, at once; a compile already running is shared by the requests that wait for it."""
    from conftest import tiny_bpe_tokenizer

    compiler = GrammarCompiler(tiny_bpe_tokenizer(), limits=GrammarLimits(timeout_s=0.05))
    compiles = count_compiles(monkeypatch, compiler)
    slow = StructuredOutputsParams(choice=["x" * 60_000])  # within the size limit; ~0.5 s to compile
    futures = [compiler.submit(slow) for _ in range(3)]
    assert futures[0] is futures[1] is futures[2]  # one compile for three requests
    with pytest.raises(RequestError, match=r"did not compile within 0.05s") as e:
        compiler.compile(slow)
    assert_short_grammar_error(e.value.message, "structured_outputs.choice")
    futures[0].exception(timeout=30)  # the compile ends, over budget: refused from now on
    with pytest.raises(RequestError, match="did not compile within"):
        compiler.compile(slow)
    assert compiles == ["choice"]  # the repeat came from the refusal cache, not a second compile


def test_budgets_are_server_flags(tiny):
    from runtime.entrypoints.openai.api_server import parse_args

    _, args = parse_args(["--max-chat-messages", "8", "--max-grammar-chars", "100", "--grammar-timeout-s", "0.5"])
    assert (args.max_chat_messages, args.max_grammar_chars, args.grammar_timeout_s) == (8, 100, 0.5)
    app = build_app(tiny.engine, served_model_names="tiny", log_stats_interval=0, start_engine=False,
                    max_chat_messages=args.max_chat_messages, max_grammar_chars=args.max_grammar_chars,
                    grammar_timeout_s=args.grammar_timeout_s)
    assert app.state.server.cfg.max_chat_messages == 8
    assert tiny.engine.grammar_limits == GrammarLimits(max_chars=100, timeout_s=0.5)
    _, defaults = parse_args([])
    assert defaults.max_chat_messages is None  # then max_model_len
    build_app(tiny.engine, served_model_names="tiny", log_stats_interval=0, start_engine=False)
    assert tiny.engine.grammar_limits == GrammarLimits()


def test_one_engine_loop_steps_an_engine_at_a_time():
    """A second server (or LLM.generate) on an engine that a running engine loop steps is refused
    with a clear error: two steppers would take each other's outputs, and a request would wait
    forever (a CI soak request did, with a module's server still up on the shared engine)."""
    llm = tiny_llm()
    first = build_app(llm.engine, served_model_names="tiny", log_stats_interval=0, start_engine=False)
    second = build_app(llm.engine, served_model_names="tiny", log_stats_interval=0, start_engine=False)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first.state.server.loop.start()
    try:
        with pytest.raises(RuntimeError, match="another engine loop"):
            second.state.server.loop.start()
        with pytest.raises(RuntimeError, match="an engine loop steps this engine"):
            llm.generate([[1, 2, 3]], greedy)
        assert not llm.engine.has_unfinished_requests()
    finally:
        first.state.server.loop.stop()
    second.state.server.loop.start()  # the first let go of the engine
    second.state.server.loop.stop()
    first.state.server.loop.start()  # and a loop can start again after its stop
    first.state.server.loop.stop()
    assert len(llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids) == 3


# ====================================================================== HTTP: the table of bad inputs


def _raw(obj) -> bytes:
    """JSON with \\u escapes kept as written (a lone surrogate cannot be encoded any other way)."""
    return json.dumps(obj).encode()


def _deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


SURROGATE = "a\ud800b"
J = {"Content-Type": "application/json"}

# (what, path, body (dict: JSON, bytes: raw), headers, status, param, code)
HOSTILE = [
    ("top_k int32+1", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2 ** 31}, J, 400, "top_k", None),
    ("top_k 2^70", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 2 ** 70}, J, 400, "top_k", None),
    ("chat top_k int32+1", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_k": 2 ** 31}, J, 400,
     "top_k", None),
    ("n 2^31", "/v1/completions", {"prompt": "hi", "n": 2 ** 31}, J, 400, "n", None),
    ("logprobs 2^40", "/v1/completions", {"prompt": "hi", "logprobs": 2 ** 40}, J, 400, "logprobs", None),
    ("min_tokens 2^40", "/v1/completions", {"prompt": "hi", "min_tokens": 2 ** 40}, J, 400, "min_tokens", None),
    ("max_tokens 2^63", "/v1/completions", {"prompt": "hi", "max_tokens": 2 ** 63}, J, 400, "max_tokens", None),
    ("seed 2^64", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2 ** 64}, J, 400, "seed", None),
    ("seed -2^63-1", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": -2 ** 63 - 1}, J, 400, "seed",
     None),
    ("priority 2^63", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "priority": 2 ** 63}, J, 400,
     "priority", None),
    ("stop_token_ids 2^31", "/v1/completions", {"prompt": "hi", "stop_token_ids": [2 ** 31]}, J, 400,
     "stop_token_ids", None),
    ("logit_bias key 2^32", "/v1/completions", {"prompt": "hi", "logit_bias": {str(2 ** 32): 1}}, J, 400,
     "logit_bias", None),
    ("surrogate prompt", "/v1/completions", _raw({"prompt": SURROGATE, "max_tokens": 2}), J, 400, "prompt",
     "invalid_text"),
    ("surrogate in prompt list", "/v1/completions", _raw({"prompt": ["ok", SURROGATE]}), J, 400, "prompt.1",
     "invalid_text"),
    ("surrogate chat content", "/v1/chat/completions", _raw({"messages": [{"role": "user", "content": SURROGATE}]}),
     J, 400, "messages.0.content", "invalid_text"),
    ("surrogate /tokenize", "/tokenize", _raw({"prompt": SURROGATE}), J, 400, "prompt", "invalid_text"),
    ("surrogate model", "/v1/completions", _raw({"prompt": "hi", "model": "m\udfffx"}), J, 400, "model",
     "invalid_text"),
    ("surrogate key", "/v1/completions", _raw({"prompt": "hi", "logit_bias": {"\ud800": 1}}), J, 400, "logit_bias",
     "invalid_text"),
    ("nested 100,000 deep", "/v1/completions", _deep(100_000), J, 400, None, "invalid_json"),
    ("integer of 5000 digits", "/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", J, 400, None,
     "invalid_json"),
    ("stop string of 2000 chars", "/v1/completions", {"prompt": "hi", "stop": ["x" * 2000]}, J, 400, "stop", None),
    ("nested 80 deep", "/v1/completions", _deep(80), J, 400, None, "invalid_json"),
    ("prompt over the char cap", "/v1/completions", {"prompt": "x" * 40_000, "max_tokens": 2}, J, 413, "prompt",
     "prompt_too_long"),
    ("chat over the char cap", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40_000}]}, J,
     413, "messages", "prompt_too_long"),
    ("/tokenize over the char cap", "/tokenize", {"prompt": "x" * 40_000}, J, 413, "prompt", "prompt_too_long"),
    ("300 prompts", "/v1/completions", {"prompt": ["hi"] * 300, "max_tokens": 2}, J, 400, "prompt",
     "too_many_prompts"),
    ("text/plain", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, {"Content-Type": "text/plain"}, 415, None,
     "unsupported_media_type"),
    ("form content type", "/v1/chat/completions", {"messages": CHAT},
     {"Content-Type": "application/x-www-form-urlencoded"}, 415, None, "unsupported_media_type"),
    ("no content type", "/tokenize", {"prompt": "hi"}, {}, 415, None, "unsupported_media_type"),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, J, 404, "model", "model_not_found"),
]


@pytest.fixture(scope="class")
def hsrv(smol_llm):
    # max_queue 4 + 16 batch slots: 20 prompts at most per request. Default prompt cap: 512 x 64 chars.
    app = build_app(smol_llm.engine, served_model_names=MODEL, max_queue=4, log_stats_interval=0)
    with ServerThread(app) as st:
        yield st
    assert not smol_llm.engine.has_unfinished_requests()


@pytest.fixture(scope="class")
def http(hsrv):
    with httpx.Client(base_url=hsrv.url, timeout=60) as c:
        yield c


class TestHostileRequests:
    @pytest.mark.parametrize("what,path,body,headers,status,param,code", HOSTILE, ids=[h[0] for h in HOSTILE])
    def test_rejected_and_server_lives(self, http, what, path, body, headers, status, param, code):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=content, headers=headers)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param, err
        if code is not None:
            assert err["code"] == code, err
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text

    @pytest.mark.parametrize("what,so", HOSTILE_GRAMMARS, ids=GRAMMAR_IDS)
    def test_hostile_grammar_is_400_at_admission(self, http, smol_llm, what, so):
        """Each of these passed admission and then failed inside a step (500 engine_error), or compiled
        for seconds; now a short 400 names the field, and the engine never sees the request."""
        added = []
        smol_llm.engine.finished_callbacks.append(added.append)
        try:
            r = http.post("/v1/completions", json={"prompt": "Output:", "max_tokens": 16, "temperature": 0,
                                                   "structured_outputs": so})
        finally:
            smol_llm.engine.finished_callbacks.remove(added.append)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "structured_outputs" and err["type"] == "invalid_request_error", err
        assert_short_grammar_error(err["message"], f"structured_outputs.{next(iter(so))}")
        assert not added  # it never reached the engine
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert_kv_idle(smol_llm.engine, wait_idle(http, smol_llm.engine))

    def test_hostile_response_format_is_400(self, http):
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        assert_short_grammar_error(r.json()["error"]["message"], "response_format.json_schema")
        assert "structured_outputs" not in r.json()["error"]["message"]  # cached under either field

    def test_chat_limits_count_messages_and_the_rendered_prompt(self, http):
        """The prompt cap counts what the template renders, not only the messages' content: 500
        messages of 60 characters are 30,000 characters of content, under the cap (512 x 64), but
        render to 44,000, and are refused before tokenizing; more messages than max_model_len are
        refused before rendering."""
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 60}] * 500})
        assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text
        assert "32768" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * 600})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text
        assert r.json()["error"]["param"] == "messages" and "512" in r.json()["error"]["message"]
        r = http.post("/tokenize", json={"messages": [{"role": "user", "content": ""}] * 600})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text

    def test_limits_are_in_the_messages(self, http):
        r = http.post("/v1/completions", json={"prompt": "x" * 40_000})
        assert "32768" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": ["hi"] * 300})
        assert "20" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "hi", "top_k": 2 ** 31})
        assert "top_k" in r.json()["error"]["message"] and "32 bits" in r.json()["error"]["message"]

    @pytest.mark.parametrize("path,body", [
        ("/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 5, "logit_bias": {str(EOS): 100}}),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 5, "logit_bias": {str(EOS): 100}}),
    ], ids=["cmpl-max_tokens=1", "cmpl-eos-first", "chat-max_tokens=1", "chat-eos-first"])
    @pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
    def test_n_with_first_token_finish(self, hsrv, smol_llm, path, body, stream):
        want = "stop" if "logit_bias" in body else "length"
        with httpx.Client(base_url=hsrv.url, timeout=20) as c:
            if not stream:
                r = c.post(path, json=body)
                assert r.status_code == 200, r.text
                choices = r.json()["choices"]
                assert sorted(ch["index"] for ch in choices) == list(range(body["n"]))
                assert all(ch["finish_reason"] == want for ch in choices)
            else:
                with c.stream("POST", path, json={**body, "stream": True}) as r:
                    lines = [x for x in r.iter_lines() if x]
                assert lines[-1] == "data: [DONE]"
                finals = {ch["index"]: ch["finish_reason"] for x in lines[:-1]
                          for ch in json.loads(x[6:])["choices"] if ch["finish_reason"]}
                assert finals == {i: want for i in range(body["n"])}
            assert_kv_idle(smol_llm.engine, wait_idle(c, smol_llm.engine))


def test_error_bodies_are_always_encodable():
    """An error that echoes a lone surrogate is written with \\u escapes, not a UnicodeEncodeError."""
    from runtime.serve import APIError

    r = APIError(404, "the model `m\udfffx` does not exist", param="model").response()
    assert json.loads(r.body)["error"]["message"] == "the model `m\udfffx` does not exist"
    assert json.loads(APIError(400, "caf\u00e9").response().body)["error"]["message"] == "caf\u00e9"


# ====================================================================== HTTP: engine failures


def test_step_error_fails_its_request_and_the_server_goes_on(smol_llm, monkeypatch):
    engine = smol_llm.engine
    real = engine.runner.execute
    failures = {"left": 0}

    def flaky(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    app = build_app(engine, served_model_names=MODEL, log_stats_interval=0)
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
        failures["left"] = 1
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "injected step failure" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        failures["left"] = 1
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x]
        assert json.loads(lines[0][6:])["error"]["code"] == "engine_error" and lines[-1] == "data: [DONE]"
        ok = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        text = wait_idle(c, engine)
        assert_kv_idle(engine, text)
        errors = [line for line in text.splitlines()
                  if line.startswith("vllm:request_success_total") and 'finished_reason="error"' in line]
        assert len(errors) == 1 and float(errors[0].split()[-1]) >= 2, errors
    engine.block_manager.check_invariants([])


# ====================================================================== HTTP: admission


def test_admission_counts_free_batch_slots(smol_llm):
    """8 simultaneous requests against 16 free slots and max_queue 4 are all admitted; past
    slots + queue (20) the server answers 503 queue_full."""
    app = build_app(smol_llm.engine, served_model_names=MODEL, max_queue=4, log_stats_interval=0,
                    start_engine=False)
    server = app.state.server
    with ServerThread(app) as st:
        async def main():
            async with httpx.AsyncClient(base_url=st.url, timeout=120) as c:
                eight = [asyncio.create_task(c.post("/v1/completions", json={"prompt": f"{i} a", "max_tokens": 2}))
                         for i in range(8)]
                t0 = time.monotonic()
                while server.loop.num_queued < 8 and not any(t.done() for t in eight):
                    await asyncio.sleep(0.01)
                    assert time.monotonic() - t0 < 30
                over = await c.post("/v1/completions", json={"prompt": ["b"] * 13, "max_tokens": 2})
                server.loop.start()
                return over, await asyncio.gather(*eight)

        over, eight = asyncio.run(main())
        assert [r.status_code for r in eight] == [200] * 8, [r.text for r in eight if r.status_code != 200]
        assert over.status_code == 503 and over.json()["error"]["code"] == "queue_full"
        with httpx.Client(base_url=st.url) as c:
            wait_idle(c, smol_llm.engine)


# ====================================================================== HTTP: huge prompts, slow clients


# A client process of its own, as real clients are (in-process, its sends would share our GIL).
FLOOD = """
import asyncio, json, sys, httpx
url, n, chars, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
text = "x" * chars if cap == "capped" else ("hello world, this is a test. " * (chars // 29))
body = json.dumps({"prompt": text, "max_tokens": 2}).encode()
async def main():
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*[c.post("/v1/completions", content=body,
                                           headers={"Content-Type": "application/json"}) for _ in range(n)])
    print(json.dumps([[r.status_code, r.json()["error"]["code"]] for r in rs]))
asyncio.run(main())
"""


def _health_during_flood(url: str, n: int, chars: int, mode: str):
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, url, str(n), str(chars), mode], stdout=subprocess.PIPE,
                            text=True)
    lat = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while proc.poll() is None:
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
    out, _ = proc.communicate(timeout=300)
    return sorted(lat), json.loads(out)


def test_health_answers_while_huge_prompts_arrive(smol_llm):
    """Huge prompts never stall the event loop. With the default cap (512 x 64 characters), eight
    4 MB prompts get 413 before any tokenizing, and /health answers within 100 ms throughout (all
    but its slowest answer: on 2 cores shared with another test process, the body checkers and the
    flood's client, one answer in ~60 has been seen at 101 ms; none may stall like a tokenization,
    which takes seconds). With the cap lifted, four 3.5 MB prompts are tokenized (off the loop) and
    rejected for their length while /health keeps answering (on the loop, each would stall it for
    seconds)."""
    app = build_app(smol_llm.engine, served_model_names=MODEL, log_stats_interval=0)
    with ServerThread(app) as st:
        lat, codes = _health_during_flood(st.url, 8, (4 << 20) - 100, "capped")
        print(f"/health during 8 x 4 MB prompts (capped): n={len(lat)} 2nd slowest={lat[-2] * 1e3:.1f}ms "
              f"max={lat[-1] * 1e3:.1f}ms")
        assert codes == [[413, "prompt_too_long"]] * 8
        assert len(lat) >= 3 and lat[-2] < 0.1 and lat[-1] < 0.5

        app.state.server.cfg.max_prompt_chars = 10 ** 8
        lat, codes = _health_during_flood(st.url, 4, 3_500_000, "lifted")
        print(f"/health during 4 x 3.5 MB prompts (tokenized): n={len(lat)} p50={lat[len(lat) // 2] * 1e3:.1f}ms "
              f"max={lat[-1] * 1e3:.1f}ms")
        assert codes == [[400, "context_length_exceeded"]] * 4
        # Each encode takes seconds of CPU; /health waits at most for a thread to hand back the GIL.
        assert len(lat) >= 20 and lat[len(lat) // 2] < 0.05 and lat[-1] < 1.0


# Four clients of their own process, each sending one hostile body after another for a few seconds.
BURST = """
import asyncio, json, sys, time, httpx
url, kind, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
if kind == "choice":
    path, obj = "/v1/completions", {"prompt": "Output:", "max_tokens": 16, "temperature": 0,
                                    "structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]}}
elif kind == "messages":
    path, obj = "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 125_000, "max_tokens": 4}
else:  # "padding": as many bytes, cheap to parse (one string), refused after parsing (n=0)
    path, obj = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": "x" * 4_000_000,
                                         "max_tokens": 4, "n": 0}
body = json.dumps(obj).encode()
async def client(c, out):
    t_end = time.monotonic() + seconds
    while True:
        t0 = time.monotonic()
        r = await c.post(path, content=body, headers={"Content-Type": "application/json"})
        out.append([r.status_code, r.json()["error"]["code"], time.monotonic() - t0])
        if time.monotonic() > t_end:
            return
async def main():
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        print("ready", flush=True)
        await asyncio.gather(*[client(c, out) for _ in range(4)])
    print(json.dumps(out), flush=True)
asyncio.run(main())
"""
NORMAL = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _normal_latencies(c: httpx.Client, n: int | None = None, until=None) -> list[float]:
    """Latencies of a normal 4-token completion and of /tokenize, one after another."""
    lat = []
    while (n is not None and len(lat) < n) or (until is not None and until()):
        t0 = time.perf_counter()
        assert c.post("/v1/completions", json=NORMAL).status_code == 200
        assert c.post("/tokenize", json={"prompt": "hello world"}).status_code == 200
        lat.append(time.perf_counter() - t0)
    return sorted(lat)


def _latency_during_burst(url: str, kind: str, seconds: float = 4.0):
    with httpx.Client(base_url=url, timeout=60) as c:
        _normal_latencies(c, 3)  # warm
        before = _normal_latencies(c, 8)
        proc = subprocess.Popen([sys.executable, "-c", BURST, url, kind, str(seconds)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        during = _normal_latencies(c, until=lambda: proc.poll() is None)
        out, _ = proc.communicate(timeout=300)
    return before, during, json.loads(out)


@pytest.mark.parametrize("kind,code", [("choice", "grammar_too_large"), ("messages", "too_many_messages")])
def test_normal_requests_keep_their_latency_during_a_burst_of_slow_bad_ones(smol_llm, kind, code):
    """Four clients sending, one after another, choice lists of 100,000 strings (or chats of 125,000
    empty messages): each is refused by a body checker process before any compile or rendering,
    without the server parsing it, and a normal 4-token completion plus a /tokenize keep their
    latency (they took 12-15 s each during such a burst before the size limits were checked first)."""
    app = build_app(smol_llm.engine, served_model_names=MODEL, log_stats_interval=0)
    with ServerThread(app) as st:
        before, during, burst = _latency_during_burst(st.url, kind)
        with httpx.Client(base_url=st.url) as c:
            assert_kv_idle(smol_llm.engine, wait_idle(c, smol_llm.engine))
    p50 = lambda x: x[len(x) // 2]  # noqa: E731
    print(f"{kind} burst: {len(burst)} refused (max {max(b[2] for b in burst) * 1e3:.0f} ms); normal request "
          f"p50 {p50(before) * 1e3:.0f} -> {p50(during) * 1e3:.0f} ms, max {before[-1] * 1e3:.0f} -> "
          f"{during[-1] * 1e3:.0f} ms over {len(during)} during the burst")
    assert {(b[0], b[1]) for b in burst} == {(400, code)} and len(burst) >= 8
    checker = app.state.server.checker
    assert checker.refused == len(burst) and checker.fallbacks == 0  # none parsed in the server
    assert len(during) >= 3
    # The target is 100 ms. This client shares the server's process (and GIL), so it sees more than
    # an outside client would. Measured on 2 cores
    # (docs/benchmarks/2026-12-06-hostile-input-and-vllm-mismatches.md, this flood as
    # `bench_hostile.py --flood 4`): with the checker processes the median moved by -31 to +45 ms
    # (load 1.4-8); parsing these bodies in the server (`--body-checkers 0`) moved it by +64 to +82
    # ms at load 3 and +101 to +142 ms at load 8; before the checkers this test measured +343 and
    # +346 ms at load < 1 and +430 and +650 ms on CI. The assert above guards the mechanism itself;
    # 300 ms guards the latency with room for a loaded CI machine (a timing bound that flakes
    # would block every landing; the mechanism is what the assert above holds exactly).
    assert p50(during) - p50(before) < 0.3, (before, during)


# Bad bodies over BULK_BODY_BYTES, as (path, request model, body, status, code).
BULK_BAD = [
    ("/v1/completions", CompletionRequest, {"prompt": "Output:", "max_tokens": 16, "temperature": 0,
                                            "structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]}},
     400, "grammar_too_large"),
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": [{"role": "user", "content": ""}] * 125_000,
                                                     "max_tokens": 4}, 400, "too_many_messages"),
    ("/v1/completions", CompletionRequest, {"prompt": "x" * 1_000_000, "max_tokens": 2}, 413, "prompt_too_long"),
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                     "response_format": {"type": "json_schema", "json_schema": {
                                                         "schema": {"enum": ["x" * 100] * 3000}}}},
     400, "grammar_too_large"),
    ("/tokenize", TokenizeRequest, {"prompt": "x" * 1_000_000}, 413, "prompt_too_long"),
    ("/v1/completions", CompletionRequest, b'{"prompt": "hi", "max_tokens": 2' + b" " * 300_000, 400, "invalid_json"),
    ("/v1/completions", CompletionRequest, _deep(200_000), 400, "invalid_json"),
]
BULK_OK = {"prompt": "hi", "max_tokens": 2, "user": "x" * 300_000}


def _body(obj) -> bytes:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    assert len(raw) > BULK_BODY_BYTES
    return raw


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_the_body_checker_imports_no_jax():
    """A checker process starts in a fraction of a second and stays small: json, pydantic and the
    protocol models, none of jax, numpy, llguidance or the tokenizer."""
    heavy = ("jax", "numpy", "llguidance", "tokenizers", "uvicorn")
    code = f"import sys; from runtime.entrypoints.openai import checker; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout


def test_a_checker_that_cannot_start_leaves_the_checks_to_the_server(monkeypatch):
    """A broken environment (the child exits before it is ready) costs one log line per slot, not a
    restart loop; with no checker left every body is checked in the server (`check` answers None)."""
    from runtime.entrypoints.openai import checker

    monkeypatch.setattr(checker, "CHILD", "import sys; sys.exit(3)")
    limits = ServerConfig([])
    body = _body(BULK_BAD[0][2])

    async def main(bc):
        return [await bc.check(body, CompletionRequest, limits) for _ in range(4)]

    bc = checker.BodyChecker(2)
    with _Lines() as lines:
        bc.start()
        try:
            assert asyncio.run(main(bc)) == [None] * 4
        finally:
            bc.close()
    assert bc.children == [] and bc.fallbacks == 2 and bc.checked == 0
    assert len(lines.lines) == 2 and all("failed to start" in line and "exit status 3" in line
                                         for line in lines.lines), lines.lines
    assert "checked in the server from now on" in lines.lines[-1]


def test_a_large_bad_body_is_refused_by_a_checker_process(smol_llm, monkeypatch):
    """A body over BULK_BODY_BYTES goes to a body checker process first. One it refuses gets the 400
    (or 413) the server's own parse gives, body for body, and the server never parses it: its parse
    would hold the GIL that normal requests wait for (~60 ms for 4 MB of small objects). One it
    passes is parsed and served as usual; a small body is parsed by the server alone."""
    app = build_app(smol_llm.engine, served_model_names=MODEL, log_stats_interval=0)
    server = app.state.server
    parsed = []
    own_parse = server.parse
    monkeypatch.setattr(server, "parse", lambda raw, model_cls: parsed.append(len(raw)) or own_parse(raw, model_cls))
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
        assert len(server.checker.pids) == 2
        for path, model_cls, obj, status, code in BULK_BAD:
            raw = _body(obj)
            r = c.post(path, content=raw, headers=J)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text[:300]
            with pytest.raises(APIError) as e:  # what the server's own parse answers
                own_parse(raw, model_cls)
            assert r.json() == e.value.body()
        assert parsed == [] and server.checker.refused == len(BULK_BAD)

        r = c.post("/v1/completions", content=_body(BULK_OK), headers=J)
        assert r.status_code == 200, r.text
        assert len(parsed) == 1 and server.checker.checked == len(BULK_BAD) + 1
        small = {"prompt": "hi", "structured_outputs": {"choice": [str(i) for i in range(3000)]}}
        r = c.post("/v1/completions", json=small)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "grammar_too_large")
        assert len(parsed) == 2 and server.checker.checked == len(BULK_BAD) + 1 and server.checker.fallbacks == 0
        pids = server.checker.pids
    assert not any(_alive(p) for p in pids)  # stopped with the server


def test_killing_a_body_checker_leaves_the_server_serving(smol_llm):
    """A checker process that dies is started again, with one log line, and the body it was given is
    checked by the server: large bodies keep their answers, bad and good, however often they die."""
    app = build_app(smol_llm.engine, served_model_names=MODEL, log_stats_interval=0)
    server = app.state.server
    path, _, bad, _, code = BULK_BAD[0]
    bad = _body(bad)
    ok = _body(BULK_OK)

    def answers(c, n: int) -> None:
        for _ in range(n):
            r = c.post(path, content=bad, headers=J)
            assert (r.status_code, r.json()["error"]["code"]) == (400, code), r.text[:300]
            assert c.post("/v1/completions", content=ok, headers=J).status_code == 200

    with _Lines() as lines, ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as c:
        answers(c, 1)
        first = server.checker.pids
        os.kill(first[0], signal.SIGKILL)
        answers(c, 3)
        assert server.checker.fallbacks >= 1
        died = [line for line in lines.lines if "body checker process" in line]
        assert len(died) == 1 and f"process {first[0]} stopped" in died[0] and "exit status -9" in died[0], died
        assert len(server.checker.pids) == 2 and first[0] not in server.checker.pids
        before = server.checker.fallbacks
        for pid in server.checker.pids:  # all of them
            os.kill(pid, signal.SIGKILL)
        answers(c, 3)
        assert server.checker.fallbacks >= before + 1 and len(server.checker.pids) == 2
        assert server.checker.refused >= 4  # the new ones answer
        pids = server.checker.pids
        assert c.get("/health").status_code == 200
    assert not any(_alive(p) for p in first + pids)


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _closed_within(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes the connection within `timeout` (reads until EOF)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_slow_clients_are_timed_out_and_connections_capped(smol_llm):
    app = build_app(smol_llm.engine, served_model_names=MODEL, log_stats_interval=0, header_timeout_s=1.0,
                    body_timeout_s=1.0, max_connections=12)
    fds_before = _num_fds()
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=10) as c:
        addr = ("127.0.0.1", st.port)
        # Slow headers: half a request head, then a trickle.
        slow = [socket.create_connection(addr) for _ in range(8)]
        for s in slow:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # More connections than the cap: the excess is closed at once.
        flood = [socket.create_connection(addr) for _ in range(20)]
        t0 = time.monotonic()
        closed_now = sum(_closed_within(s, 0.3) for s in flood)
        assert closed_now >= 15, closed_now
        t0 = time.monotonic()
        for s in slow:
            s.sendall(b"X")
        assert all(_closed_within(s, 4.0) for s in slow)
        assert time.monotonic() - t0 < 4.0
        assert all(_closed_within(s, 4.0) for s in flood)  # the survivors sent nothing: header timeout
        # Slow body: a full head, then one byte of a 100-byte body.
        body = socket.create_connection(addr)
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        body.settimeout(5)
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += body.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert time.monotonic() - t0 < 4.0
        assert _closed_within(body, 4.0)
        for s in [*slow, *flood, body]:
            s.close()
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    assert _num_fds() <= fds_before + 2  # nothing leaked


# ====================================================================== HTTP: RFC 9112 framing, auth, logs


KEY = "k3y"


@pytest.fixture(scope="class")
def keyed(smol_llm):
    app = build_app(smol_llm.engine, served_model_names=MODEL, api_key=KEY, log_stats_interval=0)
    with ServerThread(app) as st:
        yield st


def _exchange(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    """Sends `raw` on a fresh connection, then reads until the server closes it (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(raw)
        s.settimeout(timeout)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return reply


def _post(headers: str, body: bytes = b'{"prompt": "hi"}', eol: bytes = b"\r\n") -> bytes:
    head = ["POST /tokenize HTTP/1.1", "Host: x", "Content-Type: application/json", "Connection: close",
            *[h for h in headers.split("|") if h]]
    return eol.join(h.encode() for h in head) + eol + eol + body


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


class _Lines(logging.Handler):
    """Counts the lines our and uvicorn's loggers write (a record with a traceback is many)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines += self.format(record).splitlines()

    def __enter__(self):
        for name in ("runtime", "uvicorn"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in ("runtime", "uvicorn"):
            logging.getLogger(name).removeHandler(self)


AUTH = f"Authorization: Bearer {KEY}"
FRAMING = [  # (what, raw request, status)
    ("Transfer-Encoding and Content-Length", _post(f"{AUTH}|Transfer-Encoding: chunked|Content-Length: 21",
                                                   _chunked(b'{"prompt": "hi"}')), 400),
    ("Content-Length then Transfer-Encoding", _post(f"{AUTH}|Content-Length: 21|Transfer-Encoding: chunked",
                                                    _chunked(b'{"prompt": "hi"}')), 400),
    ("bare LF line endings", _post(AUTH + "|Content-Length: 16", eol=b"\n"), 400),
    ("a bare LF after one header", _post(f"{AUTH}\nContent-Length: 16"), 400),
    ("two Content-Length", _post(f"{AUTH}|Content-Length: 16|Content-Length: 17"), 400),
    ("a malformed chunk size", _post(f"{AUTH}|Transfer-Encoding: chunked", b"zz\r\n{}\r\n0\r\n\r\n"), 400),
    ("a chunk size with a bare LF", _post(f"{AUTH}|Transfer-Encoding: chunked", b"2\n{}\r\n0\r\n\r\n"), 400),
    ("a head over 64 KiB", _post(f"{AUTH}|X-Big: {'a' * 70_000}|Content-Length: 16"), 431),
    ("two Authorization headers", _post(f"{AUTH}|Authorization: Bearer other|Content-Length: 16"), 400),
    ("a key with a trailing space", _post(f"{AUTH} |Content-Length: 16"), 401),
    ("a key with a trailing tab", _post(f"{AUTH}\t|Content-Length: 16"), 401),
    ("another key", _post("Authorization: Bearer k3|Content-Length: 16"), 401),
    ("no scheme", _post(f"Authorization: {KEY}|Content-Length: 16"), 401),
    ("lowercase scheme", _post(f"Authorization: bearer {KEY}|Content-Length: 16"), 200),
    ("Transfer-Encoding:<TAB>chunked (OWS)", _post(f"{AUTH}|Transfer-Encoding:\tchunked",
                                                  _chunked(b'{"prompt": "hi"}')), 200),
]


class TestRawHTTP:
    """A server with an API key, spoken to in raw bytes. Its fixture is class-scoped: a server that
    outlived these tests would keep stepping the shared engine beside the next test's server."""

    @pytest.mark.parametrize("what,raw,status", FRAMING, ids=[f[0] for f in FRAMING])
    def test_http_framing_and_auth_are_strict(self, keyed, smol_llm, what, raw, status):
        """RFC 9112 framing: the request-smuggling shapes and bare LFs are refused (h11 served them);
        `Transfer-Encoding:<TAB>chunked` is RFC 9112's optional whitespace, and read as chunked (never
        beside a Content-Length). The API key must match exactly; the scheme in any case. Each refusal
        is one log line at most."""
        with _Lines() as logs:
            reply = _exchange(keyed.port, raw)
            time.sleep(0.2)  # a handler's line would follow the reply
        assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:300]
        assert len(logs.lines) <= 1, logs.lines
        if status != 200:
            err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
        else:
            assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["count"] == 1
        with httpx.Client(base_url=keyed.url, headers={"Authorization": AUTH.split(": ")[1]}) as c:
            assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200

    @pytest.mark.parametrize("what,raw", [
        ("10 of 100 body bytes", _post(f"{AUTH}|Content-Length: 100", b'{"prompt":')),
        ("a chunk cut short", _post(f"{AUTH}|Transfer-Encoding: chunked", b"40\r\n{\"prompt\":")),
        ("a malformed chunk after a good one", _post(f"{AUTH}|Transfer-Encoding: chunked", b"2\r\n{}\r\nzz\r\n")),
    ], ids=["content-length", "chunked", "bad-chunk"])
    def test_a_request_cut_short_is_one_log_line(self, keyed, smol_llm, what, raw):
        """A client that sends part of a body and closes (or a malformed chunk mid-body) wrote ~98 ERROR
        lines (an unhandled error and uvicorn's traceback): now one WARNING line, and no KV touched."""
        with _Lines() as logs:
            with socket.create_connection(("127.0.0.1", keyed.port)) as s:
                s.sendall(raw)
                time.sleep(0.3)
            deadline = time.monotonic() + 5
            while not logs.lines and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        assert len(logs.lines) == 1, logs.lines
        assert "ERROR" not in logs.lines[0] and "/tokenize" in logs.lines[0], logs.lines
        with httpx.Client(base_url=keyed.url, headers={"Authorization": AUTH.split(": ")[1]}) as c:
            assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200

    def test_pipelined_requests_are_answered_in_order(self, keyed):
        one = _post(f"{AUTH}|Content-Length: 16").replace(b"Connection: close\r\n", b"")
        reply = _exchange(keyed.port, one + _post(f"{AUTH}|Content-Length: 16"))
        assert reply.count(b"HTTP/1.1 200 ") == 2, reply


# ====================================================================== SIGTERM (one subprocess)


@pytest.mark.slow  # a `python -m runtime.serve` subprocess on the real SmolLM2
def test_sigterm_ends_every_stream_with_abort_then_done(tmp_path):
    """8 long streams and a short grace: each stream gets finish_reason "abort" and [DONE], and the
    process exits within grace + 2 s, its body checker processes with it."""
    grace = 3.0
    proc, url, log_path = start_cli_server(tmp_path, "--shutdown-grace-s", str(grace), "--log-stats-interval", "0")
    try:
        started = threading.Barrier(9)
        results: list[list[str] | BaseException] = [None] * 8

        def stream(i: int) -> None:
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 400, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            try:
                with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                    lines = []
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                            if len(lines) == 1:
                                started.wait(60)
                    results[i] = lines
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(120)
        checkers = _children(proc.pid)
        assert len(checkers) == 2  # the body checker processes
        proc.send_signal(signal.SIGTERM)
        t_sig = time.monotonic()
        code = proc.wait(timeout=grace + 30)
        exit_s = time.monotonic() - t_sig
        for t in threads:
            t.join(30)
        print(f"exit {code} {exit_s:.2f}s after SIGTERM (grace {grace}s)")
        for i, lines in enumerate(results):
            assert isinstance(lines, list), f"stream {i}: {lines!r}"
            assert lines[-1] == "data: [DONE]", f"stream {i}: {lines[-3:]}"
            last = json.loads(lines[-2][6:])
            assert last["choices"][0]["finish_reason"] == "abort", f"stream {i}: {lines[-2]}"
        assert code == 0, log_path.read_text()[-3000:]
        assert exit_s <= grace + 2, f"exited {exit_s:.2f}s after SIGTERM"
        assert "aborting 8 in-flight requests" in log_path.read_text()
        assert not any(_alive(p) for p in checkers)  # stopped with the server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ====================================================================== the soak's instruments


def test_soak_measures_the_server_process(smol_llm):
    from runtime.tools.bench_soak import SoakRow, growth_checks, proc_stats, soak_async

    import faulthandler

    app = build_app(smol_llm.engine, served_model_names=MODEL, log_stats_interval=0)
    # One of these six requests hung for the client's 300 s twice on loaded machines (not reproduced
    # alone): if a run takes over 60 s, every thread's stack goes to stderr, to show where it waits.
    faulthandler.dump_traceback_later(60, exit=False)
    try:
        with ServerThread(app) as st:
            rows = asyncio.run(soak_async(st.url, model=MODEL, rate=2.0, duration_s=3.0, pid=os.getpid(),
                                          max_tokens=4, log=lambda line: None))
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert len(rows) == 1
    r = rows[0]
    assert r.sent == r.ok == 6 and r.failed == 0, r.first_error
    assert 0 < r.p50_ms <= r.p99_ms
    rss, fds = proc_stats(os.getpid())
    assert r.rss_mib > 50 and abs(r.rss_mib - rss) < 500 and 3 <= r.num_fds and fds >= 3
    assert all(c.ok for c in growth_checks(rows))
    grown = [SoakRow(1, 60, 60, 0, 100, 200, 500.0, 20), SoakRow(2, 60, 60, 0, 100, 210, 510.0, 21),
             SoakRow(3, 60, 59, 1, 100, 900, 700.0, 60)]
    checks = {c.name: c for c in growth_checks(grown)}
    assert not any(c.ok for c in checks.values()), checks  # latency, RSS and fds all grew
    assert "RSS 500.0 -> 700.0 MiB" in checks["rss"].detail and "open fds 20 -> 60" in checks["fds"].detail
