"""The OpenAI handlers' shared part: request plumbing (body, parse, model, limits), sampling params,
submitting to the engine loop, collecting and streaming results, and the small endpoints. The
endpoint-specific parts are in serving_completion.py, serving_chat.py, and the APIs translated onto
the chat path (translation.py): serving_messages.py and serving_responses.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from runtime.engine.async_engine import ABORTED, DEFAULT_MAX_QUEUE, EngineLoop, QueueFull
from runtime.core.sampling_params import RequestError, SamplingParams
from runtime.core.structured_output import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_CHARS, GrammarLimits
from runtime.entrypoints.openai import admission
from runtime.entrypoints.openai.checker import DEFAULT_BODY_CHECKERS, BodyChecker
from runtime.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, ChoiceState, CompletionRequest,
                                                 Detok, DetokenizeRequest, Prepared, SamplingFields, TokenIdNames,
                                                 TokenizeRequest, bad_request, clamp_logprob, json_response, sse_data)
from runtime.entrypoints.openai.serving_chat import ChatServing
from runtime.entrypoints.openai.serving_completion import CompletionServing
from runtime.entrypoints.openai.serving_messages import CountTokensRequest, MessagesRequest, MessagesServing
from runtime.entrypoints.openai.serving_responses import ResponsesRequest, ResponsesServing

log = logging.getLogger("runtime.serve")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a connection must send a request's headers within this
DEFAULT_BODY_TIMEOUT_S = 30.0  # and its body within this
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5  # idle keep-alive connections are closed after this
DEFAULT_MAX_CONNECTIONS = 512  # open connections; more are closed at accept (each holds a file descriptor)
PROMPT_CHARS_PER_TOKEN = 64  # default prompt cap: max_model_len x this many characters
# In a request's scope, why the HTTP protocol refused the rest of it (a bad chunk): read_body logs it.
PROTOCOL_ERROR_KEY = "jaxserve.protocol_error"
PREPARE_THREADS = 2  # JSON parsing, tokenizing and chat templating run here, off the event loop
# Larger bodies are first checked by a body checker process (checker.py: a bad one is refused
# without the server parsing it), then prepared on a lane of their own (one thread): a burst of them
# never holds the threads, or the GIL, that ordinary requests wait for.
BULK_BODY_BYTES = 256 << 10


# ====================================================================== the server


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_queue: int | None = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_stats_interval: float = 10.0
    retry_after_s: int = 1
    root: str | None = None  # what the model was loaded from, for /v1/models
    max_prompt_chars: int | None = None  # None: max_model_len x PROMPT_CHARS_PER_TOKEN
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout_s: int = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    max_chat_messages: int | None = None  # None: max_model_len (each message renders to a token or more)
    max_grammar_chars: int = DEFAULT_MAX_GRAMMAR_CHARS  # a constraint's size, checked before compiling
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S  # a constraint's compile budget
    body_checkers: int = DEFAULT_BODY_CHECKERS  # processes checking bodies over BULK_BODY_BYTES (0: the server)
    # Tools and reasoning (chat_tools.py), vLLM's flags
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # replaces the model's
    default_chat_template_kwargs: dict | None = None  # under each request's chat_template_kwargs


class Server(CompletionServing, ChatServing, MessagesServing, ResponsesServing):
    """HTTP handlers around an EngineLoop. `build_app` wires them into a Starlette app. The endpoint-specific
    parts come from the mixins."""

    def __init__(self, engine, config: ServerConfig):
        self.engine = engine
        self.cfg = config
        self.model_name = config.served_model_names[0]
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.engine_config.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.loop = EngineLoop(engine, max_queue=config.max_queue, model_name=self.model_name,
                               log_stats_interval=config.log_stats_interval)
        self.detok = Detok(self.tokenizer) if self.tokenizer is not None else None
        self.draining = False
        self.num_inflight = 0
        self.created = int(time.time())
        self._openapi: dict | None = None
        if config.max_prompt_chars is None:
            config.max_prompt_chars = self.max_model_len * PROMPT_CHARS_PER_TOKEN
        if config.max_chat_messages is None:
            config.max_chat_messages = self.max_model_len
        engine.grammar_limits = GrammarLimits(config.max_grammar_chars, config.grammar_timeout_s)
        self.pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self.bulk_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare-bulk")
        self.checker = BodyChecker(config.body_checkers)  # its processes start with the app (lifespan)

    # ------------------------------------------------------------ plumbing

    async def read_body(self, request: Request) -> bytes:
        return await read_body(request, self.cfg)

    def parse(self, raw: bytes, model_cls):
        """JSON body -> request model, or the APIError refusing it (admission.admit: run off the event
        loop, parsing a big body takes a while)."""
        return admission.admit(raw, model_cls, self.cfg)

    async def off_loop(self, fn, raw: bytes, model_cls, *args):
        """Runs fn(raw, model_cls, *args), CPU work on a request body (parsing, tokenizing, chat
        templates), in a prepare pool, not on the event loop: a large body on the bulk lane, once a
        body checker passed it (one that refuses it answers for the server), the others on the
        ordinary one."""
        pool = self.pool
        if len(raw) > BULK_BODY_BYTES:
            refusal = await self.checker.check(raw, model_cls, self.cfg)
            if refusal is not None:
                raise refusal
            pool = self.bulk_pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, raw, model_cls, *args)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # The batch call releases the GIL while it runs (a single `encode` holds it: a 4 MB prompt
        # would stall the event loop for seconds even from another thread).
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def check_prompt_chars(self, n: int, param: str) -> None:
        admission.check_prompt_chars(n, self.cfg.max_prompt_chars, param)

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.cfg.served_model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"{self.cfg.served_model_names}", param="model", code="model_not_found")
        return model

    def sampling_params(self, r: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """Maps the request's fields onto SamplingParams, which owns the range checks (RequestError)."""
        bias = None
        if r.logit_bias:
            bias = {}
            for k, v in r.logit_bias.items():
                try:
                    bias[int(k)] = float(v)
                except ValueError:
                    raise bad_request(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        try:
            return SamplingParams(
                n=r.n, temperature=1.0 if r.temperature is None else r.temperature,
                top_p=1.0 if r.top_p is None else r.top_p, top_k=0 if r.top_k is None else r.top_k,
                min_p=r.min_p or 0.0, presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty, seed=r.seed,
                max_tokens=max_tokens, min_tokens=r.min_tokens, stop=r.stop, stop_token_ids=r.stop_token_ids,
                ignore_eos=r.ignore_eos, include_stop_str_in_output=r.include_stop_str_in_output,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
                skip_special_tokens=r.skip_special_tokens, priority=r.priority, trace=r.trace,
                structured_outputs=admission.request_constraint(r))
        except RequestError as e:
            raise bad_request(e.message, e.param, e.code) from None

    def _stream_flags(self, r: SamplingFields) -> tuple[bool, bool]:
        if r.stream_options is not None and not r.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        so = r.stream_options
        return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)

    @staticmethod
    def _request_error(e: ValueError, chat: bool) -> APIError:
        """The engine's RequestError as OpenAI's error body; a chat's prompt is its messages."""
        if isinstance(e, RequestError):
            return bad_request(e.message, "messages" if chat and e.param == "prompt" else e.param, e.code)
        return bad_request(str(e), None)

    # ------------------------------------------------------------ preparing requests

    def truncate(self, ids: list[int], r: SamplingFields) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last N prompt tokens (truncation_side "right": the first N)."""
        side = r.truncation_side or "left"
        if side not in ("left", "right"):
            raise bad_request(f"truncation_side must be 'left' or 'right', got {side!r}", "truncation_side")
        n = r.truncate_prompt_tokens
        if n is None:
            return ids
        if n == -1:
            n = self.max_model_len
        if n < 1 or n > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] "
                              f"(max_model_len), got {r.truncate_prompt_tokens}", "truncate_prompt_tokens")
        return ids[-n:] if side == "left" else ids[:n]

    # ------------------------------------------------------------ running requests

    def submit(self, prep: Prepared, queue: asyncio.Queue) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": str(self.cfg.retry_after_s)})
        if not self.loop.alive:
            raise APIError(503, f"the engine has failed: {self.loop.error!r}", code="engine_dead")
        try:
            self.loop.add(prep.items, queue, prep.arrival_time)
        except QueueFull as e:
            self.loop.metrics.rejected.labels(self.model_name, "queue_full").inc()
            raise APIError(503, str(e), code="queue_full",
                           headers={"Retry-After": str(self.cfg.retry_after_s)}) from None
        except ValueError as e:
            raise self._request_error(e, prep.request_id.startswith("chat")) from None

    async def results(self, prep: Prepared, queue: asyncio.Queue):
        """Yields (prompt index, RequestOutput | ABORTED | exception) until every prompt finished."""
        try:
            while len(prep.done) < len(prep.items):
                idx, item = await queue.get()
                if item is ABORTED or isinstance(item, BaseException) or item.finished:
                    prep.done.add(idx)
                yield idx, item
        finally:
            self.abort_unfinished(prep)

    def abort_unfinished(self, prep: Prepared) -> None:
        for i, (rid, _, _) in enumerate(prep.items):
            if i not in prep.done:
                prep.done.add(i)
                self.loop.abort(rid)

    # ------------------------------------------------------------ handlers

    async def _generate(self, request: Request, model_cls, prepare, chat: bool, api=None) -> Response:
        arrival = time.monotonic()
        raw = await self.read_body(request)
        body, prep, grammar = await self.off_loop(self._parse_and_prepare, raw, model_cls, prepare, arrival, api)
        if grammar is not None:
            await self._await_grammar(prep, grammar)
        if body.user:
            log.debug("request %s from user %r", prep.request_id, body.user)
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(prep, queue)
        self.num_inflight += 1
        if prep.stream:
            chunks = self._stream(prep, queue, chat)
            return _SSEResponse(sse_data(chunks) if api is None else api.events(prep, chunks),
                                on_close=lambda: self._closed(prep))
        try:
            return await _until_disconnect(request, self._collect(prep, queue, chat, api))
        finally:
            self._closed(prep)

    def _parse_and_prepare(self, raw: bytes, model_cls, prepare, arrival: float, api=None):
        """(body, Prepared, the future of its grammar or None). The grammar compiles on the grammar
        compiler's thread, not here: a slow one must not hold a thread that other requests wait for."""
        body = self.parse(raw, model_cls) if api is None else api.parse(raw, self.cfg)
        prep = prepare(body, arrival)
        chat = prep.request_id.startswith("chat")
        # The engine's checks walk every prompt token: here, not on the event loop.
        for _, ids, params in prep.items:
            try:
                self.engine.validate(ids, params, compile_grammar=False)
            except ValueError as e:
                raise self._request_error(e, chat) from None
        so = prep.items[0][2].structured_outputs  # the prompts of one request share their params
        if so is None:
            return body, prep, None
        try:
            return body, prep, self.engine.grammar_compiler(so.source_param).submit(so)
        except RequestError as e:
            raise self._request_error(e, chat) from None

    async def _await_grammar(self, prep: Prepared, future) -> None:
        """Waits for the request's grammar within the compile budget; 400 if it is refused or late."""
        so = prep.items[0][2].structured_outputs
        compiler = self.engine.grammar_compiler(so.source_param)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), compiler.limits.timeout_s)
        except (asyncio.TimeoutError, RequestError) as e:
            e = compiler.retarget(e, so) if isinstance(e, RequestError) else compiler.timeout_error(so)
            raise self._request_error(e, prep.request_id.startswith("chat")) from None

    def _closed(self, prep: Prepared) -> None:
        self.abort_unfinished(prep)  # the client left early: free the KV blocks now
        self.num_inflight -= 1

    async def _collect(self, prep: Prepared, queue: asyncio.Queue, chat: bool, api=None) -> Response:
        finals: dict[int, Any] = {}
        last: dict[int, Any] = {}
        want_ids = prep.extra.get("return_token_ids", False)
        async for idx, item in self.results(prep, queue):
            failure = _failure(item)
            if failure is not None:
                raise failure
            if item is ABORTED:
                finals[idx] = last.get(idx)
            else:
                last[idx] = item
                if item.finished:
                    finals[idx] = item
        choices = []
        num_prompt = num_out = 0
        for i in range(len(prep.items)):
            out = finals.get(i)
            _, ids, params = prep.items[i]
            num_prompt += len(ids)
            comps = out.outputs if out is not None else []
            by_index = {c.index: c for c in comps}
            for j in range(prep.n):
                c = by_index.get(j)
                num_out += len(c.token_ids) if c is not None else 0
                choice_index = i * prep.n + j
                reason = (c.finish_reason if c is not None else None) or "abort"
                stop_reason = c.stop_reason if c is not None else None
                if chat:
                    choice = self._chat_choice(prep, c, choice_index, reason, stop_reason)
                else:
                    choice = self._completion_choice(prep, i, out, c, choice_index, reason, stop_reason)
                if want_ids:
                    if not chat:  # chat has them once, at the top level (vLLM)
                        choice["prompt_token_ids"] = ids
                    choice["token_ids"] = list(c.token_ids) if c is not None else []
                choices.append(choice)
        obj = {"id": prep.request_id, "object": "chat.completion" if chat else "text_completion",
               "created": prep.created, "model": prep.model, "choices": choices,
               "usage": self._usage(num_prompt, num_out, finals.values()), "system_fingerprint": None}
        if prep.items[0][2].trace:
            obj["trace"] = _traces(prep, finals)
        if chat:
            out = finals.get(0)
            plps = out.prompt_logprobs if out is not None and prep.items[0][2].prompt_logprobs is not None else None
            obj["prompt_logprobs"] = self._prompt_logprobs(plps)
            obj["prompt_token_ids"] = prep.items[0][1] if want_ids else None
        return json_response(obj if api is None else api.response(obj, prep))

    def _usage(self, num_prompt: int, num_out: int, outputs) -> dict:
        """OpenAI's usage; with --enable-prompt-tokens-details, prompt_tokens_details.cached_tokens counts
        the prompt tokens found in the prefix cache (vLLM's)."""
        details = None
        if self.cfg.enable_prompt_tokens_details:
            details = {"cached_tokens": sum(o.num_cached_tokens for o in outputs
                                            if o is not None and o is not ABORTED)}
        return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out,
                "prompt_tokens_details": details}

    def _names(self, prep: Prepared):
        """How logprob entries name tokens: their text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return TokenIdNames() if prep.extra.get("token_ids_as_names") else self.detok

    def _prompt_logprobs(self, plps):
        if plps is None:
            return None
        return [None if d is None else {str(k): {"logprob": clamp_logprob(v), "decoded_token": self.detok.text(k)}
                                        for k, v in d.items()} for d in plps]

    async def _stream(self, prep: Prepared, queue: asyncio.Queue, chat: bool):
        """The stream's chunk objects (then, where the engine failed, the APIError), as sse_data sends them."""
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        states: dict[int, ChoiceState] = {}
        num_prompt = sum(len(ids) for _, ids, _ in prep.items)
        num_out: dict[int, int] = {}

        def chunk(choices, usage=False, **top) -> dict:
            obj = {"id": prep.request_id, "object": obj_name, "created": prep.created, "model": prep.model,
                   "choices": choices, **top}
            if chat:
                obj["system_fingerprint"] = None
            if prep.include_usage:
                obj["usage"] = None
                if usage or prep.continuous_usage:
                    obj["usage"] = self._usage(num_prompt, sum(num_out.values()), last.values())
            return obj

        last: dict[int, Any] = {}
        async for idx, item in self.results(prep, queue):
            failure = _failure(item)
            if failure is not None:
                yield failure
                break
            if item is ABORTED:
                comps = last[idx].outputs if idx in last else []
                done = {c.index for c in comps if c.finish_reason}
                for j in range(prep.n):
                    st = states.setdefault(idx * prep.n + j, ChoiceState())
                    if j not in done and st.finish_reason is None:
                        st.finish_reason = "abort"
                        yield chunk([self._finish_delta(chat, idx * prep.n + j, "abort")])
                continue
            last[idx] = item
            out = item
            for c in out.outputs:
                ci = idx * prep.n + c.index
                st = states.setdefault(ci, ChoiceState())
                if st.finish_reason is not None:
                    continue
                delta_text = c.text[st.text_len:]
                new_ids = c.token_ids[st.num_tokens:]
                new_lps = c.logprobs[st.num_logprobs:] if c.logprobs is not None else None
                first = not st.started
                if not (delta_text or (first and new_ids) or c.finish_reason or (new_lps and new_ids)):
                    continue
                st.started = True
                st.text_len, st.num_tokens = len(c.text), len(c.token_ids)
                st.num_logprobs = len(c.logprobs) if c.logprobs is not None else 0
                st.finish_reason = c.finish_reason
                stream_choice = self._stream_chat_choice if chat else self._stream_completion_choice
                for b in stream_choice(prep, idx, ci, c, st, first, delta_text, new_ids, new_lps, chunk,
                                       num_out, out):
                    yield b
        if prep.include_usage:
            yield chunk([], usage=True)
        if prep.items[0][2].trace:
            yield chunk([], trace=_traces(prep, last))

    @staticmethod
    def _finish_delta(chat: bool, index: int, reason: str, stop_reason=None) -> dict:
        if chat:  # vLLM's delta there is {"content": ""}: a client that joins the deltas gets no null
            return {"index": index, "delta": {"content": ""}, "logprobs": None, "finish_reason": reason,
                    "stop_reason": stop_reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason, "stop_reason": stop_reason}

    # ------------------------------------------------------------ small endpoints

    async def models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                 "root": self.cfg.root or name, "parent": None, "max_model_len": self.max_model_len,
                 "vocab_size": self.vocab_size} for name in self.cfg.served_model_names]
        return json_response({"object": "list", "data": data})

    async def version(self, request: Request) -> Response:
        return json_response({"version": _version()})

    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            raise APIError(503, f"the engine has failed: {self.loop.error!r}", code="engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        return Response(b"", 200)

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.loop.metrics.registry), 200, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        return await self.off_loop(self._tokenize, await self.read_body(request), TokenizeRequest)

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            from runtime.entrypoints.openai.openapi import openapi_schema

            self._openapi = openapi_schema(
                {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                 "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest, "/v1/responses":
                 ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}, _version())
        return json_response(self._openapi)

    async def docs(self, request: Request) -> Response:
        from runtime.entrypoints.openai.openapi import DOCS_HTML

        return Response(DOCS_HTML.format(title="jaxserve", schema_url="/openapi.json"), 200,
                        media_type="text/html")

    async def detokenize(self, request: Request) -> Response:
        return await self.off_loop(self._detokenize, await self.read_body(request), DetokenizeRequest)

    def _tokenize(self, raw: bytes, model_cls=TokenizeRequest) -> Response:
        r = self.parse(raw, model_cls)  # the prompt's characters are counted there
        self.check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if r.prompt is not None:
            ids = self.encode(r.prompt, add_special_tokens=r.add_special_tokens)
        else:
            ids = self._chat_ids(admission.chat_messages(r.messages, self.cfg), r.add_generation_prompt,
                                 r.chat_template_kwargs, r.continue_final_message)
        strs = [self.tokenizer.id_to_token(t) for t in ids] if r.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                               "token_strs": strs})

    def _detokenize(self, raw: bytes, model_cls=DetokenizeRequest) -> Response:
        r = self.parse(raw, model_cls)
        self.check_model(r.model)
        bad = [t for t in r.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", "tokens",
                              "invalid_token_id")
        return json_response({"prompt": self.tokenizer.decode(r.tokens)})


