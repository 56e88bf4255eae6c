"""OpenAI-compatible HTTP server in front of the engine.

    python -m runtime.serve --model smollm2-135m --port 8000
    python -m runtime.serve --plan plans/smollm2 --api-key sk-local --max-queue 128

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream=true` as SSE),
GET /v1/models, GET /health, GET /version, GET /metrics (Prometheus, vLLM's metric names), POST /tokenize,
POST /detokenize.

Threads: the engine loop runs in its own thread and is the only caller of `LLMEngine.step`. The
HTTP side (one asyncio loop, uvicorn) only enqueues requests and aborts, both thread-safe, and
receives outputs through one asyncio queue per HTTP request, filled with `call_soon_threadsafe`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from runtime.core.sampling_params import MAX_LOGPROBS, RequestError, SamplingParams

log = logging.getLogger("runtime.serve")

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a connection must send a request's headers within this
DEFAULT_BODY_TIMEOUT_S = 30.0  # and its body within this
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5  # idle keep-alive connections are closed after this
DEFAULT_MAX_CONNECTIONS = 512  # open connections; more are closed at accept (each holds a file descriptor)
MAX_HEADER_BYTES = 64 << 10  # h11's buffer for an incomplete request head
PROMPT_CHARS_PER_TOKEN = 64  # default prompt cap: max_model_len x this many characters
MAX_JSON_DEPTH = 64
PREPARE_THREADS = 2  # JSON parsing, tokenizing and chat templating run here, off the event loop
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


# ====================================================================== errors


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self.TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(_dumps(self.body()), self.status, headers=self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _dumps(obj) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate somewhere: \u-escape it rather than fail
        return json.dumps(obj, separators=(",", ":")).encode()


def _check_json_text(obj, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Rejects a parsed JSON body nested deeper than `max_depth`, or holding a string that is not
    valid Unicode (a lone surrogate from a \\ud800 escape), which the tokenizer cannot take."""
    stack = [(obj, (), 1)]
    while stack:
        x, path, depth = stack.pop()
        if depth > max_depth:
            raise bad_request(f"the JSON body is nested more than {max_depth} levels deep", None, "invalid_json")
        if isinstance(x, dict):
            for k, v in x.items():
                stack.append((k, path, depth + 1))
                stack.append((v, path + (k,), depth + 1))
        elif isinstance(x, list):
            stack.extend((v, path + (i,), depth + 1) for i, v in enumerate(x))
        elif isinstance(x, str) and not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                param = ".".join(str(p) for p in path if isinstance(p, (str, int))).encode(
                    "utf-8", "backslashreplace").decode() or None
                raise bad_request(f"{param or 'the body'}: text must be valid Unicode (no lone surrogates)",
                                  param, "invalid_text") from None


def _json_response(obj, status: int = 200) -> Response:
    return Response(_dumps(obj), status, media_type="application/json")


# ====================================================================== request bodies

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


# vLLM request options this server does not implement, with the value that means "off": any other
# value is answered 400 naming the option (never accepted and ignored).
VLLM_UNSUPPORTED = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structured_outputs": None,
    "prompt_embeds": None, "logits_processors": None, "mm_processor_kwargs": None, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None, "spaces_between_special_tokens": True,
    "chat_template": None, "documents": None, "reasoning_effort": None,
}


class _SamplingFields(BaseModel):
    """Fields shared by both generation endpoints: OpenAI's, then vLLM's extras."""

    model_config = _STRICT
    UNSUPPORTED: ClassVar[dict] = VLLM_UNSUPPORTED
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    prompt_logprobs: Optional[int] = None
    return_token_ids: bool = False  # adds token_ids (and prompt_token_ids) to each choice
    trace: bool = False  # returns each prompt's path through the engine (RequestTrace) with the response
    return_tokens_as_token_ids: bool = False  # logprob tokens named "token_id:<id>"
    truncate_prompt_tokens: Optional[int] = None  # keep only this many prompt tokens (-1: max_model_len)
    truncation_side: Optional[str] = None  # "left" (default: keep the last ones) or "right"


class CompletionRequest(_SamplingFields):
    prompt: Any = None
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatCompletionRequest(_SamplingFields):
    messages: Any = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open and continue it
    chat_template_kwargs: Optional[dict] = None
    echo: bool = False  # the response starts with the last message's content (when its role answers)


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict] = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: Optional[str] = None
    tokens: list[int]


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    # Drop pydantic's union-member tags ('str', 'list[str]') from the location.
    loc = [x for x in err["loc"] if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))]
    param = ".".join(str(x) for x in loc) or None
    return bad_request(f"{param}: {err['msg']}" if param else err["msg"], param,
                       "invalid_type" if err["type"].endswith("_type") else "invalid_value")


# ====================================================================== metrics

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def _1_2_5_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


def _pow2_buckets(limit: int) -> list[float]:
    """1, 8, 16, 32, ... up to the first power of two >= `limit` (tokens per engine step)."""
    out, b = [1.0], 8
    while True:
        out.append(float(b))
        if b >= limit:
            return out
        b *= 2


@dataclass
class Snapshot:
    """Engine counters as of the last step, taken on the engine thread (the HTTP side only reads it)."""

    time: float = 0.0
    num_running: int = 0  # requests, not sequences (vLLM counts requests)
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_recompiles: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    padding_waste_ratio: float = 0.0
    num_kv_blocks: int = 0
    num_cached_blocks: int = 0


