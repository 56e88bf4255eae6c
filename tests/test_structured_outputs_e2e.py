"""Structured outputs end to end: grammars compiled at admission, one matcher per sequence, the mask
inside the step executable. Fast tests on the tiny random model with a tiny byte-level BPE; slow ones
on the real SmolLM2, offline (LLM.generate) and over HTTP (chat, completions, streaming, n > 1, bad
schemas)."""

from __future__ import annotations

import conftest
import json
import re
from dataclasses import replace

import httpx
import jsonschema
import pytest
from conftest import tiny_bpe_tokenizer

from runtime.engine.plan import compile_plan
from config.engine_config import EngineConfig
from runtime.core.sampling_params import RequestError, SamplingParams, StructuredOutputsParams
from runtime.entrypoints.llm import LLM
from runtime.worker.model_runner import num_backend_compiles

TINY_REGEX = r"(ab|12){1,3}x"
TINY_SCHEMA = {"type": "object", "properties": {"ab": {"enum": [12, 21]}}, "required": ["ab"],
               "additionalProperties": False}


def tiny_llm(**engine_args) -> LLM:
    """The tiny random model over the tiny BPE (its vocabulary padded to 300 rows, EOS emittable)."""
    from models.config import get_preset

    tok = tiny_bpe_tokenizer()
    cfg = replace(get_preset("tiny"), name="tiny-bpe", vocab_size=300, eos_token_id=tok.eos_token_id)
    args = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64) | engine_args
    return conftest.tiny_llm(seed=0, config=cfg, tokenizer=tok, **args)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llm()


def constrained(temperature=0.0, max_tokens=40, **so) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1,
                          structured_outputs=StructuredOutputsParams(**so))


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45], [100], [7, 7, 7, 7]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_regex_choice_json(tiny, temperature):
    c0 = num_backend_compiles()
    params = [constrained(temperature, regex=TINY_REGEX), constrained(temperature, choice=["ab", "a12", "b"]),
              constrained(temperature, json=TINY_SCHEMA, disable_any_whitespace=True),
              constrained(temperature, json_object=True, disable_any_whitespace=True, max_tokens=8)]
    outs = tiny.generate(PROMPTS, params)
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(TINY_REGEX, texts[0]), texts[0]
    assert texts[1] in ("ab", "a12", "b")
    assert json.loads(texts[2])["ab"] in (12, 21)
    assert [o.outputs[0].finish_reason for o in outs[:3]] == ["stop"] * 3
    # Cut by max_tokens before the grammar completes: "length", and a prefix of an object.
    assert outs[3].outputs[0].finish_reason in ("stop", "length") and texts[3].startswith("{")
    assert num_backend_compiles() == c0 and tiny.engine.stats().num_recompiles == 0


def test_tiny_n_gt_1_each_fork_has_its_own_matcher(tiny):
    out = tiny.generate([[9, 10, 11]], replace(constrained(1.0, regex=TINY_REGEX), n=4))[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1, texts
    for t, c in zip(texts, out.outputs):
        assert re.fullmatch(TINY_REGEX, t) and c.finish_reason == "stop", t


def test_tiny_free_rows_unchanged_by_constrained_neighbours(tiny):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = tiny.generate(PROMPTS, free)
    mixed = tiny.generate(PROMPTS + PROMPTS, [free] * 4 + [constrained(regex=TINY_REGEX)] * 4)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch(TINY_REGEX, o.outputs[0].text) for o in mixed[4:])
    # and the constrained ones are the same with or without the free neighbours
    assert [o.outputs[0].token_ids for o in mixed[4:]] == [
        o.outputs[0].token_ids for o in tiny.generate(PROMPTS, constrained(regex=TINY_REGEX))]


def test_tiny_grammar_overrides_min_tokens_and_ignore_eos(tiny):
    p = replace(constrained(choice=["b"]), min_tokens=5, ignore_eos=True)
    out = tiny.generate([[3, 4]], p)[0].outputs[0]
    assert out.text == "b" and out.finish_reason == "stop"


