"""Structured outputs, host side: params and response_format, grammar compilation errors, and matchers
driven by a greedy walk over a fixed random score vector (real SmolLM2 tokenizer: slow) or a tiny
byte-level BPE (conftest.tiny_bpe_tokenizer: fast)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from conftest import tiny_bpe_tokenizer
from models.tokenizer import Tokenizer
from runtime.core.sampling_params import RequestError
from runtime.core.structured_output import (GrammarCompiler, StructuredOutputsParams, allocate_bitmask,
                                            bitmask_to_bool)

P = StructuredOutputsParams
PENALTY = 3.0  # subtracted from a token's score each time the walk picks it (see `walk`)


def walk(compiled, tokenizer, vocab_size: int, seed: int = 0, max_steps: int = 300) -> list[int]:
    """Greedy decoding under the grammar: each step takes the allowed token with the highest score
    from a seeded random vector of the model's vocabulary size. A picked token's score then drops by
    PENALTY, or free text (strings, fraction digits) would repeat its best token forever."""
    scores = np.random.default_rng(seed).standard_normal(vocab_size).astype(np.float32)
    scores[tokenizer.vocab_size:] = 100.0  # ids the tokenizer lacks must never be picked
    m, mask, out = compiled.matcher(), allocate_bitmask(1, vocab_size), []
    for _ in range(max_steps):
        if m.is_terminated():
            return out
        m.fill_bitmask(mask, 0)
        allowed = bitmask_to_bool(mask, vocab_size)[0]
        assert allowed.any() and not allowed[tokenizer.vocab_size:].any()
        t = int(np.argmax(np.where(allowed, scores, -np.inf)))
        assert m.accept_token(t)
        if t in compiled.eos_token_ids:
            assert m.is_terminated()
            return out
        out.append(t)
        scores[t] -= PENALTY
    raise AssertionError(f"not terminated after {max_steps} tokens: {tokenizer.decode(out)!r}")


def allowed_ids(matcher, vocab_size: int) -> np.ndarray:
    mask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(mask, 0)
    return np.nonzero(bitmask_to_bool(mask, vocab_size)[0])[0]


# ---- the bitmask layout (pure numpy) -----------------------------------------------------------

def test_bitmask_layout():
    mask = allocate_bitmask(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == np.int32 and (mask == -1).all()
    assert bitmask_to_bool(mask, 70).shape == (3, 70) and bitmask_to_bool(mask, 70).all()
    mask[:] = 0
    mask[1, 0] = 1 << 5
    mask.view(np.uint32)[1, 1] = 1 << 31  # token 63: the sign bit of word 1
    mask[2, 2] = 1 << 1  # token 65
    dense = bitmask_to_bool(mask, 70)
    assert np.nonzero(dense[0])[0].tolist() == []
    assert np.nonzero(dense[1])[0].tolist() == [5, 63]
    assert np.nonzero(dense[2])[0].tolist() == [65]
    assert np.nonzero(bitmask_to_bool(mask[1], 70))[0].tolist() == [5, 63]  # one row


# ---- params and response_format (no tokenizer) ---------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"disable_any_whitespace": True}, {"json": {}, "regex": "a"},
                                    {"choice": ["a"], "grammar": "start: a"}, {"json_object": False}])
def test_exactly_one_constraint(kwargs):
    with pytest.raises(RequestError) as e:
        P(**kwargs)
    assert e.value.param == "structured_outputs" and "exactly one" in e.value.message


@pytest.mark.parametrize("kwargs", [{"json": "{not json"}, {"json": 3}, {"json": [1]}, {"regex": ""},
                                    {"regex": 5}, {"grammar": ""}, {"choice": []}, {"choice": ["a", 1]},
                                    {"choice": "ab"}, {"json_object": "yes"},
                                    {"regex": "a", "disable_any_whitespace": 1}])
def test_bad_values(kwargs):
    with pytest.raises(RequestError) as e:
        P(**kwargs)
    assert e.value.param == "structured_outputs"


def test_cache_key():
    a = P(json={"type": "object", "required": ["a"]})
    b = P(json='{"required": ["a"], "type": "object"}')
    assert a.kind == b.kind == "json" and a.cache_key() == b.cache_key()
    assert a.cache_key() != P(json=a.json, disable_any_whitespace=True).cache_key()
    assert P(regex="a").cache_key() == P(regex="a", disable_any_whitespace=True).cache_key()
    assert P(choice=("x", "y")).choice == ["x", "y"]


def test_response_format():
    assert P.from_response_format(None) is None
    assert P.from_response_format({"type": "text"}) is None
    p = P.from_response_format({"type": "json_object"})
    assert p.kind == "json_object" and p.source_param == "response_format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = P.from_response_format({"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert p.kind == "json" and p.json == schema
    p = P.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert p.json == {"type": "object"}
    for bad in ["json", {"type": "xml"}, {}, {"type": "json_schema"},
                {"type": "json_schema", "json_schema": "x"},
                {"type": "json_schema", "json_schema": {"schema": [1]}},
                {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
                {"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}]:
        with pytest.raises(RequestError) as e:
            P.from_response_format(bad)
        assert e.value.param == "response_format", bad


# ---- a tiny byte-level BPE (fast) -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return tiny_bpe_tokenizer()


TINY_VOCAB = 300  # the model's rows: past the tokenizer's 262, not a multiple of 32


@pytest.fixture(scope="module")
def tiny_compiler(tiny):
    return GrammarCompiler(tiny, TINY_VOCAB)


def test_tiny_walks(tiny, tiny_compiler):
    for seed in range(3):
        text = tiny.decode(walk(tiny_compiler.compile(P(regex=r"(ab|12)+x")), tiny, TINY_VOCAB, seed))
        assert re.fullmatch(r"(ab|12)+x", text)
        text = tiny.decode(walk(tiny_compiler.compile(P(choice=["ab", "a12", "b"])), tiny, TINY_VOCAB, seed))
        assert text in ("ab", "a12", "b")
        schema = {"type": "object", "properties": {"ab": {"enum": [12, 21]}}, "required": ["ab"],
                  "additionalProperties": False}
        compiled = tiny_compiler.compile(P(json=schema, disable_any_whitespace=True))
        jsonschema.validate(json.loads(tiny.decode(walk(compiled, tiny, TINY_VOCAB, seed))), schema)


def takes(compiled, tokenizer, text: str, complete: bool = False) -> bool:
    """Whether the grammar takes `text` token by token (and then, with `complete`, a stop id)."""
    m = compiled.matcher()
    ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if complete else [])
    return all(m.accept_token(t) for t in ids)


def test_json_whitespace_is_bounded(tiny, tiny_compiler):
    """Between two JSON tokens, at most one newline and then up to 16 spaces or tabs: compact and
    pretty-printed JSON pass, but no run of whitespace a small model can loop in until max_tokens
    (issue 48). disable_any_whitespace: none at all."""
    schema = {"type": "object", "properties": {"ab": {"type": "array", "items": {"enum": [12, 21]}}},
              "required": ["ab"], "additionalProperties": False}
    value = {"ab": [12, 21]}
    for default in (tiny_compiler.compile(P(json=schema)), tiny_compiler.compile(P(json_object=True))):
        for text in (json.dumps(value), json.dumps(value, indent=4), json.dumps(value, separators=(",", ":")),
                     '{\n\t"ab" : [12,\n\t\t21\n\t]\n}'):
            assert takes(default, tiny, text, complete=True), text
        for text in ("{\n\n", "{" + " " * 17, '{"ab":\n\n', '{"ab": [12,\n \n', '{"ab": [12]  \n'):
            assert not takes(default, tiny, text), text
    compact = tiny_compiler.compile(P(json=schema, disable_any_whitespace=True))
    assert takes(compact, tiny, json.dumps(value, separators=(",", ":")), complete=True)
    assert not takes(compact, tiny, "{ ") and not takes(compact, tiny, '{"ab": ')


def test_padded_vocab_is_masked(tiny, tiny_compiler):
    """Ids past the tokenizer, and the padding bits of the last word, are never allowed."""
    m = tiny_compiler.compile(P(json_object=True)).matcher()
    mask = allocate_bitmask(2, TINY_VOCAB)
    m.fill_bitmask(mask, 1)
    assert (mask[0] == -1).all()  # other rows untouched
    dense = bitmask_to_bool(mask, mask.shape[1] * 32)[1]
    assert dense[:tiny.vocab_size].any() and not dense[tiny.vocab_size:].any()
    assert tiny_compiler.ll_tokenizer.vocab_size == TINY_VOCAB


def test_model_vocab_smaller_than_tokenizer(tiny):
    """A model that cannot emit the tokenizer's last ids: they are dropped from the mask."""
    compiler = GrammarCompiler(tiny, 250)
    m = compiler.compile(P(regex="ab|12")).matcher()
    mask = np.zeros((1, 8), np.int32)
    m.fill_bitmask(mask, 0)
    ids = np.nonzero(bitmask_to_bool(mask, 256)[0])[0].tolist()
    assert ids == [tiny.encode("1")[0], tiny.encode("a")[0]]  # not the merges "ab", "12" (ids 256, 257)
    with pytest.raises(ValueError):
        m.fill_bitmask(allocate_bitmask(1, TINY_VOCAB), 0)  # wrong width


