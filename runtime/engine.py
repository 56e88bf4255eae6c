"""LLMEngine: the loop { schedule -> step -> sample -> append/free blocks -> emit tokens }."""

from __future__ import annotations

import collections
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from runtime.core import detokenizer
from runtime.core.block_manager import BlockManager
from runtime.plan import Plan
from runtime.worker.model_runner import SAMPLED_OUTPUTS, ModelRunner, num_backend_compiles
from runtime.worker.sampler import build_inputs
from runtime.core.sampling_params import STRUCTURED_PARAM, RequestError, SamplingParams
from runtime.core.structured_output import CompiledGrammar, GrammarCompiler, allocate_bitmask
from runtime.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig
from runtime.core.sequence import Request, Sequence, SeqStatus

log = logging.getLogger("runtime.engine")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: object = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when a failed step ended this request
    trace: dict | None = None  # SamplingParams(trace=True): RequestTrace.to_dict()


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_recompiles: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prompt_throughput: float  # tok/s, averaged since the engine started
    generation_throughput: float
    padded_tokens_total: int
    scheduled_tokens_total: int
    num_kv_blocks: int
    num_cached_blocks: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def padding_waste_ratio(self) -> float:
        total = self.padded_tokens_total
        return (total - self.scheduled_tokens_total) / total if total else 0.0


@dataclass
class StepTrace:
    """Per-step timing and occupancy, for the benchmark's plots and profiles."""

    time: float
    bucket: tuple[int, int]
    num_tokens: int
    num_seqs: int
    num_sampled: int  # tokens sampled (one per sequence that reached its end this step)
    kv_used_slots: int  # slots that hold real tokens
    kv_allocated_slots: int  # slots of allocated blocks
    # Where the step's wall time went, in order:
    schedule_s: float  # drain adds/aborts, schedule (host)
    prepare_s: float  # build the step's and the sampler's input arrays (host)
    dispatch_s: float  # copy-on-write and the step call, until it returns (async: host side of the launch)
    device_s: float  # waiting for the sampled tokens: the device's share not hidden by the host work
    postprocess_s: float  # prompt logprobs, append tokens, stops, detokenize, outputs (host)

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.dispatch_s + self.postprocess_s


