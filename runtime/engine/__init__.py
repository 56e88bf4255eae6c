"""The engine: `LLMEngine.step()` (llm_engine.py), the thread that runs it for the HTTP server
(async_engine.py), a step's inputs and its outputs (step_inputs.py, output_processor.py,
outputs.py), the metrics it keeps (metrics.py), and how a model becomes a plan and a plan an
engine (plan.py, build.py)."""
