"""Structured outputs, host side: request constraints (vLLM's names), grammars compiled by llguidance,
and one matcher per sequence that writes the allowed-token bitmask for the next step.

Bitmask layout (the same as llguidance's and vLLM's): an int32 array of shape
[rows, ceil(vocab_size / 32)]; token t is allowed in row r when bit (t % 32) of word t // 32 is set,
bit 0 being the least significant. `allocate_bitmask` fills it with -1 (all allowed), so rows without
a grammar constrain nothing; a matcher rewrites its whole row. Ids the tokenizer does not have (the
model's vocabulary may be padded past the tokenizer's) are always masked off in a matcher's row.

EOS: the grammar knows the tokenizer's stop ids. While the text so far is a complete match that could
still grow, they are allowed alongside the continuations; once nothing but the end can follow, they are
the only tokens allowed and `is_terminated()` is already true: the engine may finish the sequence with
finish_reason "stop" right away instead of spending a step sampling a forced EOS.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np

from runtime.core.sampling_params import ANY_OBJECT_SCHEMA, RequestError, StructuredOutputsParams, constraint_field

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept per compiler (LRU), and as many refused ones
# JSON's whitespace between two tokens by default: at most one newline, then up to 16 spaces or tabs
# (compact and pretty-printed JSON, nesting indented up to 16). Free whitespace, llguidance's and
# vLLM's default, let SmolLM2 sample newlines until max_tokens (issue 48). disable_any_whitespace:
# none. A schema's own "x-guidance": {"whitespace_pattern": ...} (llguidance's option) overrides it.
JSON_WHITESPACE = r"\n?[ \t]{0,16}"
DEFAULT_MAX_GRAMMAR_CHARS = 64 << 10  # a constraint's text: schema JSON, regex, grammar, or all choices
DEFAULT_GRAMMAR_TIMEOUT_S = 5.0
# The admission check walks this many tokens of the grammar's forced path (or its first allowed
# token where nothing is forced), so a grammar that dead-ends early is refused before a step.
PROBE_TOKENS = 8
# llguidance's budget for building a lexeme's regex (its default is 1,000,000): (a{1000}){1000} is
# refused in 0.13 s rather than 1.5 s, while a 60,000-character literal still compiles.
INITIAL_LEXER_FUEL = 200_000
MAX_MESSAGE_CHARS = 200  # of llguidance's message in the 400 (its verbose forms hold the parser state)


@dataclass(frozen=True)
class GrammarLimits:
    """Budgets for compiling one constraint: its size, checked before any work, and the time the
    compile (with the admission check) may take. A constraint past either is a RequestError."""

    max_chars: int = DEFAULT_MAX_GRAMMAR_CHARS
    timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S

    def __post_init__(self):
        if not isinstance(self.max_chars, int) or self.max_chars < 1:
            raise ValueError(f"max_chars must be a positive int, got {self.max_chars!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """An int32 bitmask [rows, ceil(vocab_size/32)] with every token allowed (see the module doc)."""
    return np.full((rows, _words(vocab_size)), -1, dtype=np.int32)


def bitmask_to_bool(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Reference decoder: bool [rows, vocab_size], True where the token is allowed."""
    bitmask = np.asarray(bitmask, dtype=np.int32)
    squeeze = bitmask.ndim == 1
    words = bitmask.reshape(-1, bitmask.shape[-1]).astype(np.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] >> np.arange(32, dtype=np.int64)) & 1
    out = bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)
    return out[0] if squeeze else out


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar, shared by every sequence that asks for the same constraint."""

    key: tuple
    grammar: str  # llguidance's serialized grammar
    vocab_size: int  # the model's: width of the bitmask rows
    eos_token_ids: tuple[int, ...]
    llg_vocab_size: int  # llguidance's: max(model's, tokenizer's)
    _prototype: Any = field(repr=False, compare=False)  # a fresh LLMatcher, deep-copied per sequence

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self)


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


class GrammarCompiler:
    """Compiles StructuredOutputsParams into CompiledGrammars for one tokenizer and model vocabulary.
    Builds llguidance's tokenizer once (~0.2 s for a 49k vocabulary). Grammars compile on the
    compiler's own thread, one at a time, within `limits`; results are cached by
    `params.cache_key()`, refusals too (a repeated bad grammar costs a dict lookup), and requests
    for a grammar already compiling wait for that compile. `compile`/`submit` are thread-safe."""

    def __init__(self, tokenizer, vocab_size: int | None = None, *, cache_size: int = CACHE_SIZE,
                 limits: GrammarLimits | None = None):
        self.tokenizer_vocab_size = tokenizer.vocab_size
        self.vocab_size = vocab_size or self.tokenizer_vocab_size
        self.limits = limits or GrammarLimits()
        stop = sorted(getattr(tokenizer, "stop_token_ids", ()) or ())
        eos = tokenizer.eos_token_id
        self.eos_token_ids = tuple(([eos] if eos is not None else []) + [t for t in stop if t != eos])
        self._llg_vocab = max(self.vocab_size, self.tokenizer_vocab_size)
        self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self._llg_vocab,
                                                   eos_token=list(self.eos_token_ids) or None)
        # Terse errors: the verbose ones carry the parser state and the grammar into the 400.
        self._ll_limits = llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False)
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._refused: OrderedDict[tuple, RequestError] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for `params`, checked now (request admission) so that a bad schema, regex or
        grammar is a RequestError naming the problem, never a failure mid-generation. Waits at most
        `limits.timeout_s`."""
        future = self.submit(params)
        try:
            return future.result(timeout=self.limits.timeout_s)
        except FutureTimeout:
            raise self.timeout_error(params) from None
        except RequestError as e:
            raise self.retarget(e, params) from None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of `compile(params)` without waiting (an async server awaits it, bounded by
        `limits.timeout_s`, then answers `timeout_error`). The size check runs here, first."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return _done(hit)
            refused = self._refused.get(key)
            if refused is not None:
                self._refused.move_to_end(key)
                return _done(error=self.retarget(refused, params))
            future = self._inflight.get(key)
            if future is None:
                try:
                    params.check_size(self.limits.max_chars, key)
                except RequestError as e:
                    return _done(error=e)
                future = self._inflight[key] = self._pool.submit(self._run, params, key)
        return future

    @staticmethod
    def retarget(error: RequestError, params: StructuredOutputsParams) -> RequestError:
        """A fresh copy of a refusal, naming the field `params` came from: the same constraint may
        arrive as structured_outputs or as response_format, and share one compile (or refusal)."""
        old = constraint_field(params.kind, error.param)
        return RequestError(error.message.replace(old, constraint_field(params.kind, params.source_param), 1),
                            params.source_param, error.code)

    def timeout_error(self, params: StructuredOutputsParams) -> RequestError:
        name = constraint_field(params.kind, params.source_param)
        return RequestError(f"{name}: the {_WHAT[params.kind]} did not compile within {self.limits.timeout_s:g}s "
                            "(the grammar compile budget)", param=params.source_param)

    def _run(self, params: StructuredOutputsParams, key: tuple) -> CompiledGrammar:
        start = time.monotonic()
        try:
            compiled = self._compile(params, key)
            if time.monotonic() - start > self.limits.timeout_s:
                raise self.timeout_error(params)  # a repeat must not pass where this one was refused
        except BaseException as e:
            with self._lock:  # cached and no longer in flight at once: a request sees one or the other
                if isinstance(e, RequestError):
                    self._refused[key] = e
                    _trim(self._refused, self._cache_size)
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self._cache[key] = compiled
            _trim(self._cache, self._cache_size)
            self._inflight.pop(key, None)
        return compiled

    def _compile(self, params: StructuredOutputsParams, key: tuple) -> CompiledGrammar:
        what, err = _WHAT[params.kind], params.source_param

        def refuse(message: str) -> RequestError:
            where = constraint_field(params.kind, err)
            return RequestError(f"invalid {what}: {_short(message)} (in {where})", param=err)

        try:
            grammar = self._serialize(params)
        except (ValueError, TypeError, RuntimeError) as e:
            raise refuse(str(e)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer,
                                                                                 limits=self._ll_limits)
        if is_error:
            raise refuse(messages[0] if messages else "rejected")
        for m in messages:
            log.warning("structured output %s: %s", what, _short(m))
        proto = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self._ll_limits)
        if proto.is_error():
            raise refuse(proto.get_error())
        problem = self._probe(proto.deep_copy())
        if problem is not None:
            raise refuse(problem)
        return CompiledGrammar(key, grammar, self.vocab_size, self.eos_token_ids, self._llg_vocab, proto)

    def _probe(self, m) -> str | None:
        """The admission check: the first masks of a grammar, along its forced path (or its first
        allowed token where nothing is forced), for up to PROBE_TOKENS tokens. llguidance builds its
        lexer and parser rows lazily, so a grammar that can match nothing, a rule that only refers
        to itself, or a lexeme or rule too large for its limits fails here, not in a step. None, or
        what is wrong."""
        words = _words(self._llg_vocab)
        mask = np.zeros(words, np.int32)
        eos = set(self.eos_token_ids)
        for _ in range(PROBE_TOKENS):
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if m.is_error():
                message = m.get_error()
                return "it matches nothing" if "NoExtension" in message else message
            if m.is_accepting() or m.is_stopped():
                return None
            forced = m.compute_ff_tokens()
            if forced:
                token = forced[0]
            else:
                allowed = np.flatnonzero(bitmask_to_bool(mask, self._llg_vocab))
                token = next((int(t) for t in allowed if t not in eos), None)
                if token is None:
                    return "it matches nothing"
            if not m.consume_token(token):
                return m.get_error() or f"token {token} refused"
        return None

    @classmethod
    def _serialize(cls, params: StructuredOutputsParams) -> str:
        """llguidance's grammar for `params`; after a think block where `params.reasoning` says so."""
        inner = cls._serialize_answer(params)
        if params.reasoning is None:
            return inner
        try:
            top = json.loads(inner)
        except ValueError:  # a Lark grammar's text
            top = {"grammars": [{"lark_grammar": inner}]}
        top["grammars"][0]["name"] = "answer"
        return json.dumps({"grammars": [{"lark_grammar": REASONING_GRAMMARS[params.reasoning]}] + top["grammars"]})

    @staticmethod
    def _serialize_answer(params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = ANY_OBJECT_SCHEMA if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if schema is False:
                raise ValueError("the schema false matches nothing")
            if schema is True:
                schema = {}  # anything
            options = ({"whitespace_flexible": False} if params.disable_any_whitespace
                       else {"whitespace_pattern": JSON_WHITESPACE})
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from(kind, getattr(params, kind))  # "regex", "grammar" (Lark or GBNF)


# The think block before a constrained answer (StructuredOutputsParams.reasoning): thinking is any
# text up to the first "</think>" (a lazy lexeme ends there), newlines after it are the tag's, then
# the answer's own grammar (@answer).
_THINK = 'think[lazy]: /(?s:.*)<\\/think>/\nnl: /\\n+/\n'
REASONING_GRAMMARS = {"required": 'start: "<think>"? think nl? @answer\n' + _THINK,
                      "optional": 'start: ("<think>" think nl?)? @answer\n' + _THINK}


def _short(message: str) -> str:
    """llguidance's message without what only its developers need: a Rust panic's backtrace and
    build paths, the parser state, the grammar."""
    message = str(message)
    if message.lstrip().startswith("panic"):
        return "too large or complex to compile"
    text = " ".join(message.split("<", 1)[0].split()) or "rejected"
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


def _done(result=None, error: BaseException | None = None) -> Future:
    f = Future()
    if error is not None:
        f.set_exception(error)
    else:
        f.set_result(result)
    return f


def _trim(cache: OrderedDict, size: int) -> None:
    while len(cache) > size:
        cache.popitem(last=False)


class GrammarMatcher:
    """The parse state of one sequence. Not thread-safe: one thread (the engine's) drives it.

    Per step: `fill_bitmask(bitmask, row)` before sampling, `accept_token(t)` after. A token the
    grammar does not allow is refused (False) and leaves the state unchanged. Stop ids are handled
    here, not by llguidance, so `rollback` counts them like any other accepted token."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self._m = compiled._prototype.deep_copy()
        self._eos = frozenset(compiled.eos_token_ids)
        self._num_tokens = 0  # accepted so far, EOS included
        self._ended = False  # a stop id was accepted

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 [rows, ceil(vocab/32)])."""
        words = _words(self.compiled.vocab_size)
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != words:
            raise ValueError(f"bitmask must be int32 [rows, {words}], got {bitmask.dtype} {bitmask.shape}")
        dst = bitmask[row]
        if self._ended:  # only a stop id may follow
            dst[:] = 0
            for t in self._eos:
                if t < self.compiled.vocab_size:
                    dst.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
            return
        llg_words = _words(self.compiled.llg_vocab_size)
        if llg_words == words and dst.flags["C_CONTIGUOUS"]:
            self._m.unsafe_compute_mask_ptr(dst.ctypes.data, dst.nbytes)
        else:  # a model vocabulary smaller than the tokenizer's (drop the ids it cannot emit), or a
            # row that is not contiguous
            scratch = np.zeros(llg_words, np.int32)
            self._m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            dst[:] = scratch[:words]
        tail = self.compiled.vocab_size % 32
        if tail:  # the padding bits of the last word
            dst[words - 1] &= np.int32((1 << tail) - 1)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar does not allow it."""
        token_id = int(token_id)
        if self._ended:
            return False
        if token_id in self._eos:
            if not self._m.is_accepting():
                return False
            self._ended = True
        elif self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._num_tokens += 1
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (e.g. draft tokens) the grammar would accept in a row, without
        advancing."""
        if self._ended:
            return 0
        ids = [int(t) for t in token_ids]
        end = next((i for i, t in enumerate(ids) if t in self._eos), len(ids))
        n = self._m.validate_tokens(ids[:end]) if end else 0
        if n < end or end == len(ids):
            return n
        # ids[end] is a stop id: allowed when the text before it is a complete match
        consumed = self._m.try_consume_tokens(ids[:end]) if end else 0
        accepting = consumed == end and self._m.is_accepting()
        if consumed:
            self._m.rollback(consumed)
        return end + 1 if accepting else end

    @property
    def error(self) -> str | None:
        """llguidance's message when the parser gave up (a resource limit hit mid-generation): the
        mask then allows only stop ids, which `accept_token` refuses; the engine should abort the
        sequence. None normally."""
        return (self._m.get_error() or "llguidance error") if self._m.is_error() else None

    def is_terminated(self) -> bool:
        """True when the grammar is complete: a stop id was accepted, or nothing but one can follow.
        The sequence should finish with finish_reason "stop"."""
        return self._ended or (self._m.is_stopped() and not self._m.is_error())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_tokens} tokens")
        n = num_tokens
        if n and self._ended:
            self._ended = False
            n -= 1
        if n and not self._m.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")
        self._num_tokens -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar (e.g. a preempted sequence that recomputes)."""
        self.rollback(self._num_tokens)
