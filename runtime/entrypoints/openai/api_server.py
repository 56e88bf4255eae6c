"""The OpenAI-compatible HTTP server: the Starlette app, uvicorn, graceful drain, and the command line.

    python -m runtime.serve --model smollm2-135m --port 8000
    python -m runtime.serve --plan plans/smollm2 --api-key sk-local --max-queue 128

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream=true` as SSE),
POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's Messages API, with its error body),
POST /v1/responses (OpenAI's Responses API, stateless), the last two translated onto the chat path,
GET /v1/models, GET /health, GET /version, GET /metrics (Prometheus, vLLM's metric names), POST /tokenize,
POST /detokenize, GET /openapi.json, GET /docs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.routing import Route

from runtime.engine.async_engine import DEFAULT_MAX_QUEUE
from runtime.core.structured_output import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_CHARS
from runtime.entrypoints.openai.checker import DEFAULT_BODY_CHECKERS
from runtime.entrypoints.openai.http_server import Gate, UvicornServer, uvicorn_config
from runtime.entrypoints.openai.protocol import APIError
from runtime.entrypoints.openai.translation import error_response
from runtime.entrypoints.openai.serving import (BULK_BODY_BYTES, DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                                DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES,
                                                DEFAULT_MAX_CONNECTIONS, PROMPT_CHARS_PER_TOKEN, Server,
                                                ServerConfig, _version)

log = logging.getLogger("runtime.serve")

DEFAULT_SHUTDOWN_GRACE_S = 30.0


# ====================================================================== the app


def build_app(engine, *, served_model_names: list[str] | str | None = None, api_key: str | None = None,
              max_queue: int | None = DEFAULT_MAX_QUEUE, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              log_stats_interval: float = 10.0, root: str | None = None, start_engine: bool = True,
              **limits) -> Starlette:
    """The ASGI app around an `LLMEngine`. `app.state.server` is the Server (engine loop, metrics, state).

    The engine loop thread starts with the app (lifespan) unless `start_engine=False`; then call
    `app.state.server.loop.start()` yourself. `limits`: the other `ServerConfig` fields (timeouts,
    max_connections, max_prompt_chars); the connection ones apply when run by `serve` or `ServerThread`.
    """
    if isinstance(served_model_names, str):
        served_model_names = [served_model_names]
    names = list(served_model_names or [engine.config.name])
    server = Server(engine, ServerConfig(names, api_key, max_queue, max_body_bytes, log_stats_interval,
                                         root=root, **limits))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            server.loop.start()
        server.checker.start()
        try:
            yield
        finally:
            server.loop.stop()
            server.checker.close()
            server.pool.shutdown(wait=False, cancel_futures=True)
            server.bulk_pool.shutdown(wait=False, cancel_futures=True)

    async def api_error(request, exc: APIError):
        return error_response(exc, request.url.path)

    async def http_error(request, exc: HTTPException):
        return error_response(APIError(exc.status_code, exc.detail or "error", code=None,
                                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error"),
                              request.url.path)

    async def server_error(request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error_response(APIError(500, f"internal server error: {exc!r}", code="internal_error"),
                              request.url.path)

    async def model_info(request):
        # What sglang-router asks a worker when it registers it (/model_info, then /get_model_info),
        # as SGLang answers, for a user who puts one in front of several servers (our own
        # --data-parallel-size front does not need them): the model its /v1/models then lists. No tokenizer_path: the router
        # would load one to tokenize for its own use; it routes on the request's text.
        return JSONResponse({"model_path": names[0], "tokenizer_path": None, "is_generation": True})

    async def server_info(request):  # /server_info, then /get_server_info: the router's other probe
        return JSONResponse({"model_path": names[0], "served_model_name": names[0],
                             "max_model_len": engine.engine_config.max_model_len,
                             "tp_size": engine.engine_config.tensor_parallel_size, "version": _version()})

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
        Route("/docs", server.docs, methods=["GET"]),
        *(Route(path, fn, methods=["GET"]) for path, fn in (
            ("/model_info", model_info), ("/get_model_info", model_info), ("/server_info", server_info),
            ("/get_server_info", server_info))),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.add_middleware(Gate, server=server)
    app.state.server = server
    return app


# ====================================================================== running it


async def serve(app, host: str, port: int, *, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
                log_level: str = "info", access_log: bool = False) -> None:
    """Serves until SIGTERM/SIGINT; then refuses new requests (503), drains in-flight ones for up to
    `shutdown_grace_s`, aborts whatever is left, and returns. A second signal exits at once."""
    server: Server = app.state.server
    uv = UvicornServer(uvicorn_config(app, host, port, log_level=log_level, access_log=access_log,
                                        log_config=None))
    loop = asyncio.get_running_loop()
    state = {"signals": 0}

    async def drain(signame: str) -> None:
        server.draining = True
        deadline = time.monotonic() + shutdown_grace_s
        log.info("%s: refusing new requests, draining %d in flight (grace %.0fs)", signame, server.num_inflight,
                 shutdown_grace_s)
        while server.num_inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if server.num_inflight > 0:
            # Each aborted stream gets a final chunk with finish_reason "abort", then [DONE].
            log.warning("grace period over: aborting %d in-flight requests", server.num_inflight)
            server.loop.abort_all()
            t_end = time.monotonic() + 1.0
            while server.num_inflight > 0 and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
        log.info("drained; shutting down")
        uv.should_exit = True

    def on_signal(signame: str) -> None:
        state["signals"] += 1
        if state["signals"] > 1:
            log.warning("%s again: exiting now", signame)
            uv.force_exit = uv.should_exit = True
            return
        asyncio.ensure_future(drain(signame))

    for sig in (signal.SIGTERM, signal.SIGINT):
        # asyncio cannot install handlers off the main thread (RuntimeError) or on Windows
        # (NotImplementedError); there the default signal behaviour stays, without the drain.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig.name)
    await uv.serve()


def _explicit_engine_kwargs(ap: argparse.ArgumentParser, args) -> dict:
    """Engine args the user actually set (a saved plan keeps its own values for the others)."""
    from runtime.entrypoints.args import engine_kwargs_from_args

    kw = engine_kwargs_from_args(args)
    return {k: v for k, v in kw.items() if v is not None and v != ap.get_default(k)}


# The server's limits: (flag, type, default, help).
SERVER_LIMIT_FLAGS = (
    ("--max-queue", int, DEFAULT_MAX_QUEUE,
     "requests allowed to wait for a batch slot; beyond it: 503 + Retry-After (-1: no limit)"),
    ("--max-body-bytes", int, DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413"),
    ("--shutdown-grace-s", float, DEFAULT_SHUTDOWN_GRACE_S,
     "on SIGTERM, how long in-flight requests may run before they are aborted"),
    ("--max-prompt-chars", int, None,
     f"longer prompts get 413 before tokenizing (default: max_model_len x {PROMPT_CHARS_PER_TOKEN})"),
    ("--header-timeout-s", float, DEFAULT_HEADER_TIMEOUT_S,
     "close a connection that has not sent a request head within this"),
    ("--body-timeout-s", float, DEFAULT_BODY_TIMEOUT_S,
     "answer 408 when a request body takes longer than this to arrive"),
    ("--keep-alive-timeout-s", int, DEFAULT_KEEP_ALIVE_TIMEOUT_S, "close an idle keep-alive connection after this"),
    ("--max-connections", int, DEFAULT_MAX_CONNECTIONS, "open connections allowed; more are closed at accept"),
    ("--max-chat-messages", int, None,
     "chat requests with more messages get 400 before the template renders (default: max_model_len)"),
    ("--max-grammar-chars", int, DEFAULT_MAX_GRAMMAR_CHARS,
     "structured-output constraints longer than this (schema JSON, regex, grammar, all choices) get 400 "
     "before compiling"),
    ("--grammar-timeout-s", float, DEFAULT_GRAMMAR_TIMEOUT_S,
     "a structured-output constraint that takes longer to compile gets 400, and so does every repeat of it"),
    ("--body-checkers", int, DEFAULT_BODY_CHECKERS,
     f"processes that check request bodies over {BULK_BODY_BYTES >> 10} KiB before the server parses them, so "
     "that a large bad body is refused without holding the server (0: the server checks them itself)"),
)


def add_chat_args(ap) -> None:
    """vLLM's flags for tool calling, reasoning output and the chat template (docs/tools.md)."""
    from runtime.entrypoints.openai.reasoning_parsers import PARSERS as REASONING_PARSERS
    from runtime.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS

    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='tool_choice "auto" (the default with tools): the model\'s text is parsed for tool calls '
                         "by --tool-call-parser")
    ap.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                    help="the format the model writes tool calls in: hermes (Qwen 2.5/3), llama3_json (Llama 3.x), "
                         "mistral, pythonic (Llama 3.2/4, Gemma-style prompts); docs/tools.md")
    ap.add_argument("--tool-parser-plugin", help="vLLM's parser plugins: refused at start (the parsers are built in)")
    ap.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                    help="split <think>...</think> from the answer into reasoning_content")
    ap.add_argument("--chat-template", help="a Jinja chat template (a file, or the template itself) in place of "
                                            "the model's")
    ap.add_argument("--default-chat-template-kwargs", type=_json_object,
                    help='JSON object of chat_template_kwargs for every request (e.g. \'{"enable_thinking": false}\'); '
                         "a request's own override them")


