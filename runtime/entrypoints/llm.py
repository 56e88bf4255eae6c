"""LLM: offline generation with vLLM's interface, on top of LLMEngine."""

from __future__ import annotations

import sys
from typing import Sequence

from runtime.build import build_engine
from runtime.plan import Plan, load_plan
from runtime.outputs import RequestOutput
from runtime.core.sampling_params import SamplingParams

class LLM:
    """`LLM(model="smollm2-135m", **engine_args)`: a preset, GGUF file, HF directory or plan directory.

    Building one converts the weights and compiles every bucket (minutes on a cold start; the
    caches make later ones seconds), with the server's progress bars on stderr unless
    `progress=False`. As in the server, the plan's host copy of the weights is dropped once they
    are on the device (`self.plan.weights` is None): on CPU it would stay resident beside them."""

    def __init__(self, model: str = "smollm2-135m", *, check_invariants: bool = False, progress: bool = True,
                 **engine_args):
        self.plan = load_plan(model, engine_args, progress=progress)
        self.engine = build_engine(self.plan, check_invariants=check_invariants, progress=progress,
                                   release_host_weights=True)

    @classmethod
    def from_plan(cls, plan: Plan, **engine_kwargs) -> "LLM":
        """Wraps an already compiled plan (e.g. one shared by several tests)."""
        self = cls.__new__(cls)
        self.plan = plan
        self.engine = build_engine(plan, **engine_kwargs)
        return self

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts are strings or token-id lists."""
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
                if not engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("engine stopped with requests unfinished")
        finally:
            if bar:
                bar.close()
            engine.scheduler.no_more_arrivals = False
        return [done[i] for i in ids]