class Metrics:
    """Prometheus metrics in a registry of their own, so several apps can live in one process."""

    def __init__(self, model_name: str, snapshot_fn, *, max_model_len: int = 1 << 16,
                 max_num_batched_tokens: int = 1 << 16, cache_config: dict | None = None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._snapshot = snapshot_fn
        self.cache_config = cache_config or {}
        labels = ["model_name"]
        h = lambda name, doc, buckets: Histogram(name, doc, labels, buckets=buckets,  # noqa: E731
                                                 registry=self.registry).labels(model_name)
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Time between successive token steps.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Time from arrival to first scheduled.", E2E_BUCKETS)
        self.prefill_time = h("vllm:request_prefill_time_seconds", "Time from first scheduled to first token.",
                              E2E_BUCKETS)
        self.decode_time = h("vllm:request_decode_time_seconds", "Time from first token to finished.",
                             E2E_BUCKETS)
        self.inference_time = h("vllm:request_inference_time_seconds", "Time from first scheduled to finished.",
                                E2E_BUCKETS)
        tokens = _1_2_5_buckets(max_model_len)
        self.req_prompt_tokens = h("vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
                                   tokens)
        self.req_generation_tokens = h("vllm:request_generation_tokens",
                                       "Generated tokens of each finished request (all its sequences).", tokens)
        self.req_params_n = h("vllm:request_params_n", "The n of each finished request.", [1, 2, 5, 10, 20])
        self.req_params_max_tokens = h("vllm:request_params_max_tokens", "The max_tokens of each finished request.",
                                       tokens)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Tokens scheduled per engine step.",
                                  _pow2_buckets(max_num_batched_tokens))
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("vllm:request_rejected", "Requests refused before reaching the engine.",
                                labels + ["reason"], registry=self.registry)
        self.registry.register(self)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s: Snapshot = self._snapshot()
        m = self.model_name

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([m], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m], value)
            return c

        info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's settings (labels; value 1).",
                                 labels=sorted(self.cache_config))
        info.add_metric([str(self.cache_config[k]) for k in sorted(self.cache_config)], 1)
        yield info
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = 100%); cached-only "
                    "blocks are free.", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted (recompute).", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Generation tokens produced.", s.generation_tokens_total)
        yield counter("recompiles", "XLA compilations after warm-up (must stay 0).", s.num_recompiles)
        yield gauge("padding_waste_ratio", "Fraction of bucket token slots that were padding.",
                    s.padding_waste_ratio)
        yield gauge("kv_cached_blocks", "KV blocks holding prefix-cache content only.", s.num_cached_blocks)


# ====================================================================== the engine loop


class QueueFull(Exception):
    pass


_ABORTED = object()  # pushed to a request's queue when the engine aborted it


