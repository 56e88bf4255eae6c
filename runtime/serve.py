"""`python -m runtime.serve`: the OpenAI-compatible HTTP server. It lives in runtime/entrypoints/openai/
(protocol, serving, serving_completion, serving_chat, api_server); this module is its command-line
name and the public names for embedding it: `build_app(engine)` and `ServerThread(app)`."""

import sys

from runtime.entrypoints.openai.api_server import build_app, main, parse_args, serve
from runtime.entrypoints.openai.http_server import ServerThread
from runtime.entrypoints.openai.protocol import VLLM_UNSUPPORTED, APIError

__all__ = ["APIError", "ServerThread", "VLLM_UNSUPPORTED", "build_app", "main", "parse_args", "serve"]

if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