def test_eos_and_termination(tiny, tiny_compiler):
    eos = tiny.eos_token_id
    m = tiny_compiler.compile(P(regex="[0-9]+")).matcher()
    assert eos not in allowed_ids(m, TINY_VOCAB) and not m.accept_token(eos)  # empty: not a match yet
    assert all(m.accept_token(t) for t in tiny.encode("12"))
    assert not m.is_terminated()  # complete, but more digits may follow
    ids = allowed_ids(m, TINY_VOCAB)
    assert eos in ids and tiny.encode("3")[0] in ids
    assert m.accept_token(eos) and m.is_terminated()
    assert allowed_ids(m, TINY_VOCAB).tolist() == [eos] and not m.accept_token(tiny.encode("3")[0])
    # a choice is over once matched: only EOS may follow, and the engine may stop without it
    m = tiny_compiler.compile(P(choice=["ab", "b"])).matcher()
    assert m.accept_token(tiny.encode("ab")[0]) and m.is_terminated()
    assert allowed_ids(m, TINY_VOCAB).tolist() == [eos]


def test_refused_token_keeps_state(tiny, tiny_compiler):
    m = tiny_compiler.compile(P(regex="ab|12")).matcher()
    before = allowed_ids(m, TINY_VOCAB)
    assert not m.accept_token(tiny.encode("x")[0]) and not m.accept_token(TINY_VOCAB - 1)
    assert m.num_tokens == 0 and m.error is None and (allowed_ids(m, TINY_VOCAB) == before).all()
    assert m.accept_token(tiny.encode("1")[0]) and m.accept_token(tiny.encode("2")[0]) and m.is_terminated()


