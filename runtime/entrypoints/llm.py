"""LLM: offline generation with vLLM's interface, on top of LLMEngine."""

from __future__ import annotations

import sys
from typing import Sequence

from runtime.compile import Plan, compile_plan, is_plan_dir
from runtime.config import EngineConfig, resolve_dtype
from runtime.engine import LLMEngine, RequestOutput
from runtime.core.sampling_params import SamplingParams

# Engine args that only steer the host-side loop; a saved plan may be started with new values.
RUNTIME_ARGS = ("scheduling", "max_waiting_ms", "static_batch_size", "enable_prefix_caching", "seed",
                "kernel_backend", "scan_layers", "num_scheduler_steps")


def load_plan(model, engine_args: dict) -> Plan:
    """A saved plan directory (runtime args may be overridden), or a fresh in-memory compile."""
    if is_plan_dir(model):
        plan = Plan.load(model)
        fixed = {k: v for k, v in engine_args.items() if k not in RUNTIME_ARGS and k != "gpu_memory_utilization"}
        if "dtype" in fixed:
            fixed["dtype"] = resolve_dtype(fixed["dtype"])
        for k, v in fixed.items():
            if getattr(plan.engine, k, v) != v:
                raise ValueError(f"{model} was compiled with {k}={getattr(plan.engine, k)!r}; "
                                 f"recompile the plan to use {k}={v!r}")
        for k in RUNTIME_ARGS:
            if k in engine_args:
                setattr(plan.engine, k, engine_args[k])
        return plan
    return compile_plan(model, EngineConfig.from_kwargs(**engine_args))


class LLM:
    """`LLM(model="smollm2-135m", **engine_args)`: a preset, GGUF file, HF directory or plan directory."""

    def __init__(self, model: str = "smollm2-135m", *, check_invariants: bool = False, **engine_args):
        self.plan = load_plan(model, engine_args)
        self.engine = LLMEngine(self.plan, check_invariants=check_invariants)

    @classmethod
    def from_plan(cls, plan: Plan, **engine_kwargs) -> "LLM":
        """Wraps an already compiled plan (e.g. one shared by several tests)."""
        self = cls.__new__(cls)
        self.plan = plan
        self.engine = LLMEngine(plan, **engine_kwargs)
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