def _json_object(text: str) -> dict:
    import json

    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def chat_options(args) -> dict:
    """The ServerConfig fields of the chat flags, checked: a mistake is one `error:` line at start."""
    from runtime.errors import UserError

    if args.tool_parser_plugin:
        raise UserError(f"--tool-parser-plugin {args.tool_parser_plugin}: plugins are not supported; the built-in "
                        "parsers are chosen with --tool-call-parser (docs/tools.md)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or pythonic)")
    template = args.chat_template
    if template is not None:
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        elif "{{" not in template and "{%" not in template:
            raise UserError(f"--chat-template {args.chat_template}: no such file, and not a Jinja template")
        from models.tokenizer import compile_chat_template

        try:
            compile_chat_template(template)
        except Exception as e:
            raise UserError(f"--chat-template: the template does not compile: {e}") from None
    return dict(enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser, chat_template=template,
                default_chat_template_kwargs=args.default_chat_template_kwargs)


def parse_args(argv=None):
    from runtime.entrypoints.args import ArgumentParser, add_engine_args
    from runtime.distributed.multiprocess import add_distributed_args
    from runtime.distributed.replicas import add_replica_args

    ap = ArgumentParser(prog="python -m runtime.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default="smollm2-135m", help="preset name, GGUF file or HF directory")
    src.add_argument("--plan", help="a plan directory from `python -m runtime.compile` (no lowering at start)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                         "(default: $JAXSERVE_API_KEY)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="model name(s) clients use; the first is reported in responses")
    for flag, kind, default, doc in SERVER_LIMIT_FLAGS:
        ap.add_argument(flag, type=kind, default=default, help=doc)
    ap.add_argument("--log-stats-interval", type=float, default=10.0,
                    help="seconds between stats log lines (0: off)")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX persistent compilation cache (default: the plan's xla_cache/ with --plan, "
                         "else $XDG_CACHE_HOME/jaxserve/xla (~/.cache/jaxserve/xla); 'none' to disable)")
    ap.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="usage.prompt_tokens_details.cached_tokens: prompt tokens found in the prefix cache")
    add_chat_args(ap)
    ap.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_engine_args(ap)
    add_distributed_args(ap)
    add_replica_args(ap)
    args = ap.parse_args(argv)
    return ap, args