class EngineLoop:
    """Runs `engine.step()` on its own thread; routes outputs to per-HTTP-request asyncio queues."""

    def __init__(self, engine, *, max_queue: int | None = DEFAULT_MAX_QUEUE, model_name: str = "model",
                 log_stats_interval: float = 10.0):
        self.engine = engine
        self.max_queue = max_queue
        self.log_stats_interval = log_stats_interval
        self._lock = threading.Lock()
        self._subs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._queued: set[str] = set()  # added, not yet scheduled: what --max-queue bounds
        self._last_token: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.snapshot = Snapshot()
        self._take_snapshot()
        ec, bm = engine.engine_config, engine.block_manager
        self.metrics = Metrics(model_name, lambda: self.snapshot, max_model_len=ec.max_model_len,
                               max_num_batched_tokens=ec.max_num_batched_tokens, cache_config={
                                   "block_size": bm.block_size, "num_gpu_blocks": bm.num_blocks,
                                   "enable_prefix_caching": bm.enable_prefix_caching})
        engine.finished_callbacks.append(self._on_finished)
        self._last_log = (time.monotonic(), self.snapshot.prompt_tokens_total, self.snapshot.generation_tokens_total)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.abort_all()
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with contextlib.suppress(ValueError):
            self.engine.finished_callbacks.remove(self._on_finished)

    @property
    def alive(self) -> bool:
        return self.error is None

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def capacity(self) -> int | None:
        """Most requests that can be admitted at once: every batch slot plus the waiting queue."""
        return None if self.max_queue is None else self.max_queue + self.engine.engine_config.max_num_seqs

    def _free_slots(self) -> int:
        return max(0, self.engine.engine_config.max_num_seqs - len(self.engine.scheduler.running))

    # ------------------------------------------------------------ HTTP side (event loop thread)

    def add(self, items: list[tuple[str, list[int], SamplingParams]], queue: asyncio.Queue,
            arrival_time: float) -> None:
        """Adds all of an HTTP request's prompts, or none: raises QueueFull or ValueError."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop has failed: {self.error!r}")
        for _, ids, params in items:
            self.engine.validate(ids, params)
        loop = asyncio.get_running_loop()
        with self._lock:
            # Requests that will take a free batch slot at the next step do not count as waiting.
            free = self._free_slots()
            if self.max_queue is not None and len(self._queued) + len(items) > self.max_queue + free:
                raise QueueFull(f"the server's waiting queue is full ({len(self._queued)} requests not yet "
                                f"scheduled, {free} free batch slots, queue limit {self.max_queue}); retry later")
            for i, (rid, _, _) in enumerate(items):
                self._subs[rid] = (loop, queue, i)
                self._queued.add(rid)
        added = []
        try:
            for rid, ids, params in items:
                self.engine.add_request(rid, None, params, prompt_token_ids=ids, arrival_time=arrival_time)
                added.append(rid)
        except BaseException:
            for rid, _, _ in items:
                self._unsubscribe(rid)
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finally:
            self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stops a request (client gone, or shutdown); its KV blocks are freed at the next step.

        The subscription stays until the engine confirms the abort (`_on_finished`), so whoever still
        listens (a stream cut by shutdown) gets its final "abort" chunk."""
        self.engine.abort_request(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        with self._lock:
            ids = list(self._subs)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    def _unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subs.pop(request_id, None)
            self._queued.discard(request_id)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        last_snap = 0.0
        while not self._stop:
            self._wake.clear()
            if not engine.has_unfinished_requests():
                self._take_snapshot()
                self._maybe_log_stats()
                self._wake.wait(0.5)
                continue
            t0 = time.perf_counter()
            scheduled = engine.scheduled_tokens_total
            try:
                outputs = engine.step()
            except Exception as e:  # a broken engine: fail every request, refuse new ones
                log.exception("engine step failed; the server will refuse new requests")
                self.error = e
                self._fail_all()
                return
            if engine.scheduled_tokens_total > scheduled:
                self.metrics.iteration_tokens.observe(engine.scheduled_tokens_total - scheduled)
            self._dispatch(outputs)
            now = time.perf_counter()
            if now - last_snap > 0.05:
                self._take_snapshot()
                self._maybe_log_stats()
                last_snap = now
            if not outputs and now - t0 < 1e-3:
                self._wake.wait(0.002)  # nothing schedulable yet (e.g. a static batch filling up)
        self._take_snapshot()

    def _dispatch(self, outputs) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            if self._queued:
                for rid in list(self._queued):
                    req = self.engine.requests.get(rid)
                    if req is None or req.metrics.first_scheduled_time is not None:
                        self._queued.discard(rid)
            for out in outputs:
                rid = out.request_id
                m = out.metrics
                if m is not None and m.last_token_time is not None:
                    prev = self._last_token.get(rid)
                    if prev is not None and m.last_token_time > prev:
                        self.metrics.itl.observe(m.last_token_time - prev)
                    self._last_token[rid] = m.last_token_time
                sub = self._subs.pop(rid, None) if out.finished else self._subs.get(rid)
                if out.finished:
                    self._last_token.pop(rid, None)
                if sub is not None:
                    loop, q, idx = sub
                    per_loop.setdefault(loop, []).append((q, idx, out))
        for loop, batch in per_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(_deliver, batch)

    def _on_finished(self, req) -> None:
        """Engine callback (engine thread): a request finished or was aborted."""
        rid = req.request_id
        m = req.metrics
        now = time.monotonic()
        num_out = sum(s.num_output_tokens for s in req.seqs)
        reasons = sorted({s.finish_reason or "abort" for s in req.seqs})
        reason = "abort" if req.aborted else ",".join(reasons)
        end = m.finished_time or now
        ttft = (m.first_token_time - m.arrival_time) if m.first_token_time is not None else None
        if not req.aborted:
            if ttft is not None:
                self.metrics.ttft.observe(ttft)
            self.metrics.e2e.observe(end - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.metrics.queue.observe(m.first_scheduled_time - m.arrival_time)
                self.metrics.inference_time.observe(end - m.first_scheduled_time)
                if m.first_token_time is not None:
                    self.metrics.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.metrics.decode_time.observe(end - m.first_token_time)
            self.metrics.req_prompt_tokens.observe(len(req.prompt_token_ids))
            self.metrics.req_generation_tokens.observe(num_out)
            self.metrics.req_params_n.observe(req.params.n)
            if req.params.max_tokens is not None:
                self.metrics.req_params_max_tokens.observe(req.params.max_tokens)
        for r in reasons if not req.aborted else ["abort"]:
            self.metrics.success.labels(self.metrics.model_name, r).inc()
        log.info("request %s finished: prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish_reason=%s",
                 rid, len(req.prompt_token_ids), num_out, f"{ttft:.3f}s" if ttft is not None else "-",
                 end - m.arrival_time, reason)
        if req.aborted:
            with self._lock:
                sub = self._subs.pop(rid, None)
                self._queued.discard(rid)
                self._last_token.pop(rid, None)
            if sub is not None:
                loop, q, idx = sub
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_deliver, [(q, idx, _ABORTED)])

    def _fail_all(self) -> None:
        with self._lock:
            subs = list(self._subs.values())
            self._subs.clear()
            self._queued.clear()
        for loop, q, idx in subs:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, [(q, idx, self.error)])

    def _take_snapshot(self) -> None:
        e = self.engine
        st = e.stats()
        sched = e.scheduler
        self.snapshot = Snapshot(
            time=time.monotonic(),
            num_running=len({id(s.request) for s in list(sched.running)}),
            num_waiting=len({id(s.request) for s in list(sched.waiting)}),
            kv_cache_usage=st.kv_cache_usage, prefix_cache_queries=st.prefix_cache_queries,
            prefix_cache_hits=st.prefix_cache_hits, num_preemptions=st.num_preemptions,
            num_recompiles=st.num_recompiles, prompt_tokens_total=st.prompt_tokens_total,
            generation_tokens_total=st.generation_tokens_total, padding_waste_ratio=st.padding_waste_ratio,
            num_kv_blocks=st.num_kv_blocks, num_cached_blocks=st.num_cached_blocks)

    def _maybe_log_stats(self) -> None:
        if not self.log_stats_interval:
            return
        now = time.monotonic()
        t, p, g = self._last_log
        if now - t < self.log_stats_interval:
            return
        s = self.snapshot
        self._last_log = (now, s.prompt_tokens_total, s.generation_tokens_total)
        if s.prompt_tokens_total == p and s.generation_tokens_total == g and not (s.num_running or s.num_waiting):
            return  # idle: say nothing
        dt = now - t
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                 "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                 "Preemptions: %d, Recompiles: %d",
                 (s.prompt_tokens_total - p) / dt, (s.generation_tokens_total - g) / dt, s.num_running,
                 s.num_waiting, 100 * s.kv_cache_usage, 100 * hit, s.num_preemptions, s.num_recompiles)


def _deliver(batch) -> None:
    for q, idx, item in batch:
        q.put_nowait((idx, item))


# ====================================================================== output formatting


class Detok:
    """Token text and bytes for logprobs (byte-level BPE tokens map back to their exact bytes)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        try:
            from models.tokenizer import _bytes_to_unicode

            self._inv = {c: b for b, c in _bytes_to_unicode().items()}
        except Exception:  # pragma: no cover - another tokenizer family
            self._inv = {}

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self._text[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s

    def bytes(self, tid: int) -> list[int]:
        b = self._bytes.get(tid)
        if b is None:
            piece = self.tok.id_to_token(tid) or ""
            try:
                b = [self._inv[c] for c in piece]
            except KeyError:
                b = list(self.text(tid).encode("utf-8"))
            self._bytes[tid] = b
        return b


class TokenIdNames:
    """Detok's interface naming each token "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""

    @staticmethod
    def text(tid: int) -> str:
        return f"token_id:{tid}"

    def bytes(self, tid: int) -> list[int]:
        return list(self.text(tid).encode())


