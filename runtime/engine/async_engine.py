"""The engine thread and its queues: runs `LLMEngine.step()` on its own thread, and routes each request's
outputs to the asyncio queue of whoever submitted it.

Threads: the engine loop runs in its own thread and is the only caller of `LLMEngine.step`. The
asyncio side only enqueues requests and aborts, both thread-safe, and receives outputs through one
asyncio queue per caller, filled with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from runtime.core.sampling_params import SamplingParams
from runtime.engine.metrics import Metrics, Snapshot

log = logging.getLogger("runtime.engine.async_engine")

DEFAULT_MAX_QUEUE = 256


# ====================================================================== the engine loop


class QueueFull(Exception):
    pass


ABORTED = object()  # pushed to a request's queue when the engine aborted it


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
        self._seq_end: dict[str, dict[int, float]] = {}  # when each finished sample of a running request ended
        self._prompt_tokens_cached = 0  # prompt tokens of requests past prefill, found in the prefix cache
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.snapshot = Snapshot()
        self._take_snapshot()
        self.metrics = Metrics(model_name, lambda: self.snapshot, max_model_len=engine.engine_config.max_model_len,
                               cache_config=cache_config_info(engine))
        engine.finished_callbacks.append(self._on_finished)
        engine.step_hooks.append(self._on_step)
        self._last_log = (time.monotonic(), self.snapshot.prompt_tokens_total, self.snapshot.generation_tokens_total)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the loop's thread. One loop steps an engine at a time: two would each take outputs
        that the other's callers wait for."""
        if self._thread is not None and not self._thread.is_alive():  # a stop that timed out, since ended
            self._thread = None
        if self._thread is None:
            if self.engine.driver not in (None, self):
                raise RuntimeError("another engine loop already steps this engine (a server built on it is "
                                   "still running); stop it before starting this one")
            self.engine.driver = self
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.abort_all()
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # still inside a step: it lets go of the engine when that returns
                log.warning("the engine loop did not stop within %.0f s", timeout)
            else:
                self._thread = None
        with contextlib.suppress(ValueError):
            self.engine.finished_callbacks.remove(self._on_finished)
        with contextlib.suppress(ValueError):
            self.engine.step_hooks.remove(self._on_step)

    def fail(self, error: BaseException) -> None:
        """Fails every request in flight with `error`, refuses new ones and stops the loop; from any
        thread (a multi-process engine's watchdog, when a rank died or hung: the engine thread may
        be stuck in that step's collective)."""
        self.error = error
        self._stop = True
        self._wake.set()
        self._fail_all()

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
        try:
            self._loop()
        finally:  # stopped, or failed: the engine is free for another loop
            if self.engine.driver is self:
                self.engine.driver = None

    def _loop(self) -> None:
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
            tokens = engine.prompt_tokens_total + engine.generation_tokens_total
            steps = engine.num_steps
            try:
                outputs = engine.step()
            except Exception as e:  # a broken engine: fail every request, refuse new ones
                log.exception("engine step failed; the server will refuse new requests")
                self.error = e
                self._fail_all()
                return
            if engine.num_steps > steps:  # a step's tokens came back; vLLM's count: prompts whose prefill finished, plus the tokens generated
                self.metrics.iteration_tokens.observe(engine.prompt_tokens_total + engine.generation_tokens_total
                                                      - tokens)
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
                    if not out.finished:  # a sample that stopped while others go on ended at this step
                        for c in out.outputs:
                            if c.finish_reason is not None:
                                self._seq_end.setdefault(rid, {}).setdefault(c.index, m.last_token_time)
                sub = self._subs.pop(rid, None) if out.finished else self._subs.get(rid)
                if out.finished:
                    self._last_token.pop(rid, None)
                    self._seq_end.pop(rid, None)
                if sub is not None:
                    loop, q, idx = sub
                    per_loop.setdefault(loop, []).append((q, idx, out))
        for loop, batch in per_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(_deliver, batch)

    def _on_step(self, sched, outs) -> None:
        """Engine step hook (engine thread), after the step's launch: counts the prefix-cache share of
        the prompts the engine counts in this step (a first sample's prompt, when its prefill ends)."""
        for sc in sched.scheduled:
            seq = sc.seq
            if sc.samples and seq.index == 0 and seq.num_output_tokens == 0:
                self._prompt_tokens_cached += seq.num_cached_tokens

    def _on_finished(self, req) -> None:
        """Engine callback (engine thread): a request finished or was aborted. Observes vLLM's
        per-request histograms once per sample (vLLM runs each of n samples as a child request) and
        n and the longest sample once per request."""
        rid = req.request_id
        m = req.metrics
        now = time.monotonic()
        num_out = sum(s.num_output_tokens for s in req.seqs)
        end = m.finished_time or now
        ttft = (m.first_token_time - m.arrival_time) if m.first_token_time is not None else None
        ends = self._seq_end.pop(rid, {})
        met, model = self.metrics, self.metrics.model_name
        if req.aborted:
            reasons = ["abort"] * max(req.params.n, len(req.seqs))
        else:
            reasons = []
            for s in req.seqs:
                reasons.append(s.finish_reason or "abort")
                seq_end = ends.get(s.index, end)
                met.e2e.observe(seq_end - m.arrival_time)
                if ttft is not None:
                    met.ttft.observe(ttft)
                if m.first_scheduled_time is not None:
                    met.queue.observe(m.first_scheduled_time - m.arrival_time)
                    met.inference_time.observe(seq_end - m.first_scheduled_time)
                    if m.first_token_time is not None:
                        met.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                if m.first_token_time is not None:
                    decode = seq_end - m.first_token_time
                    met.decode_time.observe(decode)
                    met.tpot.observe(decode / (s.num_output_tokens - 1) if s.num_output_tokens > 1 else 0.0)
                met.req_prompt_tokens.observe(len(req.prompt_token_ids))
                met.req_generation_tokens.observe(s.num_output_tokens)
                # The first sample computed the prompt's KV; the others share its blocks.
                met.req_prefill_kv_computed.observe(len(req.prompt_token_ids) - s.num_cached_tokens
                                                    if s.index == 0 else 0)
                if req.params.max_tokens is not None:
                    met.req_params_max_tokens.observe(req.params.max_tokens)
                met.req_num_preemptions.observe(s.num_preemptions)
            met.req_params_n.observe(req.params.n)
            met.req_max_num_generation_tokens.observe(max(s.num_output_tokens for s in req.seqs))
        for r in reasons:
            met.success.labels(model, r).inc()
        reason = "abort" if req.aborted else ",".join(sorted(set(reasons)))
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
                    loop.call_soon_threadsafe(_deliver, [(q, idx, ABORTED)])

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
        capacity, deferred = _waiting_by_reason(sched)
        self.snapshot = Snapshot(
            time=time.monotonic(),
            num_running=len({id(s.request) for s in list(sched.running)}),
            num_waiting=capacity + deferred, num_waiting_capacity=capacity, num_waiting_deferred=deferred,
            kv_cache_usage=st.kv_cache_usage, prefix_cache_queries=st.prefix_cache_queries,
            prefix_cache_hits=st.prefix_cache_hits, num_preemptions=st.num_preemptions,
            num_recompiles=st.num_recompiles, prompt_tokens_total=st.prompt_tokens_total,
            prompt_tokens_cached=self._prompt_tokens_cached,
            generation_tokens_total=st.generation_tokens_total, padding_waste_ratio=st.padding_waste_ratio,
            num_kv_blocks=st.num_kv_blocks, num_cached_blocks=st.num_cached_blocks,
            spec_num_drafts=st.spec_num_drafts if e.speculative is not None else None,
            spec_num_draft_tokens=st.spec_num_draft_tokens, spec_num_accepted_tokens=st.spec_num_accepted_tokens,
            spec_accepted_per_pos=st.spec_accepted_per_pos)

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