def main(argv=None) -> int:
    """The server's entry point (`python -m runtime.serve`, `jaxserve serve`). The model or plan,
    the engine args and the port are checked first, so a mistake is one line before any compile.
    With --nnodes > 1 this process is one rank of a multi-process engine (runtime.distributed):
    rank 0 serves, the others follow it."""
    ap, args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if args.data_parallel_size < 1:
        from runtime.errors import UserError

        raise UserError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1:  # a router in front of replicas, each this command at dp 1
        from runtime.distributed import replicas

        return replicas.main(list(sys.argv[1:] if argv is None else argv), args, set(ap._option_string_actions))
    from runtime.distributed import multiprocess as distributed
    from runtime.entrypoints.args import quiet_tpu_probe
    from runtime.engine.build import build_engine

    chat = chat_options(args)  # before any compile
    dist = distributed.DistributedConfig.from_args(args)
    group = distributed.join(dist) if dist.enabled else None  # before anything touches a device
    if group is not None and not group.is_leader:
        args.port = None  # a follower serves no HTTP
    quiet_tpu_probe()
    t0 = time.perf_counter()
    try:
        plan, source = _load_plan(ap, args)
        # The memory plan is printed once, below, as the start measured it.
        log.info("plan ready in %.1fs\n%s", time.perf_counter() - t0, plan.describe(memory=False))
        if group is not None and not group.is_leader:
            return _follow(group, plan, source, args)
        if group is not None:
            group.check_peers(distributed.plan_identity(plan, source))
        # Several ranks: warm runs go to every rank at once, once all have compiled (Leader.start).
        engine = build_engine(plan, cache_dir=args.compilation_cache_dir, progress=True,
                              warm_execute="auto" if group is None else False, release_host_weights=True)
    except BaseException as e:
        if group is not None:  # no rank waits for one that stopped
            group.abort(e) if group.is_leader else group.fail(e)
        raise
    log.info("engine warm in %.1fs (%d buckets compiled or loaded); the KV pool sized from XLA's measured peak:\n%s",
             time.perf_counter() - t0, len(plan.buckets.pairs()), plan.memory.table().split("\n  peak activations =")[0])
    names = args.served_model_name or [args.model if not args.plan else plan.config.name]
    app = build_app(engine, served_model_names=names, api_key=args.api_key,
                    max_queue=None if args.max_queue < 0 else args.max_queue, max_body_bytes=args.max_body_bytes,
                    log_stats_interval=args.log_stats_interval, root=str(source),
                    max_prompt_chars=args.max_prompt_chars, header_timeout_s=args.header_timeout_s,
                    body_timeout_s=args.body_timeout_s, keep_alive_timeout_s=args.keep_alive_timeout_s,
                    max_connections=args.max_connections,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    max_chat_messages=args.max_chat_messages, max_grammar_chars=args.max_grammar_chars,
                    grammar_timeout_s=args.grammar_timeout_s, body_checkers=args.body_checkers, **chat)
    if group is not None:
        server = app.state.server

        def on_fault(message: str) -> None:  # the watchdog's thread
            server.draining = True
            server.loop.fail(distributed.RankFailure(message))
            distributed.exit_soon(distributed.FAULT_EXIT_STATUS, 1.0, message)  # the failed responses go out first

        group.on_fault = on_fault
        group.start(engine.runner, warm_execute="auto")
    log.info("serving %s on http://%s:%d (model name%s %s)", source, args.host, args.port,
             "s" if len(names) > 1 else "", ", ".join(names))
    asyncio.run(serve(app, args.host, args.port, shutdown_grace_s=args.shutdown_grace_s,
                      log_level=args.log_level, access_log=args.access_log))
    status = 0
    if group is not None:
        if group.fault is not None:
            status = distributed.FAULT_EXIT_STATUS
        elif not group.stop():
            status = distributed.FAULT_EXIT_STATUS
    log.info("server stopped")
    _exit_now(status)