def _lp(x: float) -> float:
    return MIN_LOGPROB if not math.isfinite(x) else max(float(x), MIN_LOGPROB)


def completion_logprobs(dt: Detok, token_ids, logprobs, offset: int, prompt_part: bool = False):
    """OpenAI's completions format, for `token_ids` with `logprobs[i]` = {id: logprob} (or None)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, logprobs):
        s = dt.text(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(d.get(tid, MIN_LOGPROB)))
            tops.append({dt.text(k): _lp(v) for k, v in d.items()})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(dt: Detok, token_ids, logprobs, k: int) -> list[dict]:
    """OpenAI's chat format: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    content = []
    for tid, d in zip(token_ids, logprobs):
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
        content.append({"token": dt.text(tid), "logprob": _lp(d.get(tid, MIN_LOGPROB)), "bytes": dt.bytes(tid),
                        "top_logprobs": [{"token": dt.text(a), "logprob": _lp(b), "bytes": dt.bytes(a)}
                                         for a, b in top]})
    return content


@dataclass
class ChoiceState:
    """What has been sent for one choice of a streamed response."""

    text_len: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0
    text_offset: int = 0
    started: bool = False
    finish_reason: str | None = None


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


@dataclass
class _Prepared:
    """A validated generation request: one (id, prompt ids, params) per prompt."""

    request_id: str
    created: int
    model: str
    items: list[tuple[str, list[int], SamplingParams]]
    prompt_texts: list[str | None]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    arrival_time: float
    extra: dict = field(default_factory=dict)
    done: set = field(default_factory=set)  # prompt indices whose request has ended


