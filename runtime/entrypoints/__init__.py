"""What users call: offline `LLM` and the OpenAI-compatible HTTP server."""
