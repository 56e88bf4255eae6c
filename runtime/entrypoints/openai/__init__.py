"""The OpenAI-compatible HTTP server: protocol models, serving handlers, metrics, the ASGI app."""