class Server:
    """HTTP handlers around an EngineLoop. `build_app` wires them into a Starlette app."""

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
        self.pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")

    # ------------------------------------------------------------ plumbing

    async def read_body(self, request: Request) -> bytes:
        """The raw body of a JSON request: 415 unless it says application/json (so a web page cannot
        post to a keyless local server without a CORS preflight), 413 if too large, 408 if too slow."""
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                           code="unsupported_media_type")
        length = request.headers.get("content-length")
        limit = self.cfg.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body is {int(length)} bytes; the limit is {limit} bytes",
                           code="request_too_large")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.cfg.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.cfg.body_timeout_s:g}s",
                           code="request_timeout", headers={"Connection": "close"}) from None

    @staticmethod
    def parse(raw: bytes, model_cls):
        """JSON body -> request model (run off the event loop: parsing a big body takes a while)."""
        try:
            obj = json.loads(raw)
        except ValueError as e:  # bad UTF-8, bad JSON, an integer past Python's 4300-digit limit
            raise bad_request(f"could not parse the JSON body of the request: {e}", code="invalid_json") from None
        except RecursionError:
            raise bad_request(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", None,
                              "invalid_json") from None
        if not isinstance(obj, dict):
            raise bad_request("the request body must be a JSON object", code="invalid_json")
        _check_json_text(obj)
        for name, off in getattr(model_cls, "UNSUPPORTED", {}).items():
            if name in obj and obj[name] is not None and obj[name] != off:
                raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
        try:
            return model_cls.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e) from None

    async def off_loop(self, fn, *args):
        """Runs CPU work (parsing, tokenizing, chat templates) in the prepare pool, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # The batch call releases the GIL while it runs (a single `encode` holds it: a 4 MB prompt
        # would stall the event loop for seconds even from another thread).
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def check_prompt_chars(self, n: int, param: str) -> None:
        limit = self.cfg.max_prompt_chars
        if n > limit:
            raise APIError(413, f"the prompt has {n} characters; the limit is {limit} characters", param=param,
                           code="prompt_too_long")

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.cfg.served_model_names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"{self.cfg.served_model_names}", param="model", code="model_not_found")
        return model

    def sampling_params(self, r: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
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
                skip_special_tokens=r.skip_special_tokens, priority=r.priority, trace=r.trace)
        except RequestError as e:
            raise bad_request(e.message, e.param, e.code) from None

    def _stream_flags(self, r: _SamplingFields) -> tuple[bool, bool]:
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

    def prepare_completion(self, r: CompletionRequest, arrival: float) -> _Prepared:
        model = self.check_model(r.model)
        if r.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if r.best_of is not None and r.best_of != r.n:
            raise bad_request("best_of must equal n (beam search and best-of are not supported)", "best_of",
                              "unsupported_parameter")
        prompts = r.prompt
        if prompts is None:
            raise bad_request("prompt is required", "prompt", "missing_required_parameter")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and _is_int(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "token id lists, and not empty", "prompt", "invalid_type")
        cap = self.loop.capacity
        if cap is not None and len(prompts) > cap:
            raise bad_request(f"the request has {len(prompts)} prompts; this server admits at most {cap} at once "
                              f"(max_num_seqs + max_queue)", "prompt", "too_many_prompts")
        self.check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        encoded: list[list[int]] = []
        texts: list[str | None] = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise bad_request("the prompt is empty", "prompt", "empty_prompt")
                ids = self.encode(p)
                kept = self.truncate(ids, r)
                encoded.append(kept)
                texts.append(p if len(kept) == len(ids) else None)  # echo decodes what was kept
            elif isinstance(p, list) and all(_is_int(t) for t in p):
                # Their vocabulary is the engine's to check (RequestError, param prompt).
                encoded.append(self.truncate([int(t) for t in p], r))
                texts.append(None)
            else:
                raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of token id lists", "prompt", "invalid_type")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if r.max_tokens is None else r.max_tokens
        lp = r.logprobs
        plp = r.prompt_logprobs if r.prompt_logprobs is not None else (lp if r.echo and lp is not None else None)
        base = self.sampling_params(r, max_tokens=max_tokens, logprobs=lp, prompt_logprobs=plp)
        include_usage, continuous = self._stream_flags(r)
        rid = f"cmpl-{uuid.uuid4().hex}"
        items = [(f"{rid}-{i}", ids, _copy(base)) for i, ids in enumerate(encoded)]
        return _Prepared(rid, int(time.time()), model, items, texts, r.n, r.stream, include_usage, continuous,
                         arrival, {"echo": r.echo, "logprobs": lp, "prompt_logprobs": r.prompt_logprobs,
                                   "return_token_ids": r.return_token_ids,
                                   "token_ids_as_names": r.return_tokens_as_token_ids})

    def prepare_chat(self, r: ChatCompletionRequest, arrival: float) -> _Prepared:
        model = self.check_model(r.model)
        if r.tools:
            raise bad_request("tools are not supported", "tools", "unsupported_parameter")
        if r.response_format and r.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format",
                              "unsupported_parameter")
        messages = self._messages(r.messages)
        ids = self.truncate(self._chat_ids(messages, r.add_generation_prompt, r.chat_template_kwargs,
                                           r.continue_final_message), r)
        # vLLM: the reply's role is the last message's when no generation prompt opens a new turn, and
        # echo repeats the last message's content when that message has the reply's role.
        role = "assistant" if r.add_generation_prompt else messages[-1]["role"]
        echo = messages[-1]["content"] if r.echo and messages[-1]["role"] == role else ""
        if r.top_logprobs is not None and not r.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {r.top_logprobs}", "top_logprobs")
        max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        param = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(ids), 1)  # the rest of the context
        lp = (r.top_logprobs or 0) if r.logprobs else None
        params = self.sampling_params(r, max_tokens=max_tokens, logprobs=lp, prompt_logprobs=r.prompt_logprobs)
        include_usage, continuous = self._stream_flags(r)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return _Prepared(rid, int(time.time()), model, [(f"{rid}-0", ids, params)], [None], r.n, r.stream,
                         include_usage, continuous, arrival, {"top_logprobs": r.top_logprobs or 0,
                                                              "return_token_ids": r.return_token_ids,
                                                              "token_ids_as_names": r.return_tokens_as_token_ids,
                                                              "role": role, "echo": echo})

    def _messages(self, messages) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages",
                              "missing_required_parameter" if messages is None else "invalid_value")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise bad_request(f"messages[{i}] must be an object", f"messages.{i}", "invalid_type")
            role = m.get("role")
            if not isinstance(role, str) or not role:  # any other role string goes to the template, as in vLLM
                raise bad_request(f"messages[{i}].role must be a non-empty string; got {role!r}",
                                  f"messages.{i}.role", "invalid_type")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                            part.get("text"), str):
                        raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                          f"messages.{i}.content.{j}", "unsupported_parameter")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None and role == "assistant":
                content = ""
            elif not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                                  f"messages.{i}.content", "invalid_type")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        self.check_prompt_chars(sum(len(m["content"]) for m in out), "messages")
        return out

    def _chat_ids(self, messages, add_generation_prompt=True, kwargs=None, continue_final=False) -> list[int]:
        """The templated prompt's ids. `continue_final`: the last message stays open (its end-of-turn and
        anything after it are cut), so the model continues it (HF's continue_final_message). `kwargs`
        (chat_template_kwargs) go to the template and override add_generation_prompt, as in vLLM."""
        kwargs = {"add_generation_prompt": add_generation_prompt, **(kwargs or {})}
        if continue_final and kwargs["add_generation_prompt"]:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true (set "
                              "add_generation_prompt to false)", "continue_final_message")
        try:
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as e:
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None
        if continue_final:
            final = messages[-1]["content"]
            for part in (final, final.strip()):
                at = text.rfind(part) if part else -1
                if at >= 0:
                    text = text[:at + len(part)]
                    break
            else:
                raise bad_request("continue_final_message needs a last message whose content the chat template "
                                  "renders", "continue_final_message")
        return self.encode(text)

    def truncate(self, ids: list[int], r: _SamplingFields) -> list[int]:
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

    def submit(self, prep: _Prepared, queue: asyncio.Queue) -> None:
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

    async def results(self, prep: _Prepared, queue: asyncio.Queue):
        """Yields (prompt index, RequestOutput | _ABORTED | exception) until every prompt finished."""
        try:
            while len(prep.done) < len(prep.items):
                idx, item = await queue.get()
                if item is _ABORTED or isinstance(item, BaseException) or item.finished:
                    prep.done.add(idx)
                yield idx, item
        finally:
            self.abort_unfinished(prep)

    def abort_unfinished(self, prep: _Prepared) -> None:
        for i, (rid, _, _) in enumerate(prep.items):
            if i not in prep.done:
                prep.done.add(i)
                self.loop.abort(rid)

    # ------------------------------------------------------------ handlers

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, self.prepare_completion, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, self.prepare_chat, chat=True)

    async def _generate(self, request: Request, model_cls, prepare, chat: bool) -> Response:
        arrival = time.monotonic()
        raw = await self.read_body(request)
        body, prep = await self.off_loop(self._parse_and_prepare, raw, model_cls, prepare, arrival)
        if body.user:
            log.debug("request %s from user %r", prep.request_id, body.user)
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(prep, queue)
        self.num_inflight += 1
        if prep.stream:
            return _SSEResponse(self._stream(prep, queue, chat), on_close=lambda: self._closed(prep))
        try:
            return await _until_disconnect(request, self._collect(prep, queue, chat))
        finally:
            self._closed(prep)

    def _parse_and_prepare(self, raw: bytes, model_cls, prepare, arrival: float):
        body = self.parse(raw, model_cls)
        prep = prepare(body, arrival)
        # The engine's checks walk every prompt token: here, not on the event loop.
        for _, ids, params in prep.items:
            try:
                self.engine.validate(ids, params)
            except ValueError as e:
                raise self._request_error(e, prep.request_id.startswith("chat")) from None
        return body, prep

    def _closed(self, prep: _Prepared) -> None:
        self.abort_unfinished(prep)  # the client left early: free the KV blocks now
        self.num_inflight -= 1

    async def _collect(self, prep: _Prepared, queue: asyncio.Queue, chat: bool) -> Response:
        finals: dict[int, Any] = {}
        last: dict[int, Any] = {}
        want_ids = prep.extra.get("return_token_ids", False)
        async for idx, item in self.results(prep, queue):
            failure = _failure(item)
            if failure is not None:
                raise failure
            if item is _ABORTED:
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
        return _json_response(obj)

    def _usage(self, num_prompt: int, num_out: int, outputs) -> dict:
        """OpenAI's usage; with --enable-prompt-tokens-details, prompt_tokens_details.cached_tokens counts
        the prompt tokens found in the prefix cache (vLLM's)."""
        details = None
        if self.cfg.enable_prompt_tokens_details:
            details = {"cached_tokens": sum(o.num_cached_tokens for o in outputs
                                            if o is not None and o is not _ABORTED)}
        return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out,
                "prompt_tokens_details": details}

    def _completion_choice(self, prep, i, out, c, choice_index, reason, stop_reason) -> dict:
        text = c.text if c is not None else ""
        token_ids = c.token_ids if c is not None else []
        prompt_ids = prep.items[i][1]
        echo = prep.extra["echo"]
        prefix = ""
        if echo:
            prefix = prep.prompt_texts[i] if prep.prompt_texts[i] is not None else self.tokenizer.decode(prompt_ids)
        logprobs = None
        if prep.extra["logprobs"] is not None:
            offset = 0
            tokens_part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echo:
                plps = (out.prompt_logprobs if out is not None else None) or [None] * len(prompt_ids)
                plps = list(plps) + [None] * (len(prompt_ids) - len(plps))
                tokens_part, offset = completion_logprobs(self._names(prep), prompt_ids, plps, 0)
            gen, _ = completion_logprobs(self._names(prep), token_ids, (c.logprobs or []) if c else [], offset)
            logprobs = {k: tokens_part[k] + gen[k] for k in gen}
        # vLLM's choices always carry prompt_logprobs (null unless asked for).
        plps = out.prompt_logprobs if prep.extra.get("prompt_logprobs") is not None and out is not None else None
        return {"index": choice_index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason, "prompt_logprobs": self._prompt_logprobs(plps)}

    def _names(self, prep: _Prepared):
        """How logprob entries name tokens: their text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return TokenIdNames() if prep.extra.get("token_ids_as_names") else self.detok

    def _prompt_logprobs(self, plps):
        if plps is None:
            return None
        return [None if d is None else {str(k): {"logprob": _lp(v), "decoded_token": self.detok.text(k)}
                                        for k, v in d.items()} for d in plps]

    def _chat_choice(self, prep, c, choice_index, reason, stop_reason) -> dict:
        logprobs = None
        if c is not None and c.logprobs is not None:
            logprobs = {"content": chat_logprobs(self._names(prep), c.token_ids, c.logprobs,
                                                 prep.extra["top_logprobs"])}
        content = prep.extra["echo"] + (c.text if c else "")
        return {"index": choice_index, "message": {"role": prep.extra["role"], "content": content},
                "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason}

    async def _stream(self, prep: _Prepared, queue: asyncio.Queue, chat: bool):
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        states: dict[int, ChoiceState] = {}
        num_prompt = sum(len(ids) for _, ids, _ in prep.items)
        num_out: dict[int, int] = {}

        def chunk(choices, usage=False, **top) -> bytes:
            obj = {"id": prep.request_id, "object": obj_name, "created": prep.created, "model": prep.model,
                   "choices": choices, **top}
            if chat:
                obj["system_fingerprint"] = None
            if prep.include_usage:
                obj["usage"] = None
                if usage or prep.continuous_usage:
                    obj["usage"] = self._usage(num_prompt, sum(num_out.values()), last.values())
            return b"data: " + _dumps(obj) + b"\n\n"

        last: dict[int, Any] = {}
        want_ids = prep.extra.get("return_token_ids", False)
        async for idx, item in self.results(prep, queue):
            failure = _failure(item)
            if failure is not None:
                yield b"data: " + _dumps(failure.body()) + b"\n\n"
                break
            if item is _ABORTED:
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
                if chat:
                    lp = ({"content": chat_logprobs(self._names(prep), new_ids, new_lps, prep.extra["top_logprobs"])}
                          if new_lps is not None else None)
                    if first:  # the role chunk counts no completion tokens yet (vLLM)
                        top = {"prompt_token_ids": prep.items[0][1]} if want_ids and ci == 0 else {}
                        yield chunk([{"index": ci, "delta": {"role": prep.extra["role"], "content": ""},
                                      "logprobs": None, "finish_reason": None}], **top)
                        if prep.extra["echo"]:
                            yield chunk([{"index": ci, "delta": {"content": prep.extra["echo"]}, "logprobs": None,
                                          "finish_reason": None}])
                    num_out[ci] = len(c.token_ids)
                    if delta_text or lp is not None or (want_ids and new_ids):
                        # The last content chunk carries the finish reason (no empty chunk after it).
                        ch = {"index": ci, "delta": {"content": delta_text}, "logprobs": lp,
                              "finish_reason": c.finish_reason}
                        if c.finish_reason:
                            ch["stop_reason"] = c.stop_reason
                        if want_ids:
                            ch["token_ids"] = list(new_ids)
                        yield chunk([ch])
                    elif c.finish_reason:  # nothing left to send but the reason
                        yield chunk([self._finish_delta(chat, ci, c.finish_reason, c.stop_reason)])
                else:
                    num_out[ci] = len(c.token_ids)
                    text = delta_text
                    lp = None
                    if first and prep.extra["echo"]:
                        ptxt = prep.prompt_texts[idx]
                        text = (ptxt if ptxt is not None else self.tokenizer.decode(prep.items[idx][1])) + text
                    if prep.extra["logprobs"] is not None:
                        lp, st.text_offset = completion_logprobs(self._names(prep), new_ids, new_lps or [],
                                                                 st.text_offset)
                    ch = {"index": ci, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
                    if want_ids:
                        ch["token_ids"] = list(new_ids)
                    yield chunk([ch])
        if prep.include_usage:
            yield chunk([], usage=True)
        if prep.items[0][2].trace:
            yield chunk([], trace=_traces(prep, last))
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _finish_delta(chat: bool, index: int, reason: str, stop_reason=None) -> dict:
        if chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason,
                    "stop_reason": stop_reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason, "stop_reason": stop_reason}

    # ------------------------------------------------------------ small endpoints

    async def models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
                 "root": self.cfg.root or name, "parent": None, "max_model_len": self.max_model_len,
                 "vocab_size": self.vocab_size} for name in self.cfg.served_model_names]
        return _json_response({"object": "list", "data": data})

    async def version(self, request: Request) -> Response:
        return _json_response({"version": _version()})

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
        return await self.off_loop(self._tokenize, await self.read_body(request))

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            from runtime.openapi import openapi_schema

            self._openapi = openapi_schema(
                {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                 "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}, _version())
        return _json_response(self._openapi)

    async def docs(self, request: Request) -> Response:
        from runtime.openapi import DOCS_HTML

        return Response(DOCS_HTML.format(title="jaxserve", schema_url="/openapi.json"), 200,
                        media_type="text/html")

    async def detokenize(self, request: Request) -> Response:
        return await self.off_loop(self._detokenize, await self.read_body(request))

    def _tokenize(self, raw: bytes) -> Response:
        r = self.parse(raw, TokenizeRequest)
        self.check_model(r.model)
        if (r.prompt is None) == (r.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if r.prompt is not None:
            self.check_prompt_chars(len(r.prompt), "prompt")
            ids = self.encode(r.prompt, add_special_tokens=r.add_special_tokens)
        else:
            ids = self._chat_ids(self._messages(r.messages), r.add_generation_prompt, r.chat_template_kwargs,
                                 r.continue_final_message)
        strs = [self.tokenizer.id_to_token(t) for t in ids] if r.return_token_strs else None
        return _json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                               "token_strs": strs})

    def _detokenize(self, raw: bytes) -> Response:
        r = self.parse(raw, DetokenizeRequest)
        self.check_model(r.model)
        bad = [t for t in r.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", "tokens",
                              "invalid_token_id")
        return _json_response({"prompt": self.tokenizer.decode(r.tokens)})


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
    if item is not _ABORTED and item.error is not None:
        return APIError(500, f"the engine step running this request failed: {item.error}", code="engine_error")
    return None


def _traces(prep, outputs: dict) -> list:
    """One trace per prompt (None where the request ended without one, e.g. aborted early)."""
    return [getattr(outputs.get(i), "trace", None) for i in range(len(prep.items))]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _copy(params: SamplingParams) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params)


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


# ====================================================================== the app


class _Gate:
    """ASGI middleware: API key and shutdown checks before any handler runs."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, server: Server):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            s = self.server
            err = None
            if s.draining and path not in ("/metrics", "/health"):
                err = APIError(503, "the server is shutting down", code="server_shutting_down",
                               headers={"Retry-After": str(s.cfg.retry_after_s)})
            elif s.cfg.api_key and path.startswith(self.PROTECTED):
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                scheme, _, token = auth.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                         s.cfg.api_key.encode()):
                    err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if err is not None:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine, *, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              max_queue: int | None = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              log_stats_interval: float = 10.0, root: str | None = None, start_engine: bool = True,
              **limits) -> Starlette:
    """The ASGI app around an `LLMEngine`. `app.state.server` is the Server (engine loop, metrics, state).

    The engine loop thread starts with the app (lifespan) unless `start_engine=False`; then call
    `app.state.server.loop.start()` yourself. `limits`: the other `ServerConfig` fields (timeouts,
    max_connections, max_prompt_chars); the connection ones apply when run by `serve` or `ServerThread`.
    """
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [engine.config.name])
    server = Server(engine, ServerConfig(names, api_key, max_queue, max_body_bytes, log_stats_interval,
                                         root=root, **limits))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()
            server.pool.shutdown(wait=False, cancel_futures=True)

    async def api_error(request, exc: APIError):
        return exc.response()

    async def http_error(request, exc: HTTPException):
        return APIError(exc.status_code, exc.detail or "error", code=None,
                        type="not_found_error" if exc.status_code == 404 else "invalid_request_error").response()

    async def server_error(request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return APIError(500, f"internal server error: {exc!r}", code="internal_error").response()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
        Route("/docs", server.docs, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.add_middleware(_Gate, server=server)
    app.state.server = server
    return app


# ====================================================================== running it


class _UvicornServer:
    """uvicorn.Server without its own signal handling: SIGTERM/SIGINT drain (see `serve`)."""

    def __new__(cls, config):
        import uvicorn

        class S(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return S(config)


def _guarded_protocol(header_timeout_s: float, max_connections: int):
    """uvicorn's HTTP protocol, plus what it lacks against slow or numerous clients: connections past
    `max_connections` are closed at accept, and one that has not sent a full request head within
    `header_timeout_s` (of connecting, or of its previous response) is closed."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("%d connections open (limit %d): closing a new one", len(self.connections) - 1,
                            max_connections)
                transport.close()
                return
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            # A request whose head arrived has a live cycle; its body has the body timeout.
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTPProtocol


def _uvicorn_config(app, host: str, port: int, **kwargs):
    import uvicorn

    server = getattr(getattr(app, "state", None), "server", None)
    cfg = server.cfg if server is not None else ServerConfig([])  # another ASGI app: the defaults
    return uvicorn.Config(app, host=host, port=port, lifespan="on", timeout_graceful_shutdown=2,
                          http=_guarded_protocol(cfg.header_timeout_s, cfg.max_connections),
                          limit_concurrency=cfg.max_connections + 1, timeout_keep_alive=cfg.keep_alive_timeout_s,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **kwargs)


class ServerThread:
    """Runs an app on uvicorn in a background thread (tests, benchmarks). `url` once `start()` returns."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.host = host
        self.server = _UvicornServer(_uvicorn_config(app, host, port, log_level=log_level, access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.port: int | None = None

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


async def serve(app, host: str, port: int, *, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
                log_level: str = "info", access_log: bool = False) -> None:
    """Serves until SIGTERM/SIGINT; then refuses new requests (503), drains in-flight ones for up to
    `shutdown_grace_s`, aborts whatever is left, and returns. A second signal exits at once."""
    server: Server = app.state.server
    uv = _UvicornServer(_uvicorn_config(app, host, port, log_level=log_level, access_log=access_log,
                                        log_config=None))
    loop = asyncio.get_running_loop()
    state = {"signals": 0}

    async def drain(signame: str) -> None:
        server.draining = True
        deadline = time.monotonic() + shutdown_grace_s
        log.info("%s: refusing new requests, draining %d in flight (grace %.0fs)", signame, server.num_inflight,
                 shutdown_grace_s)
        while server.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if server.num_inflight > 0:
            # Each aborted stream gets a final chunk with finish_reason "abort", then [DONE].
            log.warning("grace period over: aborting %d in-flight requests", server.num_inflight)
            server.loop.abort_all()
            t_end = time.monotonic() + 1.0
            while server.num_inflight > 0 and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
        log.info("drained; shutting down")
        uv.should_exit = True

    def on_signal(signame: str) -> None:
        state["signals"] += 1
        if state["signals"] > 1:
            log.warning("%s again: exiting now", signame)
            uv.force_exit = uv.should_exit = True
            return
        asyncio.ensure_future(drain(signame))

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig.name)
    await uv.serve()


def _explicit_engine_kwargs(ap: argparse.ArgumentParser, args) -> dict:
    """Engine args the user actually set (a saved plan keeps its own values for the others)."""
    from runtime.args import engine_kwargs_from_args

    kw = engine_kwargs_from_args(args)
    return {k: v for k, v in kw.items() if v is not None and v != ap.get_default(k)}


def parse_args(argv=None):
    from runtime.args import add_engine_args

    ap = argparse.ArgumentParser(prog="python -m runtime.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2-135m", help="preset name, GGUF file or HF directory")
    src.add_argument("--plan", help="a plan directory from `python -m runtime.compile` (no lowering at start)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                         "(default: $JAXSERVE_API_KEY)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="model name(s) clients use; the first is reported in responses")
    ap.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                    help="requests allowed to wait for a batch slot; beyond it: 503 + Retry-After (-1: no limit)")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                    help="larger request bodies get 413")
    ap.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                    help="on SIGTERM, how long in-flight requests may run before they are aborted")
    ap.add_argument("--max-prompt-chars", type=int, default=None,
                    help="longer prompts get 413 before tokenizing (default: max_model_len x "
                         f"{PROMPT_CHARS_PER_TOKEN})")
    ap.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                    help="close a connection that has not sent a request head within this")
    ap.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                    help="answer 408 when a request body takes longer than this to arrive")
    ap.add_argument("--keep-alive-timeout-s", type=int, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                    help="close an idle keep-alive connection after this")
    ap.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                    help="open connections allowed; more are closed at accept")
    ap.add_argument("--log-stats-interval", type=float, default=10.0,
                    help="seconds between stats log lines (0: off)")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX persistent compilation cache (default: the plan's xla_cache/ with --plan, "
                         "else ~/.cache/jaxserve/xla; 'none' to disable)")
    ap.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="usage.prompt_tokens_details.cached_tokens: prompt tokens found in the prefix cache")
    ap.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_args(ap)
    args = ap.parse_args(argv)
    return ap, args