def cache_config_info(engine) -> dict:
    """vllm:cache_config_info's labels: the KV cache's settings, from the engine's plan."""
    ec, bm = engine.engine_config, engine.block_manager
    pools = sorted({x.dtype for x in engine.plan.graph.runtime_inputs if "_pool." in x.name})
    return {"block_size": bm.block_size, "num_gpu_blocks": bm.num_blocks,
            "enable_prefix_caching": bm.enable_prefix_caching, "cache_dtype": ",".join(pools) or "auto",
            "gpu_memory_utilization": ec.memory_utilization}


def _waiting_by_reason(sched) -> tuple[int, int]:
    """(capacity, deferred) waiting requests. Under continuous batching every waiting request waits
    for capacity. Static and dynamic batching admit only the members of a forming batch (the
    scheduler's remaining quota, in queue order); the rest wait for the policy: deferred."""
    if sched.config.scheduling == "continuous":  # every waiting request waits for capacity: no sort
        return len({id(s.request) for s in sched.waiting}), 0
    waiting, quota = sched.queue_order(), sched.num_admissible
    capacity = {id(s.request) for s in waiting[:quota]}
    deferred = {id(s.request) for s in waiting[quota:]} - capacity
    return len(capacity), len(deferred)


def _deliver(batch) -> None:
    for q, idx, item in batch:
        q.put_nowait((idx, item))