@pytest.mark.slow
def test_tiny_multi_step_falls_back_for_constrained_batches():
    llm = tiny_llm(num_scheduler_steps=4)
    single = tiny_llm()
    multi_steps = []  # per step: (ran K steps at once, held a constrained row)
    llm.engine.step_hooks.append(lambda sched, outs: multi_steps.append(
        (outs["tokens"].ndim == 2, any(sc.seq.matcher is not None for sc in sched.scheduled))))
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
            == [o.outputs[0].token_ids for o in single.generate(PROMPTS, free)])
    assert any(k for k, _ in multi_steps)  # free decode batches do run K steps at once
    multi_steps.clear()
    p = constrained(regex=TINY_REGEX)
    got = llm.generate(PROMPTS, [p, free, p, free])
    assert not any(k and c for k, c in multi_steps)  # a batch holding a constrained row never does
    assert any(c for _, c in multi_steps) and any(k for k, _ in multi_steps)
    want = single.generate(PROMPTS, [p, free, p, free])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.stats().num_recompiles == 0


def test_tiny_bad_grammar_is_a_request_error_and_the_engine_goes_on(tiny):
    for so, what in (({"regex": "(unclosed"}, "regex"), ({"json": {"type": "nonsense"}}, "JSON schema"),
                     ({"grammar": "start: @@@"}, "grammar")):
        with pytest.raises(RequestError) as e:
            tiny.generate([[5, 6]], SamplingParams(structured_outputs=so))
        assert e.value.param == "structured_outputs" and what in e.value.message, e.value.message
    assert not tiny.engine.has_unfinished_requests()
    assert re.fullmatch(TINY_REGEX, tiny.generate([[5, 6]], constrained(regex=TINY_REGEX))[0].outputs[0].text)


def test_tiny_refused_token_ends_only_that_sequence(tiny, monkeypatch):
    from runtime.core.structured_output import GrammarMatcher

    monkeypatch.setattr(GrammarMatcher, "accept_token", lambda self, t: False)
    free = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    bad, good = tiny.generate([[5, 6], [7, 8]], [constrained(regex=TINY_REGEX), free])
    assert bad.outputs[0].finish_reason == "error" and "not allowed by the grammar" in bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == 5
    assert not tiny.engine.has_unfinished_requests() and tiny.engine.block_manager.num_used == 0


def test_no_tokenizer_is_a_request_error():
    from models.config import get_preset
    from models.weights import random_weights

    cfg = get_preset("tiny")
    plan = compile_plan(None, EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                                           num_kv_blocks=16), weights=random_weights(cfg, seed=0), config=cfg)
    llm = LLM.from_plan(plan, warmup=False)
    with pytest.raises(RequestError, match="tokenizer") as e:
        llm.engine.add_request(None, [5, 6], SamplingParams(structured_outputs={"regex": "a"}))
    assert e.value.param == "structured_outputs"


# ====================================================================== the real SmolLM2 (slow)

def _obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


SHORT = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "nested objects": (
        "Give the name and the address (city and 5-digit zip code) of a fictional person as JSON.",
        _obj({"name": SHORT, "address": _obj({"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    "bounded arrays": (
        "List a few colours of the rainbow as JSON.",
        _obj({"colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2,
                         "maxItems": 4}})),
    "enums": (
        "Classify the sentiment of 'I love this film!' as JSON.",
        _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"enum": ["low", "high"]}})),
    "bounded numbers": (
        "Give the age in years and the height in metres of a typical adult as JSON.",
        _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120},
              "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5}})),
    "required fields": (
        "Describe a famous book (title, year, optional tags) as JSON.",
        _obj({"title": SHORT, "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
              "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
             required=["title", "year"])),
}
JSON_MAX_TOKENS = 160