def _load_plan(ap, args):
    """(plan, its source) from --plan or --model, after the pre-flight checks."""
    from runtime.entrypoints.args import engine_kwargs_from_args, preflight
    from runtime.engine.plan import load_plan

    preflight(args)
    if args.plan:
        return load_plan(args.plan, _explicit_engine_kwargs(ap, args)), args.plan
    return load_plan(args.model, engine_kwargs_from_args(args), progress=True), args.model


def _follow(group, plan, source, args) -> int:
    """A follower rank: the plan's runner, compiled as rank 0 compiles its own, running rank 0's
    calls until rank 0 says stop (exit 0) or disappears (RankFailure: exit 1)."""
    from runtime.distributed import multiprocess as distributed
    from runtime.engine.build import build_runner

    group.introduce(distributed.plan_identity(plan, source))
    runner = build_runner(plan, args.compilation_cache_dir, release_host_weights=True)
    runner.warmup(progress=True)
    group.ready(runner)
    log.info("rank %d: following rank 0", group.cfg.node_rank)
    try:
        group.serve(runner)
    except distributed.RankFailure as e:
        log.error("%s", e)
        _exit_now(distributed.FAULT_EXIT_STATUS)
    _exit_now(0)


def _exit_now(status: int):
    # Interpreter teardown (the XLA client, device buffers, module globals) takes seconds and would
    # push the exit past the grace period; the server is drained and has nothing left to write. A
    # rank of a multi-process engine must not run jax.distributed's exit barrier either: a rank that
    # died would hold it for the heartbeat timeout and then abort.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))

