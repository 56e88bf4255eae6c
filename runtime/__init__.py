"""The runtime: plans, the engine loop, offline generation and the HTTP server."""

from runtime.core.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in JAX; keep `import runtime` light for the pure-Python scheduler tests.
    if name == "LLM":
        from runtime.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from runtime.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams"]
