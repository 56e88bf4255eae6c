"""LLMEngine: the loop { schedule -> step -> sample -> append/free blocks -> emit tokens }."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import threading
import time

import jax
import numpy as np

from runtime.core.block_manager import BlockManager
from runtime.engine.plan import Plan
from runtime.worker.model_runner import FEED_OUTPUT, SAMPLED_OUTPUTS, ModelRunner, num_backend_compiles
from runtime.worker.sampler import build_inputs
from runtime.core.spec_decode import make_proposer
from runtime.engine.step_inputs import Row, StepBatch, build_step, grammar_bitmask, pick_bucket
from config.engine_config import SpeculativeConfig
from runtime.core.sampling_params import STRUCTURED_PARAM, RequestError, SamplingParams
from runtime.core.structured_output import CompiledGrammar, GrammarCompiler, GrammarLimits
from runtime.core.scheduler import ScheduleOutput, Scheduler, SchedulerConfig
from runtime.core.sequence import Request, Sequence, SeqStatus
from runtime.engine.output_processor import PENDING, OutputProcessor
from runtime.engine.outputs import EngineStats, RequestOutput, StepTrace

log = logging.getLogger("runtime.engine.llm_engine")


class LLMEngine:
    """Continuous-batching engine over a compiled plan. Thread-safe add/abort; `step` from one thread."""

    def __init__(self, plan: Plan, tokenizer=None, *, runner: ModelRunner, warmup: bool = True,
                 progress: bool = False, check_invariants: bool = False, warm_execute: bool | str = False):
        """Over a plan and the runner holding it on the device; runtime.engine.build.build_engine assembles them."""
        self.plan = plan
        self.config = plan.config
        self.engine_config = e = plan.engine
        self.tokenizer = tokenizer if tokenizer is not None else plan.tokenizer
        self.runner = runner
        if warmup:
            self.warmup_s = self.runner.warmup(progress=progress, execute=warm_execute)
        self.block_manager = BlockManager(plan.num_kv_blocks, e.block_size, e.enable_prefix_caching,  # ir.kv_groups
                                          window=self.runner.kv_window, num_window_blocks=self.runner.num_window_blocks)
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
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.eos_ids, e.max_model_len)
        self.padded_tokens_total = 0
        self.num_steps = 0  # steps whose sampled tokens were read back and processed
        self.scheduled_tokens_total = 0
        self.start_time = time.monotonic()
        self.trace: list[StepTrace] | None = None
        self.finished_callbacks = []  # fn(request) when a request finishes
        # fn(schedule, outputs) after each step ran: the ScheduleOutput and the step's device outputs
        self.step_hooks = []  # (the graph's outputs, e.g. "logits", and the sampled rows); for tests and tools
        self.driver = None  # the engine loop (async_engine) that steps this engine from its thread, if one runs
        self.num_recompiles = 0
        self._step_requests: dict[str, Request] | None = None  # what the running step touches
        self.async_scheduling = e.schedules_async()
        self._inflight: _Launched | None = None  # async scheduling: the step launched, not yet read
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first structured request
        self.grammar_limits = GrammarLimits()  # a grammar's compile budgets (the server's flags)
        self.speculative = SpeculativeConfig.from_dict(e.speculative_config)
        self.proposer = make_proposer(self.speculative) if self.speculative is not None else None
        k = self.speculative.num_speculative_tokens if self.speculative is not None else 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * k
        self._grammar_lock = threading.Lock()

    # ------------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, compile_grammar=True):
        """Raises RequestError, with the exact numbers, when this engine cannot serve a request:
        the model-dependent checks (SamplingParams has checked the value ranges). Compiles the
        request's grammar (structured outputs; the server awaits `grammar_compiler().submit` itself),
        so a bad schema fails here, at admission; returns it (None without one). Thread-safe."""
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
        return self.grammar_compiler(so.source_param).compile(so) if so is not None and compile_grammar else None

    def grammar_compiler(self, param: str = STRUCTURED_PARAM) -> GrammarCompiler:
        """The engine's one GrammarCompiler (llguidance's view), built on first use; `grammar_limits` bound it."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer, and this model has "
                                       "none", param, "unsupported_parameter")
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.vocab_size)
            self._grammar_compiler.limits = self.grammar_limits
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
            # the special tokens its tokenizer adds (Gemma's <bos>), as HF's tokenizer(text) and vLLM
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
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
                    _drop_pending(s)  # its step's token is dropped with the request
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
            self._inflight = None  # a step launched in this call fails with the one it followed
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
                _drop_pending(s)  # a token the failed step never delivered
                if not s.is_finished:
                    self.scheduler.remove(s)  # frees its KV blocks
                    s.status, s.finish_reason = SeqStatus.FINISHED, "error"
            req.forked = True
            req.metrics.finished_time = time.monotonic()
            with self._lock:
                self.requests.pop(req.request_id, None)
            for cb in self.finished_callbacks:
                cb(req)
            out = self.output_processor.request_output(req)
            out.finished, out.error = True, message
            outs.append(out)
        return outs

    def _step(self) -> list[RequestOutput]:
        # Async scheduling: the step launched last time is still running. With a step to finish
        # (`cur`), the next one is scheduled and dispatched first when it can be, its decode rows
        # fed on the device from cur's sampled tokens; then cur's tokens are read and processed
        # while the next runs.
        cur, self._inflight = self._inflight, None
        if cur is not None:
            self._step_requests = dict(cur.requests)
        else:
            cur = self._launch(None)
            if cur is None:
                return []
        if self.async_scheduling and not (cur.drafts or cur.multi or cur.plp_seqs):
            self._commit(cur)
            self._inflight = self._launch(cur)
        outputs = self._complete(cur)
        nxt = self._inflight
        if nxt is not None and all(sc.seq.is_finished for sc in nxt.sched.scheduled):
            # Every sequence it runs stopped on cur's tokens: nothing to read back. Its KV writes
            # land in freed blocks before any later step (device order) can reuse them.
            self._inflight = None
        return outputs

    def _launch(self, prev: "_Launched | None") -> "_Launched | None":
        """Schedules a step, builds its inputs and dispatches it, without waiting for it. `prev`:
        the step still running, whose pending tokens (see `_commit`) this one takes on the device."""
        t0 = time.perf_counter()
        self._drain()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        requests = {s.seq.request.request_id: s.seq.request for s in sched.scheduled}
        self._step_requests = {**(self._step_requests or {}), **requests}
        drafts = self._propose(sched)  # takes KV blocks for the drafts it keeps
        bucket = pick_bucket(sched, drafts, self.plan.buckets) if drafts else sched.bucket
        multi = not drafts and self._multi_step_ready(sched)  # takes its KV blocks before the tables are built
        for sc in sched.scheduled:
            req = sc.seq.request
            if req.trace is not None:
                req.trace.step(req, sc.seq, bucket, sc.num_new_tokens + len(drafts.get(sc.seq.seq_id, ())),
                               self.runner.num_scheduler_steps if multi else 1)
        t_sched = time.perf_counter()
        batch = build_step(sched, bucket, block_size=self.engine_config.block_size,
                           max_blocks_per_seq=self.runner.max_blocks_per_seq, drafts=drafts,
                           window_group=self.runner.kv_window is not None)
        rows = batch.rows
        feed_index = self._feed_index(sched, batch, prev) if prev is not None else None
        si = build_inputs([self._row_params(r, drafts) for r in rows], bucket[1], self.engine_config.max_model_len,
                          self._stop_ids, vocab_size=self.config.vocab_size,
                          bitmask=grammar_bitmask(rows, bucket[1], self.config.vocab_size))
        t_prep = time.perf_counter()
        if sched.copies or sched.window_copies:
            self.runner.copy_blocks(sched.copies, sched.window_copies)
        if multi:
            outs = self.runner.execute_multi_step(bucket, batch.inputs, si.arrays())
        elif feed_index is not None:
            outs = self.runner.execute(bucket, batch.inputs, si.arrays(), prev.outs[FEED_OUTPUT], feed_index)
        else:
            outs = self.runner.execute(bucket, batch.inputs, si.arrays())
        t_dispatch = time.perf_counter()
        for hook in self.step_hooks:
            hook(sched, outs)
        plp_seqs = [s for s in sched.scheduled if s.seq.request.params.prompt_logprobs is not None
                    and s.seq.num_computed_tokens < s.seq.prompt_len]
        return _Launched(sched, drafts, multi, batch, outs, plp_seqs, requests,
                         (t0, t_sched, t_prep, t_dispatch), overlapped=prev is not None)

    def _commit(self, cur: "_Launched") -> None:
        """Before the next step is scheduled while `cur` runs: cur's tokens count as computed, and
        each sequence whose next token cur samples and that will surely go on (no fork, grammar or
        penalties, which read it on the host, and below its length limits) gets a placeholder for
        it: the scheduler gives it a decode row, whose token the device takes from cur's output.
        Whether the sequence in fact stops there is known only when cur is processed; then the
        next step's row for it is dropped."""
        self.scheduler.update(cur.sched)
        cur.updated = True
        limit = self.engine_config.max_model_len
        for i, r in enumerate(cur.batch.rows):
            seq, p = r.seq, r.seq.request.params
            if (r.fork_index is None and seq.request.forked and seq.status == SeqStatus.RUNNING
                    and not seq.request.aborted and seq.matcher is None and not p.needs_penalties
                    and seq.num_output_tokens + 1 < p.max_tokens and len(seq) + 1 < limit):
                seq.token_ids.append(PENDING)
                cur.pending[seq.seq_id] = i

    @staticmethod
    def _feed_index(sched: ScheduleOutput, batch, prev: "_Launched") -> np.ndarray | None:
        """For each input token of the step, the row of `prev`'s sampled tokens it is (-1: the
        host's token); None when no token comes from `prev`."""
        index = None
        for sc in sched.scheduled:
            row = prev.pending.get(sc.seq.seq_id)
            if row is None:
                continue
            seq, start = sc.seq, sc.seq.num_computed_tokens
            pos = len(seq) - 1  # the pending token is always the last
            if start <= pos < start + sc.num_new_tokens:
                if index is None:
                    index = np.full(batch.bucket[0], -1, np.int32)
                index[batch.offsets[seq.seq_id] + pos - start] = row
        return index

    def _complete(self, cur: "_Launched") -> list[RequestOutput]:
        """Reads a launched step's sampled rows and processes them: tokens, stops, outputs."""
        sched, drafts, bucket, multi, rows = cur.sched, cur.drafts, cur.batch.bucket, cur.multi, cur.batch.rows
        t0, t_sched, t_prep, t_dispatch = cur.times
        t_wait = time.perf_counter()
        sampled = jax.device_get([cur.outs[k] for k in SAMPLED_OUTPUTS])
        t2 = time.perf_counter()
        if cur.plp_seqs:
            self.output_processor.prompt_logprobs(cur.plp_seqs, cur.batch.offsets,
                                                  np.asarray(jax.device_get(cur.outs["hidden"])),
                                                  self.runner.prompt_logprobs)
        if not cur.updated:
            self.scheduler.update(sched)
        if drafts:
            touched = self._verify(rows, drafts, sampled)
        elif not multi:
            touched = self._postprocess(rows, *sampled)
        else:
            # Step k's tokens, in order, as if each were its own step: a sequence that stops at k
            # skips the rest (their KV was written into blocks it no longer holds).
            touched = {}
            for k in range(self.runner.num_scheduler_steps):
                if k:
                    self._advance([r.seq for r in rows])
                touched.update(self._postprocess(rows, *(x[k] for x in sampled)))
        for s in sched.preempted:
            touched.setdefault(s.request.request_id, s.request)
        t3 = time.perf_counter()
        self.num_steps += 1
        self.padded_tokens_total += bucket[0]
        self.scheduled_tokens_total += sched.num_tokens + sum(len(d) for d in drafts.values())
        if self.trace is not None:
            used = sum(s.num_computed_tokens for s in self.scheduler.running)
            alloc = sum(len(s.block_table) for s in self.scheduler.running) * self.engine_config.block_size
            self.trace.append(StepTrace(time.monotonic(), bucket, sched.num_tokens,
                                        len(sched.scheduled), len(rows), used, alloc, t_sched - t0,
                                        t_prep - t_sched, t_dispatch - t_prep, t2 - t_wait, t3 - t2,
                                        overlapped=cur.overlapped))
        if self.check_invariants:
            self.block_manager.check_invariants(
                [s for r in self.requests.values() for s in r.seqs if not s.is_finished])
        return [self.output_processor.request_output(r) for r in touched.values()]

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
        if not self.block_manager.can_append_all([sc.seq for sc in sched.scheduled], k):
            return False
        for sc in sched.scheduled:
            self.block_manager.may_append(sc.seq, k)
        return True

    def _propose(self, sched: ScheduleOutput) -> dict[int, list[int]]:
        """Speculative decoding: draft tokens for the decoding sequences of this step (seq_id ->
        drafts), trimmed to what a compiled bucket, the KV pool and each request's limits allow.
        Takes the KV blocks the drafts write into. Constrained sequences (a grammar) and first
        samples of n > 1 are not speculated."""
        if self.proposer is None:
            return {}
        k = self.speculative.num_speculative_tokens
        limit = self.engine_config.max_model_len
        drafts: dict[int, list[int]] = {}
        for sc in sched.scheduled:
            seq, p = sc.seq, sc.seq.request.params
            if (sc.num_new_tokens != 1 or not sc.samples or not seq.request.forked or seq.num_output_tokens == 0
                    or seq.matcher is not None):
                continue
            # Each verify row emits a token: no more rows than tokens the request may still take.
            room = min(k, p.max_tokens - seq.num_output_tokens - 1, limit - len(seq))
            d = self.proposer.propose(seq.token_ids, room) if room > 0 else []
            if d:
                drafts[seq.seq_id] = d
        while drafts and pick_bucket(sched, drafts, self.plan.buckets) is None:
            drafts.pop(max(drafts, key=lambda sid: len(drafts[sid])))  # the longest first
        bm = self.block_manager
        for sc in sched.scheduled:
            d = drafts.get(sc.seq.seq_id)
            if d is None:
                continue
            if bm.can_append(sc.seq, 1 + len(d)):
                bm.may_append(sc.seq, 1 + len(d))
            else:
                del drafts[sc.seq.seq_id]
        return drafts

    def _verify(self, rows: list[Row], drafts: dict[int, list[int]], sampled) -> dict[str, Request]:
        """Keeps each sequence's drafts up to the first one its verify row did not sample, then that
        row's token: sampling token j from the target's distribution and accepting draft j when they
        agree is speculative sampling for a draft that is one token (vLLM's n-gram case), so the
        output distribution is the target model's. Rejected drafts' KV blocks are released."""
        tokens = sampled[0]
        plain = [i for i, r in enumerate(rows) if r.seq.seq_id not in drafts]
        touched = self._postprocess([rows[i] for i in plain], *(x[plain] for x in sampled)) if plain else {}
        by_seq: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if r.seq.seq_id in drafts:
                by_seq.setdefault(r.seq.seq_id, []).append(i)
        rounds: list[list[int]] = []  # rounds[j]: rows emitting their sequence's j-th token of the step
        for sid, idx in by_seq.items():
            d = drafts[sid]
            a = 0
            while a < len(d) and int(tokens[idx[a]]) == d[a]:
                a += 1
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(d)
            self.spec_num_accepted_tokens += a
            for j in range(a):
                self.spec_accepted_per_pos[j] += 1
            seq = rows[idx[0]].seq
            if seq.request.trace is not None:
                seq.request.trace.speculated(seq, len(d), a)
            for j in range(a + 1):
                if len(rounds) <= j:
                    rounds.append([])
                rounds[j].append(idx[j])
        for j, round_rows in enumerate(rounds):
            if j:
                self._advance([rows[i].seq for i in round_rows])
            touched.update(self._postprocess([rows[i] for i in round_rows], *(x[round_rows] for x in sampled)))
        for idx in by_seq.values():
            seq = rows[idx[0]].seq
            if not seq.is_finished:
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
        return touched

    def _advance(self, seqs: list[Sequence]) -> None:
        """One more token of each unfinished sequence has its KV written (multi-step and verified
        drafts): count it computed, and cache its block once full."""
        for seq in seqs:
            if not seq.is_finished:
                seq.num_computed_tokens += 1
                self.block_manager.mark_computed(seq)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += sorted(self.eos_ids)
        return ids

    def _row_params(self, r: Row, drafts: dict[int, list[int]]):
        """A sampler row's (params, seed, counter, history, prompt length). A verify row j samples
        output token n+j with the key a plain step would use for it, so speculation changes no
        sampled token: with a fixed seed, outputs are the same with and without it."""
        seq, params = r.seq, r.seq.request.params
        if r.fork_index is not None:
            return params, _seq_seed(seq, r.fork_index), 0, seq.token_ids, seq.prompt_len
        history = seq.token_ids
        if r.draft_pos and params.needs_penalties:  # the history is only read for penalties
            history = history + drafts[seq.seq_id][:r.draft_pos]
        return params, _seq_seed(seq, None), seq.num_output_tokens + r.draft_pos, history, seq.prompt_len

    def _postprocess(self, rows, tokens, chosen_lp, top_ids, top_lp) -> dict[str, Request]:
        touched: dict[str, Request] = {}
        now = time.monotonic()
        # n > 1: fork every child from the prompt before any row appends, so a parent that
        # finishes on its first token (and frees its blocks) still has forks to share them.
        targets = [self._fork(seq, f) if f else seq for seq, f, _ in rows]
        for r, (seq, fork_index, _) in enumerate(rows):
            req = seq.request
            target = targets[r]
            if req.aborted or target.is_finished:
                continue
            self.output_processor.append(target, int(tokens[r]), float(chosen_lp[r]), top_ids[r], top_lp[r])
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

    # ------------------------------------------------------------------ stats

    @property
    def prompt_tokens_total(self) -> int:
        return self.output_processor.prompt_tokens_total

    @property
    def generation_tokens_total(self) -> int:
        return self.output_processor.generation_tokens_total

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
            num_cached_blocks=len(bm.cached), spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens, spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos))


def _drop_pending(seq: Sequence) -> None:
    """Removes the place async scheduling held for a token that will not be delivered."""
    if seq.token_ids and seq.token_ids[-1] == PENDING:
        seq.token_ids.pop()


@dataclasses.dataclass
class _Launched:
    """A dispatched step, until its sampled rows are read back and processed."""

    sched: ScheduleOutput
    drafts: dict[int, list[int]]
    multi: bool
    batch: StepBatch
    outs: dict
    plp_seqs: list
    requests: dict[str, Request]
    times: tuple[float, float, float, float]  # start, scheduled, prepared, dispatched
    overlapped: bool = False  # launched while the step before it ran
    updated: bool = False  # the scheduler counts its tokens computed
    pending: dict[int, int] = dataclasses.field(default_factory=dict)  # seq_id -> its row, held by PENDING


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _seq_seed(seq: Sequence, fork_index: int | None) -> int:
    base = seq.request.params.seed or 0
    idx = seq.index if fork_index is None else fork_index
    return (base * 1000003 + idx) & 0x7FFFFFFF