class LLMEngine:
    """Continuous-batching engine over a compiled plan. Thread-safe add/abort; `step` from one thread."""

    def __init__(self, plan: Plan, tokenizer=None, *, runner: ModelRunner | None = None,
                 warmup: bool = True, progress: bool = False, check_invariants: bool = False,
                 warm_execute: bool = False):
        self.plan = plan
        self.config = plan.config
        self.engine_config = e = plan.engine
        self.tokenizer = tokenizer if tokenizer is not None else plan.tokenizer
        self.runner = runner or ModelRunner(plan)
        if warmup:
            self.warmup_s = self.runner.warmup(progress=progress, execute=warm_execute)
        self.block_manager = BlockManager(plan.num_kv_blocks, e.block_size, e.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                            max_model_len=e.max_model_len, enable_chunked_prefill=e.enable_chunked_prefill,
                            scheduling=e.scheduling, max_waiting_ms=e.max_waiting_ms,
                            static_batch_size=e.static_batch_size),
            self.block_manager, plan.buckets)
        self.requests: dict[str, Request] = {}
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._rng = random.Random(e.seed)
        self._ids = itertools.count()
        self.check_invariants = check_invariants
        self.eos_ids = set(self.tokenizer.stop_token_ids) if self.tokenizer is not None else (
            {self.config.eos_token_id} if self.config.eos_token_id is not None else set())
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.padded_tokens_total = 0
        self.scheduled_tokens_total = 0
        self.start_time = time.monotonic()
        self.trace: list[StepTrace] | None = None
        self.finished_callbacks = []  # fn(request) when a request finishes
        # fn(schedule, outputs) after each step ran: the ScheduleOutput and the step's device outputs
        # (the graph's outputs, e.g. "logits", and the sampled rows); for tests and tools.
        self.step_hooks = []
        self.num_recompiles = 0
        self._step_requests: dict[str, Request] | None = None  # what the running step touches
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first structured request
        self._grammar_lock = threading.Lock()

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> CompiledGrammar | None:
        """Raises RequestError, with the exact numbers, when this engine cannot serve a request:
        the model-dependent checks (SamplingParams has checked the value ranges). Compiles the
        request's grammar (structured outputs), so a bad schema fails here, at admission; returns
        it (None without one). Safe to call from several threads."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt", "empty_prompt")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of vocabulary: prompt token ids must be in "
                               f"[0, {vocab}); got {bad[:5]}", "prompt", "invalid_token_id")
        limit = self.engine_config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if n + max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the prompt has {n} tokens and "
                f"max_tokens is {max_tokens} ({n + max_tokens} in total)", "prompt", "context_length_exceeded")
        if params.n > self.engine_config.max_num_seqs:
            raise RequestError(f"n must be in [1, {self.engine_config.max_num_seqs}] (max_num_seqs), got {params.n}",
                               "n")
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            for t in ids:
                if not 0 <= int(t) < vocab:
                    raise RequestError(f"{name} token id {t} is outside [0, {vocab})", name)
        so = params.structured_outputs
        return self.grammar_compiler(so.source_param).compile(so) if so is not None else None

    def grammar_compiler(self, param: str = STRUCTURED_PARAM) -> GrammarCompiler:
        """The engine's one GrammarCompiler (llguidance's view of the tokenizer), built on first use."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer, and this model has "
                                       "none", param, "unsupported_parameter")
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.vocab_size)
            return self._grammar_compiler

    def add_request(self, request_id: str | None, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, *, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None) -> str:
        """Queues a request; it joins the batch at the next step. Returns its id."""
        params = params or SamplingParams()
        if isinstance(prompt, list):
            prompt_token_ids, prompt = prompt, None
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        grammar = self.validate(prompt_token_ids, params)
        if params.max_tokens is None:
            params.max_tokens = self.engine_config.max_model_len - len(prompt_token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.seed is None:
            params = _with_seed(params, self._rng.getrandbits(31))
        req = Request(request_id, prompt, prompt_token_ids, params, arrival_time)
        if grammar is not None:
            req.grammar = grammar
            req.seqs[0].matcher = grammar.matcher()
        with self._lock:
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.requests[request_id] = req
            self._pending.append(("add", req))
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks at the start of the next step."""
        with self._lock:
            self._pending.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self.requests)

    def _drain(self) -> None:
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
        for kind, x in items:
            if kind == "add":
                if x.aborted:
                    continue
                self.scheduler.add(x.seqs[0])
            else:
                req = self.requests.get(x)
                if req is None:
                    continue
                req.aborted = True
                for s in req.seqs:
                    if not s.is_finished:
                        self.scheduler.remove(s)
                        s.status = SeqStatus.FINISHED
                        s.finish_reason = "abort"
                with self._lock:
                    self.requests.pop(x, None)
                for cb in self.finished_callbacks:
                    cb(req)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One engine step. If it raises, only the requests it touched fail (their outputs carry
        `error`); their KV blocks are freed and the engine keeps serving the others."""
        compiles_before = num_backend_compiles()
        self._step_requests = None
        try:
            return self._step()
        except Exception as e:
            log.exception("engine step failed; failing the requests it touched")
            return self._fail(e)
        finally:
            # Any XLA compile inside a step is a shape the bucket table did not cover.
            self.num_recompiles += num_backend_compiles() - compiles_before

    def _fail(self, error: Exception) -> list[RequestOutput]:
        reqs = self._step_requests
        if reqs is None:  # failed before a batch existed: every queued request is suspect
            reqs = {s.request.request_id: s.request for s in [*self.scheduler.running, *self.scheduler.waiting]}
        message = f"{type(error).__name__}: {error}"
        outs = []
        for req in reqs.values():
            for s in req.seqs:
                if not s.is_finished:
                    self.scheduler.remove(s)  # frees its KV blocks
                    s.status, s.finish_reason = SeqStatus.FINISHED, "error"
            req.forked = True
            req.metrics.finished_time = time.monotonic()
            with self._lock:
                self.requests.pop(req.request_id, None)
            for cb in self.finished_callbacks:
                cb(req)
            out = self._output(req)
            out.finished, out.error = True, message
            outs.append(out)
        return outs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._drain()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self._step_requests = {s.seq.request.request_id: s.seq.request for s in sched.scheduled}
        multi = self._multi_step_ready(sched)  # takes its KV blocks before the tables are built
        for sc in sched.scheduled:
            req = sc.seq.request
            if req.trace is not None:
                req.trace.step(req, sc.seq, sched.bucket, sc.num_new_tokens,
                               self.runner.num_scheduler_steps if multi else 1)
        t_sched = time.perf_counter()
        inputs, rows = self._prepare(sched)
        row_params = [(s.request.params, _seq_seed(s, fork_index), s.num_output_tokens if fork_index is None else 0,
                       s.token_ids, s.prompt_len) for s, fork_index in rows]
        si = build_inputs(row_params, sched.bucket[1], self.engine_config.max_model_len, self._stop_ids,
                          vocab_size=self.config.vocab_size, bitmask=self._grammar_bitmask(rows, sched.bucket[1]))
        t_prep = time.perf_counter()
        if sched.copies:
            self.runner.copy_blocks(sched.copies)
        if multi:
            outs = self.runner.execute_multi_step(sched.bucket, inputs, si.arrays())
        else:
            outs = self.runner.execute(sched.bucket, inputs, si.arrays())
        t_dispatch = time.perf_counter()
        for hook in self.step_hooks:
            hook(sched, outs)
        sampled = jax.device_get([outs[k] for k in SAMPLED_OUTPUTS])
        t2 = time.perf_counter()
        plp_seqs = [s for s in sched.scheduled if s.seq.request.params.prompt_logprobs is not None
                    and s.seq.num_computed_tokens < s.seq.prompt_len]
        if plp_seqs:
            self._prompt_logprobs(plp_seqs, sched, outs["hidden"])
        self.scheduler.update(sched)
        if not multi:
            touched = self._postprocess(rows, *sampled)
        else:
            # Step k's tokens, in order, as if each were its own step: a sequence that stops at k
            # skips the rest (their KV was written into blocks it no longer holds).
            touched = {}
            for k in range(self.runner.num_scheduler_steps):
                if k:
                    for sc in sched.scheduled:
                        if not sc.seq.is_finished:
                            sc.seq.num_computed_tokens += 1
                            self.block_manager.mark_computed(sc.seq)
                touched.update(self._postprocess(rows, *(x[k] for x in sampled)))
        for s in sched.preempted:
            touched.setdefault(s.request.request_id, s.request)
        t3 = time.perf_counter()
        self.padded_tokens_total += sched.bucket[0]
        self.scheduled_tokens_total += sched.num_tokens
        if self.trace is not None:
            used = sum(s.num_computed_tokens for s in self.scheduler.running)
            alloc = sum(len(s.block_table) for s in self.scheduler.running) * self.engine_config.block_size
            self.trace.append(StepTrace(time.monotonic(), sched.bucket, sched.num_tokens,
                                        len(sched.scheduled), len(rows), used, alloc, t_sched - t0,
                                        t_prep - t_sched, t_dispatch - t_prep, t2 - t_dispatch, t3 - t2))
        if self.check_invariants:
            self.block_manager.check_invariants(
                [s for r in self.requests.values() for s in r.seqs if not s.is_finished])
        return [self._output(r) for r in touched.values()]

    def _multi_step_ready(self, sched: ScheduleOutput) -> bool:
        """Whether this step may run num_scheduler_steps decode steps at once: every sequence
        decodes one token with nothing that changes between the steps on the host (penalties
        read the growing history; min_tokens lifts a ban mid-window; a first sample forks n; a
        grammar needs the host to write each step's mask), and there are KV blocks for all K
        tokens. Then it takes those blocks."""
        k = self.runner.num_scheduler_steps
        if k <= 1 or sched.bucket not in self.runner.multi_step_buckets:
            return False
        limit = self.engine_config.max_model_len
        for sc in sched.scheduled:
            seq, p = sc.seq, sc.seq.request.params
            if (sc.num_new_tokens != 1 or sc.num_rows != 1 or not seq.request.forked or seq.num_output_tokens == 0
                    or p.needs_penalties or seq.num_output_tokens < p.min_tokens or seq.matcher is not None
                    or seq.num_computed_tokens + k > limit):
                return False
        bm = self.block_manager
        need = sum(max(bm.blocks_needed(sc.seq.num_computed_tokens + k) - len(sc.seq.block_table), 0)
                   for sc in sched.scheduled)
        if need > bm.num_free:
            return False
        for sc in sched.scheduled:
            self.block_manager.may_append(sc.seq, k)
        return True

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += sorted(self.eos_ids)
        return ids

    def _prepare(self, sched: ScheduleOutput):
        """Host arrays for the step, padded to the bucket; and which seq each sampling row feeds."""
        T, S = sched.bucket
        bs = self.engine_config.block_size
        M = self.runner.max_blocks_per_seq
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        tables = np.zeros((S, M), np.int32)
        ctx = np.zeros(S, np.int32)
        cu = np.zeros(S + 1, np.int32)
        logits_idx = np.zeros(S, np.int32)
        rows: list[tuple[Sequence, int | None]] = []  # (seq, fork index for n > 1 first samples)
        off = 0
        for i, sc in enumerate(sched.scheduled):
            seq, n = sc.seq, sc.num_new_tokens
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            tokens[off:off + n] = seq.token_ids[start:start + n]
            positions[off:off + n] = pos
            table = np.asarray(seq.block_table, np.int32)
            slots[off:off + n] = table[pos // bs] * bs + pos % bs
            tables[i, :len(table)] = table
            ctx[i] = start + n
            cu[i + 1] = off + n
            if sc.samples:
                req = seq.request
                forks = range(req.params.n) if not req.forked else [None]
                for f in forks:
                    logits_idx[len(rows)] = off + n - 1
                    rows.append((seq, f))
            off += n
        cu[len(sched.scheduled) + 1:] = off
        inputs = {"tokens": tokens, "positions": positions, "slot_mapping": slots, "block_tables": tables,
                  "context_lens": ctx, "cu_q_lens": cu, "logits_indices": logits_idx}
        return inputs, rows

    def _grammar_bitmask(self, rows, num_rows: int) -> np.ndarray | None:
        """The step's allowed-token masks, written on the host before dispatch (overlapping this with
        the previous step on the device is left for later); None when no row is constrained. The n
        first-sample rows of a request all read the parent's matcher: none has a token yet."""
        if all(seq.matcher is None for seq, _ in rows):
            return None
        bitmask = allocate_bitmask(num_rows, self.config.vocab_size)
        for r, (seq, _) in enumerate(rows):
            if seq.matcher is not None:
                seq.matcher.fill_bitmask(bitmask, r)
        return bitmask

    def _prompt_logprobs(self, scheduled, sched: ScheduleOutput, hidden) -> None:
        hidden = np.asarray(jax.device_get(hidden))
        off = 0
        offsets = {}
        for sc in sched.scheduled:
            offsets[sc.seq.seq_id] = off
            off += sc.num_new_tokens
        for sc in scheduled:
            seq, req = sc.seq, sc.seq.request
            start = seq.num_computed_tokens
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # the first prompt token has no logprob
            if start > 0 and len(req.prompt_logprobs) < start + 1:
                # Prefix-cached tokens were never run; their logprobs are not available.
                req.prompt_logprobs += [None] * (start + 1 - len(req.prompt_logprobs))
            # Row j predicts token start + j + 1, for the tokens inside the prompt.
            n = min(sc.num_new_tokens, seq.prompt_len - 1 - start)
            if n <= 0:
                continue
            o = offsets[seq.seq_id]
            targets = np.asarray(seq.token_ids[start + 1:start + 1 + n], np.int32)
            lp, ids, top = self.runner.prompt_logprobs(hidden[o:o + n], targets)
            k = req.params.prompt_logprobs
            for j in range(n):
                d = {int(targets[j]): float(lp[j])}
                for a, b in zip(ids[j][:k], top[j][:k]):
                    d.setdefault(int(a), float(b))
                req.prompt_logprobs.append(d)

    def _postprocess(self, rows, tokens, chosen_lp, top_ids, top_lp) -> dict[str, Request]:
        touched: dict[str, Request] = {}
        now = time.monotonic()
        # n > 1: fork every child from the prompt before any row appends, so a parent that
        # finishes on its first token (and frees its blocks) still has forks to share them.
        targets = [self._fork(seq, f) if f else seq for seq, f in rows]
        for r, (seq, fork_index) in enumerate(rows):
            req = seq.request
            target = targets[r]
            if req.aborted or target.is_finished:
                continue
            self._append(target, int(tokens[r]), float(chosen_lp[r]), top_ids[r], top_lp[r])
            if req.trace is not None:
                req.trace.token(req, target, now)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            touched[req.request_id] = req
        for req in list(touched.values()):
            if req.is_finished:
                req.metrics.finished_time = now
                with self._lock:
                    self.requests.pop(req.request_id, None)
                for cb in self.finished_callbacks:
                    cb(req)
        return touched

    def _fork(self, parent: Sequence, fork_index: int) -> Sequence:
        req = parent.request
        if req.aborted:
            return parent
        child = Sequence(req, parent.token_ids[:parent.prompt_len], fork_index)
        child.status = SeqStatus.RUNNING
        if req.grammar is not None:
            child.matcher = req.grammar.matcher()  # its own parse state
        self.block_manager.fork(parent, child)
        req.seqs.append(child)
        self.scheduler.running.append(child)
        if fork_index == req.params.n - 1:
            req.forked = True
        return child

    def _append(self, seq: Sequence, tok: int, lp: float, top_ids, top_lp) -> None:
        p = seq.request.params
        if seq.matcher is not None and not seq.matcher.accept_token(tok):
            # The mask should make this impossible; end this sequence, not the engine.
            why = seq.matcher.error or f"token {tok} is not allowed by the grammar"
            seq.request.error, seq.finish_reason = f"structured output failed: {why}", "error"
            log.error("request %s: %s", seq.request.request_id, seq.request.error)
            return self.scheduler.finish(seq)
        seq.token_ids.append(tok)
        self.generation_tokens_total += 1
        if seq.num_output_tokens == 1 and seq.index == 0:
            self.prompt_tokens_total += seq.prompt_len
        seq.cumulative_logprob += lp
        if p.logprobs is not None:
            d = {tok: lp}
            for a, b in zip(top_ids[:p.logprobs], top_lp[:p.logprobs]):
                d.setdefault(int(a), float(b))
            seq.logprobs.append(d)
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_ids:
                reason = "stop"
            elif tok in p.stop_token_ids:
                reason, stop_reason = "stop", tok
        if self.tokenizer is not None and p.detokenize:
            if seq.detok_state is None:
                seq.detok_state = detokenizer.new_state()
            new_text = detokenizer.step(self.tokenizer, seq.output_token_ids, seq.detok_state,
                                        p.skip_special_tokens)
            seq.text += new_text
            if p.stop and reason is None and new_text and n_out >= p.min_tokens:
                hit = detokenizer.find_stop(seq.text, len(new_text), p.stop)
                if hit is not None:
                    i, s = hit
                    seq.text = seq.text[:i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                    reason, stop_reason = "stop", s
        if reason is None and seq.matcher is not None and seq.matcher.is_terminated():
            reason = "stop"  # the grammar is complete (its last token may be a stop id or not)
        if reason is None and (n_out >= p.max_tokens or len(seq) >= self.engine_config.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for s in sorted(req.seqs, key=lambda s: s.index):
            text = s.text
            if not s.is_finished and req.params.stop:
                hb = detokenizer.holdback(text, req.params.stop)
                text = text[:len(text) - hb] if hb else text
            outs.append(CompletionOutput(
                s.index, text, list(s.output_token_ids),
                s.cumulative_logprob if req.params.logprobs is not None else None,
                list(s.logprobs) if req.params.logprobs is not None else None,
                s.finish_reason, s.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outs,
                             req.is_finished or req.aborted, req.metrics, req.seqs[0].num_cached_tokens,
                             error=req.error, trace=req.trace.to_dict(req) if req.trace is not None else None)

    # ------------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        """A snapshot; reading it changes nothing (interval rates are the caller's: see serve)."""
        dt = max(time.monotonic() - self.start_time, 1e-9)
        ptp = self.prompt_tokens_total / dt
        gtp = self.generation_tokens_total / dt
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage(), prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits, num_preemptions=self.scheduler.num_preemptions,
            num_recompiles=self.num_recompiles, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, prompt_throughput=ptp,
            generation_throughput=gtp, padded_tokens_total=self.padded_tokens_total,
            scheduled_tokens_total=self.scheduled_tokens_total, num_kv_blocks=bm.num_blocks,
            num_cached_blocks=len(bm.cached))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, seed=seed)


def _seq_seed(seq: Sequence, fork_index: int | None) -> int:
    base = seq.request.params.seed or 0
    idx = seq.index if fork_index is None else fork_index
    return (base * 1000003 + idx) & 0x7FFFFFFF