def test_rollback_and_validate(tiny, tiny_compiler):
    a, b, one, two = (tiny.encode(c)[0] for c in "ab12")
    eos = tiny.eos_token_id
    m = tiny_compiler.compile(P(regex="(ab|12)+")).matcher()
    states = [allowed_ids(m, TINY_VOCAB)]
    for t in (a, b, one):
        assert m.accept_token(t)
        states.append(allowed_ids(m, TINY_VOCAB))
    m.rollback(2)
    assert m.num_tokens == 1 and (allowed_ids(m, TINY_VOCAB) == states[1]).all()
    assert m.accept_token(b) and m.accept_token(eos) and m.is_terminated() and m.num_tokens == 3
    m.rollback(1)  # the EOS counts like any token
    assert not m.is_terminated() and (allowed_ids(m, TINY_VOCAB) == states[2]).all()
    with pytest.raises(ValueError):
        m.rollback(3)
    m.reset()
    assert m.num_tokens == 0 and (allowed_ids(m, TINY_VOCAB) == states[0]).all()
    # drafts: how many would be accepted, without moving
    assert m.validate_tokens([a, b, one, two, eos, a]) == 5
    assert m.validate_tokens([a, b, one, eos]) == 3  # "ab1" is not a match: EOS refused
    assert m.validate_tokens([a, a]) == 1 and m.validate_tokens([eos]) == 0 and m.num_tokens == 0
    assert (allowed_ids(m, TINY_VOCAB) == states[0]).all()