async def read_body(request: Request, cfg: ServerConfig, json_only: bool = True) -> bytes:
    """The raw body of a JSON request: 415 unless it says application/json (so a web page cannot
    post to a keyless local server without a CORS preflight; `json_only=False`: any type), 413 if
    too large, 408 if too slow."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if json_only and ctype != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    limit = cfg.max_body_bytes
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body is {int(length)} bytes; the limit is {limit} bytes",
                       code="request_too_large")

    chunks: list[bytes] = []

    async def read() -> bytes:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), cfg.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {cfg.body_timeout_s:g}s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:  # one line per such request (its answer goes nowhere), no traceback
        why = request.scope.get(PROTOCOL_ERROR_KEY) or (f"the client closed the connection after "
                                                        f"{sum(map(len, chunks))} of {length or '?'} body bytes")
        log.warning("%s %s from %s: %s", request.method, request.url.path, peer(request.client), why)
        raise APIError(400, why, code="incomplete_body") from None


def peer(addr) -> str:
    """host:port of a client address (a tuple, or Starlette's Address), for log lines."""
    return f"{addr[0]}:{addr[1]}" if addr else "a client"


def _version() -> str:
    """The installed jaxserve's version ("dev" from a source checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxserve")
    except PackageNotFoundError:
        return "dev"


def _failure(item) -> APIError | None:
    """The 500 for a result that is an engine failure (the whole loop, or the step that ran this request)."""
    if isinstance(item, BaseException):
        return APIError(500, f"the engine failed: {item!r}", code="engine_error")
    if item is not ABORTED and item.error is not None:
        return APIError(500, f"the engine step running this request failed: {item.error}", code="engine_error")
    return None


def _traces(prep, outputs: dict) -> list:
    """One trace per prompt (None where the request ended without one, e.g. aborted early)."""
    return [getattr(outputs.get(i), "trace", None) for i in range(len(prep.items))]


class _SSEResponse(StreamingResponse):
    """An SSE stream whose requests are aborted however the response ends (done, disconnect, error)."""

    def __init__(self, gen, on_close):
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self._on_close()


async def _until_disconnect(request: Request, coro):
    """Runs `coro`; if the client disconnects first, cancels it (its requests get aborted)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        log.debug("client disconnected before the response; its requests were aborted")
        return Response(b"", 499)
    return task.result()