def main(argv=None) -> int:
    """The server's entry point (`python -m runtime.serve`, `jaxserve serve`). The model or plan,
    the engine args and the port are checked first, so a mistake is one line before any compile."""
    ap, args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from runtime.args import engine_kwargs_from_args, preflight
    from runtime.args import quiet_tpu_probe

    quiet_tpu_probe()
    preflight(args)
    from runtime.engine import LLMEngine
    from runtime.llm import load_plan
    from runtime.worker.model_runner import DEFAULT_COMPILATION_CACHE, ModelRunner

    t0 = time.perf_counter()
    cache = args.compilation_cache_dir
    if cache is None and not args.plan:
        cache = str(DEFAULT_COMPILATION_CACHE)
    cache = None if cache in (None, "none", "") else str(Path(cache).expanduser())
    if args.plan:
        plan = load_plan(args.plan, _explicit_engine_kwargs(ap, args))
        source = args.plan
    else:
        plan = load_plan(args.model, engine_kwargs_from_args(args))
        source = args.model
    log.info("plan ready in %.1fs\n%s", time.perf_counter() - t0, plan.describe())
    runner = ModelRunner(plan, cache_dir=cache)
    engine = LLMEngine(plan, runner=runner, progress=True, warm_execute=True)
    log.info("engine warm in %.1fs (%d buckets compiled or loaded)", time.perf_counter() - t0,
             len(plan.buckets.pairs()))
    names = args.served_model_name or [args.model if not args.plan else plan.config.name]
    app = build_app(engine, served_model_names=names, api_key=args.api_key,
                    max_queue=None if args.max_queue < 0 else args.max_queue, max_body_bytes=args.max_body_bytes,
                    log_stats_interval=args.log_stats_interval, root=str(source),
                    max_prompt_chars=args.max_prompt_chars, header_timeout_s=args.header_timeout_s,
                    body_timeout_s=args.body_timeout_s, keep_alive_timeout_s=args.keep_alive_timeout_s,
                    max_connections=args.max_connections,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    log.info("serving %s on http://%s:%d (model name%s %s)", source, args.host, args.port,
             "s" if len(names) > 1 else "", ", ".join(names))
    asyncio.run(serve(app, args.host, args.port, shutdown_grace_s=args.shutdown_grace_s,
                      log_level=args.log_level, access_log=args.access_log))
    log.info("server stopped")
    # Interpreter teardown (the XLA client, device buffers, module globals) takes seconds and would
    # push the exit past the grace period; the server is drained and has nothing left to write.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