def test_smollm2_five_schemas(smol_llm):
    convs = [[{"role": "user", "content": prompt}] for prompt, _ in SCHEMAS.values()]
    params = [SamplingParams(temperature=0, max_tokens=JSON_MAX_TOKENS, structured_outputs={"json": schema})
              for _, schema in SCHEMAS.values()]
    outs = smol_llm.chat(convs, params)
    for name, (_, schema), out in zip(SCHEMAS, SCHEMAS.values(), outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert smol_llm.engine.stats().num_recompiles == 0


CITY = _obj({"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0},
             "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
             "is_capital": {"type": "boolean"},
             "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]}})


def test_smollm2_sampled_json_closes(smol_llm):
    """Issue 48: sampled at 0.7-1.0, SmolLM2 looped in free whitespace inside the object until
    max_tokens (2 of these 20 seeds). With whitespace bounded by default every sample closes."""
    params = [SamplingParams(temperature=(0.7, 0.8, 0.9, 1.0)[i % 4], seed=i, max_tokens=200,
                             structured_outputs={"json": CITY}) for i in range(20)]
    outs = smol_llm.chat([[{"role": "user", "content": "CITY: LIMA"}]] * 20, params)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), CITY)


def test_smollm2_regex_and_choice(smol_llm):
    tok = smol_llm.get_tokenizer()
    prompts = ["The date of the first moon landing, as YYYY-MM-DD:", "Is the sky blue? Answer:"]
    regex = r"\d{4}-\d{2}-\d{2}"
    outs = smol_llm.generate(prompts, [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": regex}),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["yes", "no", "maybe"]})])
    assert re.fullmatch(regex, outs[0].outputs[0].text) and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in ("yes", "no", "maybe") and outs[1].outputs[0].finish_reason == "stop"
    assert tok is not None


def test_smollm2_free_requests_unchanged_in_a_mixed_batch(smol_llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there", "Water boils at"]
    alone = smol_llm.generate(prompts, free)
    # Compact JSON: with free whitespace, a 135M model given a bare prompt loops on newlines.
    so = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMAS["enums"][1],
                                                                         "disable_any_whitespace": True})
    mixed = smol_llm.generate([p for pair in zip(prompts, prompts) for p in pair], [free, so] * len(prompts))
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[1::2]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["enums"][1])


@pytest.fixture(scope="class")
def http(smol_llm):
    """A server over the shared engine, up only while TestHTTP runs (after the offline tests)."""
    from runtime.serve import ServerThread, build_app

    app = build_app(smol_llm.engine, served_model_names=["smollm2-135m"], log_stats_interval=0)
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=120) as client:
        yield client
    assert not smol_llm.engine.has_unfinished_requests()


class TestHTTP:
    def chat(self, http, content, **body):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                    "temperature": 0, "max_tokens": JSON_MAX_TOKENS, **body})
        return r

    def test_chat_response_format_json_schema(self, http):
        prompt, schema = SCHEMAS["nested objects"]
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
        r = self.chat(http, prompt, response_format=rf)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        # any object: its strings are unbounded, so max_tokens may cut it ("length")
        r = self.chat(http, "Reply with a JSON object about cats.", response_format={"type": "json_object"})
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")

    def test_completions_structured_outputs_regex_and_n(self, http):
        regex = r"(red|green|blue)( and (red|green|blue))?"
        r = http.post("/v1/completions", json={"prompt": "My favourite colours are", "max_tokens": 12,
                                               "temperature": 1.0, "seed": 3, "n": 3,
                                               "structured_outputs": {"regex": regex}})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3
        for c in choices:
            assert re.fullmatch(regex, c["text"]) and c["finish_reason"] == "stop", c
        # chat, n > 1, JSON: every choice validates
        prompt, schema = SCHEMAS["enums"]
        r = self.chat(http, prompt, n=3, temperature=1.0, seed=5,
                      response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        for c in r.json()["choices"]:
            jsonschema.validate(json.loads(c["message"]["content"]), schema)

    def test_streaming_text_validates(self, http):
        prompt, schema = SCHEMAS["bounded numbers"]
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "stream": True,
                "max_tokens": JSON_MAX_TOKENS, "structured_outputs": {"json": schema}}
        text, reasons = "", []
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        text += ch["delta"].get("content") or ""
                        reasons.append(ch["finish_reason"])
        jsonschema.validate(json.loads(text), schema)
        assert reasons[-1] == "stop"

    @pytest.mark.parametrize("path,extra,param,words", [
        ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
         "response_format", "JSON schema"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one"),
        ("/v1/completions", {"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "both"),
        ("/v1/completions", {"structured_outputs": {"grammar": "start: @@"}}, "structured_outputs", "grammar"),
    ])
    def test_bad_constraint_is_400_and_the_server_goes_on(self, http, path, extra, param, words):
        body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
        r = http.post(path, json={**body, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and http.get("/health").status_code == 200