def test_matchers_are_independent_and_cached(tiny_compiler, tiny):
    compiled = tiny_compiler.compile(P(regex="ab|12"))
    assert tiny_compiler.compile(P(regex="ab|12")) is compiled
    m1, m2 = compiled.matcher(), compiled.matcher()
    assert m1.accept_token(tiny.encode("1")[0])
    assert m2.num_tokens == 0 and tiny.encode("a")[0] in allowed_ids(m2, TINY_VOCAB)


BAD = [
    (P(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "JSON schema"),
    (P(json={"type": "string", "pattern": "(("}), "JSON schema"),
    (P(json={"type": "integer", "minimum": 5, "maximum": 1}), "JSON schema"),
    (P(json={"type": "frobnicate"}), "JSON schema"),
    (P(json={"type": "string", "format": "no-such-format"}), "JSON schema"),
    (P(regex="[a-z]+("), "regex"),
    (P(regex="a{3,1}"), "regex"),
    (P(grammar="start: undefined_rule"), "grammar"),
    (P(grammar="root ::= ("), "grammar"),
    (P(grammar="not a grammar at all"), "grammar"),
]


@pytest.mark.parametrize("params,what", BAD, ids=[f"{w}-{i}" for i, (_, w) in enumerate(BAD)])
def test_bad_grammars_are_request_errors(tiny_compiler, params, what):
    with pytest.raises(RequestError) as e:
        tiny_compiler.compile(params)
    assert e.value.param == "structured_outputs" and e.value.message.startswith(f"invalid {what}:")
    assert type(e.value) is RequestError


def test_bad_schema_from_response_format(tiny_compiler):
    p = P.from_response_format({"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}})
    with pytest.raises(RequestError) as e:
        tiny_compiler.compile(p)
    assert e.value.param == "response_format"


# ---- the real SmolLM2 tokenizer (slow: the `tok` fixture) ----------------------------------------

@pytest.fixture(scope="module")
def tok():
    from models.weights import find_smollm2_gguf, read_gguf_index

    fields, _ = read_gguf_index(find_smollm2_gguf())
    return Tokenizer.from_gguf_fields(fields), int(fields["llama.vocab_size"])


@pytest.fixture(scope="module")
def smol(tok):
    tokenizer, vocab_size = tok
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size)
    print(f"llguidance tokenizer: {time.perf_counter() - start:.3f}s")
    return tokenizer, vocab_size, compiler


SCHEMAS = {
    "required": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                 "properties": {"name": {"type": "string", "maxLength": 12},
                                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                "email": {"type": "string", "maxLength": 20}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "address"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 10},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["tags", "scores"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 3}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size", "ok", "none"],
              "properties": {"color": {"enum": ["red", "green", "blue"]},
                             "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                             "ok": {"type": "boolean"}, "none": {"type": "null"}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["price", "temp", "count"],
                "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100},
                               "temp": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 60},
                               "count": {"type": "integer", "minimum": 10, "maximum": 20}}},
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_walk(smol, name, seed):
    tokenizer, vocab_size, compiler = smol
    start = time.perf_counter()
    compiled = compiler.compile(P(json=SCHEMAS[name], disable_any_whitespace=True))
    print(f"compile {name}: {1e3 * (time.perf_counter() - start):.2f} ms")
    text = tokenizer.decode(walk(compiled, tokenizer, vocab_size, seed))
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_whitespace(smol):
    """Free whitespace between JSON tokens unless disable_any_whitespace."""
    tokenizer, vocab_size, compiler = smol
    space, newline = tokenizer.encode(" ")[0], tokenizer.encode("\n")[0]
    for compact in (False, True):
        m = compiler.compile(P(json=SCHEMAS["enums"], disable_any_whitespace=compact)).matcher()
        assert m.accept_token(tokenizer.encode("{")[0])
        ids = set(allowed_ids(m, vocab_size).tolist())
        assert (space in ids and newline in ids) != compact


def test_json_object_accepts_encoded_text(smol):
    tokenizer, vocab_size, compiler = smol
    m = compiler.compile(P.from_response_format({"type": "json_object"})).matcher()
    ids = tokenizer.encode('{"a": [1, 2.5, "x"], "b": {"c": null}}')
    assert all(m.accept_token(t) for t in ids) and m.is_terminated()
    assert allowed_ids(m, vocab_size).tolist() == sorted(compiler.eos_token_ids)
    m = compiler.compile(P(json_object=True)).matcher()
    assert not m.accept_token(tokenizer.encode("[")[0])  # an array is not an object


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regex_walk(smol, seed):
    tokenizer, vocab_size, compiler = smol
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{2})?"
    text = tokenizer.decode(walk(compiler.compile(P(regex=regex)), tokenizer, vocab_size, seed))
    assert re.fullmatch(regex, text)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_walk(smol, seed):
    tokenizer, vocab_size, compiler = smol
    choice = ["positive", "negative", "neutral", "it's \"mixed\""]
    text = tokenizer.decode(walk(compiler.compile(P(choice=choice)), tokenizer, vocab_size, seed))
    assert text in choice


