"""LLM: offline generation with vLLM's interface, on top of LLMEngine."""

from __future__ import annotations

import atexit
import sys
from typing import Sequence

from runtime.engine.build import build_engine
from runtime.engine.plan import Plan, load_plan
from runtime.engine.outputs import RequestOutput
from runtime.core.sampling_params import SamplingParams

class LLM:
    """`LLM(model="smollm2-135m", **engine_args)`: a preset, GGUF file, HF directory or plan directory.

    Building one converts the weights and compiles every bucket (minutes on a cold start; the
    caches make later ones seconds), with the server's progress bars on stderr unless
    `progress=False`. As in the server, the plan's host copy of the weights is dropped once they
    are on the device (`self.plan.weights` is None): on CPU it would stay resident beside them.

    Several processes, one engine: `nnodes=N, node_rank=R, dist_init_addr="HOST:PORT"` (the
    server's --nnodes, --node-rank, --dist-init-addr; runtime.distributed) with a
    tensor_parallel_size that spans their devices. Rank 0's LLM generates; on the other ranks
    the constructor runs rank 0's steps until rank 0's process ends, then returns an LLM that
    cannot generate. A rank that dies or hangs makes rank 0's generate raise RankFailure, and
    rank 0's process exits with status 1 a few seconds later."""

    def __init__(self, model: str = "smollm2-135m", *, check_invariants: bool = False, progress: bool = True,
                 **engine_args):
        from runtime.distributed import multiprocess as distributed

        dist = distributed.DistributedConfig.pop_from(engine_args)
        self.group = distributed.join(dist) if dist.enabled else None  # before anything touches a device
        self.engine = None
        try:
            self.plan = load_plan(model, engine_args, progress=progress)
            if self.group is not None and not self.group.is_leader:
                self.group.introduce(distributed.plan_identity(self.plan, model))
            else:
                if self.group is not None:
                    self.group.check_peers(distributed.plan_identity(self.plan, model))
                self.engine = build_engine(self.plan, check_invariants=check_invariants, progress=progress,
                                           release_host_weights=True)
        except BaseException as e:
            if self.group is not None:  # no rank waits for one that stopped
                self.group.abort(e) if self.group.is_leader else self.group.fail(e)
            raise
        if self.group is not None and not self.group.is_leader:
            self._follow(progress)
        elif self.group is not None:
            self.group.start(self.engine.runner)
            atexit.register(self.group.stop)  # before jax.distributed's own exit barrier (atexit runs LIFO)

    def _follow(self, progress: bool) -> None:
        from runtime.engine.build import build_runner

        runner = build_runner(self.plan, release_host_weights=True)
        runner.warmup(progress=progress)
        self.group.ready(runner)
        self.group.serve(runner)  # until rank 0 stops; RankFailure if it vanishes

    @classmethod
    def from_plan(cls, plan: Plan, **engine_kwargs) -> "LLM":
        """Wraps an already compiled plan (e.g. one shared by several tests)."""
        self = cls.__new__(cls)
        self.group = None
        self.plan = plan
        self.engine = build_engine(plan, **engine_kwargs)
        return self

    def _check_leader(self) -> None:
        if self.engine is None:
            raise RuntimeError(f"this LLM is rank {self.group.cfg.node_rank} of a multi-process engine: it ran "
                               "rank 0's steps until rank 0 stopped; generate on rank 0")
        if self.engine.driver is not None:
            raise RuntimeError("an engine loop steps this engine (a server built on it is running): generating "
                               "here would step it from a second thread; send the requests to the server, or "
                               "stop it first")

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts are strings or token-id lists."""
        self._check_leader()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 8)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them, through the chat template."""
        self._check_leader()
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        engine.scheduler.no_more_arrivals = True
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", file=sys.stderr)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        if bar:
                            bar.update(1)
                if self.group is not None and self.group.fault is not None:
                    from runtime.distributed.multiprocess import RankFailure

                    raise RankFailure(self.group.fault)
                if not engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("engine stopped with requests unfinished")
        finally:
            if bar:
                bar.close()
            engine.scheduler.no_more_arrivals = False
        return [done[i] for i in ids]