LARK = r"""
start: expr
expr: term (OP term){0,3}
term: NUMBER | "(" expr ")"
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]{0,2}/
"""
GBNF = r"""
root ::= term (op term){0,3}
term ::= [1-9] [0-9]{0,2}
op ::= "+" | "-" | "*"
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("grammar", [LARK, GBNF], ids=["lark", "gbnf"])
def test_grammar_walk(smol, grammar, seed):
    tokenizer, vocab_size, compiler = smol
    text = tokenizer.decode(walk(compiler.compile(P(grammar=grammar)), tokenizer, vocab_size, seed))
    assert re.fullmatch(r"[0-9()+\-*]+", text)
    eval(compile(text, "<grammar>", "eval"), {})  # a well-formed arithmetic expression


def test_real_tokenizer_padded_vocab(tok):
    """The model's rows past the tokenizer's vocabulary are masked off."""
    tokenizer, vocab_size = tok
    padded = vocab_size + 45
    compiler = GrammarCompiler(tokenizer, padded)
    m = compiler.compile(P(json_object=True)).matcher()
    mask = allocate_bitmask(1, padded)
    m.fill_bitmask(mask, 0)
    dense = bitmask_to_bool(mask, mask.shape[1] * 32)[0]
    assert dense[:tokenizer.vocab_size].any() and not dense[tokenizer.vocab_size:].any()
    text = tokenizer.decode(walk(compiler.compile(P(regex="[a-z]{1,5}")), tokenizer, padded))
    assert re.fullmatch("[a-z]{1,5}", text)


def test_real_bad_inputs(smol):
    _, _, compiler = smol
    with pytest.raises(RequestError, match="invalid JSON schema"):
        compiler.compile(P(json={"type": "object", "properties": {"a": {"type": "nope"}}}))
    with pytest.raises(RequestError, match="invalid regex"):
        compiler.compile(P(regex="(unclosed"))
